// Token files (llm.c header, flat uint16, sidecar JSON), memory-mapped and range-checked, the
// synthetic random:V source, and the writer kiln tokenize uses. Formats in token_file.h.
#include "kiln/data/token_file.h"

#include <algorithm>
#include <bit>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "kiln/core/error.h"
#include "kiln/io/file.h"
#include "kiln/io/json.h"

namespace kiln::data {

namespace fs = std::filesystem;
static_assert(std::endian::native == std::endian::little, "token files are little-endian");

namespace {

constexpr int32_t kLlmcMagic = 20240520;
constexpr size_t kLlmcHeaderBytes = 256 * 4;
constexpr uint64_t kMul = 0x9E3779B97F4A7C15ull;

uint64_t mix(uint64_t x) {  // splitmix64's finaliser
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// The sidecar's fields (all optional).
struct Sidecar {
  bool present = false;
  int bytes = 0;  // 0: not given
  int64_t vocab = 0, num_tokens = -1;
  std::string tokenizer;
};

Sidecar read_sidecar(const std::string& path) {
  Sidecar s;
  const std::string side = path + ".json";
  std::error_code ec;
  if (!fs::exists(side, ec)) return s;
  s.present = true;
  json::Value v;
  try {
    v = json::parse(io::read_file_prefix(side, 1 << 20));
  } catch (const Error& e) {
    fail("data: sidecar '", side, "': ", e.what());
  }
  KILN_CHECK(v.is_object(), "data: sidecar '", side, "' must hold a JSON object");
  if (const json::Value* d = v.find("dtype")) {
    const std::string& t = d->as_string("dtype");
    KILN_CHECK(t == "uint16" || t == "uint32", "data: sidecar '", side, "': dtype '", t,
               "' is not one of: uint16, uint32");
    s.bytes = t == "uint16" ? 2 : 4;
  }
  if (const json::Value* x = v.find("vocab_size")) {
    s.vocab = x->as_int("vocab_size");
    KILN_CHECK(s.vocab > 0 && s.vocab <= (int64_t{1} << 31), "data: sidecar '", side, "': vocab_size=", s.vocab,
               " must be in [1, 2^31]");
  }
  if (const json::Value* x = v.find("num_tokens")) s.num_tokens = x->as_int("num_tokens");
  if (const json::Value* x = v.find("tokenizer")) {
    s.tokenizer = x->as_string("tokenizer");
    if (s.tokenizer != "byte" && !s.tokenizer.empty() && fs::path(s.tokenizer).is_relative())
      s.tokenizer = (fs::path(side).parent_path() / s.tokenizer).lexically_normal().string();
  }
  return s;
}

}  // namespace

TokenSource::~TokenSource() = default;

int32_t TokenSource::random_id(size_t i) const {
  return static_cast<int32_t>(mix(seed_ * kMul + i) % static_cast<uint64_t>(vocab_));
}

std::shared_ptr<const TokenSource> TokenSource::open_file(const std::string& path, int64_t vocab) {
  KILN_CHECK(vocab >= 0 && vocab <= (int64_t{1} << 31), "data: vocab=", vocab, " must be in [0, 2^31] (0: the file's)");
  std::shared_ptr<io::MappedFile> map = io::MappedFile::open(path);  // names a missing or irregular file
  const Sidecar side = read_sidecar(path);
  const uint64_t size = map->size();
  std::shared_ptr<TokenSource> t(new TokenSource());
  const uint8_t* base = map->data();
  int32_t head[3] = {0, 0, 0};
  if (size >= 12) std::memcpy(head, base, 12);
  size_t header = 0;
  if (size >= 12 && head[0] == kLlmcMagic) {
    KILN_CHECK(head[1] == 1 || head[1] == 2, "data: '", path, "' has llm.c's magic number but version ", head[1],
               " (expected 1: uint16 ids, or 2: uint32 ids)");
    t->bytes_ = head[1] == 1 ? 2 : 4;
    header = kLlmcHeaderBytes;
    KILN_CHECK(size >= header, "data: '", path, "' is truncated: ", size, " bytes, less than llm.c's ", header,
               "-byte header");
    KILN_CHECK(head[2] >= 0, "data: '", path, "': the header's token count ", head[2], " is negative");
    const uint64_t want = header + static_cast<uint64_t>(head[2]) * t->bytes_;
    KILN_CHECK(size == want, "data: '", path, "' is ", size < want ? "truncated" : "longer than its header says", ": ",
               "the header says ", head[2], " tokens of ", t->bytes_, " bytes (", want, " bytes with the header), the "
               "file has ", size, " bytes");
    KILN_CHECK(!side.bytes || side.bytes == t->bytes_, "data: '", path, "': the sidecar says dtype uint",
               side.bytes * 8, ", the llm.c header uint", t->bytes_ * 8);
    t->format_ = "llm.c v" + std::to_string(head[1]) + " (uint" + std::to_string(t->bytes_ * 8) + ")";
  } else {
    t->bytes_ = side.bytes ? side.bytes : 2;
    t->format_ = std::string("flat uint") + std::to_string(t->bytes_ * 8) + (side.present ? " (sidecar)" : "");
    KILN_CHECK(size % t->bytes_ == 0, "data: '", path, "' is truncated: ", size, " bytes is not a whole number of ",
               t->bytes_, "-byte ids (", t->format_, ")");
  }
  t->count_ = (size - header) / t->bytes_;
  KILN_CHECK(t->count_ > 0, "data: '", path, "' holds no tokens (", t->format_, ", ", size, " bytes)");
  KILN_CHECK(side.num_tokens < 0 || static_cast<uint64_t>(side.num_tokens) == t->count_, "data: '", path,
             "': the sidecar says ", side.num_tokens, " tokens, the file holds ", t->count_);
  t->ids_ = base + header;
  t->map_ = map;
  t->tokenizer_ = side.tokenizer;
  // One pass: the largest id (and, past the vocabulary, where the first such id is) and a hash.
  uint32_t max_id = 0;
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < t->count_; ++i) {
    const uint32_t id = static_cast<uint32_t>((*t)[i]);
    max_id = std::max(max_id, id);
    h = (h ^ id) * kMul;
  }
  if (t->bytes_ == 4) KILN_CHECK(max_id < (1u << 31), "data: '", path, "': id ", max_id, " does not fit in int32");
  t->vocab_ = vocab > 0 ? vocab : side.vocab;
  KILN_CHECK(t->vocab_ > 0, "data: '", path, "' (", t->format_, ") does not say its vocabulary (no sidecar ", path,
             ".json with vocab_size); its largest id is ", max_id, ": pass --vocab N, the tokenizer's vocabulary "
             "(50257 for GPT-2 ids, as nanoGPT's and llm.c's GPT-2 files hold)");
  if (max_id >= static_cast<uint64_t>(t->vocab_)) {
    size_t at = 0;
    while (static_cast<uint64_t>(static_cast<uint32_t>((*t)[at])) < static_cast<uint64_t>(t->vocab_)) ++at;
    fail("data: '", path, "': token id ", static_cast<uint32_t>((*t)[at]), " at position ", at, " (of ", t->count_,
         ") is out of range for the vocabulary of ", t->vocab_, vocab > 0 ? " (--vocab)" : " (the sidecar's vocab_size)",
         "; the largest id is ", max_id);
  }
  t->checksum_ = (h ^ static_cast<uint64_t>(t->vocab_)) * kMul;
  return t;
}

std::shared_ptr<const TokenSource> TokenSource::random(int64_t vocab, int64_t count, uint64_t seed) {
  KILN_CHECK(vocab >= 1 && vocab <= (int64_t{1} << 31), "data: random:V needs V in [1, 2^31], got ", vocab);
  KILN_CHECK(count > 0, "data: random ids: count=", count, " must be positive");
  std::shared_ptr<TokenSource> t(new TokenSource());
  t->count_ = static_cast<size_t>(count);
  t->vocab_ = vocab;
  t->seed_ = seed;
  t->format_ = "random";
  t->checksum_ = mix(static_cast<uint64_t>(vocab) * kMul ^ mix(seed));
  return t;
}

bool is_token_data(const std::string& spec) {
  return spec.rfind("random:", 0) == 0 || (spec.size() > 4 && spec.compare(spec.size() - 4, 4, ".bin") == 0);
}

std::shared_ptr<const TokenSource> open_token_data(const std::string& spec, int64_t vocab, uint64_t seed) {
  if (spec.rfind("random:", 0) == 0) {
    const std::string v = spec.substr(7);
    int64_t n = 0;
    auto [p, ec] = std::from_chars(v.data(), v.data() + v.size(), n);
    KILN_CHECK(ec == std::errc() && p == v.data() + v.size() && n >= 1, "data: '", spec,
               "': random:V needs a positive vocabulary V (random:128256)");
    KILN_CHECK(vocab == 0 || vocab == n, "data: '", spec, "' draws ids below ", n, " but --vocab is ", vocab);
    return TokenSource::random(n, int64_t{1} << 32, seed);
  }
  return TokenSource::open_file(spec, vocab);
}

std::unique_ptr<Tokenizer> token_data_tokenizer(const TokenSource& source, const std::string& spec) {
  if (!source.tokenizer().empty()) return load_tokenizer(source.tokenizer());
  if (spec.empty() || spec == "byte") return nullptr;
  return load_tokenizer(spec);
}

int64_t model_vocabulary(const TokenSource* source, const Tokenizer* tok, int64_t vocab) {
  const int64_t v = source ? source->vocab() : vocab > 0 ? vocab : tok ? tok->vocab_size() : 0;
  KILN_CHECK(v > 0, "data: the model's vocabulary is unknown (no tokenizer, no --vocab)");
  KILN_CHECK(!tok || tok->vocab_size() <= v, "data: the tokenizer (", tok ? tok->kind() : "", ") has ",
             tok ? tok->vocab_size() : 0, " ids, more than the model's vocabulary of ", v,
             source ? " (the token data's)" : " (--vocab)", "; pass a --vocab of at least ", tok ? tok->vocab_size() : 0);
  return v;
}

void write_token_file(const std::string& path, const std::vector<int32_t>& ids, int64_t vocab,
                      const std::string& tokenizer) {
  KILN_CHECK(vocab >= 1 && vocab <= (int64_t{1} << 31), "write_token_file: vocab=", vocab, " must be in [1, 2^31]");
  KILN_CHECK(ids.size() <= static_cast<size_t>(INT32_MAX), "write_token_file: ", ids.size(),
             " ids are more than llm.c's header can count (2^31 - 1)");
  for (size_t i = 0; i < ids.size(); ++i)
    KILN_CHECK(ids[i] >= 0 && ids[i] < vocab, "write_token_file: id ", ids[i], " at position ", i,
               " is out of range [0, ", vocab, ")");
  const int bytes = vocab <= 65536 ? 2 : 4;
  int32_t header[256] = {};
  header[0] = kLlmcMagic;
  header[1] = bytes == 2 ? 1 : 2;
  header[2] = static_cast<int32_t>(ids.size());
  {
    io::AtomicWriter w(path);
    w.write(header, sizeof header);
    if (bytes == 4) {
      w.write(ids.data(), ids.size() * 4);
    } else {
      std::vector<uint16_t> narrow(ids.begin(), ids.end());
      w.write(narrow.data(), narrow.size() * 2);
    }
    w.commit();
  }
  json::Value side = json::Value::object();
  side["format"] = "llm.c";
  side["dtype"] = bytes == 2 ? "uint16" : "uint32";
  side["vocab_size"] = vocab;
  side["num_tokens"] = static_cast<int64_t>(ids.size());
  if (!tokenizer.empty()) side["tokenizer"] = tokenizer;
  const std::string text = side.dump(1) + "\n";
  io::AtomicWriter w(path + ".json");
  w.write(text.data(), text.size());
  w.commit();
}

}  // namespace kiln::data
