// The training memory estimate and the available-memory figure (see memory_estimate.h).
#include "kiln/train/memory_estimate.h"

#include <algorithm>
#include <fstream>
#include <sstream>
#include <vector>

#include "kiln/core/error.h"
#include "kiln/telemetry/telemetry.h"
#include "kiln/train/report.h"

namespace kiln::train {

namespace {

// a * b, saturating (a --layers 100000 estimate must not wrap around to a small number)
int64_t mul(int64_t a, int64_t b) {
  int64_t r = 0;
  return __builtin_mul_overflow(a, b, &r) ? INT64_MAX / 4 : r;
}
int64_t add(int64_t a, int64_t b) { return std::min(a + b, INT64_MAX / 4); }

// A /proc/meminfo field in bytes (-1 when absent).
int64_t meminfo(const std::string& text, const std::string& key) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(key + ":", 0) == 0) {
      try {
        return std::stoll(line.substr(key.size() + 1)) * 1024;
      } catch (...) {
        return -1;
      }
    }
  return -1;
}

std::string read_text(const std::string& path) {
  std::ifstream f(path);
  return f.good() ? std::string((std::istreambuf_iterator<char>(f)), {}) : "";
}

}  // namespace

MemoryEstimate estimate_training_memory(const TrainConfig& cfg, const nn::LlamaConfig& m, bool bf16) {
  const int64_t d = m.hidden_size, V = m.vocab_size, I = m.intermediate_size, L = m.num_hidden_layers;
  const int64_t kv = d / std::max<int64_t>(m.num_attention_heads, 1) * m.num_key_value_heads;
  // per layer: q, o (d x d), k, v (d x kv), gate, up, down (d x I), two norms
  const int64_t per_layer = add(add(mul(2 * d, d), mul(2 * d, kv)), add(mul(3 * d, I), 2 * d));
  const int64_t params = add(add(mul(V, d), m.tie_word_embeddings ? 0 : mul(V, d)), add(mul(L, per_layer), d));
  MemoryEstimate e;
  e.parameters = mul(params, bf16 ? 6 : 4);  // f32 masters (+ the forward's bf16 copies)
  // --optimizer-in-backward frees each gradient once used: about the largest one is held at a time
  // (in bf16 with its bf16 gradient beside it)
  e.gradients = cfg.optimizer_in_backward ? mul(std::max(mul(V, d), mul(d, I)), bf16 ? 6 : 4) : mul(params, 4);
  e.optimizer = mul(params, 8);  // AdamW's two moments
  const int64_t tokens = mul(cfg.batch, cfg.seq);
  const int64_t act = bf16 ? 2 : 4;
  // What the backward needs of each layer, at the least: its input, the normed input, q/k/v,
  // the attention output and the MLP's gate, up and product (the attention's T x T scores, the
  // allocator's slack and temporaries are left out). Checkpointed blocks keep their input only,
  // plus one block's activations while it is recomputed; checkpointed MLPs keep the attention's
  // part and the MLP's input, plus one MLP's gate, up and product.
  const int64_t attention_acts = mul(tokens, add(4 * d, 2 * kv)), mlp_acts = mul(tokens, 3 * I);
  const int64_t layer_acts = add(attention_acts, mlp_acts);
  if (m.checkpoint_activations == "block")
    e.activations = add(mul(mul(tokens, d), L), layer_acts);
  else if (m.checkpoint_activations == "mlp")
    e.activations = add(mul(add(attention_acts, mul(tokens, d)), L), mlp_acts);
  else
    e.activations = mul(layer_acts, L);
  e.activations = mul(e.activations, act);
  // the logits and their gradient (f32), unless the fused loss computes them in chunks
  if (!m.fused_loss) e.activations = add(e.activations, mul(mul(tokens, V), 8));
  // the step's micro-batches, built before its first forward: input and target ids (i64)
  e.batches = mul(mul(tokens, cfg.accum), 16);
  return e;
}

