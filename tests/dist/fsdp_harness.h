// The FSDP tests' training loop: a tiny Llama (a hidden size and vocabulary no world size 2-4
// divides, so shards are uneven and some empty) trained a few AdamW steps with clipping on a
// fixed global batch that every world size splits the same way (rank r takes rows
// [r * B / N, (r + 1) * B / N) of each step's batch), sharded (fully_shard per block and the
// root) or plain (the unsharded reference). Used by the ranks (fsdp_worker.cpp) and the
// in-process tests (fsdp_test.cpp).
#pragma once
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kiln/dist/backends.h"
#include "kiln/nn/llama.h"
#include "kiln/ops/ops.h"
#include "kiln/optim/adamw.h"
#include "kiln/optim/clip.h"
#include "kiln/parallel/fsdp.h"

namespace kiln::parallel::test {

inline nn::LlamaConfig tiny_config() {
  nn::LlamaConfig c;
  c.vocab_size = 37;  // rows 37: ranks of 2, 3, 4 hold 19/18, 13/13/11, 10/10/10/7
  c.hidden_size = 20;
  c.intermediate_size = 30;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 5;
  c.num_key_value_heads = 1;  // k_proj / v_proj of 4 rows: 3 ranks hold 2/2/0 (an empty shard)
  c.max_position_embeddings = 16;
  return c;
}

constexpr int64_t kGlobalBatch = 24, kSeq = 8;  // 1-4 ranks x 1-2 micro-batches divide it
constexpr uint64_t kSeed = 1234;

struct Batch {
  Tensor input, target;  // [rows, kSeq]
};

// Rows [begin, begin + n) of step `step`'s global batch: ids from a generator seeded by the step,
// targets the next ids with a few -100 (ignored) to make counts uneven across ranks.
inline Batch batch_rows(int64_t step, int64_t begin, int64_t n, int64_t vocab, Device device = kCPU) {
  std::mt19937_64 gen(977 + static_cast<uint64_t>(step));
  std::vector<int64_t> v(static_cast<size_t>(kGlobalBatch * (kSeq + 1)));
  for (auto& x : v) x = static_cast<int64_t>(gen() % static_cast<uint64_t>(vocab));
  for (int64_t r = 0; r < kGlobalBatch; ++r)
    if ((r + step) % 3 == 0) v[static_cast<size_t>(r * (kSeq + 1) + kSeq)] = -100;  // last target ignored
  Tensor ids = from_vector<int64_t>(v, {kGlobalBatch, kSeq + 1});
  Batch b;
  b.input = ids.narrow(0, begin, n).narrow(1, 0, kSeq).contiguous();
  b.target = ids.narrow(0, begin, n).narrow(1, 1, kSeq).contiguous();
  if (!device.is_cpu()) {
    b.input = b.input.to(device);
    b.target = b.target.to(device);
  }
  return b;
}

inline int64_t count_targets(const Tensor& target) {
  int64_t n = 0;
  for (int64_t t : target.to_vector<int64_t>()) n += t != -100;
  return n;
}

inline optim::AdamWOptions adam_options() {
  optim::AdamWOptions o;
  o.lr = 3e-3;
  o.weight_decay = 0.1;
  o.decay = optim::decay_matrices_only;
  return o;
}
constexpr double kClip = 0.5;

struct RunResult {
  std::vector<double> losses;                    // the global loss of each step
  std::vector<std::pair<std::string, Tensor>> params;  // final, whole (every rank: the same)
};

// `steps` steps of the unsharded reference on the whole global batch in `accum` micro-batches.
inline RunResult train_plain(int steps, int accum, const nn::LlamaConfig& config = tiny_config(),
                             Device device = kCPU) {
  nn::LlamaForCausalLM model(config, kSeed, device);
  std::vector<std::pair<std::string, Tensor>> named;
  for (auto& [n, t] : model.named_parameters()) named.emplace_back(n, *t);
  optim::AdamW opt(named, adam_options());
  RunResult r;
  for (int s = 0; s < steps; ++s) {
    const int64_t per = kGlobalBatch / accum;
    std::vector<Batch> micro;
    int64_t targets = 0;
    for (int a = 0; a < accum; ++a) {
      micro.push_back(batch_rows(s, a * per, per, model.config.vocab_size, device));
      targets += count_targets(micro.back().target);
    }
    double loss = 0;
    for (auto& b : micro) {
      Tensor l = model.loss_sum(b.input, b.target, Tensor(), static_cast<double>(targets));
      l.backward();
      loss += l.item();
    }
    optim::clip_grad_norm_(named, kClip);
    opt.step();
    opt.zero_grad();
    r.losses.push_back(loss);
  }
  for (auto& [n, t] : model.named_parameters()) r.params.emplace_back(n, t->to(kCPU).clone());
  return r;
}

struct ShardedRun {
  std::unique_ptr<nn::LlamaForCausalLM> model;
  std::shared_ptr<FsdpModule> fsdp;
  std::unique_ptr<optim::AdamW> opt;
};

inline ShardedRun make_sharded(std::shared_ptr<dist::Communicator> comm, const FsdpOptions& o = {},
                               const nn::LlamaConfig& config = tiny_config(), Device device = kCPU) {
  ShardedRun run;
  run.model = std::make_unique<nn::LlamaForCausalLM>(config, kSeed, device);
  for (auto& layer : run.model->model->layers) fully_shard(*layer, comm, o);
  run.fsdp = fully_shard(*run.model, comm, o);
  run.opt = std::make_unique<optim::AdamW>(run.fsdp->named_shards(), adam_options());
  return run;
}

// Steps [from, to) of the sharded run: this rank's rows of each global batch, in `accum`
// micro-batches (gradient sync only on the last).
inline std::vector<double> train_sharded(ShardedRun& run, int from, int to, int accum) {
  dist::Communicator& comm = *run.fsdp->communicator();
  const int N = comm.size(), R = comm.rank();
  const int64_t mine = kGlobalBatch / N, per = mine / accum;
  const Device device = run.fsdp->named_shards().front().second.device();
  std::vector<double> losses;
  for (int s = from; s < to; ++s) {
    std::vector<Batch> micro;
    int64_t targets = 0;
    for (int a = 0; a < accum; ++a) {
      micro.push_back(batch_rows(s, R * mine + a * per, per, run.model->config.vocab_size, device));
      targets += count_targets(micro.back().target);
    }
    const double global = global_count(comm, targets, device);
    double loss = 0;
    for (int a = 0; a < accum; ++a) {
      run.fsdp->set_requires_gradient_sync(a == accum - 1);
      Tensor l = run.model->loss_sum(micro[static_cast<size_t>(a)].input, micro[static_cast<size_t>(a)].target,
                                     Tensor(), global);
      l.backward();
      loss += l.item();
    }
    run.fsdp->clip_grad_norm(kClip);
    run.opt->step();
    run.opt->zero_grad();
    Tensor t = from_vector<double>({loss}, {1}, device);
    comm.all_reduce(t, dist::ReduceOp::sum)->wait();
    losses.push_back(t.item());
  }
  return losses;
}

inline std::vector<std::pair<std::string, Tensor>> full_params(ShardedRun& run) {
  std::vector<std::pair<std::string, Tensor>> out;
  for (auto& [n, t] : run.fsdp->named_shards()) out.emplace_back(n, run.fsdp->full_tensor(n).to(kCPU));
  return out;
}

}  // namespace kiln::parallel::test
