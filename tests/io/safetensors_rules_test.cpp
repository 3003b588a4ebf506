// The safetensors reader's strictness: the golden byte vectors of the format's documentation
// (Hugging Face's test vectors), then one crafted bad file per rule, each refused with a
// kiln::Error naming the tensor and the rule.
#include <gtest/gtest.h>

#include <sys/stat.h>

#include <cstring>
#include <functional>

#include "kiln/io/load.h"
#include "kiln/io/safetensors.h"
#include "tests/io/io_test_util.h"

namespace kiln::io {
namespace {

std::string le64(uint64_t n) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[static_cast<size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xFF);
  return s;
}
std::string st_bytes(const std::string& header, const std::string& data) { return le64(header.size()) + header + data; }

// The documented vector: {"test": int32 zeros [2, 2]}, header padded with spaces to 64 bytes.
const std::string kGoldenPadded = std::string("@\0\0\0\0\0\0\0", 8) +
                                  R"({"test":{"dtype":"I32","shape":[2,2],"data_offsets":[0,16]}})" + "    " +
                                  std::string(16, '\0');

TEST(SafetensorsGolden, WriterProducesTheDocumentedBytes) {
  TempDir dir;
  save_safetensors(dir.file("g.safetensors"), TensorMap{{"test", zeros({2, 2}, DType::i32)}});
  EXPECT_EQ(read_bytes(dir.file("g.safetensors")), kGoldenPadded);
}

TEST(SafetensorsGolden, ReaderReadsTheDocumentedVectors) {
  TempDir dir;
  // Padded (current writers), unpadded (older writers), and with metadata after the tensor.
  std::string vals;
  for (int32_t v : {1, 2, 3, 4}) vals.append(reinterpret_cast<const char*>(&v), 4);
  const std::string unpadded = st_bytes(R"({"test":{"dtype":"I32","shape":[2,2],"data_offsets":[0,16]}})", vals);
  const std::string with_meta = st_bytes(
      R"({"test":{"dtype":"I32","shape":[2,2],"data_offsets":[0,16]},"__metadata__":{"foo":"bar"}})", vals);
  EXPECT_EQ(with_meta[0], 'Y');
  EXPECT_EQ(unpadded[0], '<');
  write_bytes(dir.file("p"), kGoldenPadded);
  write_bytes(dir.file("u"), unpadded);
  write_bytes(dir.file("m"), with_meta);
  auto p = load_safetensors(dir.file("p"));
  ASSERT_EQ(p.size(), 1u);
  EXPECT_EQ(p[0].second.to_vector<int32_t>(), std::vector<int32_t>(4, 0));
  auto u = load_safetensors(dir.file("u"));
  EXPECT_EQ(u[0].second.to_vector<int32_t>(), (std::vector<int32_t>{1, 2, 3, 4}));
  EXPECT_EQ(u[0].second.shape(), (Shape{2, 2}));
  Metadata md;
  auto m = load_safetensors(dir.file("m"), &md);
  EXPECT_EQ(md, (Metadata{{"foo", "bar"}}));
  EXPECT_EQ(m[0].second.to_vector<int32_t>(), (std::vector<int32_t>{1, 2, 3, 4}));
}

TEST(SafetensorsGolden, ScalarsZeroSizeAndRawDtypes) {
  TempDir dir;
  // scalar F32 (4 bytes), zero-size I64, F4 [3, 2] (3 bytes), U16 [2] (4 bytes).
  std::string h = R"({"s":{"dtype":"F32","shape":[],"data_offsets":[0,4]},)"
                  R"("z":{"dtype":"I64","shape":[0,3],"data_offsets":[4,4]},)"
                  R"("f4":{"dtype":"F4","shape":[3,2],"data_offsets":[4,7]},)"
                  R"("u":{"dtype":"U16","shape":[2],"data_offsets":[7,11]}})";
  float one = 1.5f;
  std::string data(reinterpret_cast<const char*>(&one), 4);
  data += std::string("\x12\x34\x56", 3) + std::string("\xff\xff\x01\x00", 4);
  write_bytes(dir.file("r"), st_bytes(h, data));
  SafetensorsFile f = SafetensorsFile::open(dir.file("r"));
  StoredTensors all = f.tensors();
  ASSERT_EQ(all.size(), 4u);
  // Sorted by name: f4, s, u, z.
  EXPECT_EQ(all[0].dtype, "F4");
  EXPECT_TRUE(all[0].raw());
  EXPECT_EQ(all[0].shape, (Shape{3, 2}));
  EXPECT_EQ(all[0].data.to_vector<uint8_t>(), (std::vector<uint8_t>{0x12, 0x34, 0x56}));
  EXPECT_EQ(all[1].data.item(), 1.5);
  EXPECT_EQ(all[1].data.dim(), 0);
  EXPECT_TRUE(all[2].raw());
  EXPECT_EQ(all[2].data.numel(), 4);
  EXPECT_EQ(all[3].data.shape(), (Shape{0, 3}));
  // load_safetensors refuses the raw ones, naming them.
  try {
    load_safetensors(dir.file("r"));
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'f4'"), std::string::npos) << e.what();
  }
  // Raw tensors are copied through unchanged by the StoredTensors writer.
  save_safetensors(dir.file("copy"), all);
  StoredTensors again = SafetensorsFile::open(dir.file("copy")).tensors();
  ASSERT_EQ(again.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(again[i].name, all[i].name);
    EXPECT_EQ(again[i].dtype, all[i].dtype);
    EXPECT_EQ(again[i].shape, all[i].shape);
    EXPECT_EQ(tensor_bytes(again[i].data), tensor_bytes(all[i].data));
  }
}

struct BadCase {
  const char* label;
  std::string bytes;
  const char* must_contain;  // the rule
  const char* tensor;        // the tensor named, or nullptr
};

std::vector<BadCase> bad_cases() {
  const std::string d16(16, '\0');
  const std::string ok_entry = R"("a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]})";
  std::vector<BadCase> v;
  v.push_back({"too short", std::string("\x05\0\0", 3), "too short", nullptr});
  v.push_back({"header too long", le64(kMaxSafetensorsHeader + 1) + "{}", "header length", nullptr});
  v.push_back({"header past end", le64(100) + "{}", "header length", nullptr});
  v.push_back({"not {", st_bytes(R"(["a"])", ""), "does not start with '{'", nullptr});
  v.push_back({"leading space", st_bytes(R"( {})", ""), "does not start with '{'", nullptr});
  v.push_back({"bad json", st_bytes(R"({"a":)", ""), "not valid JSON", nullptr});
  v.push_back({"trailing garbage", st_bytes(R"({}x)", ""), "not valid JSON", nullptr});
  v.push_back({"invalid utf8", st_bytes(std::string("{\"a\xff\":{}}"), ""), "UTF-8", nullptr});
  v.push_back({"nesting", st_bytes(R"({"a":{"dtype":[[[[[[[[[[1]]]]]]]]]]}})", ""), "nesting", nullptr});
  v.push_back({"duplicate", st_bytes("{" + ok_entry + "," + ok_entry + "}", d16), "unique names", "'a'"});
  v.push_back({"metadata not object", st_bytes(R"({"__metadata__":"x"})", ""), "metadata", nullptr});
  v.push_back({"metadata non-string", st_bytes(R"({"__metadata__":{"k":1}})", ""), "string to string", nullptr});
  v.push_back({"entry not object", st_bytes(R"({"a":[1]})", ""), "tensor entries", "'a'"});
  v.push_back({"missing field", st_bytes(R"({"a":{"dtype":"F32","shape":[1]}})", ""), "data_offsets", "'a'"});
  v.push_back({"unknown field", st_bytes(R"({"a":{"dtype":"F32","shape":[],"data_offsets":[0,4],"x":1}})", std::string(4, '\0')),
               "unknown field", "'a'"});
  v.push_back({"unknown dtype", st_bytes(R"({"a":{"dtype":"F128","shape":[1],"data_offsets":[0,16]}})", d16),
               "unknown dtype", "'a'"});
  v.push_back({"negative dim", st_bytes(R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", std::string(4, '\0')),
               "negative", "'a'"});
  v.push_back({"float dim", st_bytes(R"({"a":{"dtype":"F32","shape":[1.5],"data_offsets":[0,4]}})", std::string(4, '\0')),
               "integer", "'a'"});
  v.push_back({"shape overflow",
               st_bytes(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,4]}})", std::string(4, '\0')),
               "overflow", "'a'"});
  v.push_back({"bits overflow",
               st_bytes(R"({"a":{"dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,4]}})", std::string(4, '\0')),
               "overflow", "'a'"});
  v.push_back({"odd F4", st_bytes(R"({"a":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}})", std::string(2, '\0')),
               "multiple of 8", "'a'"});
  v.push_back({"size mismatch", st_bytes(R"({"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,12]}})", std::string(12, '\0')),
               "size matches", "'a'"});
  v.push_back({"end before begin", st_bytes(R"({"a":{"dtype":"U8","shape":[0],"data_offsets":[4,0]}})", std::string(4, '\0')),
               "end before begin", "'a'"});
  v.push_back({"not starting at 0", st_bytes(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[4,8]}})", std::string(8, '\0')),
               "start at 0", "'a'"});
  v.push_back({"hole",
               st_bytes(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[6,10]}})",
                        std::string(10, '\0')),
               "no hole", "'b'"});
  v.push_back({"overlap",
               st_bytes(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})",
                        std::string(6, '\0')),
               "no overlap", "'b'"});
  v.push_back({"data shorter than offsets", st_bytes("{" + ok_entry + "}", std::string(8, '\0')), "last byte", nullptr});
  v.push_back({"trailing bytes (polyglot)", st_bytes("{" + ok_entry + "}", d16 + "PK"), "last byte", nullptr});
  v.push_back({"offsets not pair", st_bytes(R"({"a":{"dtype":"U8","shape":[0],"data_offsets":[0]}})", ""),
               "data_offsets", "'a'"});
  return v;
}

