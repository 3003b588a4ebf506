// What a run-time mod's expression sees (docs/jit.md, "The expression language"), for the
// generated sources of kiln/jit/flex_source.cpp, on the CPU and under NVRTC (device-only: no
// host code, kernels/device_std.h):
// - Dual<T>: forward-mode derivatives. A score_mod's derivative w.r.t. the score is its
//   expression evaluated on Dual{score, 1}; a learnable capture's, on Dual{score, 0} with the
//   capture's element seeded. Arithmetic mixes Dual with ints and floats as T would.
// - The functions an expression may call, for float, double and Dual: exp, log, sqrt, rsqrt,
//   tanh (kiln's tanh_t, as Softcap), sigmoid, abs, sin, cos, pow(x, y), min, max, where(c, a, b).
// - Capture views: a captured tensor as a read-only strided view, indexed with [] one dim at a
//   time; an index out of range reads 0 and raises the capture's flag, which the front end
//   turns into an error naming the capture (a mod is evaluated on masked pairs too, so a table
//   read must be safe at every in-range pair).
#pragma once
#include "kiln/core/macros.h"
#include "kiln/kernels/device_std.h"
#include "kiln/kernels/flex_mods.h"

namespace kiln::jit::expr {

// `inf`: +infinity as a float (NVRTC has no constexpr way to spell it, so a value that converts).
struct Inf {
  KILN_HD operator float() const {
#ifdef __CUDA_ARCH__
    return __int_as_float(0x7f800000);
#else
    return __builtin_huge_valf();
#endif
  }
};
KILN_HD float operator-(Inf i) { return -static_cast<float>(i); }
inline constexpr Inf inf{};

template <class T> struct Dual {
  T v, d;
  KILN_HD Dual() : v(0), d(0) {}
  KILN_HD Dual(T value, T deriv) : v(value), d(deriv) {}
  template <class A> KILN_HD Dual(A value) : v(static_cast<T>(value)), d(0) {}  // a constant
  KILN_HD explicit operator bool() const { return v != T(0); }
};

template <class X> struct value_type { using type = X; };
template <class T> struct value_type<Dual<T>> { using type = T; };
template <class X> KILN_HD auto val(const X& x) { return x; }
template <class T> KILN_HD T val(const Dual<T>& x) { return x.v; }
template <class X> inline constexpr bool is_dual_v = false;
template <class T> inline constexpr bool is_dual_v<Dual<T>> = true;

// ---- Dual arithmetic: (Dual, Dual), (Dual, number), (number, Dual) ----
#define KILN_EXPR_DUAL_BINARY(OP, V, D)                                                                 \
  template <class T> KILN_HD Dual<T> operator OP(const Dual<T>& a, const Dual<T>& b) { return {V, D}; } \
  template <class T, class N> KILN_HD Dual<T> operator OP(const Dual<T>& a, N n) {                      \
    const Dual<T> b(static_cast<T>(n), T(0));                                                           \
    return {V, D};                                                                                      \
  }                                                                                                     \
  template <class T, class N> KILN_HD Dual<T> operator OP(N n, const Dual<T>& b) {                      \
    const Dual<T> a(static_cast<T>(n), T(0));                                                           \
    return {V, D};                                                                                      \
  }
KILN_EXPR_DUAL_BINARY(+, a.v + b.v, a.d + b.d)
KILN_EXPR_DUAL_BINARY(-, a.v - b.v, a.d - b.d)
KILN_EXPR_DUAL_BINARY(*, a.v * b.v, a.d * b.v + a.v * b.d)
KILN_EXPR_DUAL_BINARY(/, a.v / b.v, (a.d * b.v - a.v * b.d) / (b.v * b.v))
#undef KILN_EXPR_DUAL_BINARY
template <class T> KILN_HD Dual<T> operator-(const Dual<T>& a) { return {-a.v, -a.d}; }
template <class T> KILN_HD Dual<T> operator+(const Dual<T>& a) { return a; }
#define KILN_EXPR_DUAL_COMPARE(OP)                                                                        \
  template <class T> KILN_HD bool operator OP(const Dual<T>& a, const Dual<T>& b) { return a.v OP b.v; } \
  template <class T, class N> KILN_HD bool operator OP(const Dual<T>& a, N b) { return a.v OP b; }      \
  template <class T, class N> KILN_HD bool operator OP(N a, const Dual<T>& b) { return a OP b.v; }
KILN_EXPR_DUAL_COMPARE(<)
KILN_EXPR_DUAL_COMPARE(<=)
KILN_EXPR_DUAL_COMPARE(>)
KILN_EXPR_DUAL_COMPARE(>=)
KILN_EXPR_DUAL_COMPARE(==)
KILN_EXPR_DUAL_COMPARE(!=)
#undef KILN_EXPR_DUAL_COMPARE

// ---- functions: f(x) and, for Dual, f'(x)·dx ----
template <class T> KILN_HD T fexp(T x) {
  if constexpr (sizeof(T) == 4) return ::expf(x); else return ::exp(x);
}
template <class T> KILN_HD T flog(T x) {
  if constexpr (sizeof(T) == 4) return ::logf(x); else return ::log(x);
}
template <class T> KILN_HD T fsqrt(T x) {
  if constexpr (sizeof(T) == 4) return ::sqrtf(x); else return ::sqrt(x);
}
template <class T> KILN_HD T fsin(T x) {
  if constexpr (sizeof(T) == 4) return ::sinf(x); else return ::sin(x);
}
template <class T> KILN_HD T fcos(T x) {
  if constexpr (sizeof(T) == 4) return ::cosf(x); else return ::cos(x);
}
template <class T> KILN_HD T fpow(T x, T y) {
  if constexpr (sizeof(T) == 4) return ::powf(x, y); else return ::pow(x, y);
}
template <class T> KILN_HD T fabs_(T x) { return x < T(0) ? -x : x; }

template <class X> KILN_HD X exp(X x) {
  if constexpr (is_dual_v<X>) { const auto e = fexp(x.v); return {e, e * x.d}; }
  else return fexp(x);
}
template <class X> KILN_HD X log(X x) {
  if constexpr (is_dual_v<X>) return {flog(x.v), x.d / x.v};
  else return flog(x);
}
template <class X> KILN_HD X sqrt(X x) {
  if constexpr (is_dual_v<X>) { const auto s = fsqrt(x.v); return {s, x.d / (decltype(s)(2) * s)}; }
  else return fsqrt(x);
}
template <class X> KILN_HD X rsqrt(X x) { return X(1) / sqrt(x); }
template <class X> KILN_HD X tanh(X x) {
  if constexpr (is_dual_v<X>) {
    const auto t = ::kiln::attention::tanh_t(x.v);
    return {t, (decltype(t)(1) - t * t) * x.d};
  } else {
    return ::kiln::attention::tanh_t(x);
  }
}
template <class X> KILN_HD X sigmoid(X x) { return X(1) / (X(1) + exp(-x)); }
template <class X> KILN_HD X abs(X x) {
  if constexpr (is_dual_v<X>) return x.v < 0 ? X{-x.v, -x.d} : x;
  else return fabs_(x);
}
template <class X> KILN_HD X sin(X x) {
  if constexpr (is_dual_v<X>) return {fsin(x.v), fcos(x.v) * x.d};
  else return fsin(x);
}
template <class X> KILN_HD X cos(X x) {
  if constexpr (is_dual_v<X>) return {fcos(x.v), -fsin(x.v) * x.d};
  else return fcos(x);
}
// pow with a constant exponent (x^y, derivative y·x^(y−1)·dx).
template <class X, class Y> KILN_HD X pow(X x, Y y) {
  if constexpr (is_dual_v<X>) {
    using T = typename value_type<X>::type;
    const T yy = static_cast<T>(val(y));
    return {fpow(x.v, yy), yy * fpow(x.v, yy - T(1)) * x.d};
  } else {
    return fpow(x, static_cast<X>(y));
  }
}
// min / max / where of mixed operands take the first non-number operand's type.
template <class A, class B> KILN_HD auto max(A a, B b) {
  if constexpr (is_dual_v<B> && !is_dual_v<A>) return val(a) > val(b) ? B(a) : b;
  else return val(a) > val(b) ? a : A(b);
}
template <class A, class B> KILN_HD auto min(A a, B b) {
  if constexpr (is_dual_v<B> && !is_dual_v<A>) return val(a) < val(b) ? B(a) : b;
  else return val(a) < val(b) ? a : A(b);
}
template <class A, class B> KILN_HD auto where(bool c, A a, B b) {
  if constexpr (is_dual_v<B> && !is_dual_v<A>) return c ? B(a) : b;
  else return c ? a : A(b);
}

// ---- captures ----
// What the front end passes per captured tensor (kiln/jit/flex_source.h builds it).
struct CaptureArg {
  const void* data;
  int64_t sizes[4];
  int64_t strides[4];  // elements
  int32_t rank;
  int32_t is_int;      // i32 ids rather than f32 values
  int32_t* flag;       // raised (1) by an index out of range
};

// A learnable capture's read, seeded when probing its gradient: the flat offset it read.
struct Probe {
  int64_t offset = -1;
};

// A rank-R view of a capture whose elements read as E (float or int32_t); T is the expression's
// value type (float, double or Dual) and `seed` marks the learnable capture being probed.
template <class T, class E, int R> struct View {
  const E* data;
  const int64_t* sizes;
  const int64_t* strides;
  int32_t* flag;
  Probe* probe;  // non-null: this view is the probed learnable capture
  int64_t offset;

  KILN_HD auto operator[](int64_t i) const {
    const bool ok = i >= 0 && i < sizes[0];
    if (!ok) raise();
    const int64_t at = offset + (ok ? i : 0) * strides[0];
    if constexpr (R > 1) {
      return View<T, E, R - 1>{data, sizes + 1, strides + 1, flag, probe, at};
    } else if constexpr (!is_dual_v<T> || !dev::is_same_v<E, float>) {
      return ok ? load(at) : E(0);
    } else {
      using V = typename value_type<T>::type;
      if (probe == nullptr || !ok) return T(static_cast<V>(ok ? data[at] : 0.0f), V(0));
      probe->offset = at;
      return T(static_cast<V>(data[at]), V(1));
    }
  }
  // A capture is read-only while a kernel runs: read through the non-coherent path on the GPU,
  // whose loads the compiler may keep across raise()'s atomic store (else each element reloads it).
  KILN_HD E load(int64_t at) const {
#ifdef __CUDA_ARCH__
    return __ldg(data + at);
#else
    return data[at];
#endif
  }
  KILN_HD void raise() const {
#ifdef __CUDA_ARCH__
    asm volatile("st.relaxed.gpu.global.b32 [%0], %1;" ::"l"(flag), "r"(1));
#else
    __atomic_store_n(flag, 1, __ATOMIC_RELAXED);
#endif
  }
};

// A capture as the generated functor stores it; view<T>() is what its expression indexes.
template <class E, int R> struct Capture {
  const E* data = nullptr;
  int64_t sizes[4] = {0, 0, 0, 0};
  int64_t strides[4] = {0, 0, 0, 0};
  int32_t* flag = nullptr;
  KILN_HD void bind(const CaptureArg& a) {
    data = static_cast<const E*>(a.data);
    for (int d = 0; d < 4; ++d) sizes[d] = a.sizes[d], strides[d] = a.strides[d];
    flag = a.flag;
  }
  template <class T> KILN_HD View<T, E, R> view(Probe* probe) const {
    return View<T, E, R>{data, sizes, strides, flag, probe, 0};
  }
};

}  // namespace kiln::jit::expr
