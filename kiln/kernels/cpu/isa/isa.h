// CPU instruction-set features and the run-time choice of kernel set (docs/arm.md).
//
// x86-64: the hot loops are compiled three times (x86-64-v4, x86-64-v3 and baseline, target_clones in
// kernels/cpu/vec_math.h) and the loader picks; nothing here changes them, cpu_features() only
// reports what was picked.
// aarch64: the same portable loops are compiled for Armv8-A, where GCC vectorises them with NEON
// (the NEON set, what runs on every Armv8 core). The SVE set (kernels/cpu/isa/sve_*.cpp, own
// translation units compiled with -march=armv8-a+sve, vector-length agnostic: svcntw() and
// predicated tails) is used when getauxval(AT_HWCAP) has HWCAP_SVE; KILN_CPU_ISA=neon forces the
// NEON set on an SVE core. No kernel is specialised to one vector length, so none is chosen by
// prctl(PR_SVE_GET_VL); the length is read only to report it.
//
// Each entry point of the portable set starts with a seam (KILN_SVE_SEAM) that forwards to the
// SVE table when one was chosen; on x86 the seam is empty, so x86 code is unchanged.
#pragma once
#include <cstdint>
#include <string>

namespace kiln::kernels {
struct AdamWStep;  // kernels/optim.h
}

namespace kiln::kernels::cpu::isa {

struct CpuFeatures {
  std::string arch;          // "x86_64", "aarch64", ...
  std::string kernels;       // the kernel set in use: "sve", "neon", "x86-64-v4", "x86-64-v3", "baseline"
  int vector_bits = 0;       // vector length of the set in use (SVE: svcntb() * 8; NEON 128; AVX2 256)
  int sve_bits = 0;          // the SVE length the kernel reports (prctl(PR_SVE_GET_VL)), 0 without SVE
  bool neon = false, sve = false, sve2 = false, bf16 = false;  // aarch64 (HWCAP / HWCAP2)
  bool avx2 = false, fma = false, avx512f = false;              // x86-64 (cpuid)
  std::string forced;        // KILN_CPU_ISA when set ("neon"), else empty
};

// Detected once (thread-safe static), never changes afterwards.
const CpuFeatures& cpu_features();
// "sse neon sve ..." style list of the features present, for kiln info.
std::string feature_list(const CpuFeatures& f);

// Dispatch counter: the number of calls the current thread made into the SVE kernel set.
// Tests read it to check that the SVE path is the one taken (tests/isa).
uint64_t sve_calls();
void count_sve_call();

// One f32 row's gradient in the fused loss's row pass (kernels/cpu/lce_rows.h's grad_row with
// keep_exp): z holds exp(z − max) on entry, d(loss)/dz · scale on exit.
struct LceGradRowF32 {
  const float* w;  // class weights or null (1)
  int64_t target;  // in [0, v)
  float inv_sum, p_coef, target_coef, smooth_coef, filter, scale;
};

// The SVE kernel set: the same contracts as the portable functions they stand in for (the
// declarations named on each line).
struct SveKernels {
  // kernels/cpu/vec_math.h
  void (*silu_f32)(float* y, const float* x, int64_t n, bool deriv);
  void (*swiglu_f32)(float* y, const float* g, const float* u, int64_t n);
  void (*swiglu_grad_f32)(float* dg, float* du, const float* dy, const float* g, const float* u, int64_t n);
  // kernels/cpu/attention_impl.h (flex_detail)
  void (*tile_abt)(float* s, int64_t ld, const float* a, int64_t m, int64_t n, const float* bt, int64_t nk);
  void (*tile_ax)(float* acc, int64_t n, const float* w, int64_t ld, int64_t rows, const float* x, int64_t cols);
  void (*tile_atx)(float* acc, int64_t n, const float* w, int64_t ld, int64_t rows, const float* x, int64_t cols);
  float (*row_dot)(const float* a, const float* b, int64_t n);
  float (*row_max)(const float* s, int64_t n);
  float (*row_exp_sum)(float* s, int64_t n, float m);
  void (*row_softmax_grad)(float* s, float* d, int64_t n, float lse, float delta);
  // kernels/cpu/nn.cpp, f32 rows (statistics in double as the portable loops)
  void (*rms_norm_rows_f32)(float* y, float* rstd, const float* x, const float* w, int64_t rows, int64_t d,
                            double eps);
  // rows [r0, r1) of the backward; part (d doubles, or null) accumulates dweight's partial sums
  void (*rms_norm_backward_rows_f32)(float* dx, double* part, const float* dy, const float* x, const float* w,
                                     const float* rstd, int64_t r0, int64_t r1, int64_t d);
  // kernels/cpu/optim.cpp: n elements of an AdamW step (grad f32 or bf16 bits), the gradients
  // multiplied by `scale` first (the fused clip's coefficient; 1: as given, no multiply), so that
  // the fused clipped step gives clip_grad_norm_ then step()'s bits
  void (*adamw_f32)(float* p, float* m, float* v, const float* g, int64_t n, const AdamWStep& s, float scale);
  void (*adamw_bf16)(float* p, float* m, float* v, const uint16_t* g, int64_t n, const AdamWStep& s, float scale);
  // kernels/cpu/copy.cpp: contiguous casts (BFloat16's round-to-nearest-even, NaN kept quiet)
  void (*f32_to_bf16)(uint16_t* dst, const float* src, int64_t n);
  void (*bf16_to_f32)(float* dst, const uint16_t* src, int64_t n);
  // kernels/cpu/lce_rows.h: the fused loss's f32 row pass without soft cap
  float (*lce_logits_max_f32)(float* z, const float* bias, int64_t v);
  float (*lce_weighted_sum_f32)(const float* w, const float* z, int64_t v);
  float (*lce_exp_sum_f32)(float* z, int64_t v, float mx, bool keep);
  void (*lce_grad_row_f32)(float* z, int64_t v, const LceGradRowF32& g);
  int (*vector_bits)();  // svcntb() * 8
};

// The SVE set when it is the one in use, else null (always null off aarch64).
const SveKernels* sve();
// The SVE set whenever this core has SVE (also when KILN_CPU_ISA=neon chose NEON), for tests
// that compare both sets in one process; null without SVE.
const SveKernels* sve_available();

}  // namespace kiln::kernels::cpu::isa

// The seam at the top of a portable kernel: forwards to the SVE set when it is in use.
#if defined(__aarch64__)
#define KILN_ISA_SEAMS 1
#define KILN_SVE_SEAM(fn, ...)                                            \
  do {                                                                     \
    if (const auto* kiln_sve_ = ::kiln::kernels::cpu::isa::sve()) {        \
      ::kiln::kernels::cpu::isa::count_sve_call();                         \
      return kiln_sve_->fn(__VA_ARGS__);                                   \
    }                                                                      \
  } while (0)
#else
#define KILN_ISA_SEAMS 0
#define KILN_SVE_SEAM(fn, ...) \
  do {                         \
  } while (0)
#endif
