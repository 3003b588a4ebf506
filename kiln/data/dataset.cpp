// Corpus loading with the token cache, the train/validation split, and the batch sampler.
#include "kiln/data/dataset.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "kiln/core/rng.h"
#include "kiln/io/file.h"
#include "kiln/ops/ops.h"

namespace kiln::data {

namespace fs = std::filesystem;

uint64_t fnv1a(std::string_view data, uint64_t h) {
  for (unsigned char c : data) h = (h ^ c) * 1099511628211ull;
  return h;
}

TokenStream tokenize_documents(const std::vector<std::string_view>& docs, const Tokenizer& tok) {
  TokenStream s;
  for (size_t d = 0; d < docs.size(); ++d) {
    std::vector<int32_t> ids = tok.encode(docs[d]);
    const int32_t di = static_cast<int32_t>(d);
    if (tok.bos_id() >= 0) {
      s.tokens.push_back(tok.bos_id());
      s.doc.push_back(di);
    }
    s.tokens.insert(s.tokens.end(), ids.begin(), ids.end());
    s.doc.insert(s.doc.end(), ids.size(), di);
    if (tok.eos_id() >= 0) {
      s.tokens.push_back(tok.eos_id());
      s.doc.push_back(di);
    }
  }
  return s;
}

namespace {

// Version 2: a trailing checksum of the ids and the key (version 1 files are rebuilt).
constexpr char kMagic[8] = {'K', 'I', 'L', 'N', 'T', 'O', 'K', '2'};

// A 64-bit hash of 32-bit words, two at a time (several GB/s: a cache hit of a billion tokens
// is not held up by its check, as a byte-wise FNV would hold it).
uint64_t hash_words(const std::vector<int32_t>& v, uint64_t h) {
  constexpr uint64_t kMul = 0x9E3779B97F4A7C15ull;
  size_t i = 0;
  for (; i + 1 < v.size(); i += 2) {
    const uint64_t w = static_cast<uint32_t>(v[i]) | (uint64_t{static_cast<uint32_t>(v[i + 1])} << 32);
    h = (h ^ w) * kMul;
    h ^= h >> 29;
  }
  if (i < v.size()) h = ((h ^ static_cast<uint32_t>(v[i])) * kMul) ^ (h >> 29);
  return (h ^ v.size()) * kMul;
}

uint64_t stream_checksum(const TokenStream& s, uint64_t key) { return hash_words(s.doc, hash_words(s.tokens, key)); }

// POSIX reads, so that a failure names the file and errno's text (a /proc file gave
// "basic_filebuf::underflow error reading the file: Invalid argument"). `limit` > 0: at most
// that many bytes.
std::string read_file(const fs::path& p, size_t limit = 0) {
  const int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
  KILN_CHECK(fd >= 0, "data: cannot open '", p.string(), "': ", std::strerror(errno));
  std::string out;
  char buf[1 << 16];
  while (limit == 0 || out.size() < limit) {
    const ssize_t n = ::read(fd, buf, limit == 0 ? sizeof buf : std::min(sizeof buf, limit - out.size()));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const std::string why = std::strerror(errno);
      ::close(fd);
      fail("data: cannot read '", p.string(), "': ", why);
    }
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return out;
}

// Text files have no NUL bytes (git's test): weights, optimizer state and token caches do.
bool looks_binary(const fs::path& p) {
  const std::string head = read_file(p, 8192);
  return head.find('\0') != std::string::npos;
}

// "a, b, c and 2 more"
std::string some_names(const std::vector<std::string>& names) {
  std::string out;
  for (size_t i = 0; i < names.size() && i < 3; ++i) out += (i ? ", " : "") + names[i];
  if (names.size() > 3) out += " and " + std::to_string(names.size() - 3) + " more";
  return out;
}

// Removes the oldest tokens-*.bin of `dir` beyond `max_bytes` in all, never `keep`.
void prune_cache_dir(const fs::path& dir, uint64_t max_bytes, const fs::path& keep) {
  std::error_code ec;
  std::vector<std::pair<fs::file_time_type, fs::path>> caches;
  uint64_t total = 0;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("tokens-", 0) != 0 || !e.is_regular_file(ec)) continue;
    total += e.file_size(ec);
    if (e.path() != keep) caches.emplace_back(e.last_write_time(ec), e.path());
  }
  std::sort(caches.begin(), caches.end());
  for (const auto& [when, path] : caches) {
    if (total <= max_bytes) break;
    const uint64_t size = fs::file_size(path, ec);
    if (fs::remove(path, ec)) total -= std::min(total, size);
  }
}

