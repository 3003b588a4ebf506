// fully_shard: cuts a module's parameters into shards, attaches the group to the module's
// hooks and makes the outermost call the root of the groups below it; FsdpModule's methods
// (shards, gradient sync, the global gradient norm) and global_count.
#include "kiln/parallel/fsdp.h"

#include <algorithm>
#include <cmath>
#include <set>

#include "kiln/autograd/grad_mode.h"
#include "kiln/ops/ops.h"
#include "kiln/optim/clip.h"
#include "kiln/parallel/fsdp_group.h"

namespace kiln::parallel {

namespace {
std::string join(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : prefix + "." + name;
}
FsdpGroup* group_of(const nn::Module& m) { return dynamic_cast<FsdpGroup*>(m.state()); }
// NOTE [slice alignment]: each parameter's elements in a slice begin at a multiple of 16 bytes
// in both buffers' dtypes (8 elements when either is bf16, 4 in f32): at one rank the gathered
// parameters are views of the all-gather buffer itself (NOTE [one rank's gathered parameters] in
// fsdp_group.cpp), and kernels want 16-byte aligned operands (the GEMMs' tensor-memory copies,
// vector loads). The padding is never read into a parameter or a gradient; at a few elements a
// parameter it is kept alive with views of the reduce-scatter output.
int64_t align_in_slice(int64_t n, DType param_dtype, DType reduce_dtype) {
  const auto item = static_cast<int64_t>(std::min(itemsize(param_dtype), itemsize(reduce_dtype)));
  const int64_t align = std::max<int64_t>(1, 16 / item);
  return (n + align - 1) / align * align;
}
}  // namespace

FsdpGroup::FsdpGroup(nn::Module& m, std::shared_ptr<dist::Communicator> c, const FsdpOptions& o)
    : module(m), comm(std::move(c)), rs_comm(comm), options(o), stats(std::make_shared<FsdpStats>()) {}

std::shared_ptr<FsdpModule> fully_shard(nn::Module& module, std::shared_ptr<dist::Communicator> comm,
                                        const FsdpOptions& options) {
  KILN_CHECK(comm != nullptr, "fully_shard: the communicator is null");
  KILN_CHECK(group_of(module) == nullptr, "fully_shard: this module is sharded already");
  KILN_CHECK(std::isfinite(options.gradient_divide_factor) && options.gradient_divide_factor > 0,
             "fully_shard: gradient_divide_factor=", options.gradient_divide_factor, " must be finite and > 0");
  const int N = comm->size(), R = comm->rank();
  // The groups already below this module, in forward (registration) order, and what they hold.
  std::vector<FsdpGroup*> children;
  std::set<const Tensor*> taken;
  for (auto& [prefix, m] : module.named_modules()) {
    FsdpGroup* g = group_of(*m);
    if (!g) continue;
    KILN_CHECK(g->comm == comm, "fully_shard: the sub-module '", prefix, "' is sharded over another communicator");
    children.push_back(g);
    for (const auto& p : g->params) taken.insert(p.slot);
  }
  auto group = std::make_shared<FsdpGroup>(module, comm, options);
  FsdpGroup& G = *group;
  bool have_device = false;
  for (auto& [name, t] : module.named_parameters()) {
    if (taken.count(t)) continue;
    taken.insert(t);
    KILN_CHECK(t->defined(), "fully_shard: parameter '", name, "' is undefined");
    KILN_CHECK(t->dim() >= 1, "fully_shard: parameter '", name, "' is 0-d (shards cut dim 0)");
    KILN_CHECK(is_floating(t->dtype()), "fully_shard: parameter '", name, "' has dtype ", dtype_name(t->dtype()));
    if (!have_device) {
      G.device = t->device();
      G.param_dtype = options.mixed_precision.param_dtype.value_or(t->dtype());
      G.reduce_dtype = options.mixed_precision.reduce_dtype.value_or(G.param_dtype);
      have_device = true;
    }
    KILN_CHECK(t->device() == G.device, "fully_shard: parameter '", name, "' is on ", t->device().str(),
               ", the group's first on ", G.device.str());
    FsdpParam p;
    p.local_name = name;
    p.name = name;
    p.slot = t;
    p.shape = t->shape();
    p.rows = p.shape[0];
    p.inner = p.rows > 0 ? t->numel() / p.rows : 0;
    if (p.inner == 0) {
      p.inner = 1;
      for (size_t d = 1; d < p.shape.size(); ++d) p.inner *= p.shape[d];
    }
    p.chunk_rows = (p.rows + N - 1) / N;
    p.row_begin = std::min(p.rows, R * p.chunk_rows);
    p.local_rows = std::max<int64_t>(0, std::min(p.chunk_rows, p.rows - p.row_begin));
    p.offset = align_in_slice(G.slice_numel, G.param_dtype, G.reduce_dtype);
    G.slice_numel = p.offset + p.chunk_rows * p.inner;
    p.trainable = t->requires_grad();
    {
      NoGradGuard ng;
      p.shard = t->detach().narrow(0, p.row_begin, p.local_rows).clone();
    }
    p.shard.requires_grad_(p.trainable);
    // The gathered parameter: the whole shape in param_dtype, its storage empty until gathered.
    p.full = Tensor::empty(p.shape, G.param_dtype, G.device);
    G.params.push_back(std::move(p));
  }
  G.slice_numel = align_in_slice(G.slice_numel, G.param_dtype, G.reduce_dtype);  // every rank's slice aligned
  G.attach_params();
  module.set_state(group);
  FsdpGroup* gp = &G;
  G.hook_pre = module.register_forward_pre_hook([gp](const nn::Module&) { gp->pre_forward(); });
  G.hook_post = module.register_forward_hook([gp](const nn::Module&, const Tensor& out) { return gp->post_forward(out); });
  // The root of the groups below (until a call on a module above takes them): names from here.
  G.adopt(children);
  for (auto& [prefix, m] : module.named_modules())
    if (FsdpGroup* g = group_of(*m))
      for (auto& p : g->params) p.name = join(prefix, p.local_name);
  return std::make_shared<FsdpModule>(group);
}

// ---- FsdpModule ----

std::vector<std::pair<std::string, Tensor>> FsdpModule::named_shards() const {
  std::vector<std::pair<std::string, Tensor>> out;
  for (const auto& s : shard_infos()) out.emplace_back(s.name, s.shard);
  return out;
}

std::vector<FsdpModule::ShardInfo> FsdpModule::shard_infos() const {
  std::vector<ShardInfo> out;
  for (FsdpGroup* g : group_->all_groups())
    for (const auto& p : g->params) out.push_back({p.name, p.shape, p.row_begin, p.shard});
  return out;
}

Tensor FsdpModule::full_tensor(const std::string& name) const {
  for (FsdpGroup* g : group_->all_groups())
    for (const auto& p : g->params)
      if (p.name == name) return gather_rows(*g->comm, p.shape, p.shard);
  fail("full_tensor: no parameter '", name, "' in this FSDP module");
}

Tensor gather_rows(dist::Communicator& comm, const Shape& global_shape, const Tensor& local) {
  KILN_CHECK(!global_shape.empty() && local.dim() == static_cast<int64_t>(global_shape.size()),
             "gather_rows: local ", local.shape(), " is not a block of rows of ", shape_str(global_shape));
  NoGradGuard ng;
  const int N = comm.size(), R = comm.rank();
  const int64_t rows = global_shape[0], c = (rows + N - 1) / N;
  const int64_t inner = shape_numel(global_shape) / std::max<int64_t>(rows, 1);
  const int64_t want = std::max<int64_t>(0, std::min(c, rows - std::min(rows, R * c)));
  KILN_CHECK(local.size(0) == want, "gather_rows: rank ", R, " holds ", local.size(0), " rows of ",
             shape_str(global_shape), ", its shard has ", want);
  const int64_t slice = c * inner;
  Tensor buf = zeros({N * slice}, local.dtype(), local.device());
  if (want > 0) buf.narrow(0, R * slice, want * inner).copy_(local.detach().contiguous().view({want * inner}));
  comm.all_gather_single(buf, buf.narrow(0, R * slice, slice))->wait();
  return buf.narrow(0, 0, rows * inner).view(global_shape).clone();
}

void FsdpModule::set_requires_gradient_sync(bool on) {
  for (FsdpGroup* g : group_->all_groups()) g->sync_gradients = on;
}

void FsdpModule::set_reshard_after_forward(bool on) {
  for (FsdpGroup* g : group_->all_groups()) g->options.reshard_after_forward = on;
}

void FsdpModule::unshard() {
  for (FsdpGroup* g : group_->all_groups()) g->unshard();
}

void FsdpModule::reshard() {
  for (FsdpGroup* g : group_->all_groups()) g->reshard();
}

namespace {
std::vector<Tensor> shard_grads(FsdpGroup& root) {
  std::vector<Tensor> out;
  for (FsdpGroup* g : root.all_groups())
    for (const auto& p : g->params)
      if (p.shard.grad().defined()) out.push_back(p.shard.grad());
  return out;
}

// This rank's sum of squares in clip_grad_norm_'s order (optim::sum_of_norm_partials: one
// multi-tensor pass for the shards' contiguous f32 / bf16 gradients), summed over the ranks, so
// one rank gives clip_grad_norm_'s bits.
double global_norm(FsdpGroup& root, const std::vector<Tensor>& grads) {
  Tensor s = from_vector<double>({optim::sum_of_norm_partials(grads, 2.0)}, {1}, root.device);
  root.comm->all_reduce(s, dist::ReduceOp::sum)->wait();
  return std::sqrt(s.item());
}
}  // namespace

double FsdpModule::grad_norm() { return global_norm(*group_, shard_grads(*group_)); }

double FsdpModule::clip_grad_norm(double max_norm) {
  KILN_CHECK(!std::isnan(max_norm) && max_norm >= 0.0, "clip_grad_norm: max_norm=", max_norm,
             " must be >= 0 (or inf)");
  std::vector<Tensor> grads = shard_grads(*group_);
  const double norm = global_norm(*group_, grads);
  if (!std::isfinite(norm)) return norm;
  const double coef = max_norm / (norm + 1e-6);  // as optim::clip_grad_norm_, rounded as it rounds
  if (coef < 1.0) {
    NoGradGuard ng;
    for (Tensor& g : grads) mul_(g, g.dtype() == DType::f64 ? coef : static_cast<double>(static_cast<float>(coef)));
  }
  return norm;
}

FsdpStats FsdpModule::stats() const { return *group_->stats; }

void FsdpModule::reset_peak_stats() {
  FsdpStats& s = *group_->stats;
  s.peak_gathered_bytes = s.gathered_bytes;
  s.peak_gathered_groups = s.gathered_groups;
  s.peak_all_gather_buffers = s.all_gather_buffers;
  s.peak_reduce_scatter_buffers = s.reduce_scatter_buffers;
}

const std::shared_ptr<dist::Communicator>& FsdpModule::communicator() const { return group_->comm; }

const std::shared_ptr<dist::Communicator>& FsdpModule::reduce_scatter_communicator() const {
  return group_->rs_comm;
}

double global_count(dist::Communicator& comm, int64_t local, Device device) {
  Tensor t = from_vector<int64_t>({local}, {1}, device);
  comm.all_reduce(t, dist::ReduceOp::sum)->wait();
  return static_cast<double>(t.to_vector<int64_t>()[0]);
}

}  // namespace kiln::parallel
