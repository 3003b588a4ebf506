// Names of the dtypes and their parsing.
#include "kiln/core/dtype.h"

#include "kiln/core/error.h"

namespace kiln {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f64: return "f64";
    case DType::f32: return "f32";
    case DType::f16: return "f16";
    case DType::bf16: return "bf16";
    case DType::i64: return "i64";
    case DType::i32: return "i32";
    case DType::i16: return "i16";
    case DType::i8: return "i8";
    case DType::u8: return "u8";
    case DType::boolean: return "bool";
    case DType::f8_e4m3: return "f8_e4m3";
    case DType::f8_e5m2: return "f8_e5m2";
  }
  return "?";
}

DType parse_dtype(std::string_view s) {
  struct Alias { std::string_view name; DType t; };
  static constexpr Alias kAliases[] = {
      {"f64", DType::f64}, {"float64", DType::f64}, {"double", DType::f64},
      {"f32", DType::f32}, {"float32", DType::f32}, {"float", DType::f32},
      {"f16", DType::f16}, {"float16", DType::f16}, {"half", DType::f16},
      {"bf16", DType::bf16}, {"bfloat16", DType::bf16},
      {"i64", DType::i64}, {"int64", DType::i64}, {"i32", DType::i32}, {"int32", DType::i32},
      {"i16", DType::i16}, {"int16", DType::i16}, {"i8", DType::i8}, {"int8", DType::i8},
      {"u8", DType::u8}, {"uint8", DType::u8}, {"bool", DType::boolean},
      {"f8_e4m3", DType::f8_e4m3}, {"f8_e5m2", DType::f8_e5m2}};
  for (const auto& a : kAliases)
    if (a.name == s) return a.t;
  fail("unknown dtype '", std::string(s), "' (expected one of f64, f32, f16, bf16, i64, i32, i16, i8, u8, bool)");
}

void check_value_fits(double value, DType t, const char* op) {
  if (!is_integral(t)) return;  // floating, storage-only and bool take any value
  double lo = 0, hi = 0;  // the dtype's range, [lo, hi)
  switch (t) {
    case DType::i64: lo = -0x1p63, hi = 0x1p63; break;
    case DType::i32: lo = -0x1p31, hi = 0x1p31; break;
    case DType::i16: lo = -0x1p15, hi = 0x1p15; break;
    case DType::i8: lo = -0x1p7, hi = 0x1p7; break;
    default: lo = 0, hi = 0x1p8; break;  // u8
  }
  KILN_CHECK(value >= lo && value < hi, op, ": value ", value, " does not fit dtype ", dtype_name(t));
}

}  // namespace kiln
