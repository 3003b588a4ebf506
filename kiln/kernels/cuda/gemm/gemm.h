// kiln's GEMM front door (docs/gemm.md): out[b] = epilogue(alpha · op(a[b]) · op(b[b])) on CUDA,
// by kiln's own Hopper kernel (sm_90a: TMA, wgmma, a producer warpgroup and two consumer
// warpgroups; kernels/cuda/gemm/sm90_gemm.cuh) or by cuBLASLt followed by the same epilogue as a
// separate pass (the reference, and the fallback where kiln's kernel does not apply), chosen by
// the backend selection: KILN_GEMM_BACKEND=auto|cublaslt|kiln, GemmOptions::backend, or
// set_default_backend (unset: cuBLASLt for now, options.h). `auto` takes kiln's kernel where a
// one-time measurement per (shape, layout, dtype, epilogue) chose it; the choices are cached on
// disk (autotune_cache.h).
// Plain C++ (no CUDA types): tests, benchmarks and ops include it in every build; without CUDA
// the entry points say "built without CUDA".
#pragma once
#include <cstdint>
#include <string>
#include <string_view>

#include "kiln/core/tensor.h"
#include "kiln/kernels/cuda/gemm/options.h"

namespace kiln::kernels::gemm {

// Backend and Epilogue (names, parsing, the process default) are in options.h. The epilogues,
// applied to v = alpha · the f32 accumulator of element (r, c):
//   none       out = v, cast to out's dtype ("scale and cast")
//   bias       out = v + bias[c]                    (bias [N], out's dtype)
//   residual   out = v + residual[r, c]             (residual out's shape and dtype; may be out)
//   swiglu     out[r, c/2] = silu(v[c]) · v[c + 1]  for even c (gate and up interleaved; out [M, N/2])
//   accumulate out += v                             (out f32: dW accumulated across chunks)
//   row_lse    out = v; row_stats[b, r, t] = log Σ exp(v) over the columns of tile t (f32; of
//              out as stored with lse_of_stored)
//   row_sumsq  out = v; row_stats[b, r, t] = Σ out² over tile t's columns (out as stored)
// Tile t holds columns [kTileN·t, kTileN·(t+1)); combine_row_stats sums or log-sum-exps them.
inline constexpr int64_t kTileN = 128;  // columns per row partial of row_lse / row_sumsq
inline int64_t row_stat_tiles(int64_t n) { return (n + kTileN - 1) / kTileN; }

struct EpilogueArgs {
  Epilogue kind = Epilogue::none;
  float alpha = 1.0f;
  Tensor bias;       // bias: [N]
  Tensor residual;   // residual: like out
  Tensor row_stats;  // row_lse / row_sumsq: f32 [batch, M, row_stat_tiles(N)], contiguous
  // row_lse over out as stored (rounded to its dtype) instead of v: the log-sum-exp a softmax
  // over the stored values needs (the fused loss's row pass reads those).
  bool lse_of_stored = false;
};

// The product: a is [batch, M, K] ([batch, K, M] when trans_a), b is [batch, K, N] ([batch, N, K]
// when trans_b), out [batch, M, N] ([batch, M, N/2] for swiglu); 2-D tensors are batch 1. Each
// has a contiguous last dim and any leading dim (row stride) and batch stride (0 broadcasts a or
// b). a and b are bf16 or f16 (the same); out is that dtype or f32 (f32 only for accumulate).
struct GemmProblem {
  Tensor a, b, out;
  bool trans_a = false, trans_b = false;
  // Optional, batch 1: a is block-sparse. u8 [ceil(M/64), ceil(K/64)] (any strides, on a's
  // device); entry (i, j) == 0 promises that op(a)'s rows 64i .. 64i + 63 are zero over K
  // 64j .. 64j + 63. kiln's kernel skips a tile's K block where all its rows are (no load, no
  // product); cuBLASLt computes it (the same product). The fused loss's gradient filter.
  Tensor a_nonzero{};
};
inline int64_t sparse_blocks(int64_t n) { return (n + 63) / 64; }  // 64-wide blocks of a_nonzero

struct GemmOptions {
  Backend backend = default_backend();
  int tile_n = 0;  // kiln's kernel: 128 or 256 output columns a tile; 0 chooses (N and the SM count)
  // kiln's kernel: store every epilogue from registers, not the tiles of a 16-bit out by TMA
  // (none, bias, residual, row_lse, row_sumsq) where the output's layout lets them (kiln bench
  // gemm --store direct: the two side by side).
  bool direct_store = false;
};

// Runs the product with its epilogue on the device's current stream. Backend kiln where kiln's
// kernel does not apply is an error saying why (kiln_supported); auto and cublaslt never fail
// for that reason.
void gemm(const GemmProblem& p, const EpilogueArgs& e, const GemmOptions& o = {});
// Whether kiln's kernel runs this problem (an sm_90 device, 16-byte aligned rows and bases,
// sizes below 2^31); otherwise `why` says what does not fit.
bool kiln_supported(const GemmProblem& p, const EpilogueArgs& e, std::string* why = nullptr);
// Whether kiln's kernel (where it applies) stores this problem's output tiles by TMA: the
// epilogues none, bias, residual, row_lse and row_sumsq into a 16-bit out whose base, rows and
// batch stride are 16-byte multiples, unless o.direct_store.
bool kiln_stores_by_tma(const GemmProblem& p, const EpilogueArgs& e, const GemmOptions& o = {});
// The backend gemm() would use now for this problem (auto measures if it has not yet).
Backend chosen_backend(const GemmProblem& p, const EpilogueArgs& e, const GemmOptions& o = {});
// The key of a problem in the autotune cache: "MxNxK*batch|layout|dtype>out|epilogue", layout
// "nn", "nt", "tn" or "tt" (trans_a, trans_b), and "|sparse" for a block-sparse a (a_nonzero:
// its time depends on the flags, so it is not the dense problem's choice).
inline std::string problem_key(const GemmProblem& p, const EpilogueArgs& e) {
  const Tensor& a = p.a;
  const int64_t batch = a.dim() == 3 ? a.size(0) : (p.out.dim() == 3 ? p.out.size(0) : 1);
  const int64_t m = p.trans_a ? a.size(-1) : a.size(-2), k = p.trans_a ? a.size(-2) : a.size(-1);
  const int64_t n = p.trans_b ? p.b.size(-2) : p.b.size(-1);
  return std::to_string(m) + "x" + std::to_string(n) + "x" + std::to_string(k) + "*" + std::to_string(batch) + "|" +
         (p.trans_a ? "t" : "n") + (p.trans_b ? "t" : "n") + "|" + dtype_name(a.dtype()) + ">" +
         dtype_name(p.out.dtype()) + "|" + epilogue_name(e.kind) + (p.a_nonzero.defined() ? "|sparse" : "");
}

// out[b, r] = Σ_t stats[b, r, t] (sumsq) or log Σ_t exp(stats[b, r, t]) (lse), t in order;
// stats f32 [batch, M, T], out f32 [batch, M]. On the device of the tensors.
void combine_row_stats(const Tensor& out, const Tensor& stats, Epilogue kind);

}  // namespace kiln::kernels::gemm
