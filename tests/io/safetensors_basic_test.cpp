// safetensors round trips through kiln's writer and reader: every kiln dtype, scalars,
// zero-size tensors, metadata, non-contiguous inputs, views of the mapping.
#include <gtest/gtest.h>

#include <sys/stat.h>

#include <cstring>
#include <filesystem>

#include "kiln/io/json.h"
#include "kiln/io/safetensors.h"
#include "kiln/ops/ops.h"
#include "tests/io/io_test_util.h"
#include "tests/ops/harness.h"

namespace kiln::io {
namespace {

TEST(Safetensors, RoundTripEveryKilnDType) {
  TempDir dir;
  Generator gen(1234);
  TensorMap in;
  for (const auto& fd : format_dtypes()) {
    if (!fd.kiln) continue;
    Tensor t = random_bytes_tensor({3, 7}, *fd.kiln, gen);
    in.emplace_back(std::string("t_") + fd.name, t);
  }
  in.emplace_back("scalar", scalar_tensor(2.5, DType::f32));
  in.emplace_back("empty", zeros({0, 5}, DType::f16));
  in.emplace_back("odd", randn({129}, gen, DType::bf16));
  Metadata meta{{"format", "pt"}, {"note", "ünï"}};
  save_safetensors(dir.file("a.safetensors"), in, meta);
  Metadata got_meta;
  TensorMap out = load_safetensors(dir.file("a.safetensors"), &got_meta);
  EXPECT_EQ(got_meta, meta);
  ASSERT_EQ(out.size(), in.size());
  for (const auto& [name, t] : in) {
    auto it = std::find_if(out.begin(), out.end(), [&](const auto& p) { return p.first == name; });
    ASSERT_NE(it, out.end()) << name;
    EXPECT_TRUE(same_bits(it->second, t, name));
  }
  for (size_t i = 1; i < out.size(); ++i) EXPECT_LT(out[i - 1].first, out[i].first);
}

TEST(Safetensors, LoadedTensorsAreViewsOfTheMapping) {
  TempDir dir;
  Generator gen(7);
  Tensor a = randn({64, 33}, gen);
  save_safetensors(dir.file("v.safetensors"), TensorMap{{"a", a}});
  TensorMap out = load_safetensors(dir.file("v.safetensors"));
  ASSERT_EQ(out.size(), 1u);
  EXPECT_TRUE(out[0].second.storage()->borrowed());
  // Writing to a view must not change the file (copy-on-write mapping).
  out[0].second.fill_(0.0);
  TensorMap again = load_safetensors(dir.file("v.safetensors"));
  EXPECT_TRUE(same_bits(again[0].second, a, "a"));
}

TEST(Safetensors, NonContiguousInputsAreWrittenRowMajor) {
  TempDir dir;
  Generator gen(9);
  Tensor a = randn({5, 7}, gen, DType::f64);
  Tensor at = a.t();
  save_safetensors(dir.file("t.safetensors"), TensorMap{{"at", at}});
  TensorMap out = load_safetensors(dir.file("t.safetensors"));
  EXPECT_TRUE(same_bits(out[0].second, at.contiguous(), "at"));
}

TEST(Safetensors, HeaderIsPaddedAndTensorsAligned) {
  TempDir dir;
  Generator gen(3);
  TensorMap in{{"b", randn({3}, gen, DType::f16)}, {"a", randn({3}, gen, DType::f64)},
               {"c", random_bytes_tensor({5}, DType::u8, gen)}, {"d", randn({2}, gen, DType::f32)}};
  save_safetensors(dir.file("p.safetensors"), in);
  SafetensorsFile f = SafetensorsFile::open(dir.file("p.safetensors"));
  EXPECT_EQ(f.header_bytes() % 8, 0u);
  for (const auto& e : f.entries()) EXPECT_EQ(e.begin % format_alignment(*e.dtype), 0u) << e.name;
  // Descending alignment: f64 first, then f32, f16, u8.
  std::vector<std::pair<uint64_t, std::string>> by_offset;
  for (const auto& e : f.entries()) by_offset.emplace_back(e.begin, e.name);
  std::sort(by_offset.begin(), by_offset.end());
  EXPECT_EQ(by_offset[0].second, "a");
  EXPECT_EQ(by_offset[1].second, "d");
  EXPECT_EQ(by_offset[2].second, "b");
  EXPECT_EQ(by_offset[3].second, "c");
}

TEST(Safetensors, WriterRefusesDuplicatesAndLeavesNoFile) {
  TempDir dir;
  TensorMap in{{"x", zeros({2})}, {"x", zeros({3})}};
  EXPECT_THROW(save_safetensors(dir.file("d.safetensors"), in), Error);
  EXPECT_FALSE(std::filesystem::exists(dir.file("d.safetensors")));
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir.path()), {}), 0);
}

