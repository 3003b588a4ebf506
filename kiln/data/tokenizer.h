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
};

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
