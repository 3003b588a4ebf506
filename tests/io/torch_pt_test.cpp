// The PyTorch zip checkpoint reader without torch: zip archives and pickles built byte by byte
// here exercise the zip reader (plain and ZIP64), the restricted unpickler, views/strides and
// flattening; malicious pickles (os.system, builtins.eval) are refused, never run.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>

#include "kiln/io/load.h"
#include "kiln/io/pickle.h"
#include "kiln/io/torch_pt.h"
#include "kiln/io/zip.h"
#include "tests/io/io_test_util.h"

namespace kiln::io {
namespace {

void put_le(std::string& s, uint64_t v, int n) {
  for (int i = 0; i < n; ++i) s += static_cast<char>((v >> (8 * i)) & 0xFF);
}

// A stored-only zip with 64-byte aligned data (as torch writes), optionally in ZIP64 form.
std::string make_zip(const std::vector<std::pair<std::string, std::string>>& entries, bool zip64) {
  std::string out, cd;
  for (const auto& [name, data] : entries) {
    const uint64_t local = out.size();
    const size_t base = out.size() + 30 + name.size() + 4;
    const size_t pad = (64 - base % 64) % 64;
    std::string extra;
    put_le(extra, 0x1234, 2);  // padding field, as torch's writer does
    put_le(extra, pad, 2);
    extra.append(pad, 'Z');
    put_le(out, 0x04034b50, 4);
    put_le(out, 20, 2); put_le(out, 0, 2); put_le(out, 0, 2); put_le(out, 0, 4);
    put_le(out, crc32(data), 4); put_le(out, data.size(), 4); put_le(out, data.size(), 4);
    put_le(out, name.size(), 2); put_le(out, extra.size(), 2);
    out += name + extra + data;
    std::string cextra;
    if (zip64) {
      put_le(cextra, 0x0001, 2); put_le(cextra, 24, 2);
      put_le(cextra, data.size(), 8); put_le(cextra, data.size(), 8); put_le(cextra, local, 8);
    }
    put_le(cd, 0x02014b50, 4);
    put_le(cd, 45, 2); put_le(cd, 45, 2); put_le(cd, 0, 2); put_le(cd, 0, 2); put_le(cd, 0, 4);
    put_le(cd, crc32(data), 4);
    put_le(cd, zip64 ? 0xFFFFFFFF : data.size(), 4); put_le(cd, zip64 ? 0xFFFFFFFF : data.size(), 4);
    put_le(cd, name.size(), 2); put_le(cd, cextra.size(), 2); put_le(cd, 0, 2);
    put_le(cd, 0, 2); put_le(cd, 0, 2); put_le(cd, 0, 4); put_le(cd, zip64 ? 0xFFFFFFFF : local, 4);
    cd += name + cextra;
  }
  const uint64_t cd_off = out.size();
  out += cd;
  if (zip64) {
    const uint64_t z = out.size();
    put_le(out, 0x06064b50, 4); put_le(out, 44, 8); put_le(out, 45, 2); put_le(out, 45, 2);
    put_le(out, 0, 4); put_le(out, 0, 4); put_le(out, entries.size(), 8); put_le(out, entries.size(), 8);
    put_le(out, cd.size(), 8); put_le(out, cd_off, 8);
    put_le(out, 0x07064b50, 4); put_le(out, 0, 4); put_le(out, z, 8); put_le(out, 1, 4);
  }
  put_le(out, 0x06054b50, 4); put_le(out, 0, 2); put_le(out, 0, 2);
  put_le(out, zip64 ? 0xFFFF : entries.size(), 2); put_le(out, zip64 ? 0xFFFF : entries.size(), 2);
  put_le(out, zip64 ? 0xFFFFFFFF : cd.size(), 4); put_le(out, zip64 ? 0xFFFFFFFF : cd_off, 4); put_le(out, 0, 2);
  return out;
}

// Pickle opcodes, protocol 2.
struct Pickle {
  std::string b = "\x80\x02";
  Pickle& op(char c) { b += c; return *this; }
  Pickle& global(const std::string& m, const std::string& n) { b += 'c' + m + '\n' + n + '\n'; return *this; }
  Pickle& str(const std::string& s) { b += 'X'; put_le(b, s.size(), 4); b += s; return *this; }
  Pickle& i(int v) { b += 'K'; b += static_cast<char>(v); return *this; }
  Pickle& put(int k) { b += 'q'; b += static_cast<char>(k); return *this; }
  Pickle& get(int k) { b += 'h'; b += static_cast<char>(k); return *this; }
  // _rebuild_tensor_v2(storage(key, numel), offset, size, stride, False, OrderedDict())
  Pickle& tensor(const std::string& type, const std::string& key, int numel, int offset, std::vector<int> size,
                 std::vector<int> stride) {
    global("torch._utils", "_rebuild_tensor_v2").op('(');
    op('(').str("storage").global("torch", type).str(key).str("cpu").i(numel).op('t').op('Q');
    i(offset);
    op('(');
    for (int s : size) i(s);
    op('t').op('(');
    for (int s : stride) i(s);
    op('t').op('\x89').global("collections", "OrderedDict").op(')').op('R').op('t').op('R');
    return *this;
  }
  std::string done() { return b + "."; }
};

std::string f32_bytes(const std::vector<float>& v) { return std::string(reinterpret_cast<const char*>(v.data()), v.size() * 4); }

std::string state_dict_pickle() {
  Pickle p;
  p.global("collections", "OrderedDict").op(')').op('R').put(0).op('(');
  p.str("w").tensor("FloatStorage", "0", 6, 0, {2, 3}, {3, 1});
  p.str("wt").tensor("FloatStorage", "0", 6, 0, {3, 2}, {1, 3});  // a transposed view of the same storage
  p.str("nested").op('}').str("col").tensor("FloatStorage", "0", 6, 1, {2}, {3}).op('s');
  p.str("ids").tensor("LongStorage", "1", 3, 0, {3}, {1});
  p.str("layers").op(']').op('(').tensor("HalfStorage", "2", 2, 0, {2}, {1}).op('e');
  p.str("step").i(5);
  p.op('u');
  return p.done();
}

std::string torch_zip(const std::string& pkl, bool zip64 = false) {
  const std::vector<float> w = {0.5f, 1, 2, 3, 4, 5};
  std::string ids;
  for (int64_t v : std::vector<int64_t>{7, -1, int64_t{1} << 40}) ids.append(reinterpret_cast<const char*>(&v), 8);
  const std::string half("\x00\x3c\x00\xc0", 4);  // 1.0, -2.0 in f16
  return make_zip({{"archive/data.pkl", pkl}, {"archive/byteorder", "little"}, {"archive/data/0", f32_bytes(w)},
                   {"archive/data/1", ids}, {"archive/data/2", half}, {"archive/version", "3\n"}},
                  zip64);
}

TEST(TorchPt, HandCraftedCheckpointLoads) {
  TempDir dir;
  for (bool zip64 : {false, true}) {
    SCOPED_TRACE(zip64 ? "zip64" : "zip");
    const std::string path = dir.file(zip64 ? "m64.pt" : "m.bin");
    write_bytes(path, torch_zip(state_dict_pickle(), zip64));
    EXPECT_EQ(sniff_format(path), FileFormat::torch_zip);
    TensorMap t = load(path);
    ASSERT_EQ(t.size(), 5u);
    std::map<std::string, Tensor> m(t.begin(), t.end());
    ASSERT_TRUE(m.count("w") && m.count("wt") && m.count("nested.col") && m.count("ids") && m.count("layers.0"));
    EXPECT_EQ(m["w"].shape(), (Shape{2, 3}));
    EXPECT_EQ(m["w"].to_vector<float>(), (std::vector<float>{0.5f, 1, 2, 3, 4, 5}));
    EXPECT_EQ(m["wt"].to_vector<float>(), (std::vector<float>{0.5f, 3, 1, 4, 2, 5}));
    EXPECT_EQ(m["nested.col"].to_vector<float>(), (std::vector<float>{1, 4}));
    EXPECT_EQ(m["ids"].to_vector<int64_t>(), (std::vector<int64_t>{7, -1, 1LL << 40}));
    EXPECT_EQ(m["layers.0"].dtype(), DType::f16);
    EXPECT_EQ(m["layers.0"].to(DType::f32).to_vector<float>(), (std::vector<float>{1, -2}));
    // Zero-copy: views share one borrowed storage.
    EXPECT_EQ(m["w"].storage(), m["wt"].storage());
    EXPECT_TRUE(m["w"].storage()->borrowed());
  }
}

TEST(TorchPt, ConvertsToSafetensorsThroughTheCli) {
  TempDir dir;
  write_bytes(dir.file("m.pt"), torch_zip(state_dict_pickle()));
  const std::string cmd = std::string(KILN_CLI_COMMAND) + " convert " + dir.file("m.pt") + " " + dir.file("m.safetensors") +
                          " > /dev/null";
  ASSERT_EQ(std::system(cmd.c_str()), 0);
  TensorMap a = load(dir.file("m.pt")), b = load(dir.file("m.safetensors"));
  ASSERT_EQ(a.size(), b.size());
  for (size_t k = 0; k < a.size(); ++k) {
    EXPECT_EQ(a[k].first, b[k].first);
    EXPECT_TRUE(same_bits(b[k].second, a[k].second.contiguous(), a[k].first));
  }
}

void expect_refused(const std::string& path, const std::string& needle) {
  try {
    load(path);
    ADD_FAILURE() << "accepted; expected an error containing " << needle;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(TorchPt, MaliciousGlobalsAreRefusedNotRun) {
  TempDir dir;
  const std::string marker = dir.file("pwned");
  // os.system("touch <marker>") via GLOBAL + REDUCE.
  Pickle a;
  a.global("os", "system").op('(').str("touch " + marker).op('t').op('R');
  write_bytes(dir.file("a.pt"), make_zip({{"archive/data.pkl", a.done()}}, false));
  expect_refused(dir.file("a.pt"), "'os.system'");
  // builtins.eval via STACK_GLOBAL (protocol 4 opcodes).
  Pickle b;
  b.b = "\x80\x04";
  b.str("builtins").str("eval").op('\x93').op('(').str("__import__('os').system('touch " + marker + "')").op('t').op('R');
  write_bytes(dir.file("b.pt"), make_zip({{"archive/data.pkl", b.done()}}, false));
  expect_refused(dir.file("b.pt"), "'builtins.eval'");
  // A callable that is allowed as a name but not as a call target.
  Pickle c;
  c.global("torch", "FloatStorage").op(')').op('R');
  write_bytes(dir.file("c.pt"), make_zip({{"archive/data.pkl", c.done()}}, false));
  expect_refused(dir.file("c.pt"), "cannot be called");
  EXPECT_FALSE(std::filesystem::exists(marker));
}

TEST(TorchPt, MalformedArchivesAreErrors) {
  TempDir dir;
  const std::string good = torch_zip(state_dict_pickle());
  // Truncated: the end record is gone.
  write_bytes(dir.file("t.pt"), good.substr(0, good.size() / 2));
  expect_refused(dir.file("t.pt"), "end-of-central-directory");
  // A tensor reaching past its storage.
  Pickle big;
  big.tensor("FloatStorage", "0", 6, 4, {2, 3}, {3, 1});
  write_bytes(dir.file("o.pt"), make_zip({{"archive/data.pkl", big.done()}, {"archive/data/0", f32_bytes({1, 2, 3, 4, 5, 6})}}, false));
  expect_refused(dir.file("o.pt"), "reaches past its storage");
  // Missing storage entry.
  Pickle miss;
  miss.tensor("FloatStorage", "9", 6, 0, {6}, {1});
  write_bytes(dir.file("m.pt"), make_zip({{"archive/data.pkl", miss.done()}}, false));
  expect_refused(dir.file("m.pt"), "missing from the archive");
  // Storage type with no kiln dtype.
  Pickle cplx;
  cplx.tensor("ComplexFloatStorage", "0", 1, 0, {1}, {1});
  write_bytes(dir.file("c.pt"), make_zip({{"archive/data.pkl", cplx.done()}, {"archive/data/0", std::string(8, '\0')}}, false));
  expect_refused(dir.file("c.pt"), "ComplexFloatStorage");
  // Truncated pickle, unknown opcode, memo miss.
  write_bytes(dir.file("p1.pt"), make_zip({{"archive/data.pkl", std::string("\x80\x02(X\xff\x00\x00\x00" "ab", 10)}}, false));
  expect_refused(dir.file("p1.pt"), "runs past the end");
  write_bytes(dir.file("p2.pt"), make_zip({{"archive/data.pkl", std::string("\x80\x02\xfe.", 4)}}, false));
  expect_refused(dir.file("p2.pt"), "opcode 0xfe");
  write_bytes(dir.file("p3.pt"), make_zip({{"archive/data.pkl", std::string("\x80\x02h\x05.", 4)}}, false));
  expect_refused(dir.file("p3.pt"), "memo key 5");
  // A str that is not UTF-8 (Python's unpickler refuses it; kept as a name, convert wrote
  // safetensors that no reader took).
  Pickle bad_name;
  bad_name.op('}').str("\xff").i(1).op('s');
  write_bytes(dir.file("u.pt"), make_zip({{"archive/data.pkl", bad_name.done()}}, false));
  expect_refused(dir.file("u.pt"), "not valid UTF-8");
  // A zip that is not a torch checkpoint.
  write_bytes(dir.file("z.pt"), make_zip({{"readme.txt", "hi"}}, false));
  expect_refused(dir.file("z.pt"), "without a data.pkl");
  // A flipped bit in a tensor's data (or in the pickle) fails the entry's CRC-32, naming it;
  // it used to load (and convert) silently with the wrong value.
  {
    const std::string data0 = "archive/data/0";
    std::string flipped = good;
    const size_t at = flipped.find(f32_bytes({1.0f}));  // the first stored value of archive/data/0
    ASSERT_NE(at, std::string::npos);
    flipped[at + 3] = static_cast<char>(flipped[at + 3] ^ 0x01);
    write_bytes(dir.file("flip.pt"), flipped);
    expect_refused(dir.file("flip.pt"), "zip entry '" + data0 + "' fails its CRC-32 check");
    EXPECT_EQ(crc32("123456789"), 0xCBF43926u);  // the standard check value of CRC-32 (IEEE)
    EXPECT_EQ(crc32(""), 0u);
    EXPECT_EQ(crc32("56789", crc32("1234")), 0xCBF43926u);  // continued
  }
  // Every truncation of a good file is an error or a valid load, never a crash.
  for (size_t n = 0; n < good.size(); n += 37) {
    write_bytes(dir.file("cut.pt"), good.substr(0, n));
    try {
      load(dir.file("cut.pt"));
    } catch (const Error&) {
    }
  }
}

// Pickles nesting containers 200,000 deep, of every kind the unpickler builds, are refused at
// its depth limit as they are read (they overflowed the stack of `kiln inspect` and `kiln
// convert`, while building and again while freeing the tree).
TEST(TorchPt, DeepPicklesAreRefusedForEveryContainerKind) {
  TempDir dir;
  constexpr int N = 200000;
  auto rep = [](const std::string& s, int n) {
    std::string out;
    out.reserve(s.size() * static_cast<size_t>(n));
    for (int k = 0; k < n; ++k) out += s;
    return out;
  };
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"LIST", rep("(", N) + rep("l", N)},
      {"TUPLE", rep("(", N) + rep("t", N)},
      {"TUPLE1", ")" + rep("\x85", N)},
      {"APPEND", rep("]", N) + rep("a", N - 1)},
      {"APPENDS", rep("](", N) + "]" + rep("e", N)},
      {"DICT", rep("(K\x01", N) + "}" + rep("d", N)},
      {"SETITEM", "}" + rep("K\x01}", N - 1) + rep("s", N - 1)},
      {"SETITEMS", rep("}(K\x01", N) + "}" + rep("u", N)},
  };
  for (const auto& [kind, body] : cases) {
    SCOPED_TRACE(kind);
    write_bytes(dir.file("deep.pt"), make_zip({{"archive/data.pkl", "\x80\x02" + body + "."}}, false));
    expect_refused(dir.file("deep.pt"), "nests containers deeper than 1000 levels");
  }
  // 1000 levels is the limit, not an error (the tree is read, and is no tensor).
  write_bytes(dir.file("ok.pt"), make_zip({{"archive/data.pkl", "\x80\x02" + rep("(", 999) + rep("l", 999) + "."}}, false));
  expect_refused(dir.file("ok.pt"), "nests containers deeper than 64");  // flatten's own limit, with no crash
  // A container may not grow once inside another (its parent's depth would be stale: nesting
  // grown from the inside out), nor hold itself.
  write_bytes(dir.file("grow.pt"),
              make_zip({{"archive/data.pkl", std::string("\x80\x02]q\x00]q\x01" "a0h\x01]a.", 15)}}, false));
  expect_refused(dir.file("grow.pt"), "APPEND adds to a list that is already inside another container");
  write_bytes(dir.file("self.pt"), make_zip({{"archive/data.pkl", std::string("\x80\x02]q\x00h\x00" "a.", 9)}}, false));
  expect_refused(dir.file("self.pt"), "APPEND puts a list inside itself");
}

// Freeing a deep tree uses no recursion proportional to its depth.
TEST(TorchPt, DeepObjectTreesAreFreedWithoutRecursion) {
  pickle::Ref root = pickle::Object::make(pickle::Object::Kind::list);
  pickle::Object* at = root.get();
  for (int k = 0; k < 2000000; ++k) {
    auto child = pickle::Object::make(k % 2 ? pickle::Object::Kind::list : pickle::Object::Kind::dict);
    if (at->kind == pickle::Object::Kind::dict) at->entries.emplace_back(pickle::Object::make(pickle::Object::Kind::none), child);
    else at->items.push_back(child);
    at = child.get();
  }
  pickle::Ref shared = root->items[0];  // a subtree still referenced elsewhere survives
  root.reset();
  ASSERT_EQ(shared->entries.size(), 1u);
  shared.reset();
}

// A zip directory naming an entry twice, or entries whose bytes overlap, is refused at once
// (12,000 entries pointing at one 20 MB member took 47 s: each was checksummed).
TEST(TorchPt, DuplicateAndOverlappingZipEntriesAreRefused) {
  TempDir dir;
  Pickle p;
  p.tensor("FloatStorage", "0", 2, 0, {2}, {1});
  const std::string pkl = p.done();
  write_bytes(dir.file("dup.pt"), make_zip({{"archive/data.pkl", pkl}, {"archive/data/0", f32_bytes({1, 2})},
                                            {"archive/data/0", f32_bytes({3, 4})}}, false));
  expect_refused(dir.file("dup.pt"), "names the entry 'archive/data/0' more than once");
  // Every directory entry after the first pointed at the first entry's local header.
  std::vector<std::pair<std::string, std::string>> many = {{"archive/data.pkl", pkl},
                                                           {"archive/data/big", std::string(1 << 20, 'x')}};
  for (int k = 0; k < 3000; ++k) many.emplace_back("archive/data/" + std::to_string(k), "");
  std::string zip = make_zip(many, false);
  size_t big_local = std::string::npos;
  for (size_t at = 0, seen = 0; (at = zip.find("PK\x01\x02", at)) != std::string::npos; ++at, ++seen) {
    if (seen == 1) big_local = static_cast<unsigned char>(zip[at + 42]) | static_cast<unsigned char>(zip[at + 43]) << 8 |
                               static_cast<unsigned char>(zip[at + 44]) << 16 | static_cast<size_t>(static_cast<unsigned char>(zip[at + 45])) << 24;
    if (seen >= 2) {  // the empty members now point at the 1 MB one
      std::string off;
      put_le(off, big_local, 4);
      zip.replace(at + 42, 4, off);
      std::string sz;
      put_le(sz, 1 << 20, 4);
      zip.replace(at + 20, 4, sz);
      zip.replace(at + 24, 4, sz);
      std::string crc;
      put_le(crc, crc32(std::string(1 << 20, 'x')), 4);
      zip.replace(at + 16, 4, crc);
    }
  }
  write_bytes(dir.file("overlap.pt"), zip);
  const auto t0 = std::chrono::steady_clock::now();
  expect_refused(dir.file("overlap.pt"), "overlap in the file");
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 1.0);
}

TEST(TorchPt, AllowListIsSmall) {
  const auto& g = torch_allowed_globals();
  EXPECT_NE(std::find(g.begin(), g.end(), "torch._utils._rebuild_tensor_v2"), g.end());
  EXPECT_EQ(std::find(g.begin(), g.end(), "builtins.eval"), g.end());
  EXPECT_NE(std::find(g.begin(), g.end(), "torch._utils._rebuild_tensor_v3"), g.end());
  EXPECT_LT(g.size(), 40u);
  // Only torch's tensor/storage/dtype rebuilders and OrderedDict: nothing that runs code.
  for (const auto& name : g)
    EXPECT_TRUE(name.rfind("torch.", 0) == 0 || name == "collections.OrderedDict") << name;
}

}  // namespace
}  // namespace kiln::io
