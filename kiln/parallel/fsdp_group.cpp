// FsdpGroup's state machine: copy-in, the flat all-gather and copy-out (at one rank, views of
// the buffer instead) before a forward or a backward, the prefetch of the neighbour group,
// freeing after, and the reduce-scatter of the gathered gradients onto the shards when the last
// of them has accumulated.
#include "kiln/parallel/fsdp_group.h"

#include <new>

#include "kiln/autograd/grad_mode.h"
#include "kiln/ops/ops.h"

namespace kiln::parallel {

namespace {

using Clock = std::chrono::steady_clock;

// NOTE [gathered parameter storage]: the module computes with `full`, whose storage the
// autograd graph shares (SavedTensor keeps a detached alias of it). FSDP2 frees it after the
// forward with storage.resize_(0) and refills it before the backward, so the saved aliases see
// the regathered values and the memory is not held from the forward to the backward. kiln's
// Storage has no resize, so the Storage object itself is replaced in place (destroyed and
// constructed again at the same address, which every alias reaches through its shared_ptr):
// an owned block of `nbytes` through the device's allocator (counted by memory_stats), or an
// empty borrowed one. Its version counter restarts at 0; every gather makes the same copies
// into it, so the version a saved alias recorded in the forward is found again in the backward.
// `borrow_from`, when given, is a buffer whose bytes [byte_offset, byte_offset + nbytes) the
// storage borrows instead (keeping the buffer's storage alive).
void resize_storage(Storage& s, size_t nbytes, const Tensor* borrow_from = nullptr, size_t byte_offset = 0) {
  if (!borrow_from && s.nbytes() == nbytes && (nbytes == 0 || !s.borrowed())) return;
  const Device d = s.device();
  s.~Storage();
  if (nbytes > 0) {
    try {
      if (borrow_from)
        ::new (static_cast<void*>(&s)) Storage(static_cast<uint8_t*>(borrow_from->data_ptr()) + byte_offset, nbytes, d,
                                                borrow_from->storage());
      else
        ::new (static_cast<void*>(&s)) Storage(nbytes, d);
      return;
    } catch (...) {
      ::new (static_cast<void*>(&s)) Storage(nullptr, 0, d, nullptr);
      throw;
    }
  }
  ::new (static_cast<void*>(&s)) Storage(nullptr, 0, d, nullptr);
}

// The copies between a parameter viewed [rows, inner] and the rank-major flat buffer viewed
// [N, slice], appended to one batch (copy_many): rows [r * c, (r + 1) * c) of the parameter are
// elements [offset, offset + c * inner) of rank r's slice. Two strided copies at most: the ranks
// whose rows are all there, then the one cut short (padding is neither read nor written).
struct CopyBatch {
  std::vector<Tensor> dsts, srcs;
  void add(const Tensor& dst, const Tensor& src) {
    dsts.push_back(dst);
    srcs.push_back(src);
  }
  void run() { copy_many(dsts, srcs); }
};

void copy_rows(CopyBatch& batch, const Tensor& flat2d, const FsdpParam& p, const Tensor& param2d, bool into_param) {
  const int64_t c = p.chunk_rows;
  if (c == 0 || p.rows == 0 || p.inner == 0) return;
  const int64_t q = p.rows / c, rem = p.rows - q * c;
  const Tensor cols = flat2d.narrow(1, p.offset, c * p.inner);
  auto copy = [&](const Tensor& buf, const Tensor& par) {
    if (into_param) batch.add(par, buf);
    else batch.add(buf, par);
  };
  if (q > 0) copy(cols.narrow(0, 0, q), param2d.narrow(0, 0, q * c).view({q, c * p.inner}));
  if (rem > 0) copy(cols.narrow(0, q, 1).narrow(1, 0, rem * p.inner), param2d.narrow(0, q * c, rem).view({1, rem * p.inner}));
}

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

void count(int64_t& now, int64_t& peak, int64_t delta) {
  now += delta;
  peak = std::max(peak, now);
}

}  // namespace

FsdpGroup::~FsdpGroup() = default;

void FsdpGroup::attach_params() {
  grads_pending_ = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    FsdpParam& p = params[i];
    resize_storage(*p.full.storage(), 0);
    p.full.requires_grad_(p.trainable);
    if (p.trainable) {
      p.accumulator = register_post_accumulate_grad_hook(p.full, [this, i](const Tensor&) { on_grad(i); });
      grads_pending_++;
    }
    *p.slot = p.full;
  }
}