// A cache is used only when it is the user's own file, whole and unchanged (its count fits its
// size, its checksum its ids); anything else is rebuilt. (A cache in a shared folder with its ids
// rewritten changed an evaluation's loss without a word.)
bool read_cache(const fs::path& p, uint64_t key, TokenStream& s) {
  struct stat st {};
  if (::stat(p.c_str(), &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != ::geteuid()) return false;
  std::ifstream f(p, std::ios::binary);
  if (!f.good()) return false;
  char magic[8];
  uint64_t n = 0;
  f.read(magic, 8);
  f.read(reinterpret_cast<char*>(&n), 8);
  if (!f.good() || std::memcmp(magic, kMagic, 8) != 0 || n > (uint64_t{1} << 36)) return false;
  std::error_code ec;  // a count its file does not hold (a damaged cache): rebuilt, never allocated
  if (fs::file_size(p, ec) != 24 + 8 * n || ec) return false;
  s.tokens.resize(n);
  s.doc.resize(n);
  uint64_t checksum = 0;
  f.read(reinterpret_cast<char*>(s.tokens.data()), static_cast<std::streamsize>(n * 4));
  f.read(reinterpret_cast<char*>(s.doc.data()), static_cast<std::streamsize>(n * 4));
  f.read(reinterpret_cast<char*>(&checksum), 8);
  return f.good() && f.peek() == EOF && checksum == stream_checksum(s, key);
}

// Through io::AtomicWriter (a fresh temporary name, O_EXCL: a planted symlink is not followed).
void write_cache(const fs::path& p, uint64_t key, const TokenStream& s) {
  try {
    io::AtomicWriter w(p.string());
    const uint64_t n = s.tokens.size(), checksum = stream_checksum(s, key);
    w.write(kMagic, 8);
    w.write(&n, 8);
    w.write(s.tokens.data(), n * 4);
    w.write(s.doc.data(), n * 4);
    w.write(&checksum, 8);
    w.commit();
  } catch (const Error&) {
    // a cache is an optimisation: failing to write it is not an error
  }
}

}  // namespace

bool is_run_or_checkpoint_dir(const std::string& d) {
  const fs::path dir(d);
  std::error_code ec;
  auto has = [&](const char* f) { return fs::exists(dir / f, ec); };
  if (has("config.json") && (has("model.safetensors") || has("model.safetensors.index.json") || has("pytorch_model.bin")))
    return true;
  if (!has("latest") && !has("metrics.jsonl")) return false;
  if (has("loss.svg") || has("trainer_state.json")) return true;
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (e.path().filename().string().rfind("step-", 0) == 0 && e.is_directory(ec)) return true;
  return false;
}

std::string clamp_batches(size_t tokens, int64_t batch, int64_t seq, const char* flag, int64_t& batches) {
  const int64_t per_batch = std::max<int64_t>(batch * seq, 1);
  const int64_t held = std::max<int64_t>(1, (static_cast<int64_t>(tokens) - 1) / per_batch);
  if (batches <= held) return "";
  std::string note = "note: " + std::string(flag) + " " + std::to_string(batches) + " is more than the " +
                     std::to_string(tokens) + " held-out tokens hold (" + std::to_string(held) + " batch" +
                     (held == 1 ? "" : "es") + " of " + std::to_string(batch) + " x " + std::to_string(seq) +
                     "); evaluating " + std::to_string(held);
  batches = held;
  return note;
}

std::optional<std::string> user_cache_dir(const std::string& name) {
  std::error_code ec;  // TMPDIR missing or a file: no cache (eval failed with "temp_directory_path")
  const fs::path tmp = fs::temp_directory_path(ec);
  if (ec || !fs::is_directory(tmp, ec)) return std::nullopt;
  const fs::path dir = tmp / (name + "-" + std::to_string(::geteuid()));
  ::mkdir(dir.c_str(), 0700);
  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != ::geteuid() || (st.st_mode & 077) != 0)
    return std::nullopt;
  return dir.string();
}

