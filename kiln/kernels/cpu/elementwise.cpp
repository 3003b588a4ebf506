// CPU bodies of the elementwise kernels (math in kernels/elementwise.h).
#include "kiln/kernels/elementwise.h"

#include "kiln/kernels/cpu/loops.h"
#include "kiln/kernels/cpu/vec_math.h"

namespace kiln::kernels::cpu {

void unary(UnaryOp op, const Tensor& out, const Tensor& a, double scalar) {
  // SiLU and its derivative on contiguous f32 (the MLP's activation): vectorised with fast_expf.
  if ((op == UnaryOp::silu || op == UnaryOp::silu_deriv) && a.dtype() == DType::f32 && a.is_contiguous() &&
      out.is_contiguous()) {
    const float* x = a.data<float>();
    float* y = out.data<float>();
    parallel_for(a.numel(), kParallelGrain,
                 [&](int64_t b, int64_t e) { silu_f32(y + b, x + b, e - b, op == UnaryOp::silu_deriv); });
    return;
  }
  dispatch_floating(a.dtype(), "unary", [&]<class T>() {
    using A = acc_t<T>;
    const T* x = static_cast<const T*>(a.data_ptr());
    T* y = static_cast<T*>(out.data_ptr());
    A s = static_cast<A>(scalar);
    dispatch_unary_op(op, [&]<UnaryOp Op>() {
      for_each_strided<2>(a.shape(), {out.strides(), a.strides()}, [&](const std::array<int64_t, 2>& o) {
        y[o[0]] = T(unary_math<Op, A>(static_cast<A>(x[o[1]]), s));
      });
    });
  });
}

void binary(BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b) {
  dispatch_all(a.dtype(), "binary", [&]<class T>() {
    using A = acc_t<T>;
    const T* pa = static_cast<const T*>(a.data_ptr());
    const T* pb = static_cast<const T*>(b.data_ptr());
    dispatch_binary_op(op, [&]<BinaryOp Op>() {
      if constexpr (is_comparison(Op)) {
        bool* y = static_cast<bool*>(out.data_ptr());
        for_each_strided<3>(out.shape(), {out.strides(), a.strides(), b.strides()}, [&](const std::array<int64_t, 3>& o) {
          y[o[0]] = binary_math<Op, A>(static_cast<A>(pa[o[1]]), static_cast<A>(pb[o[2]]));
        });
      } else if constexpr (std::is_same_v<T, bool>) {
        fail("binary: arithmetic on bool tensors is not supported");
      } else {
        T* y = static_cast<T*>(out.data_ptr());
        for_each_strided<3>(out.shape(), {out.strides(), a.strides(), b.strides()}, [&](const std::array<int64_t, 3>& o) {
          y[o[0]] = T(binary_math<Op, A>(static_cast<A>(pa[o[1]]), static_cast<A>(pb[o[2]])));
        });
      }
    });
  });
}

void where(const Tensor& out, const Tensor& cond, const Tensor& a, const Tensor& b) {
  const bool* c = static_cast<const bool*>(cond.data_ptr());
  dispatch_all(a.dtype(), "where", [&]<class T>() {
    const T* pa = static_cast<const T*>(a.data_ptr());
    const T* pb = static_cast<const T*>(b.data_ptr());
    T* y = static_cast<T*>(out.data_ptr());
    for_each_strided<4>(out.shape(), {out.strides(), cond.strides(), a.strides(), b.strides()},
                        [&](const std::array<int64_t, 4>& o) { y[o[0]] = c[o[1]] ? pa[o[2]] : pb[o[3]]; });
  });
}

}  // namespace kiln::kernels::cpu
