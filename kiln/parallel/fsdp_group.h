// FsdpGroup: the state fully_shard attaches to a module (nn::ModuleState): its parameters'
// shards, the gathered parameters the module computes with, the flat all-gather and
// reduce-scatter buffers and their Works, and the state machine the hooks drive
// (sharded -> gathering -> unsharded -> sharded). The root group (the outermost fully_shard)
// keeps the forward order of the others for prefetching, the shared reduce-scatter
// communicator, the statistics, and ends every backward (a queued backward callback). Internal
// to kiln/parallel; users hold FsdpModule (fsdp.h).
#pragma once
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "kiln/ops/backward.h"
#include "kiln/parallel/fsdp.h"

namespace kiln::parallel {

struct FsdpParam {
  std::string local_name;  // its name in the group's module
  std::string name;        // its name from the root module (set when the root is sharded)
  Tensor* slot = nullptr;  // the module's member
  Shape shape;             // the whole parameter's
  int64_t rows = 0, inner = 0;  // dim 0, and the elements of one row
  int64_t chunk_rows = 0;       // rows per rank, ceil(rows / N)
  int64_t offset = 0;           // its first element in one rank's slice of the flat buffers
  int64_t row_begin = 0, local_rows = 0;  // the rows this rank holds
  bool trainable = true;
  Tensor shard;  // this rank's rows: a leaf the optimizer steps on
  Tensor full;   // the gathered parameter (param dtype), the module's member; empty storage while sharded
  std::shared_ptr<AccumulateGrad> accumulator;  // keeps the post-accumulate hook
  bool got_grad = false;                          // in this backward
};

enum class GroupState : uint8_t { sharded, gathering, unsharded };

class FsdpGroup final : public nn::ModuleState {
 public:
  FsdpGroup(nn::Module& module, std::shared_ptr<dist::Communicator> comm, const FsdpOptions& options);
  ~FsdpGroup() override;

  // Frees the gathered parameters' storage, hooks their accumulators and puts them into the
  // module (after `params` is filled).
  void attach_params();

  // ---- what the hooks call ----
  void pre_forward();
  Tensor post_forward(const Tensor& output);
  void pre_backward();
  void on_grad(size_t param);
  void finish_backward();  // root: the end-of-backward callback
  // Root: every group sharded, counters ready for the next backward; `failed`: a backward ended
  // by an exception, whose gathered gradients and pending reductions are dropped.
  void reset_pass(bool failed);

  // ---- gathering and freeing ----
  void start_all_gather();
  void finish_all_gather();
  void unshard();
  void reshard();
  void post_backward();
  void start_reduce_scatter();
  void finish_reduce_scatter();

  // Makes this group the root of `children` (the groups in its module's subtree, forward order).
  void adopt(const std::vector<FsdpGroup*>& children);
  FsdpGroup& root() { return *root_; }
  bool is_root() const { return root_ == this; }
  // Every group of the tree, root last (root only).
  std::vector<FsdpGroup*> all_groups();

  nn::Module& module;
  std::shared_ptr<dist::Communicator> comm, rs_comm;
  FsdpOptions options;
  DType param_dtype = DType::f32, reduce_dtype = DType::f32;
  Device device;
  std::vector<FsdpParam> params;
  int64_t slice_numel = 0;  // one rank's slice of the flat buffers
  GroupState state = GroupState::sharded;
  bool sync_gradients = true;
  std::shared_ptr<FsdpStats> stats;
  int hook_pre = -1, hook_post = -1;

 private:
  void count_gathered(int64_t sign);
  void setup_reduce_scatter_comm();
  bool rs_ready_ = false;
  FsdpGroup* root_ = this;
  std::vector<FsdpGroup*> order_;  // root: the other groups in forward order
  int index_ = -1;                 // place in the root's order (-1: the root)
  Tensor ag_buffer_;
  dist::WorkPtr ag_work_;
  Tensor rs_input_, rs_output_;
  dist::WorkPtr rs_work_;
  size_t grads_pending_ = 0;
  bool post_backward_done_ = false;
  bool backward_queued_ = false;  // root: the end-of-backward callback is queued
  bool in_pass_ = false;          // a backward through this group is under way
  FsdpGroup* pending_rs_ = nullptr;  // root: the group whose reduce-scatter is in flight
};

}  // namespace kiln::parallel