TokenStream load_corpus(const std::string& path, const Tokenizer& tok, const std::string& cache_dir, bool* cache_hit,
                        bool use_cache, uint64_t max_cache_bytes) {
  fs::path root(path);
  KILN_CHECK(!path.empty(), "data: the path is empty ('')");
  KILN_CHECK(fs::exists(root), "data: '", path, "' does not exist");
  std::vector<fs::path> files;
  std::vector<std::string> skipped_files, skipped_dirs, notes;
  if (fs::is_directory(root)) {
    std::error_code ec;
    auto it = fs::recursive_directory_iterator(root, fs::directory_options::skip_permission_denied, ec);
    KILN_CHECK(!ec, "data: cannot list folder '", path, "': ", ec.message());
    for (; it != fs::recursive_directory_iterator(); it.increment(ec)) {
      KILN_CHECK(!ec, "data: cannot list folder '", path, "' (at '", it->path().string(), "'): ", ec.message());
      const std::string name = it->path().filename().string();
      const std::string rel = fs::relative(it->path(), root, ec).string();
      if (it->is_directory(ec)) {
        // the cache directory (a run directory) inside the folder holds no text to train on
        if (!cache_dir.empty() && fs::equivalent(it->path(), cache_dir, ec)) {
          it.disable_recursion_pending();
        } else if (is_run_or_checkpoint_dir(it->path().string())) {
          it.disable_recursion_pending();
          skipped_dirs.push_back(rel);
        }
        continue;
      }
      if (!it->is_regular_file(ec) || name[0] == '.' || name.rfind("tokens-", 0) == 0) continue;
      if (looks_binary(it->path())) skipped_files.push_back(rel);
      else files.push_back(it->path());
    }
    std::sort(files.begin(), files.end());
    std::sort(skipped_files.begin(), skipped_files.end());
    std::sort(skipped_dirs.begin(), skipped_dirs.end());
    if (!skipped_dirs.empty())
      notes.push_back("data: skipped " + std::to_string(skipped_dirs.size()) + " folder(s) of kiln runs or checkpoints in " +
                      path + " (" + some_names(skipped_dirs) + ")");
    if (!skipped_files.empty())
      notes.push_back("data: skipped " + std::to_string(skipped_files.size()) + " file(s) that are not text in " + path +
                      " (" + some_names(skipped_files) + ")");
    KILN_CHECK(!files.empty(), "data: folder '", path, "' holds no text files",
               notes.empty() ? std::string() : " (" + notes[0] + (notes.size() > 1 ? "; " + notes[1] : "") + ")");
  } else {
    // a device or a pipe (/dev/zero, /dev/stdin) would be read until memory runs out
    KILN_CHECK(fs::is_regular_file(root), "data: '", path, "' is neither a regular file nor a folder");
    files.push_back(root);
  }
  std::vector<std::string> texts;
  uint64_t h = fnv1a(tok.fingerprint());
  for (const auto& f : files) {
    texts.push_back(read_file(f));
    h = fnv1a(fs::relative(f, fs::is_directory(root) ? root : root.parent_path()).string(), h);
    h = fnv1a(texts.back(), h);
  }
  char name[64];
  std::snprintf(name, sizeof name, "tokens-%016llx.bin", static_cast<unsigned long long>(h));
  fs::path dir = cache_dir.empty() ? (fs::is_directory(root) ? root : root.parent_path()) : fs::path(cache_dir);
  fs::path cache = dir / name;
  TokenStream s;
  if (use_cache && read_cache(cache, h, s)) {
    if (cache_hit) *cache_hit = true;
    s.source_hash = h;
    s.notes = notes;
    return s;
  }
  if (cache_hit) *cache_hit = false;
  std::vector<std::string_view> views(texts.begin(), texts.end());
  s = tokenize_documents(views, tok);
  s.source_hash = h;
  s.notes = notes;
  if (use_cache && (max_cache_bytes == 0 || 24 + 8 * s.tokens.size() <= max_cache_bytes)) {
    std::error_code ec;
    fs::create_directories(dir, ec);
    write_cache(cache, h, s);
    if (max_cache_bytes > 0) prune_cache_dir(dir, max_cache_bytes, cache);
  }
  return s;
}

SampleMode parse_sample_mode(const std::string& s) {
  if (s == "windows") return SampleMode::windows;
  if (s == "packed") return SampleMode::packed;
  fail("data: sampling mode '", s, "' is not one of: windows, packed");
}

