// Data and configuration tests: byte tokenizer, token cache, split, sampler reproducibility
// and resumption, the TOML subset, the config field table, presets and clear errors for bad values.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <set>

#include <filesystem>
#include <fstream>

#include "kiln/data/dataset.h"
#include "kiln/data/default_corpus.h"
#include "kiln/data/tokenizer.h"
#include "kiln/io/toml.h"
#include "kiln/train/config.h"

using namespace kiln;
namespace fs = std::filesystem;

namespace {
fs::path temp_dir(const std::string& name) {
  fs::path p = fs::temp_directory_path() / ("kiln_test_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}
template <class F>
void expect_error(F&& f, const std::string& text) {
  try {
    f();
    ADD_FAILURE() << "no error, expected one containing: " << text;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
  }
}
}  // namespace

TEST(Tokenizer, ByteRoundTrip) {
  data::ByteTokenizer t;
  std::string s = "héllo\n\x01\xff";
  auto ids = t.encode(s);
  EXPECT_EQ(ids.size(), s.size());
  EXPECT_EQ(t.decode(ids), s);
  ids.push_back(t.eos_id());
  EXPECT_EQ(t.decode(ids), s);
  EXPECT_EQ(t.vocab_size(), 259);
}

TEST(Tokenizer, SentencePieceTrainsOnPathsWithSpaces) {
  if (!data::sentencepiece_available()) GTEST_SKIP() << "kiln built without SentencePiece";
  // The options went to SentencePiece as one command line, which it splits at every space:
  // 'my corpus.txt' or an --out in 'out dir' failed with "unknown field name" (or set options).
  fs::path d = temp_dir("sp_spaces");
  fs::create_directories(d / "out dir");
  std::ofstream(d / "my corpus.txt") << data::default_corpus().substr(0, 20000);
  data::SentencePieceTrainOptions o;
  o.vocab_size = 600;
  o.output_prefix = (d / "out dir" / "sp").string();
  data::train_sentencepiece({(d / "my corpus.txt").string()}, o);
  EXPECT_EQ(data::load_tokenizer(o.output_prefix + ".model")->vocab_size(), 600);
  // SentencePiece splits its input list at commas: a clear error, not "a: No such file"
  std::ofstream(d / "a,b.txt") << "text";
  expect_error([&] { data::train_sentencepiece({(d / "a,b.txt").string()}, o); }, "has a comma");
  o.output_prefix = "";
  expect_error([&] { data::train_sentencepiece({(d / "my corpus.txt").string()}, o); }, "--out must not be empty");
  // SentencePiece's own messages were a source line and an assertion, or the wrong label
  // ("Permission denied" for a missing folder); an --out folder wrote hidden '.model' / '.vocab'.
  const std::string corpus = (d / "my corpus.txt").string();
  o.output_prefix = (d / "no such dir" / "sp").string();
  expect_error([&] { data::train_sentencepiece({corpus}, o); }, "sp': folder '");
  expect_error([&] { data::train_sentencepiece({corpus}, o); }, "' does not exist");
  o.output_prefix = (d / "out dir").string() + "/";
  expect_error([&] { data::train_sentencepiece({corpus}, o); }, "is a folder; give a file prefix in it");
  o.output_prefix = (d / "out dir").string();
  expect_error([&] { data::train_sentencepiece({corpus}, o); }, "is a folder; give a file prefix in it");
  o.output_prefix = (d / "out dir" / "sp2").string();
  std::ofstream(d / "empty.txt") << "";
  expect_error([&] { data::train_sentencepiece({(d / "empty.txt").string()}, o); },
               "the text has no line SentencePiece can learn from");
  expect_error([&] { data::load_tokenizer(corpus); }, "is not a SentencePiece model");
  fs::remove_all(d);
}

// Streaming text token by token: what each token adds to the decoded text (SentencePiece's
// spaces between pieces were lost, "hello world" printed "helloworld"), held while the text ends
// inside a character (byte pieces print as U+FFFD until they are whole).
TEST(Tokenizer, ContinuationsDecodeInContext) {
  data::ByteTokenizer b;
  const std::vector<int32_t> ctx = b.encode("ab");
  EXPECT_EQ(b.decode_continuation(ctx, b.encode("c\xe2\x82\xac")), "c\xe2\x82\xac");
  EXPECT_FALSE(data::ends_mid_character("c\xe2\x82\xac"));
  EXPECT_TRUE(data::ends_mid_character("c\xe2\x82"));
  EXPECT_TRUE(data::ends_mid_character("c\xe2"));
  EXPECT_TRUE(data::ends_mid_character("x\xef\xbf\xbd"));
  EXPECT_FALSE(data::ends_mid_character("plain"));
  EXPECT_FALSE(data::ends_mid_character(""));
  // For display: invalid bytes and control characters as U+FFFD (a byte model printed BEL).
  EXPECT_EQ(data::displayable("a\x8b" "b\x07" "c\n\t\xe2\x82\xac\xe2"),
            "a\xEF\xBF\xBD" "b\xEF\xBF\xBD" "c\n\t\xe2\x82\xac\xEF\xBF\xBD");
  if (!data::sentencepiece_available()) GTEST_SKIP() << "kiln built without SentencePiece";
  fs::path d = temp_dir("sp_stream");
  std::ofstream(d / "corpus.txt") << data::default_corpus().substr(0, 20000);
  data::SentencePieceTrainOptions o;
  o.vocab_size = 600;
  o.output_prefix = (d / "sp").string();
  data::train_sentencepiece({(d / "corpus.txt").string()}, o);
  auto sp = data::load_tokenizer(o.output_prefix + ".model");
  const std::vector<int32_t> head = sp->encode("the model"), tail = sp->encode(" trains on text");
  std::vector<int32_t> all = head;
  all.insert(all.end(), tail.begin(), tail.end());
  EXPECT_EQ(sp->decode_continuation(head, tail), " trains on text");
  // Token by token, each continuation extends the last: the stream prints the whole text.
  std::string streamed;
  for (size_t n = 1; n <= tail.size(); ++n) {
    const std::string text = sp->decode_continuation(head, std::vector<int32_t>(tail.begin(), tail.begin() + n));
    ASSERT_EQ(text.compare(0, streamed.size(), streamed), 0) << text;
    streamed = text;
  }
  EXPECT_EQ("the model" + streamed, sp->decode(all));
  fs::remove_all(d);
}

TEST(Data, DefaultCorpusIsEmbedded) {
  std::string_view c = data::default_corpus();
  EXPECT_GT(c.size(), 10000u);
  EXPECT_NE(c.find("kiln"), std::string_view::npos);
}

TEST(Data, TokenCacheIsWrittenOnceAndReused) {
  fs::path d = temp_dir("cache");
  fs::create_directories(d / "corpus");
  std::ofstream(d / "corpus" / "a.txt") << "first document";
  std::ofstream(d / "corpus" / "b.txt") << "second";
  data::ByteTokenizer tok;
  bool hit = true;
  data::TokenStream s1 = data::load_corpus((d / "corpus").string(), tok, (d / "out").string(), &hit);
  EXPECT_FALSE(hit);
  EXPECT_EQ(s1.size(), 14u + 2 + 6 + 2);
  EXPECT_EQ(s1.tokens[0], tok.bos_id());
  EXPECT_EQ(s1.doc.back(), 1);
  data::TokenStream s2 = data::load_corpus((d / "corpus").string(), tok, (d / "out").string(), &hit);
  EXPECT_TRUE(hit);
  EXPECT_EQ(s1.tokens, s2.tokens);
  EXPECT_EQ(s1.doc, s2.doc);
  // A damaged cache whose count its file does not hold is rebuilt, not allocated (2^36 tokens
  // would be 512 GB).
  for (const auto& f : fs::directory_iterator(d / "out")) {
    std::fstream cache(f.path(), std::ios::in | std::ios::out | std::ios::binary);
    const uint64_t n = uint64_t{1} << 36;
    cache.seekp(8);
    cache.write(reinterpret_cast<const char*>(&n), 8);
  }
  data::TokenStream s3 = data::load_corpus((d / "corpus").string(), tok, (d / "out").string(), &hit);
  EXPECT_FALSE(hit);
  EXPECT_EQ(s1.tokens, s3.tokens);
  // (From a probe) ids rewritten in place, count and size kept: the checksum rebuilds it (an
  // evaluation read the changed ids and reported another loss).
  for (const auto& f : fs::directory_iterator(d / "out")) {
    std::fstream cache(f.path(), std::ios::in | std::ios::out | std::ios::binary);
    const int32_t id = 65;
    cache.seekp(16 + 4);
    cache.write(reinterpret_cast<const char*>(&id), 4);
  }
  data::TokenStream s3b = data::load_corpus((d / "corpus").string(), tok, (d / "out").string(), &hit);
  EXPECT_FALSE(hit);
  EXPECT_EQ(s1.tokens, s3b.tokens);
  data::load_corpus((d / "corpus").string(), tok, (d / "out").string(), &hit);
  EXPECT_TRUE(hit);
  const std::optional<std::string> user_dir = data::user_cache_dir("kiln-test-cache");
  ASSERT_TRUE(user_dir.has_value());
  EXPECT_NE(user_dir->find("kiln-test-cache-" + std::to_string(::geteuid())), std::string::npos);
  EXPECT_EQ(fs::status(*user_dir).permissions() & fs::perms::all, fs::perms::owner_all);
  // A folder at that name that others can reach (planted, or widened) is not used; nor a symlink.
  fs::permissions(*user_dir, fs::perms::owner_all | fs::perms::group_all | fs::perms::others_all);
  EXPECT_FALSE(data::user_cache_dir("kiln-test-cache").has_value());
  fs::remove_all(*user_dir);
  fs::create_directories(d / "elsewhere");
  fs::permissions(d / "elsewhere", fs::perms::owner_all);
  fs::create_directory_symlink(d / "elsewhere", *user_dir);
  EXPECT_FALSE(data::user_cache_dir("kiln-test-cache").has_value());
  fs::remove(*user_dir);
  // Without the cache: tokenized, nothing written.
  const size_t files_before = std::distance(fs::directory_iterator(d / "out"), {});
  data::load_corpus((d / "corpus").string(), tok, (d / "out").string(), &hit, false);
  EXPECT_FALSE(hit);
  EXPECT_EQ(static_cast<size_t>(std::distance(fs::directory_iterator(d / "out"), {})), files_before);
  // A run directory inside the data folder (its cache directory) is not read as text.
  fs::create_directories(d / "corpus" / "run" / "step-1");
  std::ofstream(d / "corpus" / "run" / "metrics.jsonl") << "{\"step\": 1}\n";
  std::ofstream(d / "corpus" / "run" / "step-1" / "config.json") << "{}";
  data::TokenStream s4 = data::load_corpus((d / "corpus").string(), tok, (d / "corpus" / "run").string(), &hit);
  EXPECT_EQ(s1.tokens, s4.tokens);
  fs::remove_all(d / "corpus" / "run");
  expect_error([&] { data::load_corpus("/dev/zero", tok, (d / "out").string()); },
               "'/dev/zero' is neither a regular file nor a folder");
  std::ofstream(d / "corpus" / "b.txt") << "changed!";  // new contents: a new key
  data::load_corpus((d / "corpus").string(), tok, (d / "out").string(), &hit);
  EXPECT_FALSE(hit);
  fs::remove_all(d);
}

TEST(Data, SamplerIsReproducibleAndResumable) {
  data::ByteTokenizer tok;
  std::string text(5000, 'a');
  for (size_t i = 0; i < text.size(); ++i) text[i] = static_cast<char>('a' + (i * 7919) % 26);
  data::TokenStream s = data::tokenize_documents({text, text.substr(0, 700)}, tok);
  data::Split sp = data::split_stream(s, 0.1, 32);
  EXPECT_EQ(s.size() - sp.train_end, static_cast<size_t>(0.1 * static_cast<double>(s.size())));
  for (auto mode : {data::SampleMode::windows, data::SampleMode::packed}) {
    data::Sampler a(s, 0, sp.train_end, 4, 32, 9, mode), b(s, 0, sp.train_end, 4, 32, 9, mode);
    std::vector<std::vector<int64_t>> seq_a;
    for (int i = 0; i < 5; ++i) seq_a.push_back(a.next().input.to_vector<int64_t>());
    for (int i = 0; i < 3; ++i) b.next();
    data::Sampler c(s, 0, sp.train_end, 4, 32, 9, mode);
    c.set_position(b.position());
    EXPECT_EQ(c.next().input.to_vector<int64_t>(), seq_a[3]);
    data::Batch x = c.next();
    EXPECT_EQ(x.input.to_vector<int64_t>(), seq_a[4]);
    // targets are the inputs shifted by one
    auto in = x.input.to_vector<int64_t>(), tg = x.target.to_vector<int64_t>();
    for (size_t i = 0; i + 1 < 32; ++i) {
      if (tg[i] != -100) {
        EXPECT_EQ(tg[i], in[i + 1]);
      }
    }
    data::Sampler other(s, 0, sp.train_end, 4, 32, 10, mode);
    if (mode == data::SampleMode::windows) {
      EXPECT_NE(other.next().input.to_vector<int64_t>(), seq_a[0]);
    } else {
      EXPECT_TRUE(x.doc_ids.defined());
    }
  }
  expect_error([&] { data::split_stream(s, 0.1, 100000); }, "too few for sequence length 100000");
  data::TokenStream short_docs;  // a doc id list shorter than the tokens was read past its end
  short_docs.tokens.assign(10, 1);
  short_docs.doc = {0};
  expect_error([&] { data::Sampler(short_docs, 0, 10, 1, 3, 1, data::SampleMode::packed); },
               "packed sampling needs a document id per token, the stream has 1 ids for 10 tokens");
}

TEST(Config, TomlSubset) {
  json::Value v = io::parse_toml(
      "# comment\npreset = \"tiny\"  # trailing\nsteps = 1_000\nlr = 3e-4\n[model]\nhidden = 96\n"
      "tie_embeddings = true\nname = 'lit#eral'\n");
  EXPECT_EQ(v.find("preset")->as_string(), "tiny");
  EXPECT_EQ(v.find("steps")->as_int(), 1000);
  EXPECT_DOUBLE_EQ(v.find("lr")->as_double(), 3e-4);
  EXPECT_EQ(v.find("model")->find("hidden")->as_int(), 96);
  EXPECT_TRUE(v.find("model")->find("tie_embeddings")->as_bool());
  EXPECT_EQ(v.find("model")->find("name")->as_string(), "lit#eral");
  expect_error([] { io::parse_toml("a = [1, 2]"); }, "config:1");
  expect_error([] { io::parse_toml("x = 1\nx = 2"); }, "defined twice");
  expect_error([] { io::parse_toml("just text"); }, "expected 'key = value'");
  // Integers as TOML has them: decimal without leading zeros ("010" was read as octal 8), the
  // 0x / 0o / 0b bases, signs; out-of-range numbers are errors, not 0 or a wrapped value.
  json::Value n = io::parse_toml("a = 0x1F\nb = 0o17\nc = 0b101\nd = -42\ne = +7\nf = 0\ng = -0\nh = inf\n");
  EXPECT_EQ(n.find("a")->as_int(), 31);
  EXPECT_EQ(n.find("b")->as_int(), 15);
  EXPECT_EQ(n.find("c")->as_int(), 5);
  EXPECT_EQ(n.find("d")->as_int(), -42);
  EXPECT_EQ(n.find("e")->as_int(), 7);
  EXPECT_EQ(n.find("f")->as_int(), 0);
  EXPECT_EQ(n.find("g")->as_int(), 0);
  EXPECT_TRUE(std::isinf(n.find("h")->as_double()));
  expect_error([] { io::parse_toml("steps = 010"); }, "config:1: integer '010' has a leading zero");
  expect_error([] { io::parse_toml("steps = -007"); }, "leading zero");
  expect_error([] { io::parse_toml("steps = 9223372036854775808"); }, "does not fit in 64 bits");
  expect_error([] { io::parse_toml("x = 0xFFFFFFFFFFFFFFFFF"); }, "does not fit in 64 bits");
  expect_error([] { io::parse_toml("clip = 1e999"); }, "number '1e999' is out of the range of a double");
  expect_error([] { io::parse_toml("x = 0x"); }, "is not a string, number or boolean");
  expect_error([] { io::parse_toml("x = 12abc"); }, "is not a string, number or boolean");
  expect_error([] { io::parse_toml("x = +"); }, "is not a string, number or boolean");
  expect_error([] { io::parse_toml("a = 1\nprompt = \"\\ud800\""); }, "config:2: string value of 'prompt': JSON:");
  // (From a probe) '_' only between digits, as TOML says (1__0 and 4_ were read as 10 and 4); a
  // byte order mark is skipped (it became part of the first key: "unknown key '\xEF\xBB\xBFsteps'").
  EXPECT_EQ(io::parse_toml("steps = 1_000").find("steps")->as_int(), 1000);
  EXPECT_EQ(io::parse_toml("x = 0xff_ff").find("x")->as_int(), 0xffff);
  for (const char* bad : {"steps = 1__0", "steps = 4_", "steps = _4", "lr = 1_.5", "lr = 1_e5", "lr = 1e_5"})
    expect_error([&] { io::parse_toml(bad); }, "'_' only between two digits");
  EXPECT_EQ(io::parse_toml("\xEF\xBB\xBFsteps = 3").find("steps")->as_int(), 3);
  // resume cannot come from a config file (a resumed run refuses --config); overwrite can.
  train::TrainConfig c = train::preset("tiny");
  expect_error([&] { train::set_config_value(c, "resume", json::Value("run1")); }, "pass --resume DIR");
  train::set_config_value(c, "overwrite", json::Value(true));
  EXPECT_TRUE(c.overwrite);
}

// The field table (config.h) is the one place a setting is named: every row sets and reads its
// member (a value of its type round-trips through set_config_value and to_json, changing that
// member alone), is found by its key and by its flag's name, and the derived lists agree.
TEST(Config, FieldTableDrivesSettersJsonAndResume) {
  const train::TrainConfig base = train::preset("tiny");
  std::mt19937_64 rng(std::random_device{}());
  std::set<std::string> keys, flags;
  for (const train::ConfigField& f : train::config_fields()) {
    EXPECT_TRUE(keys.insert(f.key).second) << f.key;
    EXPECT_TRUE(flags.insert(f.flag).second) << f.flag;
    ASSERT_EQ(f.flag.rfind("--", 0), 0u) << f.flag;
    EXPECT_FALSE(f.help.empty()) << f.key;
    EXPECT_EQ(f.metavar.empty(), f.is_switch()) << f.key;
    EXPECT_EQ(train::find_config_field(f.key), &f);
    EXPECT_EQ(train::find_config_field(f.flag.substr(2)), &f);  // "sample-mode", "eval-every"
    // a fresh value of the member's type, different from the preset's
    json::Value v;
    const json::Value was = f.get(base);
    switch (was.kind()) {
      case json::Value::Kind::string: v = "s" + std::to_string(rng() % 100000); break;
      case json::Value::Kind::integer: v = static_cast<int64_t>(rng() % 1000000) + was.as_int() + 1; break;
      case json::Value::Kind::number: v = was.as_double() + 0.25 + static_cast<double>(rng() % 1000) / 8; break;
      case json::Value::Kind::boolean: v = !was.as_bool(); break;
      default: FAIL() << f.key << " reads as " << was.dump();
    }
    train::TrainConfig c = base;
    if (!f.in_file) {
      expect_error([&] { train::set_config_value(c, f.key, v); }, "cannot be set in a config file: pass " + f.flag);
      f.set(c, v);
    } else {
      train::set_config_value(c, f.key, v);
    }
    EXPECT_EQ(f.get(c).dump(), v.dump()) << f.key;
    // to_json changes in this key alone (or not at all for a setting that is not the run's)
    const json::Value a = base.to_json(), b = c.to_json();
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.as_object().size(); ++i) {
      const auto& [k, av] = a.as_object()[i];
      EXPECT_EQ(b.as_object()[i].first, k);
      EXPECT_EQ(av.dump() == b.as_object()[i].second.dump(), !(f.saved && k == f.key)) << f.key << " vs " << k;
    }
    EXPECT_EQ(b.contains(f.key), f.saved) << f.key;
    train::TrainConfig d = base;
    f.copy(d, c);
    EXPECT_EQ(f.get(d).dump(), v.dump()) << f.key;
    // a value of another type names the key and the value
    expect_error([&] { f.set(c, json::Value::array()); }, "");
  }
  EXPECT_EQ(base.to_json().size(), static_cast<size_t>(std::count_if(
      train::config_fields().begin(), train::config_fields().end(), [](const auto& f) { return f.saved; })));
  EXPECT_EQ(train::find_config_field("sample_mode")->key, "sample");
  EXPECT_EQ(train::find_config_field("nope"), nullptr);
  const std::vector<std::string> changeable = {"steps", "eval_every", "ckpt_every", "keep_ckpts", "log_every",
                                               "max_time", "sample_tokens", "prompt"};
  EXPECT_EQ(train::changeable_on_resume(), changeable);
  for (const char* k : {"out", "resume", "overwrite", "profile", "peak_tflops", "nproc", "gemm_backend", "cuda_graphs"})
    EXPECT_EQ(train::find_config_field(k)->on_resume, train::OnResume::command) << k;
  for (const char* k : {"resume", "overwrite", "profile", "peak_tflops", "nproc", "gemm_backend", "cuda_graphs"})
    EXPECT_FALSE(train::find_config_field(k)->saved) << k;
  train::TrainConfig c = base;
  expect_error([&] { train::set_config_value(c, "seed", json::Value(int64_t{-1})); }, "key 'seed' = -1: seed must be >= 0");
}

TEST(Config, FileFlagsAndValidation) {
  fs::path d = temp_dir("config");
  std::ofstream(d / "run.toml") << "[train]\nsteps = 77\nlr = 0.01\n[model]\nhidden = 96\nheads = 4\n";
  train::TrainConfig c = train::preset("tiny");
  train::apply_config_file(c, (d / "run.toml").string());
  EXPECT_EQ(c.steps, 77);
  EXPECT_EQ(c.hidden, 96);
  c.validate();
  std::ofstream(d / "run.json") << R"({"batch": 3, "model": {"layers": 1}})";
  train::apply_config_file(c, (d / "run.json").string());
  EXPECT_EQ(c.batch, 3);
  EXPECT_EQ(c.layers, 1);
  expect_error([&] { train::apply_config_file(c, d.string()); }, "is a directory, not a TOML or JSON file");
  std::ofstream(d / "huge.json") << R"({"clip": 1e999})";  // was read as clip = 0: clipping off
  expect_error([&] { train::apply_config_file(c, (d / "huge.json").string()); },
               "huge.json: JSON: number 1e999 is out of the range of a double");
  expect_error([&] { train::set_config_value(c, "stepz", json::Value(int64_t{1})); }, "unknown key 'stepz'");
  expect_error([&] { train::set_config_value(c, "steps", json::Value("many")); }, "key 'steps' = \"many\": ");
  train::TrainConfig bad = train::preset("tiny");
  bad.lr = -1;
  expect_error([&] { bad.validate(); }, "lr=-1");
  bad = train::preset("tiny");
  bad.telemetry_every = -5;  // was accepted
  expect_error([&] { bad.validate(); }, "telemetry_every=-5 must be >= 0");
  bad = train::preset("tiny");
  bad.heads = 5;
  expect_error([&] { bad.validate(); }, "hidden_size=64 is not divisible by num_attention_heads=5");
  bad = train::preset("tiny");
  bad.dtype = "f8";
  expect_error([&] { bad.validate(); }, "dtype='f8'");
  bad = train::preset("tiny");
  bad.gemm_backend = "cublas";
  expect_error([&] { bad.validate(); }, "gemm_backend='cublas' is not one of: auto, cublaslt, kiln");
  for (const char* ok : {"", "auto", "cublaslt", "kiln"}) {
    bad.gemm_backend = ok;
    bad.validate();
  }
  // (From a probe) a prompt or path that is not UTF-8 made a run whose trainer_state.json no
  // reader takes: it could never be resumed.
  bad = train::preset("tiny");
  bad.prompt = "\xff\xfe";
  expect_error([&] { bad.validate(); }, "config: prompt is not valid UTF-8 (byte 0)");
  bad = train::preset("tiny");
  bad.data = "dir\xff/d.txt";
  expect_error([&] { bad.validate(); }, "config: data is not valid UTF-8 (byte 3)");
  expect_error([] { train::preset("huge"); }, "preset 'huge' is not one of: tiny, small, 125m, 1b");
  for (const auto& n : train::preset_names()) train::preset(n).validate();
  fs::remove_all(d);
}
