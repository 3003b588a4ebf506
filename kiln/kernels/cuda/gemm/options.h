// The GEMM backend selection and epilogue names (gemm.h): Backend, Epilogue, their names and
// parsing, and the process default backend (set_default_backend, else KILN_GEMM_BACKEND, else
// kUnsetDefaultBackend). Plain C++, header-only: every build has them, with or without CUDA.
#pragma once
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "kiln/core/error.h"

namespace kiln::kernels::gemm {

enum class Backend : uint8_t { automatic, cublaslt, kiln };

inline const char* backend_name(Backend b) {
  switch (b) {
    case Backend::automatic: return "auto";
    case Backend::cublaslt: return "cublaslt";
    case Backend::kiln: return "kiln";
  }
  return "?";
}

// Parses a backend name; an error names `what` and the accepted values.
inline Backend parse_backend(std::string_view s, const char* what) {
  if (s == "auto") return Backend::automatic;
  if (s == "cublaslt") return Backend::cublaslt;
  if (s == "kiln") return Backend::kiln;
  fail(what, ": '", std::string(s), "' is not a GEMM backend (expected auto, cublaslt or kiln)");
}

namespace detail {
// -1: not set by set_default_backend.
inline std::atomic<int>& default_backend_override() {
  static std::atomic<int> v{-1};
  return v;
}
}  // namespace detail

// The default when neither set_default_backend nor KILN_GEMM_BACKEND says: cuBLASLt until kiln's
// kernel has passed its tests on the GPU (tests/cuda/gemm_test.cpp); then auto.
inline constexpr Backend kUnsetDefaultBackend = Backend::cublaslt;

// The process default: set_default_backend's, else KILN_GEMM_BACKEND's (a bad value is an error
// naming the variable), else kUnsetDefaultBackend.
inline Backend default_backend() {
  const int o = detail::default_backend_override().load(std::memory_order_relaxed);
  if (o >= 0) return static_cast<Backend>(o);
  const char* e = std::getenv("KILN_GEMM_BACKEND");
  if (e == nullptr || *e == '\0') return kUnsetDefaultBackend;
  return parse_backend(e, "KILN_GEMM_BACKEND");
}
inline void set_default_backend(Backend b) {
  detail::default_backend_override().store(static_cast<int>(b), std::memory_order_relaxed);
}
// Forgets set_default_backend's choice (KILN_GEMM_BACKEND, or the unset default, applies again).
inline void clear_default_backend() { detail::default_backend_override().store(-1, std::memory_order_relaxed); }

// The epilogues: gemm.h says what each computes.
enum class Epilogue : uint8_t { none, bias, residual, swiglu, accumulate, row_lse, row_sumsq };
inline constexpr Epilogue kAllEpilogues[] = {Epilogue::none,       Epilogue::bias,    Epilogue::residual,
                                             Epilogue::swiglu,     Epilogue::accumulate, Epilogue::row_lse,
                                             Epilogue::row_sumsq};

inline const char* epilogue_name(Epilogue e) {
  switch (e) {
    case Epilogue::none: return "none";
    case Epilogue::bias: return "bias";
    case Epilogue::residual: return "residual";
    case Epilogue::swiglu: return "swiglu";
    case Epilogue::accumulate: return "accumulate";
    case Epilogue::row_lse: return "row_lse";
    case Epilogue::row_sumsq: return "row_sumsq";
  }
  return "?";
}

inline Epilogue parse_epilogue(std::string_view s, const char* what) {
  for (Epilogue e : kAllEpilogues)
    if (s == epilogue_name(e)) return e;
  fail(what, ": '", std::string(s),
       "' is not a GEMM epilogue (expected none, bias, residual, swiglu, accumulate, row_lse or row_sumsq)");
}

}  // namespace kiln::kernels::gemm
