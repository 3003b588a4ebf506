// Factories: zeros/ones/full/arange/rand/randn/from_vector, empty_in_layout.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "kiln/kernels/copy.h"
#include "kiln/kernels/dispatch.h"
#include "kiln/ops/ops.h"

namespace kiln {

Tensor full(const Shape& shape, double value, DType dtype, Device device) {
  check_value_fits(value, dtype, "full");
  Tensor t = Tensor::empty(shape, dtype, device);
  KILN_DEVICE_CALL(device, fill, t, value);
  return t;
}
Tensor zeros(const Shape& shape, DType dtype, Device device) { return full(shape, 0.0, dtype, device); }
Tensor ones(const Shape& shape, DType dtype, Device device) { return full(shape, 1.0, dtype, device); }
Tensor zeros_like(const Tensor& t) { return zeros(t.shape(), t.dtype(), t.device()); }
Tensor ones_like(const Tensor& t) { return ones(t.shape(), t.dtype(), t.device()); }
Tensor empty_like(const Tensor& t) { return Tensor::empty(t.shape(), t.dtype(), t.device()); }

Tensor empty_in_layout(const Shape& shape, const Strides& like, DType dtype, Device device) {
  KILN_CHECK(like.size() == shape.size(), "empty_in_layout: ", like.size(), " strides for shape ", shape);
  // The dims from the largest stride to the smallest (ties keep their order): allocated in that
  // order, then permuted back into `shape`'s.
  std::vector<int64_t> order(shape.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return like[a] > like[b]; });
  Shape stored;
  std::vector<int64_t> back(order.size());
  for (size_t i = 0; i < order.size(); ++i) stored.push_back(shape[order[i]]), back[order[i]] = static_cast<int64_t>(i);
  return Tensor::empty(stored, dtype, device).permute(back);
}
Tensor scalar_tensor(double value, DType dtype, Device device) { return full({}, value, dtype, device); }

Tensor arange(double start, double end, double step, DType dtype, Device device) {
  KILN_CHECK(step != 0 && std::isfinite(step) && std::isfinite(start) && std::isfinite(end),
             "arange: start, end and step must be finite and step non-zero, got ", start, ", ", end, ", ", step);
  KILN_CHECK(dtype != DType::boolean, "arange: dtype bool is not supported (as in PyTorch): 0, 1, 2, ... has no bool");
  double count = std::ceil((end - start) / step);
  KILN_CHECK(count < 0x1p62, "arange: ", count, " elements are too many");
  int64_t n = count > 0 ? static_cast<int64_t>(count) : 0;
  if (n > 0) {  // the first and last values (the others lie between)
    check_value_fits(start, dtype, "arange");
    check_value_fits(start + static_cast<double>(n - 1) * step, dtype, "arange");
  }
  Tensor t = Tensor::empty({n}, dtype, device);
  KILN_DEVICE_CALL(device, arange, t, start, step);
  return t;
}

Tensor rand(const Shape& shape, Generator& gen, DType dtype, Device device) {
  KILN_CHECK(is_floating(dtype), "rand: dtype must be floating, got ", dtype_name(dtype));
  Tensor t = Tensor::empty(shape, dtype, device);
  KILN_DEVICE_CALL(device, rand_uniform, t, gen.seed, gen.next_offset());
  return t;
}

Tensor randn(const Shape& shape, Generator& gen, DType dtype, Device device) {
  KILN_CHECK(is_floating(dtype), "randn: dtype must be floating, got ", dtype_name(dtype));
  Tensor t = Tensor::empty(shape, dtype, device);
  KILN_DEVICE_CALL(device, rand_normal, t, gen.seed, gen.next_offset());
  return t;
}

template <class T>
Tensor from_vector(const std::vector<T>& values, const Shape& shape, Device device) {
  KILN_CHECK(static_cast<int64_t>(values.size()) == shape_numel(shape), "from_vector: ", values.size(),
             " values for shape ", shape, " (", shape_numel(shape), " elements)");
  Tensor host = Tensor::empty(shape, dtype_of<T>, kCPU);
  if (!values.empty()) std::memcpy(host.data_ptr(), values.data(), values.size() * sizeof(T));
  return device.is_cpu() ? host : host.to(device);
}
template Tensor from_vector(const std::vector<double>&, const Shape&, Device);
template Tensor from_vector(const std::vector<float>&, const Shape&, Device);
template Tensor from_vector(const std::vector<Half>&, const Shape&, Device);
template Tensor from_vector(const std::vector<BFloat16>&, const Shape&, Device);
template Tensor from_vector(const std::vector<int64_t>&, const Shape&, Device);
template Tensor from_vector(const std::vector<int32_t>&, const Shape&, Device);
template Tensor from_vector(const std::vector<int16_t>&, const Shape&, Device);
template Tensor from_vector(const std::vector<int8_t>&, const Shape&, Device);
template Tensor from_vector(const std::vector<uint8_t>&, const Shape&, Device);
template <>
Tensor from_vector(const std::vector<bool>& values, const Shape& shape, Device device) {
  std::vector<uint8_t> b(values.begin(), values.end());
  Tensor host = from_vector(b, shape, kCPU);
  Tensor out = Tensor::empty(shape, DType::boolean, kCPU);
  if (!b.empty()) std::memcpy(out.data_ptr(), b.data(), b.size());
  return device.is_cpu() ? out : out.to(device);
}

}  // namespace kiln
