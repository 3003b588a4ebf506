// The argument checks every backend runs before queueing an operation (communicator.h).
#include "kiln/dist/communicator.h"

#include <algorithm>
#include <numeric>

#include "kiln/dist/auth.h"

namespace kiln::dist {

OpRecord describe_op(const std::string& comm, int rank, int size, int64_t seq, const char* op, const Tensor& in,
                     const Tensor& out, int peer, Millis timeout) {
  OpRecord r;
  FrEntry& e = r.entry;
  e.comm = comm;
  e.comm_rank = rank;
  e.comm_size = size;
  e.seq = seq;
  e.op = op;
  e.in_numel = in.defined() ? in.numel() : 0;
  e.out_numel = out.defined() ? out.numel() : 0;
  e.dtype = in.defined() ? dtype_name(in.dtype()) : "";
  e.peer = peer;
  e.timeout_ms = timeout.count();
  r.what = detail::str_cat(op, " #", seq, " of '", comm, "'");
  if (in.defined()) r.what += detail::str_cat(" (", e.in_numel, " elements of ", e.dtype, ")");
  if (peer >= 0 && std::string_view(op) != "broadcast") r.what += detail::str_cat(" with rank ", peer);
  return r;
}

void check_tensor(const char* op, const char* arg, const Tensor& t, TensorPlace place) {
  KILN_CHECK(t.defined(), op, ": ", arg, " is an undefined tensor");
  if (place == TensorPlace::cpu)
    KILN_CHECK(t.is_cpu(), op, ": ", arg, " is on ", t.device().str(),
               "; the gloo backend takes CPU tensors (use the nccl backend for CUDA tensors)");
  else
    KILN_CHECK(t.is_cuda(), op, ": ", arg, " is on ", t.device().str(),
               "; the nccl backend takes CUDA tensors (use the gloo backend for CPU tensors)");
  KILN_CHECK(t.is_contiguous(), op, ": ", arg, " of shape ", shape_str(t.shape()),
             " is not contiguous (call .contiguous() first)");
}

void check_reduce(const char* op, DType dt, ReduceOp r) {
  const bool reducible = dt == DType::f32 || dt == DType::bf16 || dt == DType::f16 || dt == DType::f64 ||
                         dt == DType::i32 || dt == DType::i64 || dt == DType::u8;
  KILN_CHECK(reducible, op, ": dtype ", dtype_name(dt),
             " cannot be reduced (expected f32, bf16, f16, f64, i32, i64 or u8)");
  KILN_CHECK(r != ReduceOp::avg || is_floating(dt), op, ": avg of dtype ", dtype_name(dt),
             " (avg needs a floating dtype; use sum and divide)");
}

void check_same_dtype(const char* op, const Tensor& a, const Tensor& b) {
  KILN_CHECK(a.dtype() == b.dtype(), op, ": output dtype ", dtype_name(a.dtype()), " differs from input dtype ",
             dtype_name(b.dtype()));
}

void check_rank(const char* op, const char* arg, int r, int size, int self, bool self_allowed) {
  KILN_CHECK(r >= 0 && r < size, op, ": ", arg, "=", r, " out of range [0, ", size, ")");
  KILN_CHECK(self_allowed || r != self, op, ": ", arg, "=", r, " is this rank");
}

int check_split(const std::vector<int>& ranks, const std::string& name, int size, int self) {
  KILN_CHECK(!name.empty(), "split: the new communicator's name is empty");
  KILN_CHECK(!ranks.empty(), "split: the rank list is empty");
  int new_rank = -1;
  for (size_t i = 0; i < ranks.size(); ++i) {
    check_rank("split", "ranks[i]", ranks[i], size, self, true);
    KILN_CHECK(std::count(ranks.begin(), ranks.begin() + static_cast<std::ptrdiff_t>(i), ranks[i]) == 0,
               "split: rank ", ranks[i], " appears twice in the list");
    if (ranks[i] == self) new_rank = static_cast<int>(i);
  }
  KILN_CHECK(new_rank >= 0, "split: this rank (", self, ") is not in the list; only the listed ranks call split");
  return new_rank;
}

std::string next_split_store_path(std::map<std::string, int>& counts, const std::string& name,
                                  const std::vector<int>& ranks) {
  std::string list;
  for (int r : ranks) list += std::to_string(r) + ",";
  // A digest, not the list itself: a long list would pass the store's key bound.
  const std::string group = "split/" + name + "/" + sha256_hex(list).substr(0, 16);
  return group + "/" + std::to_string(counts[group]++);
}

std::vector<int64_t> all_to_all_counts(const char* arg, const Tensor& t, const std::vector<int64_t>& splits,
                                       int size) {
  if (splits.empty()) {
    KILN_CHECK(t.numel() % size == 0, "all_to_all_single: ", arg, " has ", t.numel(),
               " elements, not divisible by the world size ", size, " (give split sizes)");
    return std::vector<int64_t>(static_cast<size_t>(size), t.numel() / size);
  }
  KILN_CHECK(static_cast<int>(splits.size()) == size, "all_to_all_single: ", arg, " splits has ", splits.size(),
             " entries (expected the world size ", size, ")");
  for (size_t i = 0; i < splits.size(); ++i)
    KILN_CHECK(splits[i] >= 0, "all_to_all_single: ", arg, " splits[", i, "]=", splits[i], " is negative");
  const int64_t total = std::accumulate(splits.begin(), splits.end(), int64_t{0});
  KILN_CHECK(total == t.numel(), "all_to_all_single: ", arg, " splits sum to ", total, " but ", arg, " has ",
             t.numel(), " elements");
  return splits;
}

}  // namespace kiln::dist
