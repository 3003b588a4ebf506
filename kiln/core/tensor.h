// Tensor: a view (shape, strides, offset, dtype) of a shared Storage, plus the autograd
// metadata (requires_grad, grad, grad_fn). Copying a Tensor copies a handle; views share
// storage. Methods that compute are defined with the ops (kiln/ops/) and are listed here so
// that `t.transpose(0, 1).contiguous()` reads as users of PyTorch expect; code below the ops
// layer cannot call them (each layer links alone against the ones below it: cmake/layers.cmake).
#pragma once
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "kiln/core/device.h"
#include "kiln/core/dtype.h"
#include "kiln/core/storage.h"

namespace kiln {

using Shape = std::vector<int64_t>;
using Strides = std::vector<int64_t>;

class Node;  // kiln/autograd/node.h
class Tensor;

int64_t shape_numel(const Shape& s);
Strides contiguous_strides(const Shape& s);
std::string shape_str(const Shape& s);
// Dim `dim` of a tensor of rank `rank` as an index in [0, rank), counting from the end when
// negative; out of range is a kiln::Error naming `op` and the valid range. With
// `scalar_as_1d`, a 0-d tensor takes dim 0 and -1 (returned as 0), as PyTorch's reductions,
// softmax, squeeze and transpose do.
int64_t wrap_dim(int64_t dim, int64_t rank, const char* op, bool scalar_as_1d = false);

// Autograd metadata of one tensor.
struct AutogradMeta {
  bool requires_grad = false;
  std::shared_ptr<Node> grad_fn;   // set on non-leaf tensors
  int output_nr = 0;               // which output of grad_fn this is
  std::shared_ptr<Tensor> grad;    // accumulated gradient (leaves, or retained)
  std::weak_ptr<Node> grad_accumulator;  // leaves: the node that accumulates into grad
  // Guards grad_accumulator's creation and the accumulation into grad: graphs built and run
  // backward from several threads may share a leaf (as in PyTorch; two threads' backwards on
  // one leaf aborted with "pure virtual method called").
  std::mutex mutex;
};

struct TensorImpl {
  std::shared_ptr<Storage> storage;
  Shape shape;
  Strides strides;   // in elements
  int64_t offset = 0;  // in elements
  DType dtype = DType::f32;
  std::unique_ptr<AutogradMeta> autograd;  // null until needed
};

class Tensor {
 public:
  Tensor() = default;
  explicit Tensor(std::shared_ptr<TensorImpl> impl) : impl_(std::move(impl)) {}

  // Uninitialised tensor (contents undefined) of `shape`.
  static Tensor empty(const Shape& shape, DType dtype = DType::f32, Device device = kCPU);
  // A tensor over existing storage with the given layout (no copy).
  static Tensor from_storage(std::shared_ptr<Storage> storage, const Shape& shape,
                             const Strides& strides, int64_t offset, DType dtype);

  bool defined() const { return impl_ != nullptr; }
  const Shape& shape() const { return impl()->shape; }
  const Strides& strides() const { return impl()->strides; }
  int64_t offset() const { return impl()->offset; }
  DType dtype() const { return impl()->dtype; }
  Device device() const { return impl()->storage->device(); }
  int64_t dim() const { return static_cast<int64_t>(impl()->shape.size()); }
  int64_t size(int64_t d) const;     // negative d counts from the end
  int64_t stride(int64_t d) const;
  int64_t numel() const { return shape_numel(impl()->shape); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * itemsize(dtype()); }
  bool is_contiguous() const;
  bool is_cpu() const { return device().is_cpu(); }
  bool is_cuda() const { return device().is_cuda(); }

  const std::shared_ptr<Storage>& storage() const { return impl()->storage; }
  // Pointer to the first element (storage data + offset).
  void* data_ptr() const;
  template <class T> T* data() const {
    KILN_CHECK(dtype_of<T> == dtype(), "Tensor::data: tensor has dtype ", dtype_name(dtype()),
               ", asked for ", dtype_name(dtype_of<T>));
    return static_cast<T*>(data_ptr());
  }
  TensorImpl* impl() const {
    KILN_CHECK(impl_ != nullptr, "use of an undefined tensor");
    return impl_.get();
  }
  const std::shared_ptr<TensorImpl>& impl_ptr() const { return impl_; }
  bool is_same(const Tensor& o) const { return impl_ == o.impl_; }

  // ---- views (share storage; recorded by autograd) — kiln/ops/views.cpp ----
  Tensor view(const Shape& shape) const;      // needs compatible strides
  Tensor reshape(const Shape& shape) const;   // view when possible, else a copy
  Tensor flatten(int64_t start = 0, int64_t end = -1) const;
  Tensor slice(int64_t dim, int64_t start, int64_t end, int64_t step = 1) const;
  Tensor narrow(int64_t dim, int64_t start, int64_t length) const;
  Tensor select(int64_t dim, int64_t index) const;
  Tensor transpose(int64_t d0, int64_t d1) const;
  Tensor t() const;  // as PyTorch: 0-d and 1-d unchanged, 2-d transposed, more dims an error
  Tensor permute(const std::vector<int64_t>& dims) const;
  Tensor expand(const Shape& shape) const;
  Tensor squeeze(int64_t dim) const;
  Tensor unsqueeze(int64_t dim) const;

  // ---- copies and conversions — kiln/ops/copy.cpp ----
  Tensor contiguous() const;
  Tensor to(DType dtype) const;
  Tensor to(Device device) const;
  Tensor clone() const;
  // In place (bump the version counter; refused on leaves that require grad while grad mode is on).
  // copy_ records no autograd history: a src that requires grad (grad mode on) is an error.
  Tensor& copy_(const Tensor& src);
  Tensor& fill_(double value);
  Tensor& zero_() { return fill_(0.0); }

  // ---- element access (syncs with the device) — kiln/ops/readout.cpp ----
  double item() const;               // one-element tensors
  template <class T> std::vector<T> to_vector() const;  // any layout, any device

  // ---- autograd — kiln/autograd/graph.cpp; set_grad and backward kiln/ops/backward.cpp ----
  bool requires_grad() const;
  Tensor& requires_grad_(bool on = true);
  bool is_leaf() const;
  const std::shared_ptr<Node>& grad_fn() const;
  Tensor grad() const;                 // undefined when none
  void set_grad(const Tensor& g);
  Tensor detach() const;               // same storage, no autograd history
  void backward(const Tensor& gradient = Tensor(), bool retain_graph = false) const;
  uint64_t version() const { return impl()->storage->version(); }
  void bump_version() const { impl()->storage->bump_version(); }

  std::string str() const;  // printed like PyTorch: values, shape, dtype, device (ops/readout.cpp)

 private:
  std::shared_ptr<TensorImpl> impl_;
};

std::ostream& operator<<(std::ostream& os, const Tensor& t);

// The storage elements a tensor's layout reaches: [lo, hi] (elements, not bytes; hi < lo when
// it is empty), whether no two indices reach the same element (dims sorted by stride, each
// stride at least the span of the dims below it; an expand() fails this), and whether it
// reaches every element between (dense: then its elements are exactly [lo, hi]).
struct ElementSpan {
  int64_t lo = 0, hi = -1;
  bool distinct = true, dense = true;
};
ElementSpan element_span(const Tensor& t);

}  // namespace kiln
