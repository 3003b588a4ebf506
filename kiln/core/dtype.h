// DType: the element types kiln stores and computes with, their sizes and names, the C++ type
// of each, and dispatch_*: one switch from a run-time dtype to a templated lambda
// (`dispatch_floating(dt, "op", [&]<class T>() { ... })`).
// f8_e4m3 and f8_e5m2 are storage-only (for IO): no op computes with them.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>

#include "kiln/core/error.h"
#include "kiln/core/half.h"

namespace kiln {

enum class DType : uint8_t { f64, f32, f16, bf16, i64, i32, i16, i8, u8, boolean, f8_e4m3, f8_e5m2 };
inline constexpr int kNumDTypes = 12;

constexpr size_t itemsize(DType t) {
  switch (t) {
    case DType::f64: case DType::i64: return 8;
    case DType::f32: case DType::i32: return 4;
    case DType::f16: case DType::bf16: case DType::i16: return 2;
    default: return 1;
  }
}
constexpr bool is_floating(DType t) {
  return t == DType::f64 || t == DType::f32 || t == DType::f16 || t == DType::bf16;
}
constexpr bool is_integral(DType t) {
  return t == DType::i64 || t == DType::i32 || t == DType::i16 || t == DType::i8 || t == DType::u8;
}
// The dtype floating math runs in: f64 for f64, else f32 (16-bit storage computes in f32).
constexpr DType compute_dtype(DType t) { return t == DType::f64 ? DType::f64 : DType::f32; }
// Storage-only formats: tensors of these can be held, copied and saved, not computed with.
constexpr bool is_storage_only(DType t) { return t == DType::f8_e4m3 || t == DType::f8_e5m2; }

const char* dtype_name(DType t);
// Parses "f32", "float32", "bf16", "bfloat16", "i64", "int64", "bool", ...
DType parse_dtype(std::string_view s);

inline std::ostream& operator<<(std::ostream& os, DType t) { return os << dtype_name(t); }

template <class T> struct DTypeOf;
template <> struct DTypeOf<double> { static constexpr DType value = DType::f64; };
template <> struct DTypeOf<float> { static constexpr DType value = DType::f32; };
template <> struct DTypeOf<Half> { static constexpr DType value = DType::f16; };
template <> struct DTypeOf<BFloat16> { static constexpr DType value = DType::bf16; };
template <> struct DTypeOf<int64_t> { static constexpr DType value = DType::i64; };
template <> struct DTypeOf<int32_t> { static constexpr DType value = DType::i32; };
template <> struct DTypeOf<int16_t> { static constexpr DType value = DType::i16; };
template <> struct DTypeOf<int8_t> { static constexpr DType value = DType::i8; };
template <> struct DTypeOf<uint8_t> { static constexpr DType value = DType::u8; };
template <> struct DTypeOf<bool> { static constexpr DType value = DType::boolean; };
template <class T> inline constexpr DType dtype_of = DTypeOf<T>::value;

// The type arithmetic on T is done in: float for the 16-bit floats, T otherwise.
template <class T> struct AccType { using type = T; };
template <> struct AccType<Half> { using type = float; };
template <> struct AccType<BFloat16> { using type = float; };
template <class T> using acc_t = typename AccType<T>::type;

// Floating dtypes only; `op` names the caller in the error.
template <class F>
decltype(auto) dispatch_floating(DType t, const char* op, F&& f) {
  switch (t) {
    case DType::f64: return f.template operator()<double>();
    case DType::f32: return f.template operator()<float>();
    case DType::f16: return f.template operator()<Half>();
    case DType::bf16: return f.template operator()<BFloat16>();
    default: fail(op, ": dtype ", dtype_name(t), " is not supported (expected a floating dtype)");
  }
}

// Every computable dtype (not the storage-only 8-bit floats).
template <class F>
decltype(auto) dispatch_all(DType t, const char* op, F&& f) {
  switch (t) {
    case DType::f64: return f.template operator()<double>();
    case DType::f32: return f.template operator()<float>();
    case DType::f16: return f.template operator()<Half>();
    case DType::bf16: return f.template operator()<BFloat16>();
    case DType::i64: return f.template operator()<int64_t>();
    case DType::i32: return f.template operator()<int32_t>();
    case DType::i16: return f.template operator()<int16_t>();
    case DType::i8: return f.template operator()<int8_t>();
    case DType::u8: return f.template operator()<uint8_t>();
    case DType::boolean: return f.template operator()<bool>();
    default: fail(op, ": dtype ", dtype_name(t), " is storage-only and cannot be computed with");
  }
}

// A value that an integer dtype can hold (finite, within its range; bool takes any value):
// otherwise an error naming `op`, the value and the dtype (the cast was undefined behaviour,
// INT_MIN-like garbage for NaN or 1e30).
void check_value_fits(double value, DType t, const char* op);

// Integer index dtypes (i64, i32).
template <class F>
decltype(auto) dispatch_index(DType t, const char* op, F&& f) {
  switch (t) {
    case DType::i64: return f.template operator()<int64_t>();
    case DType::i32: return f.template operator()<int32_t>();
    default: fail(op, ": index dtype ", dtype_name(t), " is not supported (expected i64 or i32)");
  }
}

}  // namespace kiln