std::vector<FsdpGroup*> FsdpGroup::all_groups() {
  std::vector<FsdpGroup*> out = order_;
  out.push_back(this);
  return out;
}

void FsdpGroup::adopt(const std::vector<FsdpGroup*>& children) {
  order_ = children;
  for (size_t i = 0; i < children.size(); ++i) {
    FsdpGroup* c = children[i];
    c->root_ = this;
    c->index_ = static_cast<int>(i);
    c->order_.clear();
    c->stats = stats;
    c->rs_comm = rs_comm;
  }
}

void FsdpGroup::count_gathered(int64_t sign) {
  int64_t bytes = 0;
  for (const auto& p : params) bytes += static_cast<int64_t>(p.full.nbytes());
  stats->gathered_bytes += sign * bytes;
  stats->peak_gathered_bytes = std::max(stats->peak_gathered_bytes, stats->gathered_bytes);
  if (!is_root()) {
    stats->gathered_groups += sign;
    stats->peak_gathered_groups = std::max(stats->peak_gathered_groups, stats->gathered_groups);
  }
}

// ---- gathering ----

void FsdpGroup::start_all_gather() {
  if (state != GroupState::sharded) return;
  NoGradGuard ng;
  const int N = comm->size();
  ag_buffer_ = Tensor::empty({N * slice_numel}, param_dtype, device);
  Tensor mine = ag_buffer_.narrow(0, comm->rank() * slice_numel, slice_numel);
  CopyBatch copy_in;  // each shard (cast to param_dtype) into this rank's slice
  for (const auto& p : params)
    if (p.local_rows > 0 && p.inner > 0)
      copy_in.add(mine.narrow(0, p.offset, p.local_rows * p.inner), p.shard.detach().view({p.local_rows * p.inner}));
  copy_in.run();
  ag_work_ = comm->all_gather_single(ag_buffer_, mine);
  stats->all_gathers++;
  count(stats->all_gather_buffers, stats->peak_all_gather_buffers, +1);
  state = GroupState::gathering;
}

void FsdpGroup::finish_all_gather() {
  if (state != GroupState::gathering) return;
  NoGradGuard ng;
  const auto t0 = Clock::now();
  dist::WorkPtr w = std::move(ag_work_);
  w->wait_on_device();  // NCCL: the stream waits, the host runs on (NOTE [waiting on the device])
  stats->all_gather_wait_s += seconds_since(t0);
  // NOTE [one rank's gathered parameters]: at one rank the buffer holds each parameter whole,
  // contiguous at its offset (aligned: NOTE [slice alignment] in fsdp.cpp), so the gathered
  // parameters borrow its bytes and no copy-out runs; the buffer lives until the last of them is
  // resharded. Over more ranks a parameter's rows lie in every rank's slice: they are copied out.
  if (comm->size() == 1) {
    const size_t item = itemsize(param_dtype);
    for (auto& p : params)
      resize_storage(*p.full.storage(), p.full.nbytes(), &ag_buffer_, static_cast<size_t>(p.offset) * item);
  } else {
    const Tensor flat2d = ag_buffer_.view({comm->size(), slice_numel});
    CopyBatch copy_out;  // every rank's rows into the gathered parameters
    for (auto& p : params) {
      resize_storage(*p.full.storage(), p.full.nbytes());
      copy_rows(copy_out, flat2d, p, p.full.detach().view({p.rows, p.inner}), true);
    }
    copy_out.run();
  }
  ag_buffer_ = Tensor();
  count(stats->all_gather_buffers, stats->peak_all_gather_buffers, -1);
  state = GroupState::unsharded;
  count_gathered(+1);
}

