// Pre-tokenized training data: token files memory-mapped as nanoGPT and llm.c write them, and
// synthetic uniform ids for throughput benchmarks. Formats (docs/training.md, "Token files"):
//   - llm.c: a header of 256 little-endian int32 (magic 20240520, version 1 = uint16 ids or
//     2 = uint32 ids, the token count), then the ids;
//   - flat (nanoGPT's train.bin): uint16 ids and nothing else;
//   - either with a sidecar FILE.bin.json: {"dtype": "uint16"|"uint32", "vocab_size": N,
//     "tokenizer": "byte"|"path/to/tokenizer.model"} (all optional; a flat uint32 file needs
//     it). kiln tokenize writes llm.c files with such a sidecar.
// Every id is checked against the vocabulary when a file is opened: an id out of range is an
// error naming its position. A file is mapped read-only; its bytes are never copied.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kiln/data/tokenizer.h"

namespace kiln::data {

class TokenSource {
 public:
  // Maps `path`; vocab > 0 is the model's vocabulary (every id must be below it), 0 takes the
  // sidecar's vocab_size (an error asking for --vocab when there is none).
  static std::shared_ptr<const TokenSource> open_file(const std::string& path, int64_t vocab);
  // `count` uniform ids in [0, vocab), id i a hash of (seed, i): a benchmark's data only.
  static std::shared_ptr<const TokenSource> random(int64_t vocab, int64_t count, uint64_t seed);
  ~TokenSource();
  TokenSource(const TokenSource&) = delete;
  TokenSource& operator=(const TokenSource&) = delete;

  size_t size() const { return count_; }
  int32_t operator[](size_t i) const {
    if (bytes_ == 2) return static_cast<const uint16_t*>(ids_)[i];
    if (bytes_ == 4) return static_cast<int32_t>(static_cast<const uint32_t*>(ids_)[i]);
    return random_id(i);
  }
  int64_t vocab() const { return vocab_; }
  // "llm.c v1 (uint16)", "flat uint16", "random", ...: for messages.
  const std::string& format() const { return format_; }
  // The sidecar's tokenizer (a path made absolute, or "byte"), or empty.
  const std::string& tokenizer() const { return tokenizer_; }
  // A hash of the ids (and the vocabulary), computed when opened: the run's data checksum.
  uint64_t checksum() const { return checksum_; }

 private:
  TokenSource() = default;
  int32_t random_id(size_t i) const;
  const void* ids_ = nullptr;
  std::shared_ptr<const void> map_;  // the io::MappedFile the ids live in
  size_t count_ = 0;
  int bytes_ = 0;  // 2, 4, or 0 (random)
  int64_t vocab_ = 0;
  uint64_t seed_ = 0;
  uint64_t checksum_ = 0;
  std::string format_, tokenizer_;
};

// Whether --data names token ids rather than text: "random:V" or a path ending in ".bin".
bool is_token_data(const std::string& spec);
// "random:V" (V uniform ids, 2^32 positions) or a token file, as above.
std::shared_ptr<const TokenSource> open_token_data(const std::string& spec, int64_t vocab, uint64_t seed);

// The tokenizer of a run on token data: the sidecar's, else `spec` unless it is "byte" (the
// default, which token ids need not be made by), else null (no sample, none in a checkpoint).
std::unique_ptr<Tokenizer> token_data_tokenizer(const TokenSource& source, const std::string& spec);
// The model's vocabulary: the token data's (source non-null), else `vocab` if > 0, else the
// tokenizer's; a tokenizer with more ids than that is an error (its ids would index past the
// embedding).
int64_t model_vocabulary(const TokenSource* source, const Tokenizer* tok, int64_t vocab);

// Writes ids as an llm.c file (uint16 when vocab <= 65536, else uint32) and its sidecar
// (dtype, vocab_size, num_tokens, tokenizer when not empty), both atomically. Ids are checked.
void write_token_file(const std::string& path, const std::vector<int32_t>& ids, int64_t vocab,
                      const std::string& tokenizer);

}  // namespace kiln::data