AvailableMemory available_memory(const Device& dev, const std::string& root) {
  AvailableMemory a;
  if (dev.is_cuda()) {
    try {
      const telemetry::Sample s = telemetry::sample(dev);
      if (s.memory_total_bytes && s.memory_used_bytes) {
        a.bytes = *s.memory_total_bytes - *s.memory_used_bytes;
        a.source = "free on " + dev.str() + " (NVML)";
      }
    } catch (const Error&) {
      // no NVML: the device cannot say, and no estimate refuses the run
    }
    return a;
  }
  const std::string info = read_text(root + "/proc/meminfo");
  const int64_t avail = meminfo(info, "MemAvailable"), swap = meminfo(info, "SwapFree");
  if (avail >= 0) {
    a.bytes = avail + std::max<int64_t>(swap, 0);
    a.source = swap > 0 ? "MemAvailable + SwapFree" : "MemAvailable";
  }
  // a container's limit (cgroup v2), when it is the tighter one
  try {
    const std::string max = read_text(root + "/sys/fs/cgroup/memory.max"), cur = read_text(root + "/sys/fs/cgroup/memory.current");
    if (!max.empty() && max.rfind("max", 0) != 0 && !cur.empty()) {
      const int64_t left = std::stoll(max) - std::stoll(cur);
      if (a.bytes < 0 || left < a.bytes) {
        a.bytes = std::max<int64_t>(left, 0);
        a.source = "the cgroup's memory.max less memory.current";
      }
    }
  } catch (...) {
  }
  return a;
}

void check_memory_fits(const TrainConfig& cfg, const nn::LlamaConfig& m, bool bf16, const Device& dev,
                       const AvailableMemory& available) {
  if (available.bytes < 0) return;
  const MemoryEstimate e = estimate_training_memory(cfg, m, bf16);
  if (e.total() <= available.bytes) return;
  std::ostringstream msg;
  msg << "train: this run needs at least " << format_bytes(e.total()) << " of memory on " << dev.str()
      << ", more than the " << format_bytes(available.bytes) << " available (" << available.source
      << "): parameters " << format_bytes(e.parameters) << ", gradients " << format_bytes(e.gradients)
      << " and AdamW state " << format_bytes(e.optimizer) << " (" << cfg.preset << " preset: --hidden " << m.hidden_size
      << ", --layers " << m.num_hidden_layers << ", --intermediate " << m.intermediate_size << ", vocabulary "
      << m.vocab_size << "), activations " << format_bytes(e.activations) << " (--batch " << cfg.batch << " x --seq "
      << cfg.seq << "), the step's batches " << format_bytes(e.batches) << " (--accum " << cfg.accum << "). ";
  // the flags of the largest parts first
  std::vector<std::pair<int64_t, std::string>> parts = {
      {e.parameters + e.gradients + e.optimizer, "a smaller model (--preset, --layers, --hidden, --intermediate)"},
      {e.activations, "a smaller --batch or --seq (with --accum to keep the tokens per step)"},
      {e.batches, "a smaller --accum"}};
  std::stable_sort(parts.begin(), parts.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  msg << "Use " << parts[0].second << ", or " << parts[1].second;
  if (!dev.is_cuda()) msg << ", or train on a GPU (--device cuda)";
  // The memory-saving switches that alone would make this run fit.
  std::vector<std::string> would_fit;
  if (m.checkpoint_activations == "none") {
    nn::LlamaConfig block = m;
    block.checkpoint_activations = "block";
    if (estimate_training_memory(cfg, block, bf16).total() <= available.bytes)
      would_fit.push_back("--checkpoint-activations block (each block's activations recomputed in the backward)");
  }
  if (!cfg.optimizer_in_backward && cfg.global_batch == 0 && cfg.optimizer_in_backward_unavailable().empty()) {
    TrainConfig in_backward = cfg;
    in_backward.optimizer_in_backward = true;
    if (estimate_training_memory(in_backward, m, bf16).total() <= available.bytes)
      would_fit.push_back("--optimizer-in-backward --clip 0 (each gradient freed as soon as it is used)");
  }
  for (size_t i = 0; i < would_fit.size(); ++i) msg << (i == 0 ? ". It would fit with " : ", or with ") << would_fit[i];
  fail(msg.str());
}

}  // namespace kiln::train