// (From a probe) the rename replaced whatever the path named: /dev/null, a pipe or a socket
// became a regular file; a symlink became a file instead of its target being written; the new
// file always had mode 0644 (a 0600 file became world-readable). Names and metadata that are
// not UTF-8 made a header no reader takes.
TEST(Safetensors, SaveRespectsWhatThePathIs) {
  TempDir dir;
  const TensorMap one{{"x", ones({2})}};
  const std::string fifo = dir.file("fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_KILN_ERROR(save_safetensors(fifo, one), "fifo", "not a regular file", "refusing to replace it");
  EXPECT_TRUE(std::filesystem::is_fifo(fifo));
  EXPECT_KILN_ERROR(save_safetensors(dir.path(), one), "not a regular file", "a folder");
  EXPECT_KILN_ERROR(save_safetensors("", one), "empty path");
  // Through a symlink: its target is replaced, the link kept.
  const std::string target = dir.file("real.safetensors"), link = dir.file("link.safetensors");
  save_safetensors(target, TensorMap{{"old", zeros({1})}});
  std::filesystem::create_symlink(target, link);
  save_safetensors(link, one);
  EXPECT_TRUE(std::filesystem::is_symlink(link));
  EXPECT_EQ(load_safetensors(target)[0].first, "x");
  // A dangling link (relative): its target is created, the link kept (the link was replaced).
  std::filesystem::create_symlink("made.safetensors", dir.file("dangling.safetensors"));
  save_safetensors(dir.file("dangling.safetensors"), one);
  EXPECT_TRUE(std::filesystem::is_symlink(dir.file("dangling.safetensors")));
  EXPECT_EQ(load_safetensors(dir.file("made.safetensors"))[0].first, "x");
  // Modes: the replaced file's; a new file's is 0666 less the umask.
  namespace fs = std::filesystem;
  fs::permissions(target, fs::perms::owner_read | fs::perms::owner_write);
  save_safetensors(target, one);
  EXPECT_EQ(fs::status(target).permissions() & fs::perms::all, fs::perms::owner_read | fs::perms::owner_write);
  const mode_t old_mask = ::umask(027);
  save_safetensors(dir.file("new.safetensors"), one);
  ::umask(old_mask);
  EXPECT_EQ(fs::status(dir.file("new.safetensors")).permissions() & fs::perms::all,
            fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read);
  // Not UTF-8: refused before anything is written.
  EXPECT_KILN_ERROR(save_safetensors(dir.file("u.safetensors"), TensorMap{{"a\xff", ones({1})}}), "tensor 0",
                    "not valid UTF-8", "byte 1");
  EXPECT_KILN_ERROR(save_safetensors(dir.file("u.safetensors"), one, Metadata{{"k", "\xc3"}}), "metadata entry 'k'",
                    "not valid UTF-8");
  EXPECT_FALSE(fs::exists(dir.file("u.safetensors")));
  EXPECT_KILN_ERROR(json::quote("ok\xe2\x82"), "not valid UTF-8", "byte 2");
  EXPECT_EQ(json::quote("\xe2\x82\xac"), "\"\xe2\x82\xac\"");  // € passes as is
}

TEST(Safetensors, SaveReplacesAtomically) {
  TempDir dir;
  save_safetensors(dir.file("r.safetensors"), TensorMap{{"x", ones({4})}});
  save_safetensors(dir.file("r.safetensors"), TensorMap{{"y", zeros({2})}});
  TensorMap out = load_safetensors(dir.file("r.safetensors"));
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].first, "y");
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir.path()), {}), 1);
}

}  // namespace
}  // namespace kiln::io

namespace kiln::io {
namespace {

TEST(Safetensors, MaterializeOwnsCopies) {
  TempDir dir;
  Generator gen(21);
  TensorMap in{{"big", randn({3000, 700}, gen)}, {"small", randn({5}, gen, DType::f16)}};
  save_safetensors(dir.file("m.safetensors"), in);
  TensorMap t = load_safetensors(dir.file("m.safetensors"));
  materialize(t);
  std::filesystem::remove(dir.file("m.safetensors"));
  for (size_t k = 0; k < t.size(); ++k) {
    EXPECT_FALSE(t[k].second.storage()->borrowed());
    EXPECT_TRUE(same_bits(t[k].second, in[k].second, t[k].first));
  }
}

}  // namespace
}  // namespace kiln::io
