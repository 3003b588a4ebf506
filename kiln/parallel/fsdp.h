// FSDP2-style fully sharded data parallelism (torch.distributed.fsdp.fully_shard): each
// parameter of a module is cut along dim 0 into one shard per rank; a group (the parameters of
// one fully_shard call) is all-gathered into the module's parameters just before its forward
// and freed after it, gathered again for its backward, and its gradients reduce-scattered onto
// the shards, on which the optimizer steps. Everything attaches to hooks: the module's forward
// hooks (nn/module.h: Module::call), post-accumulate-grad hooks on the gathered parameters and
// an end-of-backward callback (autograd/node.h); the training loop has no FSDP branches.
//
// How a trainer uses it (every rank runs the same code; world size 1 too, bitwise the unsharded run):
//
//   auto world = dist::init_world("gloo");                 // or "nccl"; kiln launch / torchrun
//   nn::LlamaForCausalLM model(cfg, seed, device);         // the same seed on every rank
//   for (auto& layer : model.model->layers) parallel::fully_shard(*layer, world, opts);
//   auto fsdp = parallel::fully_shard(model, world, opts); // the root, last: the rest (embedding, norm, lm_head)
//   optim::AdamW opt(fsdp->named_shards(), aopts);         // the optimizer steps on the f32 shards
//   per step:
//     int64_t targets = <non-ignored targets of this rank's micro-batches>;
//     const double global = parallel::global_count(*world, targets, device);  // one all-reduce
//     for (a = 0; a < accum; ++a) {
//       fsdp->set_requires_gradient_sync(a == accum - 1);  // accumulation: reduce once, at the last
//       model.loss_sum(in, tgt, {}, global).backward();    // gradients on the shards when it returns
//     }
//     double norm = fsdp->clip_grad_norm(max_norm);        // over every shard of every rank
//     if (std::isfinite(norm)) opt.step();
//     opt.zero_grad();
//   checkpoints: parallel::save_checkpoint / load_checkpoint (parallel/dcp.h).
//
// Gradient averaging: gradients are SUMMED over ranks (divided by gradient_divide_factor, 1 by
// default). The trainer's loss is each rank's sum of token losses divided by the GLOBAL count of
// non-ignored targets of the step (all ranks, all micro-batches), so the summed gradient is the
// gradient of the global mean loss, independent of the world size and of how the batch is split
// (torch's FSDP averages instead, which is the same only when every rank has as many tokens).
//
// Shards: dim 0 of a parameter of d0 rows is padded to ceil(d0 / N) * N rows and rank r holds
// rows [r * c, min((r + 1) * c, d0)) with c = ceil(d0 / N) (trailing ranks may hold fewer rows,
// or none). A group all-gathers one flat buffer of N * sum_p(c_p * inner_p) elements (each
// parameter's place aligned to 16 bytes) in param_dtype (copy-in: each shard into this rank's
// slice; copy-out: each rank's slice into the parameters, one strided copy kernel per parameter
// and block of ranks; at one rank none: the parameters are views of the buffer) and
// reduce-scatters one buffer of the same size in reduce_dtype (in place at one rank). Padding is
// never read into a parameter or a gradient.
//
// Between steps the module's parameters keep their shapes but hold no memory (their storage is
// empty): read parameters through named_shards() or full_tensor(), not through the module, and
// do not move, cast or replace them (Module::to) once sharded.
// Prefetch: a group's pre-forward starts the all-gather of the next group in forward order (so
// at most two groups besides the root are gathered at once in the forward); its pre-backward
// starts the previous group's. The root's parameters stay gathered from its forward to the end
// of the backward. Without grad mode (evaluation, generation) every group, the root too, is
// freed after its forward.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "kiln/dist/communicator.h"
#include "kiln/nn/module.h"

