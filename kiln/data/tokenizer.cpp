// The byte tokenizer, load_tokenizer, and text for streaming and display (decode_continuation,
// ends_mid_character, displayable). SentencePiece bodies live in sentencepiece.cpp.
#include "kiln/data/tokenizer.h"

#include <algorithm>
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

std::string Tokenizer::decode_continuation(const std::vector<int32_t>& context,
                                           const std::vector<int32_t>& continuation) const {
  std::vector<int32_t> all = context;
  all.insert(all.end(), continuation.begin(), continuation.end());
  // Past what the two decodes share: when the context's decode ends inside a character (a
  // U+FFFD the continuation completes) that character comes with the continuation.
  const std::string whole = decode(all), head = decode(context);
  const size_t common = static_cast<size_t>(
      std::mismatch(head.begin(), head.end(), whole.begin(), whole.end()).first - head.begin());
  return whole.substr(common);
}

namespace {
constexpr std::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD, UTF-8
}  // namespace

bool ends_mid_character(std::string_view text) {
  if (text.size() >= kReplacement.size() && text.substr(text.size() - kReplacement.size()) == kReplacement) return true;
  // Back over at most 3 continuation bytes to the sequence's first byte.
  size_t i = text.size(), tail = 0;
  while (i > 0 && tail < 3 && (static_cast<unsigned char>(text[i - 1]) & 0xC0) == 0x80) --i, ++tail;
  if (i == 0) return tail > 0;
  const int len = json::utf8_lead_length(static_cast<unsigned char>(text[i - 1]));
  return len > 1 && tail + 1 < static_cast<size_t>(len);  // fewer bytes than its lead byte announces
}

std::string displayable(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    const size_t n = json::utf8_sequence_length(text, i);
    const auto c = static_cast<unsigned char>(text[i]);
    if (n == 0 || (n == 1 && ((c < 0x20 && c != '\t' && c != '\n') || c == 0x7F))) {
      out += kReplacement;
      i += 1;
    } else {
      out.append(text.substr(i, n));
      i += n;
    }
  }
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
    const fs::path config = p / "tokenizer_config.json";
    std::ifstream f(config);
    std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    try {  // errors name the file (a bare "JSON: expected a string key at byte 2" did not)
      json::Value v = json::parse(text);
      if (const json::Value* k = v.is_object() ? v.find("kiln_tokenizer") : nullptr;
          k && k->as_string("kiln_tokenizer") == "byte")
        return std::make_unique<ByteTokenizer>();
    } catch (const Error& e) {
      fail("tokenizer: ", config.string(), ": ", e.what());
    }
  }
  fail("tokenizer: no tokenizer found in '", spec,
       "' (expected tokenizer.model or a kiln tokenizer_config.json; pass --tokenizer byte for bytes)");
}

}  // namespace kiln::data