TEST(SafetensorsRules, EveryViolationIsANamedError) {
  TempDir dir;
  for (const auto& c : bad_cases()) {
    const std::string path = dir.file("bad.safetensors");
    write_bytes(path, c.bytes);
    try {
      SafetensorsFile::open(path);
      ADD_FAILURE() << c.label << ": accepted";
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(c.must_contain), std::string::npos) << c.label << ": " << msg;
      if (c.tensor) {
        EXPECT_NE(msg.find(c.tensor), std::string::npos) << c.label << ": " << msg;
      }
      EXPECT_NE(msg.find(path), std::string::npos) << c.label << ": " << msg;
    }
  }
}

TEST(SafetensorsRules, ZeroSizeTensorsMayShareAnOffset) {
  TempDir dir;
  write_bytes(dir.file("z"), st_bytes(R"({"a":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},)"
                                      R"("b":{"dtype":"F16","shape":[2,0],"data_offsets":[0,0]},)"
                                      R"("c":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})",
                                      "\x07"));
  auto t = load_safetensors(dir.file("z"));
  ASSERT_EQ(t.size(), 3u);
  EXPECT_EQ(t[2].second.to_vector<uint8_t>(), std::vector<uint8_t>{7});
}

TEST(SafetensorsRules, LoadSniffsByContent) {
  TempDir dir;
  write_bytes(dir.file("weights.bin"), kGoldenPadded);  // extension does not matter
  EXPECT_EQ(sniff_format(dir.file("weights.bin")), FileFormat::safetensors);
  EXPECT_EQ(load(dir.file("weights.bin")).size(), 1u);
  write_bytes(dir.file("junk.safetensors"), "hello world, not a tensor file");
  try {
    load(dir.file("junk.safetensors"));
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("kiln reads safetensors"), std::string::npos) << e.what();
  }
  // A legacy (pre-zip) torch pickle starts with PROTO 2 then LONG1 (the magic number).
  write_bytes(dir.file("old.pt"), std::string("\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19.", 15));
  EXPECT_EQ(sniff_format(dir.file("old.pt")), FileFormat::torch_legacy);
  try {
    load(dir.file("old.pt"));
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("legacy PyTorch"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("torch.save"), std::string::npos) << e.what();
  }
}

// A pipe or a device is refused at once, naming what it is: opening a FIFO with no writer used to
// block kiln inspect / load forever (open() waits for a writer), and /dev/zero is endless.
TEST(SafetensorsRules, PipesAndDevicesAreRefusedWithoutWaiting) {
  TempDir dir;
  const std::string fifo = dir.file("model.safetensors");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  auto expect_refused = [](const std::function<void()>& f, const std::string& what) {
    try {
      f();
      ADD_FAILURE() << "no error for " << what;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("not a regular file: it is " + what), std::string::npos) << e.what();
    }
  };
  expect_refused([&] { sniff_format(fifo); }, "a pipe (FIFO)");
  expect_refused([&] { load(fifo); }, "a pipe (FIFO)");
  expect_refused([&] { load("/dev/zero"); }, "a character device");
  expect_refused([&] { load_safetensors("/dev/null"); }, "a character device");
}

}  // namespace
}  // namespace kiln::io