namespace kiln::parallel {

struct MixedPrecision {
  // The dtype of the gathered parameters the forward and backward compute in (bf16 on CUDA);
  // unset: the parameters' own (f32).
  std::optional<DType> param_dtype;
  // The dtype of the reduce-scatter (f32 with bf16 parameters); unset: param_dtype's.
  std::optional<DType> reduce_dtype;
};

struct FsdpOptions {
  // Free the gathered parameters after the forward and gather them again for the backward
  // (memory of ~2 groups); false keeps them from the forward to the backward (no second gather).
  bool reshard_after_forward = true;
  MixedPrecision mixed_precision;
  // Reduce-scatters on a second communicator split from the first, so that they do not queue
  // behind the next all-gathers (torch's set_separate_reduce_scatter_group). Unset: on when the
  // world has more than one rank.
  std::optional<bool> separate_reduce_scatter_group;
  // The reduced gradient is sum over ranks / this (1: the sum; see "Gradient averaging" above).
  double gradient_divide_factor = 1.0;
};

// Counters of one process's FSDP work, summed over its groups (measured, not estimated).
struct FsdpStats {
  int64_t all_gathers = 0, reduce_scatters = 0;
  int64_t gathered_groups = 0, peak_gathered_groups = 0;  // groups other than the root gathered now / at most
  int64_t gathered_bytes = 0, peak_gathered_bytes = 0;    // bytes of gathered parameters, every group
  // Flat buffers alive now / at most: all-gather outputs (freed at the copy-out, before the next
  // group's gather starts; at one rank counted until the copy-out's place, though the
  // parameters then keep it) and reduce-scatter inputs (one in flight at a time).
  int64_t all_gather_buffers = 0, peak_all_gather_buffers = 0;
  int64_t reduce_scatter_buffers = 0, peak_reduce_scatter_buffers = 0;
  // The host's time waiting for them (exposed): near 0 over NCCL, whose waits order streams.
  double all_gather_wait_s = 0, reduce_scatter_wait_s = 0;
};

class FsdpGroup;

// The handle fully_shard returns (torch's FSDPModule). The root's (the last call, on the module
// that holds the others) acts on every group of the tree; another group's on its own.
class FsdpModule {
 public:
  explicit FsdpModule(std::shared_ptr<FsdpGroup> group) : group_(std::move(group)) {}

  // The shards this rank holds, named by the parameters' paths from the root module
  // ("model.layers.0.self_attn.q_proj.weight"): f32 leaves shaped [rows held, dims 1...]
  // (possibly 0 rows) whose .grad the backward sets. Give these to the optimizer.
  std::vector<std::pair<std::string, Tensor>> named_shards() const;
  // Where each shard sits in its parameter.
  struct ShardInfo {
    std::string name;
    Shape global_shape;
    int64_t row_begin = 0;  // first row of the parameter this rank holds
    Tensor shard;
  };
  std::vector<ShardInfo> shard_infos() const;
  // The whole parameter `name` (f32, every rank must call it: one all-gather).
  Tensor full_tensor(const std::string& name) const;

  // false: the backward keeps the gathered gradients (accumulation micro-batches) and reduces
  // nothing; the next backward with true reduce-scatters their sum.
  void set_requires_gradient_sync(bool on);
  void set_reshard_after_forward(bool on);
  // Gathers / frees the parameters by hand (outside a forward, e.g. to read them).
  void unshard();
  void reshard();

  // clip_grad_norm_ over the shards of every rank: one all-reduce of the sum of squares (norm
  // type 2). The same formula and rounding as optim::clip_grad_norm_, so world size 1 has its
  // bits. Returns the norm before clipping; a non-finite norm leaves the gradients unchanged.
  double clip_grad_norm(double max_norm);
  // The global gradient norm alone.
  double grad_norm();

  FsdpStats stats() const;
  void reset_peak_stats();
  const std::shared_ptr<dist::Communicator>& communicator() const;
  // The communicator the reduce-scatters run on (communicator() unless separate; split at the
  // root's first forward).
  const std::shared_ptr<dist::Communicator>& reduce_scatter_communicator() const;
  FsdpGroup& group() const { return *group_; }

 private:
  std::shared_ptr<FsdpGroup> group_;
};

// Shards the parameters of `module` that no fully_shard call on a sub-module took as one group,
// and attaches the group to the module's hooks. Apply it to each decoder block, then to the
// root (which must hold them all, and takes what is left). The parameters are read once, here
// (the same on every rank, e.g. the same seed), then freed. kiln::Error for a module sharded
// twice, a parameter of another device than the others, or options out of range.
std::shared_ptr<FsdpModule> fully_shard(nn::Module& module, std::shared_ptr<dist::Communicator> comm,
                                        const FsdpOptions& options = {});

// The whole tensor of `global_shape` from every rank's rows of it, cut as fully_shard cuts
// (rank r: rows [r * c, min((r + 1) * c, d0)), c = ceil(d0 / N)); every rank calls it (one
// all-gather) and gets the whole, in `local`'s dtype, on its device.
Tensor gather_rows(dist::Communicator& comm, const Shape& global_shape, const Tensor& local);

// Sum of `local` over the ranks (the global count of non-ignored targets the loss divides by).
// `device`: where the communicator's tensors live (a CUDA device for NCCL).
double global_count(dist::Communicator& comm, int64_t local, Device device = kCPU);

}  // namespace kiln::parallel
