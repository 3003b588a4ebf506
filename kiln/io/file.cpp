// MappedFile (mmap), AtomicWriter (temp file + fsync + rename) and small file helpers.
#include "kiln/io/file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <vector>

#include "kiln/autograd/grad_mode.h"
#include "kiln/core/error.h"

namespace kiln::io {

namespace {
std::string errno_text() { return std::strerror(errno); }

std::string parent_dir(const std::string& path) {
  auto slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

const char* file_kind(mode_t mode) {
  if (S_ISFIFO(mode)) return "a pipe (FIFO)";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISDIR(mode)) return "a directory";
  return "not a regular file";
}

// Opens a regular file for reading, or fails naming what the path is instead. O_NONBLOCK: a pipe
// with no writer would otherwise block open() itself (no effect on a regular file's reads).
int open_regular(const std::string& path, struct stat& st) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  KILN_CHECK(fd >= 0, path, ": cannot open: ", errno_text());
  if (::fstat(fd, &st) != 0) {
    const std::string why = errno_text();
    ::close(fd);
    fail(path, ": cannot stat: ", why);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail(path, ": not a regular file: it is ", file_kind(st.st_mode), " (checkpoints are read from files)");
  }
  return fd;
}
}  // namespace

std::shared_ptr<MappedFile> MappedFile::open(const std::string& path) {
  struct stat st {};
  int fd = open_regular(path, st);
  std::shared_ptr<MappedFile> m(new MappedFile());
  m->path_ = path;
  m->size_ = static_cast<uint64_t>(st.st_size);
  if (m->size_ > 0) {
    void* p = ::mmap(nullptr, m->size_, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      std::string why = errno_text();
      ::close(fd);
      fail(path, ": cannot map ", m->size_, " bytes: ", why);
    }
    m->data_ = static_cast<uint8_t*>(p);
  }
  ::close(fd);
  return m;
}

MappedFile::~MappedFile() {
  if (data_) ::munmap(data_, size_);
}

std::string_view MappedFile::bytes(uint64_t begin, uint64_t len) const {
  KILN_CHECK(begin <= size_ && len <= size_ - begin, path_, ": byte range [", begin, ", +", len,
             ") lies outside the file of ", size_, " bytes");
  return std::string_view(reinterpret_cast<const char*>(data_) + begin, len);
}

Tensor MappedFile::view(uint64_t begin, const Shape& shape, DType dtype, const std::shared_ptr<MappedFile>& self) const {
  const int64_t numel = shape_numel(shape);
  const uint64_t nbytes = static_cast<uint64_t>(numel) * itemsize(dtype);
  std::string_view b = bytes(begin, nbytes);
  void* p = const_cast<char*>(b.data());
  if (reinterpret_cast<uintptr_t>(p) % itemsize(dtype) != 0) {  // unaligned: own a copy
    Tensor t = Tensor::empty(shape, dtype);
    if (nbytes) std::memcpy(t.data_ptr(), p, nbytes);
    return t;
  }
  auto storage = std::make_shared<Storage>(p, nbytes, kCPU, std::shared_ptr<void>(self));
  return Tensor::from_storage(std::move(storage), shape, contiguous_strides(shape), 0, dtype);
}

namespace {
// The file a path names, through symlinks (a dangling one included: writing through it creates
// its target, as open(2) would). At most 40 links, as the kernel's limit.
std::string through_symlinks(const std::string& path) {
  namespace fs = std::filesystem;
  fs::path p(path);
  for (int hops = 0; hops < 40; ++hops) {
    struct stat lst {};
    if (::lstat(p.c_str(), &lst) != 0 || !S_ISLNK(lst.st_mode)) return p.string();
    std::error_code ec;
    const fs::path target = fs::read_symlink(p, ec);
    if (ec) return p.string();
    p = target.is_absolute() ? target : p.parent_path() / target;
  }
  fail(path, ": too many levels of symbolic links");
}
}  // namespace