void FsdpGroup::unshard() {
  start_all_gather();
  finish_all_gather();
}

void FsdpGroup::reshard() {
  finish_all_gather();
  if (state != GroupState::unsharded) return;
  for (auto& p : params) resize_storage(*p.full.storage(), 0);
  state = GroupState::sharded;
  count_gathered(-1);
}

// ---- the hooks ----

void FsdpGroup::setup_reduce_scatter_comm() {
  rs_ready_ = true;
  const int N = comm->size();
  if (!options.separate_reduce_scatter_group.value_or(N > 1) || N == 1) return;
  std::vector<int> ranks(static_cast<size_t>(N));
  for (int r = 0; r < N; ++r) ranks[static_cast<size_t>(r)] = r;
  rs_comm = comm->split(ranks, comm->name() + ".fsdp_reduce_scatter");
  for (FsdpGroup* g : order_) g->rs_comm = rs_comm;
}

void FsdpGroup::pre_forward() {
  // The root's first forward: every rank is here, in the same order, so it may split.
  if (is_root() && !rs_ready_) setup_reduce_scatter_comm();
  // A backward that failed (an exception) never ran its end callback: start clean.
  if (is_root() && backward_queued_ && !in_backward()) reset_pass(true);
  unshard();
  // The recomputation of activation checkpointing runs inside the backward: no prefetch then.
  if (in_backward()) return;
  FsdpGroup& r = *root_;
  const size_t next = is_root() ? 0 : static_cast<size_t>(index_) + 1;
  if (next < r.order_.size()) r.order_[next]->start_all_gather();
}

Tensor FsdpGroup::post_forward(const Tensor& output) {
  if (in_backward()) return output;  // a recomputation: its backward follows at once
  if (!grad_enabled() || !output.defined() || !output.requires_grad()) {
    reshard();  // no backward comes (evaluation, generation)
    return output;
  }
  if (!is_root() && options.reshard_after_forward) reshard();
  // An identity node in front of the output: its backward is this group's pre-backward.
  Tensor y = output.detach();
  record("fsdp_pre_backward", {output}, y, [this](const std::vector<Tensor>& grads) {
    pre_backward();
    return grads;
  });
  return y;
}

void FsdpGroup::pre_backward() {
  FsdpGroup& r = *root_;
  if (!r.backward_queued_) {
    FsdpGroup* rp = &r;
    queue_backward_callback([rp] { rp->finish_backward(); });
    r.backward_queued_ = true;
  }
  in_pass_ = true;
  unshard();
  // Prefetch the group whose backward comes next (the previous one in forward order).
  if (is_root()) {
    if (!order_.empty()) order_.back()->start_all_gather();
  } else if (index_ > 0) {
    r.order_[static_cast<size_t>(index_) - 1]->start_all_gather();
  }
}

void FsdpGroup::on_grad(size_t i) {
  FsdpParam& p = params[i];
  if (p.got_grad) return;
  p.got_grad = true;
  in_pass_ = true;
  if (grads_pending_ > 0 && --grads_pending_ == 0) post_backward();
}

void FsdpGroup::post_backward() {
  if (post_backward_done_) return;
  post_backward_done_ = true;
  if (sync_gradients) start_reduce_scatter();
  reshard();
}

void FsdpGroup::finish_backward() {
  const std::vector<FsdpGroup*> groups = all_groups();
  // A group some of whose parameters got no gradient reduces now (those count as zeros).
  for (FsdpGroup* g : groups)
    if (g->in_pass_ && !g->post_backward_done_) g->post_backward();
  if (pending_rs_) pending_rs_->finish_reduce_scatter();
  reset_pass(false);
}

