// Training data: a corpus (a text file, a folder of text files, or the embedded default)
// tokenized once into a cached token file keyed by a hash of the tokenizer and the contents;
// a train/validation split of the token stream; and a Sampler that draws batches either as
// random fixed-length windows or as packed documents (consecutive chunks in a shuffled order,
// with per-token document ids for document masks). The sampler's whole state is its seed and
// the number of batches drawn, so a checkpoint can restore it exactly.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kiln/core/tensor.h"
#include "kiln/data/token_file.h"
#include "kiln/data/tokenizer.h"

namespace kiln::data {

// The token stream of a corpus: each document is <bos> tokens <eos>; doc[i] is the index of
// the document token i belongs to.
struct TokenStream {
  std::vector<int32_t> tokens;
  std::vector<int32_t> doc;
  // load_corpus: the hash of the tokenizer and the texts (file names included) it came from,
  // its cache key; 0 from tokenize_documents.
  uint64_t source_hash = 0;
  // load_corpus: what it left out of a folder and why ("data: skipped ..."), for the user.
  std::vector<std::string> notes;
  // Token data (a token file or random ids, data/token_file.h): the ids come from here, and
  // `tokens` and `doc` stay empty (no documents: windows sampling only).
  std::shared_ptr<const TokenSource> source;
  size_t size() const { return source ? source->size() : tokens.size(); }
  int32_t token(size_t i) const { return source ? (*source)[i] : tokens[i]; }
};

// Tokenizes documents (no cache).
TokenStream tokenize_documents(const std::vector<std::string_view>& docs, const Tokenizer& tok);
// Tokenizes a file or every text file under a folder (sorted by path, one document per file),
// through a cache file `cache_dir/tokens-<hash>.bin` (created when absent; cache_dir empty:
// next to the data). `cache_hit` (optional) tells whether the cache was used.
// In a folder, files that are not text (a NUL byte in their first 8 KiB: weights, optimizer
// state, token caches) and folders that hold a kiln run or a checkpoint (an earlier `--data .`
// run trained on its own weights) are skipped, and `notes` says so. Errors name the file and
// errno's text.
// A cache file is used only when it is the user's own, whole and unchanged (a count that fits
// its size, a checksum of its ids and its key); else it is rebuilt. `use_cache` false: neither
// read nor written. `max_cache_bytes` > 0 bounds the cache folder: a cache larger than that is
// not written, and the oldest tokens-*.bin there are removed beyond that total.
TokenStream load_corpus(const std::string& path, const Tokenizer& tok, const std::string& cache_dir,
                        bool* cache_hit = nullptr, bool use_cache = true, uint64_t max_cache_bytes = 0);
// A per-user cache folder in the temporary directory, NAME-<uid>, created with mode 0700; none
// (nullopt) when that name is taken by anything but a folder of the user's own that only they
// can reach (another user could plant one, or a symlink, at a name anyone can predict), or when
// there is no temporary directory (TMPDIR naming no folder): the cache is an optimisation.
std::optional<std::string> user_cache_dir(const std::string& name);
// Whether a folder holds a kiln run (a `latest` or metrics.jsonl with step-N checkpoints or a
// loss.svg) or a checkpoint (config.json with model weights).
bool is_run_or_checkpoint_dir(const std::string& dir);

// `batches` clamped to the distinct batches of `batch` x `seq` tokens that `tokens` held-out
// tokens hold (at least 1); the note says so when it clamped ("" otherwise). `flag` names it.
std::string clamp_batches(size_t tokens, int64_t batch, int64_t seq, const char* flag, int64_t& batches);

struct Batch {
  Tensor input;    // [B, T] i64
  Tensor target;   // [B, T] i64 (the next token; -100 = ignored)
  Tensor doc_ids;  // [B, T] i64 on the host (the model builds its masks there), or undefined (packed mode only)
  int64_t num_targets = 0;  // targets that are not ignored
};

enum class SampleMode { windows, packed };
SampleMode parse_sample_mode(const std::string& s);

class Sampler {
 public:
  // Draws from tokens [begin, end) of `stream` (which must outlive the sampler).
  Sampler(const TokenStream& stream, size_t begin, size_t end, int64_t batch, int64_t seq, uint64_t seed,
          SampleMode mode);
  Batch next(Device device = kCPU);
  uint64_t position() const { return position_; }
  void set_position(uint64_t p) { position_ = p; }

 private:
  int64_t window_start(uint64_t sample) const;
  const TokenStream& stream_;
  size_t begin_, end_;
  int64_t batch_, seq_;
  uint64_t seed_;
  SampleMode mode_;
  uint64_t position_ = 0;  // samples drawn so far
  // packed mode: the shuffled chunk order of the current epoch
  mutable int64_t perm_epoch_ = -1;
  mutable std::vector<int64_t> perm_;
};

// Splits a stream: the last `val_fraction` of tokens (at least seq+1 of them) are validation.
// Throws a clear error when the corpus is too small for the sequence length.
struct Split {
  size_t train_end = 0;  // train: [0, train_end), validation: [train_end, size)
};
Split split_stream(const TokenStream& s, double val_fraction, int64_t seq);

// FNV-1a 64, for cache keys.
uint64_t fnv1a(std::string_view data, uint64_t h = 1469598103934665603ull);

}  // namespace kiln::data
