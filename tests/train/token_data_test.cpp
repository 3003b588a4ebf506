// Token files (kiln/data/token_file.h): llm.c's header format and nanoGPT's flat uint16, in
// both dtypes, with and without a sidecar; truncated, empty and out-of-vocabulary files; the
// random:V source; kiln tokenize's round trip; and training on token data (the checkpoint
// records the vocabulary).
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>

#include "kiln/core/error.h"
#include "kiln/data/dataset.h"
#include "kiln/data/token_file.h"
#include "kiln/io/json.h"
#include "tests/train/train_test_util.h"

namespace kiln {
namespace {

namespace fs = std::filesystem;

template <class T>
void write_raw(const fs::path& p, const std::vector<T>& v, const std::vector<int32_t>& header = {}) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  if (!header.empty()) f.write(reinterpret_cast<const char*>(header.data()), header.size() * 4);
  f.write(reinterpret_cast<const char*>(v.data()), static_cast<std::streamsize>(v.size() * sizeof(T)));
}

void write_text(const fs::path& p, const std::string& s) { std::ofstream(p, std::ios::binary) << s; }

std::vector<int32_t> read_all(const data::TokenSource& t) {
  std::vector<int32_t> v(t.size());
  for (size_t i = 0; i < t.size(); ++i) v[i] = t[i];
  return v;
}

std::vector<int32_t> random_ids(size_t n, int32_t vocab, uint32_t seed) {
  std::mt19937 g(seed);
  std::vector<int32_t> v(n);
  for (auto& x : v) x = static_cast<int32_t>(g() % static_cast<uint32_t>(vocab));
  v[n / 2] = vocab - 1;  // the largest id is allowed
  return v;
}

using test::error_of;

std::vector<int32_t> llmc_header(int version, int32_t count) {
  std::vector<int32_t> h(256, 0);
  h[0] = 20240520;
  h[1] = version;
  h[2] = count;
  return h;
}

TEST(TokenFile, ReadsLlmcAndFlatFilesInBothDtypes) {
  const fs::path dir = test::temp_dir("tokfile_formats");
  const uint32_t seed = static_cast<uint32_t>(std::random_device{}());
  SCOPED_TRACE("seed " + std::to_string(seed));
  // llm.c, written by kiln (uint16 up to 65536 ids, uint32 beyond), read back with the sidecar's vocabulary
  for (int32_t vocab : {300, 65536, 128256}) {
    const std::vector<int32_t> ids = random_ids(1001, vocab, seed + vocab);
    const fs::path p = dir / ("kiln" + std::to_string(vocab) + ".bin");
    data::write_token_file(p.string(), ids, vocab, "byte");
    auto t = data::TokenSource::open_file(p.string(), 0);
    EXPECT_EQ(read_all(*t), ids);
    EXPECT_EQ(t->vocab(), vocab);
    EXPECT_EQ(t->format(), vocab <= 65536 ? "llm.c v1 (uint16)" : "llm.c v2 (uint32)");
    EXPECT_EQ(t->tokenizer(), "byte");
    EXPECT_EQ(fs::file_size(p), 1024u + ids.size() * (vocab <= 65536 ? 2 : 4));
  }
  // llm.c as its own scripts write it (no sidecar): the vocabulary comes from --vocab
  {
    const std::vector<int32_t> ids = random_ids(777, 50257, seed);
    write_raw(dir / "llmc.bin", std::vector<uint16_t>(ids.begin(), ids.end()), llmc_header(1, 777));
    EXPECT_EQ(read_all(*data::TokenSource::open_file((dir / "llmc.bin").string(), 50257)), ids);
    const std::vector<int32_t> big = random_ids(333, 128256, seed + 1);
    write_raw(dir / "llmc2.bin", std::vector<uint32_t>(big.begin(), big.end()), llmc_header(2, 333));
    EXPECT_EQ(read_all(*data::TokenSource::open_file((dir / "llmc2.bin").string(), 128256)), big);
    // without --vocab: asks for it, naming the largest id
    const std::string e = error_of([&] { data::TokenSource::open_file((dir / "llmc.bin").string(), 0); });
    EXPECT_NE(e.find("pass --vocab"), std::string::npos) << e;
    EXPECT_NE(e.find("largest id is 50256"), std::string::npos) << e;
  }
  // nanoGPT's flat uint16, and a flat uint32 described by a sidecar
  {
    const std::vector<int32_t> ids = random_ids(4097, 50257, seed + 2);
    write_raw(dir / "train.bin", std::vector<uint16_t>(ids.begin(), ids.end()));
    auto t = data::TokenSource::open_file((dir / "train.bin").string(), 50304);
    EXPECT_EQ(read_all(*t), ids);
    EXPECT_EQ(t->format(), "flat uint16");
    const std::vector<int32_t> big = random_ids(999, 100000, seed + 3);
    write_raw(dir / "flat32.bin", std::vector<uint32_t>(big.begin(), big.end()));
    write_text(dir / "flat32.bin.json", R"({"dtype": "uint32", "vocab_size": 100000, "tokenizer": "tok.model"})");
    auto t2 = data::TokenSource::open_file((dir / "flat32.bin").string(), 0);
    EXPECT_EQ(read_all(*t2), big);
    EXPECT_EQ(t2->vocab(), 100000);
    EXPECT_EQ(t2->tokenizer(), (dir / "tok.model").lexically_normal().string());  // relative to the sidecar
  }
  fs::remove_all(dir);
}

TEST(TokenFile, TruncatedEmptyAndBadFilesAreErrors) {
  const fs::path dir = test::temp_dir("tokfile_bad");
  auto open = [&](const std::string& name, int64_t vocab) {
    return error_of([&] { data::TokenSource::open_file((dir / name).string(), vocab); });
  };
  std::vector<uint16_t> ids(100, 7);
  write_raw(dir / "short.bin", std::vector<uint16_t>(ids.begin(), ids.end() - 1), llmc_header(1, 100));
  EXPECT_NE(open("short.bin", 300).find("truncated: the header says 100 tokens"), std::string::npos)
      << open("short.bin", 300);
  write_raw(dir / "long.bin", ids, llmc_header(1, 99));
  EXPECT_NE(open("long.bin", 300).find("longer than its header says"), std::string::npos);
  write_raw(dir / "headeronly.bin", std::vector<int32_t>{1, 5, 0}, {20240520});  // 16 bytes of a 1024-byte header
  EXPECT_NE(open("headeronly.bin", 300).find("less than llm.c's 1024-byte header"), std::string::npos)
      << open("headeronly.bin", 300);
  write_raw(dir / "odd.bin", std::vector<uint8_t>{1, 0, 2, 0, 3});
  EXPECT_NE(open("odd.bin", 300).find("truncated: 5 bytes is not a whole number of 2-byte ids"), std::string::npos)
      << open("odd.bin", 300);
  write_raw(dir / "version.bin", ids, llmc_header(3, 100));
  EXPECT_NE(open("version.bin", 300).find("version 3"), std::string::npos);
  write_raw(dir / "empty.bin", std::vector<uint16_t>{});
  EXPECT_NE(open("empty.bin", 300).find("holds no tokens"), std::string::npos) << open("empty.bin", 300);
  write_raw(dir / "empty_llmc.bin", std::vector<uint16_t>{}, llmc_header(1, 0));
  EXPECT_NE(open("empty_llmc.bin", 300).find("holds no tokens"), std::string::npos);
  EXPECT_NE(open("missing.bin", 300).find("missing.bin"), std::string::npos);
  // a sidecar that disagrees with the header or the file
  write_raw(dir / "disagree.bin", ids, llmc_header(1, 100));
  write_text(dir / "disagree.bin.json", R"({"dtype": "uint32"})");
  EXPECT_NE(open("disagree.bin", 300).find("the sidecar says dtype uint32, the llm.c header uint16"),
            std::string::npos);
  write_text(dir / "disagree.bin.json", R"({"num_tokens": 101})");
  EXPECT_NE(open("disagree.bin", 300).find("the sidecar says 101 tokens, the file holds 100"), std::string::npos);
  write_text(dir / "disagree.bin.json", R"({"dtype": "int8"})");
  EXPECT_NE(open("disagree.bin", 300).find("dtype 'int8' is not one of: uint16, uint32"), std::string::npos);
  fs::remove_all(dir);
}

TEST(TokenFile, IdsPastTheVocabularyNameTheirPosition) {
  const fs::path dir = test::temp_dir("tokfile_range");
  std::vector<int32_t> ids(500, 3);
  ids[123] = 300;  // == vocab: out of range
  ids[400] = 65535;
  write_raw(dir / "a.bin", std::vector<uint16_t>(ids.begin(), ids.end()));
  std::string e = error_of([&] { data::TokenSource::open_file((dir / "a.bin").string(), 300); });
  EXPECT_NE(e.find("token id 300 at position 123 (of 500) is out of range for the vocabulary of 300 (--vocab)"),
            std::string::npos) << e;
  EXPECT_NE(e.find("largest id is 65535"), std::string::npos) << e;
  // the sidecar's vocabulary is checked too, and --vocab wins over it
  data::write_token_file((dir / "b.bin").string(), std::vector<int32_t>{1, 2, 299}, 300, "");
  EXPECT_NE(error_of([&] { data::TokenSource::open_file((dir / "b.bin").string(), 299); }).find("position 2"),
            std::string::npos);
  EXPECT_EQ(data::TokenSource::open_file((dir / "b.bin").string(), 1000)->vocab(), 1000);
  // and the writer refuses ids it cannot store
  EXPECT_NE(error_of([&] { data::write_token_file((dir / "c.bin").string(), {0, 5, -1}, 10, ""); })
                .find("id -1 at position 2 is out of range [0, 10)"),
            std::string::npos);
  EXPECT_FALSE(fs::exists(dir / "c.bin"));
  fs::remove_all(dir);
}

TEST(TokenFile, RandomIdsAreUniformAndReproducible) {
  auto a = data::open_token_data("random:1000", 0, 7), b = data::open_token_data("random:1000", 1000, 7);
  auto c = data::open_token_data("random:1000", 0, 8);
  EXPECT_EQ(a->size(), size_t{1} << 32);
  std::vector<int64_t> hist(10, 0);
  int same_seed_differs = 0, other_seed_same = 0;
  for (size_t i = 0; i < 100000; ++i) {
    const int32_t x = (*a)[i];
    ASSERT_TRUE(x >= 0 && x < 1000) << x;
    ++hist[static_cast<size_t>(x / 100)];
    same_seed_differs += x != (*b)[i];
    other_seed_same += x == (*c)[i];
  }
  EXPECT_EQ(same_seed_differs, 0);
  EXPECT_LT(other_seed_same, 300);  // 1 in 1000 by chance: about 100
  for (int64_t h : hist) EXPECT_NEAR(static_cast<double>(h), 10000.0, 600.0);  // > 6 sigma
  EXPECT_NE(error_of([] { data::open_token_data("random:0", 0, 1); }).find("positive vocabulary"), std::string::npos);
  EXPECT_NE(error_of([] { data::open_token_data("random:12x", 0, 1); }).find("random:V"), std::string::npos);
  EXPECT_NE(error_of([] { data::open_token_data("random:100", 50, 1); }).find("--vocab is 50"), std::string::npos);
  EXPECT_TRUE(data::is_token_data("x/train.bin"));
  EXPECT_FALSE(data::is_token_data("train.txt"));
}

int run_cli(const std::string& args) {
  const std::string cmd = std::string(KILN_CLI_COMMAND) + " " + args + " 2>/dev/null";
  return std::system(cmd.c_str());
}

TEST(TokenFile, TokenizeRoundTrip) {
  const fs::path dir = test::temp_dir("tokenize");
  const std::string a = "First document, with UTF-8: \xc3\xa9t\xc3\xa9.\n", b = "second\n\nthird line";
  write_text(dir / "a.txt", a);
  write_text(dir / "b.txt", b);
  const fs::path out = dir / "out.bin";
  ASSERT_EQ(run_cli("tokenize --tokenizer byte " + (dir / "a.txt").string() + " " + (dir / "b.txt").string() +
                    " --out " + out.string()), 0);
  auto t = data::TokenSource::open_file(out.string(), 0);
  data::ByteTokenizer tok;
  const data::TokenStream want = data::tokenize_documents({a, b}, tok);
  EXPECT_EQ(read_all(*t), want.tokens);
  EXPECT_EQ(t->vocab(), tok.vocab_size());
  EXPECT_EQ(t->tokenizer(), "byte");
  // the documents decode back to the texts (bos, text, eos each)
  const std::vector<int32_t> ids = read_all(*t);
  EXPECT_EQ(ids.front(), tok.bos_id());
  EXPECT_EQ(tok.decode(std::vector<int32_t>(ids.begin() + 1, ids.begin() + 1 + static_cast<long>(a.size()))), a);
  EXPECT_EQ(tok.decode(std::vector<int32_t>(ids.end() - 1 - static_cast<long>(b.size()), ids.end() - 1)), b);
  // --vocab records a larger vocabulary; bad arguments are errors
  ASSERT_EQ(run_cli("tokenize " + (dir / "a.txt").string() + " --vocab 70000 --out " + out.string()), 0);
  auto t2 = data::TokenSource::open_file(out.string(), 0);
  EXPECT_EQ(t2->vocab(), 70000);
  EXPECT_EQ(t2->format(), "llm.c v2 (uint32)");
  EXPECT_NE(run_cli("tokenize " + (dir / "a.txt").string() + " --vocab 100 --out " + out.string()), 0);
  EXPECT_NE(run_cli("tokenize " + (dir / "a.txt").string() + " --out " + (dir / "x.txt").string()), 0);
  EXPECT_NE(run_cli("tokenize " + (dir / "nope.txt").string() + " --out " + out.string()), 0);
  fs::remove_all(dir);
}

TEST(TokenFile, TrainsOnTokenFilesAndRecordsTheVocabulary) {
  const fs::path dir = test::temp_dir("tokfile_train");
  std::vector<int32_t> ids = random_ids(6000, 1000, 11);
  data::write_token_file((dir / "d.bin").string(), ids, 1000, "");
  train::TrainConfig c = test::tiny_run(dir / "run", 3);
  c.data = (dir / "d.bin").string();
  c.eval_every = 0;
  c.sample_tokens = 20;  // no tokenizer: skipped, with a note
  train::TrainSummary s = train::run_training(c, test::quiet());
  EXPECT_EQ(s.steps_done, 3);
  EXPECT_TRUE(std::isfinite(s.final_loss));
  EXPECT_TRUE(s.sample.empty());
  EXPECT_NEAR(s.first_loss, std::log(1000.0), 0.2);  // a fresh model over 1000 ids
  std::ifstream cf(fs::path(s.checkpoint) / "config.json");
  const json::Value cfg = json::parse(std::string(std::istreambuf_iterator<char>(cf), {}));
  EXPECT_EQ(cfg.find("vocab_size")->as_int(), 1000);
  // --vocab pads the model's vocabulary past the data's; one below an id in the file is an error
  c.vocab = 1024;
  c.out = (dir / "run2").string();
  EXPECT_EQ(train::run_training(c, test::quiet()).steps_done, 3);
  c.vocab = 999;
  c.out = (dir / "run3").string();
  EXPECT_NE(error_of([&] { train::run_training(c, test::quiet()); }).find("out of range for the vocabulary of 999"),
            std::string::npos);
  // random:V trains at V; packed sampling needs documents
  c.vocab = 0;
  c.data = "random:5000";
  c.out = (dir / "run4").string();
  s = train::run_training(c, test::quiet());
  EXPECT_NEAR(s.first_loss, std::log(5000.0), 0.2);
  c.sample = "packed";
  c.out = (dir / "run5").string();
  EXPECT_NE(error_of([&] { train::run_training(c, test::quiet()); }).find("packed sampling needs documents"),
            std::string::npos);
  // text data: --vocab below the tokenizer's is an error
  c.sample = "windows";
  c.data = "";
  c.vocab = 100;
  c.out = (dir / "run6").string();
  EXPECT_NE(error_of([&] { train::run_training(c, test::quiet()); }).find("more than the model's vocabulary of 100"),
            std::string::npos);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace kiln