void FsdpGroup::reset_pass(bool failed) {
  pending_rs_ = nullptr;
  for (FsdpGroup* g : all_groups()) {
    if (failed) {  // what the failed backward left: its gathered gradients and reductions
      for (auto& p : g->params) p.full.set_grad(Tensor());
      if (g->rs_work_) {
        g->rs_work_.reset();
        g->rs_input_ = g->rs_output_ = Tensor();
        count(stats->reduce_scatter_buffers, stats->peak_reduce_scatter_buffers, -1);
      }
    }
    g->reshard();
    g->post_backward_done_ = false;
    g->in_pass_ = false;
    g->grads_pending_ = 0;
    for (auto& p : g->params) {
      p.got_grad = false;
      if (p.trainable) g->grads_pending_++;
    }
  }
  backward_queued_ = false;
}

// ---- reducing ----

void FsdpGroup::start_reduce_scatter() {
  FsdpGroup& r = *root_;
  if (r.pending_rs_ && r.pending_rs_ != this) r.pending_rs_->finish_reduce_scatter();  // one in flight
  NoGradGuard ng;
  const int N = comm->size();
  rs_input_ = Tensor::empty({N * slice_numel}, reduce_dtype, device);
  bool gaps = false;  // padding or a parameter without a gradient: zeros there
  for (const auto& p : params)
    if (p.trainable && (!p.full.grad().defined() || p.chunk_rows * N != p.rows)) gaps = true;
  if (gaps) rs_input_.zero_();
  const Tensor flat2d = rs_input_.view({N, slice_numel});
  CopyBatch grads_in;
  for (auto& p : params) {
    if (!p.trainable) continue;
    const Tensor g = p.full.grad();
    if (g.defined()) copy_rows(grads_in, flat2d, p, g.contiguous().view({p.rows, p.inner}), false);
  }
  grads_in.run();
  for (auto& p : params)
    if (p.trainable) p.full.set_grad(Tensor());  // the gathered gradients are freed once copied
  // One rank reduces in place (its slice is the whole input): no copy from input to output.
  rs_output_ = N == 1 ? rs_input_ : Tensor::empty({slice_numel}, reduce_dtype, device);
  rs_work_ = rs_comm->reduce_scatter_single(rs_output_, rs_input_, dist::ReduceOp::sum);
  stats->reduce_scatters++;
  count(stats->reduce_scatter_buffers, stats->peak_reduce_scatter_buffers, +1);
  r.pending_rs_ = this;
}

void FsdpGroup::finish_reduce_scatter() {
  if (!rs_work_) return;
  NoGradGuard ng;
  const auto t0 = Clock::now();
  dist::WorkPtr w = std::move(rs_work_);
  w->wait_on_device();  // NCCL: the stream waits, the host runs on (NOTE [waiting on the device])
  stats->reduce_scatter_wait_s += seconds_since(t0);
  rs_input_ = Tensor();
  count(stats->reduce_scatter_buffers, stats->peak_reduce_scatter_buffers, -1);
  // Views of the output keep all of it alive: only when this rank's gradients fill it (no
  // padding rows, no frozen parameter's rows; the few elements that align each parameter aside),
  // else copies, so a gradient never holds more than its rows.
  bool as_views = true;
  for (const auto& p : params)
    if (!p.trainable || p.local_rows != p.chunk_rows) as_views = false;
  for (auto& p : params) {
    if (!p.trainable) continue;
    Tensor g = rs_output_.narrow(0, p.offset, p.local_rows * p.inner).view(p.shard.shape());
    if (options.gradient_divide_factor != 1.0) g = mul(g, 1.0 / options.gradient_divide_factor);
    Tensor existing = p.shard.grad();
    if (existing.defined()) {
      existing.copy_(add(existing, g.to(existing.dtype())));
    } else if (g.dtype() == p.shard.dtype()) {
      // The reduced rows themselves where they may be (as FSDP2's sharded .grad): a view of this
      // group's output, which lives until the last of its parameters' gradients is dropped.
      p.shard.set_grad(as_views ? g : g.clone());
    } else {
      p.shard.set_grad(g.to(p.shard.dtype()));
    }
  }
  rs_output_ = Tensor();
  if (root_->pending_rs_ == this) root_->pending_rs_ = nullptr;
}

}  // namespace kiln::parallel
