// CUDA bodies of the elementwise kernels: the math is unary_math/binary_math of
// kernels/elementwise.h (shared with the CPU bodies), run through launch_elementwise of
// kernels/cuda/indexing.cuh (any strides, broadcasting by stride 0).
#include "kiln/kernels/cuda/indexing.cuh"
#include "kiln/kernels/elementwise.h"

namespace kiln::kernels::cuda {

namespace {

// The math of the unary and binary ops on one element, for Map1 and Map2 (indexing.cuh).
template <UnaryOp Op, class T>
struct UnaryMath {
  acc_t<T> s;
  __device__ T operator()(T v) const {
    using A = acc_t<T>;
    return T(unary_math<Op, A>(static_cast<A>(v), s));
  }
};

template <BinaryOp Op, class T, class Out>
struct BinaryMath {
  __device__ Out operator()(T u, T w) const {
    using A = acc_t<T>;
    return Out(binary_math<Op, A>(static_cast<A>(u), static_cast<A>(w)));
  }
};

template <class T>
struct WhereFn {
  T* y;
  const bool* c;
  const T* a;
  const T* b;
  __device__ void operator()(const int64_t* o) const { y[o[0]] = c[o[1]] ? a[o[2]] : b[o[3]]; }
};

void check_same_device(const Tensor& out, std::initializer_list<const Tensor*> ins, const char* op) {
  KILN_CHECK(out.is_cuda(), op, ": expected a CUDA output, got one on ", out.device().str());
  for (const Tensor* t : ins)
    KILN_CHECK(t->device() == out.device(), op, ": input on ", t->device().str(), ", output on ", out.device().str());
}

}  // namespace

void unary(UnaryOp op, const Tensor& out, const Tensor& a, double scalar) {
  check_same_device(out, {&a}, "unary");
  cudaStream_t stream = cuda::stream(out.device().index);
  dispatch_floating(a.dtype(), "unary", [&]<class T>() {
    using A = acc_t<T>;
    dispatch_unary_op(op, [&]<UnaryOp Op>() {
      Map1<T, T, UnaryMath<Op, T>> f{static_cast<T*>(out.data_ptr()), static_cast<const T*>(a.data_ptr()),
                                     {static_cast<A>(scalar)}};
      launch_elementwise<2>(a.shape(), {&out.strides(), &a.strides()}, f, stream, "unary");
    });
  });
}

void binary(BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b) {
  check_same_device(out, {&a, &b}, "binary");
  cudaStream_t stream = cuda::stream(out.device().index);
  dispatch_all(a.dtype(), "binary", [&]<class T>() {
    dispatch_binary_op(op, [&]<BinaryOp Op>() {
      const T* pa = static_cast<const T*>(a.data_ptr());
      const T* pb = static_cast<const T*>(b.data_ptr());
      if constexpr (is_comparison(Op)) {
        Map2<bool, T, BinaryMath<Op, T, bool>> f{static_cast<bool*>(out.data_ptr()), pa, pb, {}};
        launch_elementwise<3>(out.shape(), {&out.strides(), &a.strides(), &b.strides()}, f, stream, "binary");
      } else if constexpr (std::is_same_v<T, bool>) {
        fail("binary: arithmetic on bool tensors is not supported");
      } else {
        Map2<T, T, BinaryMath<Op, T, T>> f{static_cast<T*>(out.data_ptr()), pa, pb, {}};
        launch_elementwise<3>(out.shape(), {&out.strides(), &a.strides(), &b.strides()}, f, stream, "binary");
      }
    });
  });
}

void where(const Tensor& out, const Tensor& cond, const Tensor& a, const Tensor& b) {
  check_same_device(out, {&cond, &a, &b}, "where");
  KILN_CHECK(cond.dtype() == DType::boolean, "where: condition must be bool, got ", dtype_name(cond.dtype()));
  cudaStream_t stream = cuda::stream(out.device().index);
  dispatch_all(a.dtype(), "where", [&]<class T>() {
    WhereFn<T> f{static_cast<T*>(out.data_ptr()), static_cast<const bool*>(cond.data_ptr()),
                 static_cast<const T*>(a.data_ptr()), static_cast<const T*>(b.data_ptr())};
    launch_elementwise<4>(out.shape(), {&out.strides(), &cond.strides(), &a.strides(), &b.strides()}, f, stream,
                          "where");
  });
}

}  // namespace kiln::kernels::cuda
