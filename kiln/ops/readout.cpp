// The Tensor readouts declared in core/tensor.h that copy to the host or cast first: item,
// to_vector, str and operator<< (printed like PyTorch, long dimensions elided). In ops because
// they go through to() and contiguous() (ops/copy.cpp).
#include <cstring>
#include <functional>
#include <iomanip>
#include <sstream>
#include <string>
#include <vector>

#include "kiln/core/error.h"
#include "kiln/core/tensor.h"

namespace kiln {

double Tensor::item() const {
  KILN_CHECK(numel() == 1, "item: tensor of shape ", shape(), " has ", numel(), " elements, expected 1");
  return to(kCPU).to(DType::f64).to_vector<double>()[0];
}

template <class T>
std::vector<T> Tensor::to_vector() const {
  Tensor c = (device().is_cpu() ? *this : to(kCPU));
  if (c.dtype() != dtype_of<T>) c = c.to(dtype_of<T>);
  c = c.contiguous();
  std::vector<T> out(static_cast<size_t>(c.numel()));
  if (!out.empty()) std::memcpy(out.data(), c.data_ptr(), out.size() * sizeof(T));
  return out;
}
template std::vector<double> Tensor::to_vector<double>() const;
template std::vector<float> Tensor::to_vector<float>() const;
template std::vector<Half> Tensor::to_vector<Half>() const;
template std::vector<BFloat16> Tensor::to_vector<BFloat16>() const;
template std::vector<int64_t> Tensor::to_vector<int64_t>() const;
template std::vector<int32_t> Tensor::to_vector<int32_t>() const;
template std::vector<int16_t> Tensor::to_vector<int16_t>() const;
template std::vector<int8_t> Tensor::to_vector<int8_t>() const;
template std::vector<uint8_t> Tensor::to_vector<uint8_t>() const;
template <>
std::vector<bool> Tensor::to_vector<bool>() const {
  auto v = to(DType::u8).to_vector<uint8_t>();
  return std::vector<bool>(v.begin(), v.end());
}

std::string Tensor::str() const {
  if (!defined()) return "tensor(undefined)";
  std::ostringstream o;
  if (is_storage_only(dtype())) {
    o << "tensor(<" << numel() << " " << dtype_name(dtype()) << " values>, shape=" << shape_str(shape()) << ")";
    return o.str();
  }
  constexpr int64_t kEdge = 3;
  std::vector<double> v = to(kCPU).to(DType::f64).to_vector<double>();
  const Shape& sh = shape();
  const bool integral = !is_floating(dtype());
  auto fmt = [&](double x) {
    std::ostringstream s;
    if (integral) s << static_cast<int64_t>(x);
    else s << std::setprecision(4) << x;
    return s.str();
  };
  Strides cs = contiguous_strides(sh);
  // Recursive print with elision of long dimensions.
  std::function<void(size_t, int64_t, int)> rec = [&](size_t d, int64_t base, int indent) {
    if (d == sh.size()) {
      o << fmt(v[static_cast<size_t>(base)]);
      return;
    }
    o << '[';
    int64_t n = sh[d];
    for (int64_t i = 0; i < n; ++i) {
      if (n > 2 * kEdge && i == kEdge) {
        o << "...";
        i = n - kEdge - 1;
        if (d + 1 < sh.size()) o << ",\n" << std::string(static_cast<size_t>(indent + 1), ' ');
        else o << ", ";
        continue;
      }
      rec(d + 1, base + i * cs[d], indent + 1);
      if (i + 1 < n) {
        if (d + 1 < sh.size()) o << ",\n" << std::string(static_cast<size_t>(indent + 1), ' ');
        else o << ", ";
      }
    }
    o << ']';
  };
  o << "tensor(";
  rec(0, 0, 7);
  o << ", shape=" << shape_str(sh) << ", dtype=" << dtype_name(dtype()) << ", device=" << device().str();
  if (requires_grad()) o << ", requires_grad";
  o << ")";
  return o.str();
}

std::ostream& operator<<(std::ostream& os, const Tensor& t) { return os << t.str(); }

}  // namespace kiln
