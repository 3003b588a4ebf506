// Tensor layout helpers, construction and element spans. Readouts that copy or cast (item,
// to_vector, str) are ops/readout.cpp's, as the views and copies are ops/views.cpp's and copy.cpp's.
#include "kiln/core/tensor.h"

#include <algorithm>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kiln/core/error.h"

namespace kiln {

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) {
    KILN_CHECK(d >= 0, "negative dimension in shape ", s);
    KILN_CHECK(d == 0 || n <= std::numeric_limits<int64_t>::max() / d, "shape ", s, " has too many elements");
    n *= d;
  }
  return n;
}

Strides contiguous_strides(const Shape& s) {
  Strides st(s.size());
  int64_t acc = 1;
  for (size_t i = s.size(); i-- > 0;) {
    st[i] = acc;
    acc *= std::max<int64_t>(s[i], 1);
  }
  return st;
}

std::string shape_str(const Shape& s) { return detail::str_cat(s); }

Tensor Tensor::empty(const Shape& shape, DType dtype, Device device) {
  check_device_available(device, "empty");
  auto impl = std::make_shared<TensorImpl>();
  int64_t n = shape_numel(shape);
  // In bytes too (shape_numel bounds the element count): {2^61} f64 wrapped to a 0-byte buffer
  // that the first write ran past.
  KILN_CHECK(static_cast<uint64_t>(n) <= (uint64_t{1} << 62) / itemsize(dtype), "empty: shape ", shape, " of ",
             dtype_name(dtype), " needs more than 2^62 bytes");
  const size_t nbytes = static_cast<size_t>(n) * itemsize(dtype);
  impl->storage = std::make_shared<Storage>(nbytes, device);
  if (nbytes > 0 && fill_uninitialized_memory())
    impl->storage->fill(uninitialized_fill_byte(dtype));
  impl->shape = shape;
  impl->strides = contiguous_strides(shape);
  impl->dtype = dtype;
  return Tensor(std::move(impl));
}

Tensor Tensor::from_storage(std::shared_ptr<Storage> storage, const Shape& shape, const Strides& strides,
                            int64_t offset, DType dtype) {
  KILN_CHECK(storage != nullptr, "from_storage: null storage");
  KILN_CHECK(shape.size() == strides.size(), "from_storage: shape ", shape, " and strides ", strides,
             " differ in rank");
  KILN_CHECK(offset >= 0, "from_storage: negative offset ", offset);
  // The furthest element must lie inside the storage.
  int64_t last = offset;
  bool empty = false;
  for (size_t i = 0; i < shape.size(); ++i) {
    KILN_CHECK(shape[i] >= 0 && strides[i] >= 0, "from_storage: bad shape ", shape, " / strides ", strides);
    if (shape[i] == 0) empty = true;
    else last += (shape[i] - 1) * strides[i];
  }
  KILN_CHECK(empty || static_cast<size_t>(last + 1) * itemsize(dtype) <= storage->nbytes(),
             "from_storage: view of shape ", shape, " at offset ", offset, " exceeds the storage of ",
             storage->nbytes(), " bytes");
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = std::move(storage);
  impl->shape = shape;
  impl->strides = strides;
  impl->offset = offset;
  impl->dtype = dtype;
  return Tensor(std::move(impl));
}

int64_t wrap_dim(int64_t d, int64_t rank, const char* op, bool scalar_as_1d) {
  const int64_t n = scalar_as_1d && rank == 0 ? 1 : rank;
  KILN_CHECK(n > 0, op, ": dim ", d, " given for a 0-d tensor, which has no dims");
  KILN_CHECK(d >= -n && d < n, op, ": dim ", d, " out of range for a tensor of rank ", rank, " (expected ", -n,
             " to ", n - 1, ")");
  return d < 0 ? d + n : d;
}

int64_t Tensor::size(int64_t d) const { return shape()[wrap_dim(d, dim(), "size")]; }
int64_t Tensor::stride(int64_t d) const { return strides()[wrap_dim(d, dim(), "stride")]; }

bool Tensor::is_contiguous() const {
  int64_t expected = 1;
  const auto& sh = shape();
  const auto& st = strides();
  for (size_t i = sh.size(); i-- > 0;) {
    if (sh[i] == 1) continue;
    if (st[i] != expected) return false;
    expected *= sh[i];
  }
  return true;
}

void* Tensor::data_ptr() const {
  return static_cast<char*>(impl()->storage->data()) + impl()->offset * static_cast<int64_t>(itemsize(dtype()));
}

ElementSpan element_span(const Tensor& t) {
  ElementSpan sp;
  if (t.numel() == 0) return sp;
  sp.lo = sp.hi = t.offset();
  std::vector<std::pair<int64_t, int64_t>> dims;  // |stride|, size, for dims of size > 1
  for (int64_t d = 0; d < t.dim(); ++d) {
    const int64_t n = t.shape()[static_cast<size_t>(d)], st = t.strides()[static_cast<size_t>(d)];
    if (n == 1) continue;
    (st >= 0 ? sp.hi : sp.lo) += (n - 1) * st;
    dims.emplace_back(st < 0 ? -st : st, n);
  }
  std::sort(dims.begin(), dims.end());
  int64_t span = 1;  // elements the smaller-stride dims cover
  for (const auto& [st, n] : dims) {
    if (st < span) sp.distinct = false;
    span = st * (n - 1) + span;
  }
  sp.dense = sp.distinct && sp.hi - sp.lo + 1 == t.numel();
  return sp;
}

}  // namespace kiln
