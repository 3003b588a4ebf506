// The byte tokenizer and load_tokenizer (SentencePiece bodies live in sentencepiece.cpp).
#include "kiln/data/tokenizer.h"

#include <filesystem>
#include <fstream>

#include "kiln/core/error.h"
#include "kiln/io/json.h"

namespace kiln::data {

std::vector<int32_t> ByteTokenizer::encode(std::string_view text) const {
  std::vector<int32_t> out(text.size());
  for (size_t i = 0; i < text.size(); ++i) out[i] = static_cast<unsigned char>(text[i]);
  return out;
}

std::string ByteTokenizer::decode(const std::vector<int32_t>& ids) const {
  std::string s;
  for (int32_t id : ids) {
    if (id >= 0 && id < 256) s.push_back(static_cast<char>(id));
    // specials and out-of-range ids decode to nothing
  }
  return s;
}

void ByteTokenizer::save(const std::string& dir) const {
  json::Value v = json::Value::object();
  v["kiln_tokenizer"] = "byte";
  v["vocab_size"] = static_cast<int64_t>(kVocab);
  v["bos_token"] = "<bos>";
  v["eos_token"] = "<eos>";
  v["pad_token"] = "<pad>";
  v["bos_token_id"] = static_cast<int64_t>(kBos);
  v["eos_token_id"] = static_cast<int64_t>(kEos);
  v["pad_token_id"] = static_cast<int64_t>(kPad);
  std::ofstream f(std::filesystem::path(dir) / "tokenizer_config.json");
  f << v.dump(2) << "\n";
  KILN_CHECK(f.good(), "tokenizer: cannot write ", dir, "/tokenizer_config.json");
}

std::unique_ptr<Tokenizer> load_tokenizer(const std::string& spec) {
  namespace fs = std::filesystem;
  if (spec.empty() || spec == "byte") return std::make_unique<ByteTokenizer>();
  fs::path p(spec);
  if (fs::is_regular_file(p)) return load_sentencepiece(spec);
  KILN_CHECK(fs::is_directory(p), "tokenizer: '", spec, "' is neither 'byte', a tokenizer.model file nor a directory");
  if (fs::exists(p / "tokenizer.model")) return load_sentencepiece((p / "tokenizer.model").string());
  if (fs::exists(p / "tokenizer_config.json")) {
    std::ifstream f(p / "tokenizer_config.json");
    std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    json::Value v = json::parse(text);
    if (const json::Value* k = v.find("kiln_tokenizer"); k && k->as_string() == "byte")
      return std::make_unique<ByteTokenizer>();
  }
  fail("tokenizer: no tokenizer found in '", spec,
       "' (expected tokenizer.model or a kiln tokenizer_config.json; pass --tokenizer byte for bytes)");
}

}  // namespace kiln::data
