// The one comparison family of kiln's tests (namespace kiln::test), each returning
// ::testing::AssertionResult for EXPECT_TRUE / ASSERT_TRUE:
//   Tol                      the bound of one element: atol and rtol, how they combine, and
//                            whether a NaN or an inf expected is matched by the same value
//   default_tol, device_tol, collective_tol
//                            the columns of the one per-dtype table, kDTypeTols
//   finite_only(tol)         tol where every NaN and inf fails
//   all_close(got, expected, tol, what)
//                            Tensor vs Tensor (any devices; the same shape and dtype), Tensor vs
//                            float64 values, values vs float64 values, one value vs one value;
//                            compared in float64, a failure gives the count of elements out of
//                            bounds and the first few (index, got, expected), the shape and tol
//   same_bits(got, expected, what)
//                            bitwise equality of two tensors (any devices; the same shape and
//                            dtype) or of two vectors; -0.0 and +0.0 differ, NaN payloads count
// and error_of(f), the message of the kiln::Error (or the given subclass) `f` throws, for the
// tests that check what an error says.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iomanip>
#include <limits>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "kiln/core/device.h"
#include "kiln/core/error.h"
#include "kiln/core/tensor.h"

namespace kiln::test {

// got matches expected where |got - expected| <= bound, the bound being atol + rtol·|expected|
// (Bound::sum, numpy.isclose's) or max(atol, rtol·|expected|) (Bound::max, math.isclose's). A NaN
// expected is matched by a NaN got only (by nothing where !nan_matches), an inf expected by the
// same inf only (by nothing where !inf_matches); a NaN or inf got never matches a finite value.
struct Tol {
  double atol = 0;
  double rtol = 0;
  enum class Bound : uint8_t { sum, max };
  Bound bound = Bound::sum;
  bool nan_matches = true;
  bool inf_matches = true;
};

// `tol` where every element must be finite on both sides.
constexpr Tol finite_only(Tol tol) {
  tol.nan_matches = tol.inf_matches = false;
  return tol;
}

// Per-dtype tolerances (atol = rtol), one row per floating dtype; every other dtype compares
// exactly. The columns:
//   op          one rounding in the dtype against float64 on the same inputs (the op harness)
//   device      the same computation on two devices, CPU against CUDA: one rounding plus the
//               math libraries' ulp-level differences
//   collective  a collective's result against the float64 reference rounded to the dtype:
//               exact but for avg's division, bounded by max(atol, rtol·|expected|)
struct DTypeTol {
  DType dtype;
  double op, device, collective;
};
inline constexpr DTypeTol kDTypeTols[] = {
    {DType::f64, 1e-10, 1e-12, 0},
    {DType::f32, 1e-5, 2e-5, 1e-6},
    {DType::f16, 2e-3, 4e-3, 1e-3},
    {DType::bf16, 1.6e-2, 2e-2, 1e-2},
};

namespace expect_detail {

inline DTypeTol dtype_tol_row(DType t) {
  for (const DTypeTol& r : kDTypeTols)
    if (r.dtype == t) return r;
  return {t, 0, 0, 0};
}

inline double element_bound(double want, const Tol& t) {
  const double rel = t.rtol * std::fabs(want);
  return t.bound == Tol::Bound::sum ? t.atol + rel : std::max(t.atol, rel);
}

inline bool element_close(double got, double want, const Tol& t) {
  if (std::isnan(got) || std::isnan(want)) return t.nan_matches && std::isnan(got) && std::isnan(want);
  if (std::isinf(got) || std::isinf(want)) return t.inf_matches && got == want;
  return std::fabs(got - want) <= element_bound(want, t);
}

inline std::string prefix(const std::string& what) { return what.empty() ? "" : what + ": "; }

inline std::string tol_str(const Tol& t) {
  std::ostringstream o;
  o << "atol " << t.atol << ", rtol " << t.rtol
    << (t.bound == Tol::Bound::sum ? ", bound atol + rtol·|expected|" : ", bound max(atol, rtol·|expected|)");
  if (!t.nan_matches) o << ", NaN fails";
  if (!t.inf_matches) o << ", inf fails";
  return o.str();
}

// Element i's index in `shape`, as (i0, i1, ...), for rank >= 2.
inline std::string coords(int64_t i, const Shape& shape) {
  if (shape.size() < 2) return "";
  std::vector<int64_t> c(shape.size());
  for (size_t d = shape.size(); d-- > 0;) {
    const int64_t n = std::max<int64_t>(shape[d], 1);
    c[d] = i % n;
    i /= n;
  }
  std::string s = " (";
  for (size_t d = 0; d < c.size(); ++d) s += (d ? ", " : "") + std::to_string(c[d]);
  return s + ")";
}

constexpr int kShownElements = 5;

inline ::testing::AssertionResult compare(const std::vector<double>& got, const std::vector<double>& want,
                                          const Shape& shape, const Tol& tol, const std::string& what) {
  if (got.size() != want.size())
    return ::testing::AssertionFailure() << prefix(what) << got.size() << " elements (shape " << shape_str(shape)
                                         << "), expected " << want.size();
  int64_t bad = 0;
  std::ostringstream first;
  first << std::setprecision(std::numeric_limits<double>::max_digits10);
  for (size_t i = 0; i < got.size(); ++i) {
    if (element_close(got[i], want[i], tol)) continue;
    if (bad++ < kShownElements)
      first << "\n  [" << i << "]" << coords(static_cast<int64_t>(i), shape) << " got " << got[i] << ", expected "
            << want[i] << " (|diff| " << std::fabs(got[i] - want[i]) << ", bound " << element_bound(want[i], tol)
            << ")";
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << prefix(what) << bad << " of " << got.size()
                                       << " elements out of bounds (shape " << shape_str(shape) << ", " << tol_str(tol)
                                       << "):" << first.str() << (bad > kShownElements ? "\n  ..." : "");
}

// Both defined, the same shape and the same dtype.
inline ::testing::AssertionResult same_layout(const Tensor& got, const Tensor& expected, const std::string& what) {
  if (!got.defined() || !expected.defined())
    return ::testing::AssertionFailure() << prefix(what) << (got.defined() ? "expected" : "got") << " is undefined";
  if (got.shape() != expected.shape())
    return ::testing::AssertionFailure() << prefix(what) << "shape " << shape_str(got.shape()) << ", expected "
                                         << shape_str(expected.shape());
  if (got.dtype() != expected.dtype())
    return ::testing::AssertionFailure() << prefix(what) << "dtype " << dtype_name(got.dtype()) << ", expected "
                                         << dtype_name(expected.dtype());
  return ::testing::AssertionSuccess();
}

inline std::string bits_str(const uint8_t* p, size_t n) {
  std::ostringstream o;
  o << "0x" << std::hex << std::setfill('0');
  for (size_t b = n; b-- > 0;) o << std::setw(2) << static_cast<unsigned>(p[b]);  // little-endian element
  return o.str();
}

// The elements of two same-sized byte arrays of `n` elements of `size` bytes that differ;
// value(i, is_got) prints element i where it has a value to print.
template <class Value>
::testing::AssertionResult compare_bits(const uint8_t* got, const uint8_t* want, int64_t n, size_t size,
                                        const Shape& shape, Value&& value, const std::string& what) {
  int64_t bad = 0;
  std::ostringstream first;
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t *g = got + static_cast<size_t>(i) * size, *w = want + static_cast<size_t>(i) * size;
    if (std::memcmp(g, w, size) == 0) continue;
    if (bad++ < kShownElements)
      first << "\n  [" << i << "]" << coords(i, shape) << " got " << bits_str(g, size) << value(i, true)
            << ", expected " << bits_str(w, size) << value(i, false);
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << prefix(what) << bad << " of " << n << " elements differ in bits (shape "
                                       << shape_str(shape) << "):" << first.str()
                                       << (bad > kShownElements ? "\n  ..." : "");
}

inline std::string value_str(double v) {
  std::ostringstream o;
  o << " (" << std::setprecision(std::numeric_limits<double>::max_digits10) << v << ")";
  return o.str();
}

}  // namespace expect_detail

inline Tol default_tol(DType t) {
  const double x = expect_detail::dtype_tol_row(t).op;
  return {x, x};
}
inline Tol device_tol(DType t) {
  const double x = expect_detail::dtype_tol_row(t).device;
  return {x, x};
}
inline Tol collective_tol(DType t) {
  const double x = expect_detail::dtype_tol_row(t).collective;
  return finite_only({x, x, Tol::Bound::max});
}

inline ::testing::AssertionResult all_close(const Tensor& got, const Tensor& expected, Tol tol,
                                            const std::string& what = "") {
  if (auto r = expect_detail::same_layout(got, expected, what); !r) return r;
  return expect_detail::compare(got.to_vector<double>(), expected.to_vector<double>(), got.shape(), tol, what);
}

// The tolerance a rule (default_tol, device_tol, ...) gives the tensors' dtype.
inline ::testing::AssertionResult all_close(const Tensor& got, const Tensor& expected, Tol (*tol_of)(DType),
                                            const std::string& what = "") {
  return all_close(got, expected, expected.defined() ? tol_of(expected.dtype()) : Tol{}, what);
}

// `expected`: got's elements in row-major order.
inline ::testing::AssertionResult all_close(const Tensor& got, const std::vector<double>& expected, Tol tol,
                                            const std::string& what = "") {
  if (!got.defined()) return ::testing::AssertionFailure() << expect_detail::prefix(what) << "got is undefined";
  return expect_detail::compare(got.to_vector<double>(), expected, got.shape(), tol, what);
}

template <class G>
::testing::AssertionResult all_close(const std::vector<G>& got, const std::vector<double>& expected, Tol tol,
                                     const std::string& what = "") {
  static_assert(std::is_arithmetic_v<G>, "all_close: values of an arithmetic type");
  return expect_detail::compare(std::vector<double>(got.begin(), got.end()), expected,
                                Shape{static_cast<int64_t>(got.size())}, tol, what);
}

inline ::testing::AssertionResult all_close(double got, double expected, Tol tol, const std::string& what = "") {
  return expect_detail::compare({got}, {expected}, Shape{}, tol, what);
}

inline ::testing::AssertionResult same_bits(const Tensor& got, const Tensor& expected, const std::string& what = "") {
  if (auto r = expect_detail::same_layout(got, expected, what); !r) return r;
  const Tensor g = got.to(kCPU).contiguous(), e = expected.to(kCPU).contiguous();
  std::vector<double> gv, ev;  // values to print, read once there is a difference to print
  auto value = [&](int64_t i, bool is_got) {
    if (is_storage_only(g.dtype())) return std::string();
    if (gv.empty()) gv = g.to_vector<double>(), ev = e.to_vector<double>();
    return expect_detail::value_str((is_got ? gv : ev)[static_cast<size_t>(i)]);
  };
  return expect_detail::compare_bits(static_cast<const uint8_t*>(g.data_ptr()),
                                     static_cast<const uint8_t*>(e.data_ptr()), g.numel(), itemsize(g.dtype()),
                                     g.shape(), value, what);
}

template <class T>
::testing::AssertionResult same_bits(const std::vector<T>& got, const std::vector<T>& expected,
                                     const std::string& what = "") {
  static_assert(std::is_trivially_copyable_v<T> && !std::is_same_v<T, bool>, "same_bits: elements held as bytes");
  if (got.size() != expected.size())
    return ::testing::AssertionFailure() << expect_detail::prefix(what) << got.size() << " elements, expected "
                                         << expected.size();
  auto value = [&](int64_t i, bool is_got) {
    if constexpr (std::is_arithmetic_v<T>)
      return expect_detail::value_str(static_cast<double>((is_got ? got : expected)[static_cast<size_t>(i)]));
    else
      return std::string();
  };
  return expect_detail::compare_bits(
      reinterpret_cast<const uint8_t*>(got.data()), reinterpret_cast<const uint8_t*>(expected.data()),
      static_cast<int64_t>(got.size()), sizeof(T), Shape{static_cast<int64_t>(got.size())}, value, what);
}

// The message of the E (kiln::Error or a subclass) that `f` throws, or "(no error)"; any other
// exception goes on (and fails the test).
template <class E = Error, class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace kiln::test
