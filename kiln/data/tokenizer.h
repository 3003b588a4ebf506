// Tokenizers: the built-in byte-level tokenizer (ids 0..255 are bytes, then <bos>, <eos>,
// <pad>) and SentencePiece models (BPE or unigram, through Debian's libsentencepiece when kiln
// was built with it). A tokenizer saves its files into a checkpoint directory and
// load_tokenizer() finds them there again.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace kiln::data {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  virtual std::vector<int32_t> encode(std::string_view text) const = 0;
  virtual std::string decode(const std::vector<int32_t>& ids) const = 0;
  virtual int64_t vocab_size() const = 0;
  virtual int32_t bos_id() const = 0;
  virtual int32_t eos_id() const = 0;
  virtual std::string kind() const = 0;         // "byte" or "sentencepiece"
  virtual std::string fingerprint() const = 0;  // identifies the vocabulary (cache keys)
  // Writes the tokenizer's files into `dir` (tokenizer_config.json, tokenizer.model, ...).
  virtual void save(const std::string& dir) const = 0;
  // The text `continuation` adds after `context`: decode(context + continuation) past what it
  // shares with decode(context). Callers that stream pass the context's last few tokens.
  // Token by token decoding loses what depends on the neighbours: SentencePiece drops a piece's
  // leading space at the start of a decode ("hello world" came out "helloworld") and joins
  // byte-fallback pieces into characters only when they are decoded together.
  std::string decode_continuation(const std::vector<int32_t>& context, const std::vector<int32_t>& continuation) const;
};

// Whether text ends inside a character: an incomplete UTF-8 sequence (a byte tokenizer's
// partial character) or U+FFFD (SentencePiece's stand-in for byte pieces not yet whole). A
// stream holds such text back until the next token completes it.
bool ends_mid_character(std::string_view text);
// Text as a terminal or a UTF-8 file should get it: bytes that are not valid UTF-8 and control
// characters other than tab and newline become U+FFFD (a byte model's sample printed lone
// continuation bytes and BEL). Decoding itself stays exact; this is for display only.
std::string displayable(std::string_view text);

class ByteTokenizer final : public Tokenizer {
 public:
  static constexpr int32_t kBos = 256, kEos = 257, kPad = 258, kVocab = 259;
  std::vector<int32_t> encode(std::string_view text) const override;
  std::string decode(const std::vector<int32_t>& ids) const override;
  int64_t vocab_size() const override { return kVocab; }
  int32_t bos_id() const override { return kBos; }
  int32_t eos_id() const override { return kEos; }
  std::string kind() const override { return "byte"; }
  std::string fingerprint() const override { return "byte-v1"; }
  void save(const std::string& dir) const override;
};

// Whether kiln was built with SentencePiece.
bool sentencepiece_available();
// Loads a SentencePiece tokenizer.model (kiln::Error if absent or kiln was built without it).
std::unique_ptr<Tokenizer> load_sentencepiece(const std::string& model_path);
struct SentencePieceTrainOptions {
  int64_t vocab_size = 8000;
  std::string model_type = "bpe";  // bpe | unigram
  std::string output_prefix = "tokenizer";  // writes PREFIX.model and PREFIX.vocab
};
void train_sentencepiece(const std::vector<std::string>& files, const SentencePieceTrainOptions& options);

// "byte", a path to a tokenizer.model, or a checkpoint directory holding tokenizer files.
std::unique_ptr<Tokenizer> load_tokenizer(const std::string& spec);

}  // namespace kiln::data
