// kiln::dist::Communicator: the one API over the Gloo (CPU tensors) and NCCL (CUDA tensors)
// backends, after torchcomms. Every operation is asynchronous and returns a Work; outputs may
// be the inputs (in place); tensors must be contiguous and on the backend's device; reductions
// take f32, bf16, f16, f64, i32, i64 and u8 (avg only floating types). A communicator that
// failed raises at once on its next operation. The argument checks both backends share are
// here, so a bad call gets the same kiln::Error (naming the op, the argument and the values)
// from either, and leaves the communicator usable.
#pragma once
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kiln/core/tensor.h"
#include "kiln/dist/flight_recorder.h"
#include "kiln/dist/work.h"

namespace kiln::dist {

class Communicator : public std::enable_shared_from_this<Communicator> {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual const std::string& name() const = 0;
  virtual const char* backend() const = 0;
  // Where its tensors must be: the CPU for Gloo, this rank's CUDA device for NCCL. Callers that
  // make a tensor of their own for a collective (a flag, a count) make it here.
  virtual Device device() const = 0;
  // How many times this communicator's group has shrunk (0 for a fresh one).
  virtual int generation() const = 0;

  virtual WorkPtr all_reduce(const Tensor& t, ReduceOp op, CallOptions o = {}) = 0;
  // output = the inputs of ranks 0..size-1 concatenated (output.numel() == size * input.numel()).
  virtual WorkPtr all_gather_single(const Tensor& output, const Tensor& input, CallOptions o = {}) = 0;
  // output = this rank's chunk of the reduction of the inputs (input.numel() == size * output.numel()).
  virtual WorkPtr reduce_scatter_single(const Tensor& output, const Tensor& input, ReduceOp op,
                                        CallOptions o = {}) = 0;
  // Chunk j of the input goes to rank j; chunk i of the output comes from rank i. Empty split
  // lists mean equal chunks; otherwise element counts per rank.
  virtual WorkPtr all_to_all_single(const Tensor& output, const Tensor& input,
                                    const std::vector<int64_t>& output_splits = {},
                                    const std::vector<int64_t>& input_splits = {}, CallOptions o = {}) = 0;
  virtual WorkPtr broadcast(const Tensor& t, int root, CallOptions o = {}) = 0;
  virtual WorkPtr send(const Tensor& t, int dst, CallOptions o = {}) = 0;
  virtual WorkPtr recv(const Tensor& t, int src, CallOptions o = {}) = 0;
  virtual WorkPtr barrier(CallOptions o = {}) = 0;
  // A new communicator over `ranks` (ranks of this one, the caller among them), renumbered in
  // the order given. Called by exactly those ranks, with the same list and name.
  virtual std::shared_ptr<Communicator> split(const std::vector<int>& ranks, const std::string& name) = 0;
  // Ends the communicator: pending and later operations fail at once.
  virtual void abort() = 0;
};

// What the backends record of an operation: its flight-recorder entry and its description,
// "all_reduce #3 of 'world' (12 elements of f32)" (undefined tensors: a barrier).
struct OpRecord {
  FrEntry entry;
  std::string what;
};
OpRecord describe_op(const std::string& comm, int rank, int size, int64_t seq, const char* op, const Tensor& in,
                     const Tensor& out, int peer, Millis timeout);

// ---- argument checks shared by the backends (each throws kiln::Error) ----
enum class TensorPlace : uint8_t { cpu, cuda };
void check_tensor(const char* op, const char* arg, const Tensor& t, TensorPlace place);
void check_reduce(const char* op, DType dtype, ReduceOp r);
void check_same_dtype(const char* op, const Tensor& a, const Tensor& b);
void check_rank(const char* op, const char* arg, int r, int size, int self, bool self_allowed);
// split(ranks, name)'s arguments: a non-empty name, ranks in range, none twice, this rank among
// them. Returns this rank's place in the new communicator.
int check_split(const std::vector<int>& ranks, const std::string& name, int size, int self);
// The store path of the next split of this name and rank list: the name, a digest of the ranks (so
// disjoint groups that split under one name never meet in the store) and how many such splits the
// communicator made before, counted in `counts` (the communicator's, keyed by name and digest).
std::string next_split_store_path(std::map<std::string, int>& counts, const std::string& name,
                                  const std::vector<int>& ranks);
// Element counts per rank of an all_to_all_single side (splits given or equal chunks).
std::vector<int64_t> all_to_all_counts(const char* arg, const Tensor& t, const std::vector<int64_t>& splits,
                                       int size);

}  // namespace kiln::dist