AtomicWriter::AtomicWriter(std::string path) : path_(std::move(path)) {
  KILN_CHECK(!path_.empty(), "cannot write a file at an empty path");
  target_ = through_symlinks(path_);  // the link is kept, the file it names replaced
  struct stat st {};
  const bool exists = ::stat(target_.c_str(), &st) == 0;
  // The rename would replace whatever is there: /dev/null, a pipe or a socket became a regular
  // file (as root, the system's /dev/null). Such a target, or a folder, is refused.
  KILN_CHECK(!exists || S_ISREG(st.st_mode), path_, ": exists and is not a regular file (",
             S_ISDIR(st.st_mode) ? "a folder" : "a device, pipe or socket", "): refusing to replace it");
  // The temporary file is created as open(2) creates one (mode 0666 less the umask), or, when it
  // replaces a file, owner-only until it takes that file's mode (a 0600 file became 0644, and
  // a wider mode in between would let others open what is written).
  std::random_device rd;
  for (int attempt = 0; attempt < 100 && fd_ < 0; ++attempt) {
    char suffix[32];
    std::snprintf(suffix, sizeof suffix, ".tmp.%08x", static_cast<unsigned>(rd()));
    tmp_ = target_ + suffix;
    fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, exists ? 0600 : 0666);
    if (fd_ < 0 && errno != EEXIST) break;
  }
  KILN_CHECK(fd_ >= 0, path_, ": cannot create a temporary file next to it: ", errno_text());
  if (exists) ::fchmod(fd_, st.st_mode & 07777);
}

AtomicWriter::~AtomicWriter() {
  if (fd_ >= 0) {
    ::close(fd_);
    ::unlink(tmp_.c_str());
  }
}

void AtomicWriter::write(const void* data, size_t n) {
  KILN_CHECK(fd_ >= 0, path_, ": write after commit");
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = ::write(fd_, p, std::min<size_t>(n, size_t{1} << 30));
    if (w < 0 && errno == EINTR) continue;
    KILN_CHECK(w > 0, path_, ": write failed after ", written_, " bytes: ", errno_text());
    p += w;
    n -= static_cast<size_t>(w);
    written_ += static_cast<uint64_t>(w);
  }
}

void AtomicWriter::write_tensor(const Tensor& t) {
  if (t.numel() == 0) return;
  NoGradGuard no_grad;  // host copies of parameters must not join an autograd graph
  Tensor c = t.is_cpu() ? t : t.to(kCPU);
  if (!c.is_contiguous()) {
    if (is_storage_only(c.dtype()))  // 1-byte storage-only floats: copy through a u8 view
      c = Tensor::from_storage(c.storage(), c.shape(), c.strides(), c.offset(), DType::u8).contiguous();
    else
      c = c.contiguous();
  }
  write(c.data_ptr(), c.nbytes());
}

void AtomicWriter::commit() {
  KILN_CHECK(fd_ >= 0, path_, ": committed twice");
  KILN_CHECK(::fsync(fd_) == 0, path_, ": fsync failed: ", errno_text());
  ::close(fd_);
  fd_ = -1;
  if (::rename(tmp_.c_str(), target_.c_str()) != 0) {
    std::string why = errno_text();
    ::unlink(tmp_.c_str());
    fail(path_, ": cannot rename the temporary file into place: ", why);
  }
  int dfd = ::open(parent_dir(target_).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

std::string read_file_prefix(const std::string& path, size_t max_bytes) {
  struct stat st {};
  int fd = open_regular(path, st);
  std::string out;
  char buf[65536];
  while (out.size() < max_bytes) {
    ssize_t r = ::read(fd, buf, std::min(sizeof buf, max_bytes - out.size()));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;
    out.append(buf, static_cast<size_t>(r));
  }
  ::close(fd);
  return out;
}

bool is_directory(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

}  // namespace kiln::io
