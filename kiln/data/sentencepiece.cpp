// SentencePiece tokenizers through Debian's libsentencepiece (cmake/sentencepiece.cmake
// defines KILN_HAVE_SENTENCEPIECE when it is found). Without it, every entry point throws a
// kiln::Error that says how to get it.
#include <filesystem>
#include <fstream>
#include <unordered_map>

#include "kiln/core/error.h"
#include "kiln/data/tokenizer.h"
#include "kiln/io/json.h"

#ifdef KILN_HAVE_SENTENCEPIECE
#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>
#endif

namespace kiln::data {

#ifdef KILN_HAVE_SENTENCEPIECE

namespace {

class SentencePieceTokenizer final : public Tokenizer {
 public:
  explicit SentencePieceTokenizer(const std::string& path) : path_(path) {
    auto st = sp_.Load(path);
    KILN_CHECK(st.ok(), "tokenizer: '", path,
               "' is not a SentencePiece model (a .model file from kiln tokenizer train or SentencePiece); "
               "SentencePiece says: ", st.ToString());
    std::ifstream f(path, std::ios::binary);
    bytes_.assign((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  }
  std::vector<int32_t> encode(std::string_view text) const override {
    std::vector<int> ids;
    auto st = sp_.Encode(text, &ids);
    KILN_CHECK(st.ok(), "tokenizer: SentencePiece encode failed: ", st.ToString());
    return std::vector<int32_t>(ids.begin(), ids.end());
  }
  std::string decode(const std::vector<int32_t>& ids) const override {
    std::vector<int> v;
    for (int32_t id : ids)
      if (id >= 0 && id < sp_.GetPieceSize()) v.push_back(id);
    std::string out;
    auto st = sp_.Decode(v, &out);
    KILN_CHECK(st.ok(), "tokenizer: SentencePiece decode failed: ", st.ToString());
    return out;
  }
  int64_t vocab_size() const override { return sp_.GetPieceSize(); }
  int32_t bos_id() const override { return sp_.bos_id(); }
  int32_t eos_id() const override { return sp_.eos_id(); }
  std::string kind() const override { return "sentencepiece"; }
  std::string fingerprint() const override {
    uint64_t h = 1469598103934665603ull;
    for (char c : bytes_) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
    return "sp-" + std::to_string(h);
  }
  void save(const std::string& dir) const override {
    namespace fs = std::filesystem;
    {
      std::ofstream f(fs::path(dir) / "tokenizer.model", std::ios::binary);
      f.write(bytes_.data(), static_cast<std::streamsize>(bytes_.size()));
      KILN_CHECK(f.good(), "tokenizer: cannot write ", dir, "/tokenizer.model");
    }
    json::Value v = json::Value::object();
    v["tokenizer_class"] = "LlamaTokenizer";
    v["kiln_tokenizer"] = "sentencepiece";
    if (bos_id() >= 0) v["bos_token"] = sp_.IdToPiece(bos_id());
    if (eos_id() >= 0) v["eos_token"] = sp_.IdToPiece(eos_id());
    std::ofstream f(fs::path(dir) / "tokenizer_config.json");
    f << v.dump(2) << "\n";
  }

 private:
  std::string path_;
  std::string bytes_;
  sentencepiece::SentencePieceProcessor sp_;
};

}  // namespace

bool sentencepiece_available() { return true; }

std::unique_ptr<Tokenizer> load_sentencepiece(const std::string& model_path) {
  KILN_CHECK(std::filesystem::is_regular_file(model_path), "tokenizer: '", model_path, "' is not a file");
  return std::make_unique<SentencePieceTokenizer>(model_path);
}

void train_sentencepiece(const std::vector<std::string>& files, const SentencePieceTrainOptions& o) {
  KILN_CHECK(!files.empty(), "tokenizer train: no input files");
  KILN_CHECK(o.vocab_size > 4, "tokenizer train: --vocab ", o.vocab_size, " is too small");
  KILN_CHECK(o.model_type == "bpe" || o.model_type == "unigram", "tokenizer train: --model-type '", o.model_type,
             "' is not one of: bpe, unigram");
  KILN_CHECK(!o.output_prefix.empty(), "tokenizer train: --out must not be empty");
  {  // the prefix names files PREFIX.model and PREFIX.vocab: it must have a name, in a folder that exists
    const std::filesystem::path prefix(o.output_prefix);
    KILN_CHECK(!prefix.filename().empty() && !std::filesystem::is_directory(prefix), "tokenizer train: --out '",
               o.output_prefix, "' is a folder; give a file prefix in it, e.g. '",
               (prefix / "tokenizer").lexically_normal().string(), "' (writes tokenizer.model and tokenizer.vocab)");
    const std::filesystem::path parent = prefix.parent_path().empty() ? "." : prefix.parent_path();
    KILN_CHECK(std::filesystem::is_directory(parent), "tokenizer train: --out '", o.output_prefix, "': folder '",
               parent.string(), "' does not exist");
  }
  std::string input;
  for (const auto& f : files) {
    KILN_CHECK(std::filesystem::is_regular_file(f), "tokenizer train: '", f, "' is not a file");
    // SentencePiece splits its input list at commas
    KILN_CHECK(f.find(',') == std::string::npos, "tokenizer train: '", f,
               "': SentencePiece cannot read a file whose name has a comma (rename or copy it)");
    input += (input.empty() ? "" : ",") + f;
  }
  // As a map, not a command line: SentencePiece splits a command line at every space, paths included.
  const std::unordered_map<std::string, std::string> args = {
      {"input", input}, {"model_prefix", o.output_prefix}, {"vocab_size", std::to_string(o.vocab_size)},
      {"model_type", o.model_type}, {"byte_fallback", "true"}, {"character_coverage", "1.0"},
      {"bos_id", "1"}, {"eos_id", "2"}, {"unk_id", "0"}, {"pad_id", "-1"}, {"minloglevel", "2"}};
  auto st = sentencepiece::SentencePieceTrainer::Train(args);
  // Its one common failure, said in kiln's words (its message is a source line and an assertion).
  KILN_CHECK(st.ok() || st.ToString().find("sentences_.empty()") == std::string::npos,
             "tokenizer train: the text has no line SentencePiece can learn from: it skips empty lines and lines "
             "longer than 4192 bytes (split long lines)");
  KILN_CHECK(st.ok(), "tokenizer train: SentencePiece failed: ", st.ToString());
}

#else

namespace {
[[noreturn]] void unavailable() {
  fail("SentencePiece support is not built in: install libsentencepiece-dev (scripts/setup) and reconfigure kiln; "
       "the byte tokenizer (--tokenizer byte) works without it");
}
}  // namespace

bool sentencepiece_available() { return false; }
std::unique_ptr<Tokenizer> load_sentencepiece(const std::string&) { unavailable(); }
void train_sentencepiece(const std::vector<std::string>&, const SentencePieceTrainOptions&) { unavailable(); }

#endif

}  // namespace kiln::data
