// Sharded checkpoints (Hugging Face layout) written and read back; the index's consistency
// rules; checkpoint folders; the CLI on them and on bad files.
#include <gtest/gtest.h>

#include <filesystem>

#include "kiln/io/json.h"
#include "kiln/io/load.h"
#include "kiln/io/sharded.h"
#include "tests/io/io_test_util.h"

namespace kiln::io {
namespace {

TensorMap some_tensors(Generator& gen) {
  TensorMap t;
  for (int k = 0; k < 7; ++k) t.emplace_back("layer." + std::to_string(k) + ".w", randn({16, 1 + k}, gen));
  t.emplace_back("emb", randn({33, 8}, gen, DType::bf16));
  return t;
}

TEST(Sharded, WritesHuggingFaceLayoutAndReadsItBack) {
  TempDir dir;
  Generator gen(11);
  TensorMap in = some_tensors(gen);
  auto files = save_sharded(dir.file("ckpt"), in, 256, {{"format", "pt"}});
  ASSERT_GT(files.size(), 2u);
  const size_t n = files.size() - 1;
  char first[64];
  std::snprintf(first, sizeof first, "model-00001-of-%05zu.safetensors", n);
  EXPECT_TRUE(std::filesystem::exists(dir.file("ckpt/") + first));
  json::Value idx = json::parse(read_bytes(dir.file("ckpt/model.safetensors.index.json")));
  uint64_t total = 0;
  for (const auto& [name, t] : in) total += t.nbytes();
  EXPECT_EQ(static_cast<uint64_t>(idx.find("metadata")->find("total_size")->as_int()), total);
  EXPECT_EQ(idx.find("weight_map")->size(), in.size());
  for (const std::string& p : {dir.file("ckpt"), dir.file("ckpt/model.safetensors.index.json")}) {
    Metadata md;
    StoredTensors got = load_stored(p, &md);
    EXPECT_EQ(md, (Metadata{{"format", "pt"}}));
    ASSERT_EQ(got.size(), in.size());
    for (const auto& [name, t] : in) {
      auto it = std::find_if(got.begin(), got.end(), [&](const StoredTensor& s) { return s.name == name; });
      ASSERT_NE(it, got.end()) << name;
      EXPECT_TRUE(same_bits(it->data, t, name));
    }
  }
}

TEST(Sharded, OneShardIsAPlainModelFile) {
  TempDir dir;
  Generator gen(12);
  auto files = save_sharded(dir.path(), some_tensors(gen), uint64_t{1} << 30);
  ASSERT_EQ(files.size(), 1u);
  EXPECT_EQ(files[0], dir.file("model.safetensors"));
  EXPECT_EQ(load(dir.path()).size(), 8u);
}

TEST(Sharded, ASaveReplacesTheOtherFormOfAnEarlierOne) {
  TempDir dir;
  Generator gen(15);
  TensorMap a = some_tensors(gen), b{{"only", randn({4, 4}, gen)}};
  save_sharded(dir.path(), a, 256);  // an index and shards
  save_sharded(dir.path(), b, uint64_t{1} << 30);  // one model.safetensors
  EXPECT_FALSE(std::filesystem::exists(dir.file(kIndexFile)));
  TensorMap got = load(dir.path());
  ASSERT_EQ(got.size(), 1u);
  EXPECT_TRUE(same_bits(got[0].second, b[0].second, "only"));
  save_sharded(dir.path(), a, 256);  // shards again: the model.safetensors goes
  EXPECT_FALSE(std::filesystem::exists(dir.file("model.safetensors")));
  EXPECT_EQ(load(dir.path()).size(), a.size());
}

TEST(Sharded, InconsistentIndexesAreErrors) {
  TempDir dir;
  Generator gen(13);
  save_sharded(dir.path(), some_tensors(gen), 256);
  const std::string index = dir.file("model.safetensors.index.json");
  json::Value idx = json::parse(read_bytes(index));
  auto expect_error = [&](const json::Value& doc, const std::string& needle) {
    write_bytes(dir.file("bad.index.json"), doc.dump());
    try {
      load(dir.file("bad.index.json"));
      ADD_FAILURE() << "accepted: " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  json::Value extra = idx;
  extra["weight_map"]["ghost"] = "model-00001-of-00009.safetensors";
  expect_error(extra, "cannot open");
  json::Value missing = idx;
  auto& wm = missing["weight_map"].as_object();
  // Drop a tensor whose shard holds others too (so that shard is still read).
  auto shared = std::find_if(wm.begin(), wm.end(), [&](const auto& kv) {
    return std::count_if(wm.begin(), wm.end(), [&](const auto& o) { return o.second.as_string() == kv.second.as_string(); }) > 1;
  });
  ASSERT_NE(shared, wm.end());
  wm.erase(shared);
  expect_error(missing, "does not list");
  json::Value escape = idx;
  escape["weight_map"]["emb"] = "../../etc/passwd";
  expect_error(escape, "not a file name");
  json::Value nul = idx;  // a NUL cut the name short: a.safetensors was opened for a.safetensors\0x
  nul["weight_map"]["emb"] = std::string("model-00001-of-00002.safetensors\0x", 34);
  expect_error(nul, "not a file name");
  json::Value self = idx;
  self["weight_map"]["emb"] = "bad.index.json";  // the index itself: no endless recursion
  expect_error(self, "shard bad.index.json is a sharded-checkpoint index, not a checkpoint file");
  json::Value no_map = json::Value::object();
  no_map["metadata"] = json::Value::object();
  expect_error(no_map, "weight_map");
}

int run_cli(const std::string& args, std::string* out) {
  const std::string cmd = std::string(KILN_CLI_COMMAND) + " " + args + " > " + out[0] + " 2>&1";
  return std::system(cmd.c_str());
}

TEST(Cli, InspectAndConvert) {
  TempDir dir;
  Generator gen(14);
  save_sharded(dir.file("ck"), some_tensors(gen), 300, {{"k", "v"}});
  std::string log = dir.file("log");
  ASSERT_EQ(run_cli("inspect " + dir.file("ck") + " --json", &log), 0);
  json::Value doc = json::parse(read_bytes(log));
  EXPECT_EQ(doc.find("total_tensors")->as_int(), 8);
  EXPECT_EQ(doc.find("metadata")->find("k")->as_string(), "v");
  ASSERT_EQ(run_cli("convert " + dir.file("ck/model.safetensors.index.json") + " " + dir.file("one.safetensors"), &log), 0);
  TensorMap a = load(dir.file("ck")), b = load(dir.file("one.safetensors"));
  ASSERT_EQ(a.size(), b.size());
  for (size_t k = 0; k < a.size(); ++k) EXPECT_TRUE(same_bits(b[k].second, a[k].second, a[k].first));
  ASSERT_EQ(run_cli("convert " + dir.file("one.safetensors") + " " + dir.file("resharded") + " --shard-size 1KB", &log), 0);
  EXPECT_TRUE(std::filesystem::exists(dir.file("resharded/model.safetensors.index.json")));
  ASSERT_EQ(run_cli("inspect " + dir.file("one.safetensors"), &log), 0);
  EXPECT_NE(read_bytes(log).find("layer.6.w"), std::string::npos);
  // Bad file: non-zero exit, one line naming the rule.
  write_bytes(dir.file("bad.safetensors"), std::string("\x10\0\0\0\0\0\0\0{\"a\":1} x       ", 24));
  EXPECT_NE(run_cli("inspect " + dir.file("bad.safetensors"), &log), 0);
  const std::string msg = read_bytes(log);
  EXPECT_NE(msg.find("not valid JSON"), std::string::npos) << msg;
  EXPECT_EQ(std::count(msg.begin(), msg.end(), '\n'), 1) << msg;
  EXPECT_NE(run_cli("convert " + dir.file("bad.safetensors") + " " + dir.file("x.safetensors"), &log), 0);
  EXPECT_FALSE(std::filesystem::exists(dir.file("x.safetensors")));
  EXPECT_NE(run_cli("convert " + dir.file("one.safetensors") + " o --shard-size inf", &log), 0);
  EXPECT_NE(read_bytes(log).find("'inf' is too large"), std::string::npos) << read_bytes(log);
  // A valid safetensors file holding no tensors (Python's safetensors writes and reads one)
  // round-trips through convert.
  save_safetensors(dir.file("empty.safetensors"), TensorMap{});
  EXPECT_EQ(run_cli("convert " + dir.file("empty.safetensors") + " " + dir.file("e2.safetensors"), &log), 0)
      << read_bytes(log);
  ASSERT_TRUE(std::filesystem::exists(dir.file("e2.safetensors")));
  EXPECT_TRUE(load_safetensors(dir.file("e2.safetensors")).empty());
  EXPECT_EQ(run_cli("inspect " + dir.file("empty.safetensors"), &log), 0);  // inspect still lists it
}

TEST(Cli, ConvertNeverReplacesItsInput) {
  TempDir dir;
  Generator gen(16);
  const std::string shard = save_sharded(dir.file("ck"), some_tensors(gen), 300).at(0);
  save_safetensors(dir.file("one.safetensors"), some_tensors(gen));
  std::filesystem::create_symlink("one.safetensors", dir.file("link.safetensors"));
  std::filesystem::copy_file(std::string(KILN_SOURCE_DIR) + "/tests/io/fixtures/checkpoint.pt", dir.file("m.pt"));
  const std::string one = read_bytes(dir.file("one.safetensors")), pt = read_bytes(dir.file("m.pt"));
  const std::string first = read_bytes(shard);
  const std::string index = read_bytes(dir.file("ck/model.safetensors.index.json"));
  auto convert = [&](const std::string& args) {  // in the folder, so that relative paths name its files
    return std::system(("cd " + dir.path() + " && " + KILN_CLI_COMMAND + " convert " + args + " > log 2>&1").c_str());
  };
  for (const std::string& args : std::vector<std::string>{
           "one.safetensors " + dir.file("one.safetensors"), "m.pt ./m.pt", "link.safetensors one.safetensors",
           "ck " + shard, "ck ck/model.safetensors.index.json", shard + " ck --shard-size 100B",
           "ck " + dir.file("ck/") + " --shard-size 1GB"}) {
    EXPECT_NE(convert(args), 0) << args;
    const std::string msg = read_bytes(dir.file("log"));
    EXPECT_NE(msg.find("the input file"), std::string::npos) << args << ": " << msg;
    EXPECT_EQ(std::count(msg.begin(), msg.end(), '\n'), 1) << msg;
  }
  EXPECT_TRUE(read_bytes(dir.file("one.safetensors")) == one) << "one.safetensors changed";
  EXPECT_TRUE(read_bytes(dir.file("m.pt")) == pt) << "m.pt changed";
  EXPECT_TRUE(read_bytes(shard) == first) << shard << " changed";
  EXPECT_TRUE(read_bytes(dir.file("ck/model.safetensors.index.json")) == index) << "the index changed";
  EXPECT_FALSE(std::filesystem::exists(dir.file("ck/model.safetensors")));
  // Next to the input, or into a folder that holds none of its files, is fine.
  EXPECT_EQ(convert("ck ck/all.safetensors"), 0) << read_bytes(dir.file("log"));
  EXPECT_EQ(convert("one.safetensors ck2 --shard-size 100B"), 0) << read_bytes(dir.file("log"));
  EXPECT_EQ(load(dir.file("ck")).size(), load(dir.file("ck/all.safetensors")).size());
}

}  // namespace
}  // namespace kiln::io