Split split_stream(const TokenStream& s, double val_fraction, int64_t seq) {
  KILN_CHECK(val_fraction >= 0 && val_fraction < 1, "data: val_fraction=", val_fraction, " must be in [0, 1)");
  const size_t need = static_cast<size_t>(seq + 1);
  size_t val = static_cast<size_t>(static_cast<double>(s.size()) * val_fraction);
  if (val_fraction > 0) val = std::max(val, need);
  KILN_CHECK(s.size() >= val + need, "data: the corpus has ", s.size(), " tokens, too few for sequence length ", seq,
             (val_fraction > 0 ? " with a validation split" : ""), " (need at least ", val + need,
             "); use a shorter --seq or more data");
  return Split{s.size() - val};
}

Sampler::Sampler(const TokenStream& stream, size_t begin, size_t end, int64_t batch, int64_t seq, uint64_t seed,
                 SampleMode mode)
    : stream_(stream), begin_(begin), end_(end), batch_(batch), seq_(seq), seed_(seed), mode_(mode) {
  KILN_CHECK(batch > 0 && seq > 0, "Sampler: batch=", batch, " and seq=", seq, " must be positive");
  KILN_CHECK(end <= stream.size() && begin + static_cast<size_t>(seq) + 1 <= end, "Sampler: range [", begin, ", ",
             end, ") is too short for sequence length ", seq);
  // Packed batches read a document id per token: a shorter doc list was read past its end.
  KILN_CHECK(mode != SampleMode::packed || !stream.source, "Sampler: packed sampling needs documents, which token ",
             "data (", stream.source ? stream.source->format() : "", ") does not mark; use windows sampling");
  KILN_CHECK(mode != SampleMode::packed || stream.doc.size() == stream.tokens.size(), "Sampler: packed sampling needs ",
             "a document id per token, the stream has ", stream.doc.size(), " ids for ", stream.tokens.size(), " tokens");
}

int64_t Sampler::window_start(uint64_t sample) const {
  const int64_t span = static_cast<int64_t>(end_ - begin_);
  if (mode_ == SampleMode::windows) {
    const int64_t choices = span - seq_;  // starts in [0, span - seq - 1]
    Philox4 r = philox_element(seed_, 0x5A3D1E, sample);
    const uint64_t x = (static_cast<uint64_t>(r.v[0]) << 32) | r.v[1];
    return static_cast<int64_t>(begin_) + static_cast<int64_t>(x % static_cast<uint64_t>(choices));
  }
  const int64_t chunks = (span - 1) / seq_;
  const int64_t epoch = static_cast<int64_t>(sample / static_cast<uint64_t>(chunks));
  if (epoch != perm_epoch_) {
    perm_.resize(static_cast<size_t>(chunks));
    for (int64_t i = 0; i < chunks; ++i) perm_[static_cast<size_t>(i)] = i;
    for (int64_t i = chunks - 1; i > 0; --i) {  // Fisher-Yates from counter-based draws
      Philox4 r = philox_element(seed_, 0xC4A0000 + static_cast<uint64_t>(epoch), static_cast<uint64_t>(i));
      std::swap(perm_[static_cast<size_t>(i)], perm_[r.v[0] % static_cast<uint64_t>(i + 1)]);
    }
    perm_epoch_ = epoch;
  }
  return static_cast<int64_t>(begin_) + perm_[sample % static_cast<uint64_t>(chunks)] * seq_;
}

Batch Sampler::next(Device device) {
  const size_t n = static_cast<size_t>(batch_ * seq_);
  std::vector<int64_t> in(n), tg(n), dc;
  if (mode_ == SampleMode::packed) dc.resize(n);
  for (int64_t b = 0; b < batch_; ++b) {
    const int64_t s0 = window_start(position_++);
    for (int64_t t = 0; t < seq_; ++t) {
      const size_t i = static_cast<size_t>(b * seq_ + t), src = static_cast<size_t>(s0 + t);
      in[i] = stream_.token(src);
      tg[i] = stream_.token(src + 1);
      if (mode_ == SampleMode::packed) {
        dc[i] = stream_.doc[src];
        // the first token of the next document is not predicted from the previous one
        if (stream_.doc[src + 1] != stream_.doc[src]) tg[i] = -100;
      }
    }
  }
  Batch out;
  out.input = from_vector(in, {batch_, seq_}, device);
  out.target = from_vector(tg, {batch_, seq_}, device);
  if (!dc.empty()) out.doc_ids = from_vector(dc, {batch_, seq_});  // host: no device round trip for the masks
  out.num_targets = static_cast<int64_t>(std::count_if(tg.begin(), tg.end(), [](int64_t x) { return x != -100; }));
  return out;
}

}  // namespace kiln::data
