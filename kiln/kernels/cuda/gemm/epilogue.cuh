// The GEMM epilogues as a functor (the interface in sm90_gemm.cuh), device-only: RtEpilogue<T>
// applies the epilogue kind of its parameters (gemm.h: none, bias, residual, swiglu,
// accumulate, row_lse, row_sumsq) to pairs of f32 accumulators and stores them in the output
// dtype (T or f32). The same functor finishes the cuBLASLt path (unfused.cu: the product in f32
// first, then this epilogue over it), so both backends share one definition of each epilogue.
// A specialised epilogue (the fused loss's) is another functor with the same members.
// NOTE [epilogue kind fixed per tile]: RtEpilogue<T> reads its kind from its parameters;
// with_fixed_kind(f) switches on it once and calls f with RtEpilogue<T, kind>, whose kind() is a
// constant, so the kernel's unrolled tile epilogue is instantiated once per kind and a tile runs
// one straight block of code. Switching per element instead made one epilogue of every kind,
// interleaved (~17 k instructions a kernel for 128-column tiles, 2 × that for 256): the tile
// then ran out of the instruction cache.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kiln/kernels/device_std.h"

namespace kiln::kernels::cuda::gemm_sm90 {

// gemm.h's Epilogue values.
enum EpiKind : int { kEpiNone = 0, kEpiBias, kEpiResidual, kEpiSwiglu, kEpiAccumulate, kEpiRowLse, kEpiRowSumsq };

struct EpiParams {
  int kind;
  int out_f32;             // 1: out (and bias, residual) f32; 0: the input dtype
  int pair_stores;         // 1: out's base, ldo and batch stride let (r, c), (r, c + 1) with c even
                           // be stored as one 4-byte (16-bit out) or 8-byte (f32 out) store
  int staged;              // 1: the sm90 kernel stores a stageable kind's tiles by TMA (its map of out)
  int pair_res;            // 1: the residual's base, ldr and batch stride let (r, c), (r, c + 1) with
                           // c even be read as one 4-byte (16-bit) or 8-byte (f32) load
  int pair_bias;           // 1: likewise for the bias (its base)
  int lse_stored;          // row_lse: of the values as stored (rounded to out's dtype), not of v
  void* out;
  int64_t ldo, out_bstride;  // elements
  const void* bias;          // [N]
  const void* res;
  int64_t ldr, res_bstride;
  float alpha;
  float* stats;              // [batch, M, tiles_n]
  int64_t stats_ld, stats_bstride;
};

template <class T> __device__ __forceinline__ float to_f32(T x);
template <> __device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <> __device__ __forceinline__ float to_f32<__half>(__half x) { return __half2float(x); }
template <class T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }

template <class T, int kFixedKind = -1>
struct RtEpilogue {
  // The kind's reduction exists unless a fixed kind has none (run-time kind: skipped when unused).
  static constexpr bool kRowStats = kFixedKind < 0 || kFixedKind == kEpiRowLse || kFixedKind == kEpiRowSumsq;
  struct Row {
    float a, b;  // row_lse: (max, Σ exp(v − max)); row_sumsq: (Σ v², unused)
  };
  EpiParams p;

  __device__ __forceinline__ int kind() const { return kFixedKind >= 0 ? kFixedKind : p.kind; }
  // f(RtEpilogue<T, p.kind>{p}) (NOTE [epilogue kind fixed per tile]); f(*this) once fixed.
  template <class F>
  __device__ __forceinline__ void with_fixed_kind(F&& f) const {
    if constexpr (kFixedKind >= 0) {
      f(*this);
    } else {
      switch (p.kind) {
        case kEpiBias: f(RtEpilogue<T, kEpiBias>{p}); return;
        case kEpiResidual: f(RtEpilogue<T, kEpiResidual>{p}); return;
        case kEpiSwiglu: f(RtEpilogue<T, kEpiSwiglu>{p}); return;
        case kEpiAccumulate: f(RtEpilogue<T, kEpiAccumulate>{p}); return;
        case kEpiRowLse: f(RtEpilogue<T, kEpiRowLse>{p}); return;
        case kEpiRowSumsq: f(RtEpilogue<T, kEpiRowSumsq>{p}); return;
        default: f(RtEpilogue<T, kEpiNone>{p}); return;
      }
    }
  }

  __device__ __forceinline__ Row row_init() const {
    return kind() == kEpiRowLse ? Row{-INFINITY, 0.f} : Row{0.f, 0.f};
  }
  static __device__ __forceinline__ Row sum_merge(Row x, Row y) { return Row{x.a + y.a, 0.f}; }
  static __device__ __forceinline__ Row lse_merge(Row x, Row y) {
    if (y.a == -INFINITY) return x;
    if (x.a == -INFINITY) return y;
    const float m = fmaxf(x.a, y.a);
    return Row{m, x.b * expf(x.a - m) + y.b * expf(y.a - m)};
  }
  // lse_merge(x, Row{v, 1}) with one exp: the larger of the two maxima rescales the other sum.
  static __device__ __forceinline__ Row lse_push(Row x, float v) {
    if (v == -INFINITY) return x;
    if (v <= x.a) return Row{x.a, x.b + expf(v - x.a)};
    return Row{v, x.b * expf(x.a - v) + 1.f};  // x.a = -inf: x.b = 0, exp(-inf) = 0
  }

  __device__ __forceinline__ float load_out_dtype(const void* base, int64_t off) const {
    return p.out_f32 ? static_cast<const float*>(base)[off] : to_f32(static_cast<const T*>(base)[off]);
  }
  // v as out holds it (rounded to T unless out is f32).
  __device__ __forceinline__ float as_stored(float v) const { return p.out_f32 ? v : to_f32(from_f32<T>(v)); }
  // Stores v at element offset off of out.
  __device__ __forceinline__ void store(int64_t off, float v) const {
    if (p.out_f32) static_cast<float*>(p.out)[off] = v;
    else static_cast<T*>(p.out)[off] = from_f32<T>(v);
  }

  // Stores (v0, v1) at offsets off, off + 1 (off even); one store where pair_stores allows.
  __device__ __forceinline__ void store_pair(int64_t off, float v0, float v1) const {
    if (!p.pair_stores) {
      store(off, v0);
      store(off + 1, v1);
    } else if (p.out_f32) {
      *reinterpret_cast<float2*>(static_cast<float*>(p.out) + off) = make_float2(v0, v1);
    } else {
      T h[2] = {from_f32<T>(v0), from_f32<T>(v1)};
      *reinterpret_cast<uint32_t*>(static_cast<T*>(p.out) + off) = *reinterpret_cast<const uint32_t*>(h);
    }
  }

  // (base[off], base[off + 1]) in out's dtype as floats; one 4- or 8-byte load when `pair`
  // (off even, the base aligned for it), else one or two (ok1: whether off + 1 is in bounds).
  __device__ __forceinline__ float2 load_pair(const void* base, int64_t off, bool ok1, bool pair) const {
    if (pair && ok1) {
      if (p.out_f32) return *reinterpret_cast<const float2*>(static_cast<const float*>(base) + off);
      const uint32_t raw = *reinterpret_cast<const uint32_t*>(static_cast<const T*>(base) + off);
      const T* h = reinterpret_cast<const T*>(&raw);
      return make_float2(to_f32(h[0]), to_f32(h[1]));
    }
    return make_float2(load_out_dtype(base, off), ok1 ? load_out_dtype(base, off + 1) : 0.f);
  }

  // What element() adds at (r, c), (r, c + 1): the bias, the residual, or out's own values
  // (accumulate), zeros for the other kinds. Apart from element() so that a caller can issue a
  // row's loads together before its stores (the sm90 kernel does: one load latency a row, not
  // one an element).
  struct Addend {
    float a0, a1;
  };
  __device__ __forceinline__ Addend addend(int b, int r, int c, bool ok1) const {
    if (kind() == kEpiBias) {
      const float2 x = load_pair(p.bias, c, ok1, p.pair_bias);
      return Addend{x.x, x.y};
    }
    if (kind() == kEpiResidual) {
      const float2 x = load_pair(p.res, b * p.res_bstride + static_cast<int64_t>(r) * p.ldr + c, ok1, p.pair_res);
      return Addend{x.x, x.y};
    }
    if (kind() == kEpiAccumulate) {  // out is f32 (host-checked)
      const float2 x = load_pair(p.out, b * p.out_bstride + static_cast<int64_t>(r) * p.ldo + c, ok1, p.pair_stores);
      return Addend{x.x, x.y};
    }
    return Addend{0.f, 0.f};
  }

  __device__ __forceinline__ void element(int b, int r, int c, float v0, float v1, bool ok1, Row& row) const {
    element_plus(b, r, c, v0, v1, ok1, addend(b, r, c, ok1), row);
  }

  // The kinds whose output is out's [M, N] tile as computed (no swiglu halving, no
  // read-modify-write): the kernel may stage their values in shared memory and store the tile
  // by TMA (value_plus, then the kernel's store), where out is 16-bit (EpiParams::staged).
  static constexpr bool kStageable = kFixedKind == kEpiNone || kFixedKind == kEpiBias ||
                                     kFixedKind == kEpiResidual || kFixedKind == kEpiRowLse ||
                                     kFixedKind == kEpiRowSumsq;
  __device__ __forceinline__ bool staged() const { return p.staged != 0; }
  // The two values to store at (r, c), (r, c + 1) for those kinds (the addend read beforehand),
  // the row's state updated; rounding to out's dtype is the store's.
  __device__ __forceinline__ float2 value_plus(int b, int r, int c, float v0, float v1, bool ok1, Addend add,
                                               Row& row) const {
    v0 *= p.alpha, v1 *= p.alpha;
    switch (kind()) {
      case kEpiBias:
      case kEpiResidual:
        return make_float2(v0 + add.a0, v1 + add.a1);
      case kEpiRowLse:
        row = lse_push(row, p.lse_stored ? as_stored(v0) : v0);
        if (ok1) row = lse_push(row, p.lse_stored ? as_stored(v1) : v1);
        return make_float2(v0, v1);
      case kEpiRowSumsq: {  // Σ out² of out as stored
        const float s0 = as_stored(v0), s1 = as_stored(v1);
        row.a += s0 * s0;
        if (ok1) row.a += s1 * s1;
        return make_float2(v0, v1);
      }
      default:
        return make_float2(v0, v1);
    }
  }

  // element() with its addend read beforehand.
  __device__ __forceinline__ void element_plus(int b, int r, int c, float v0, float v1, bool ok1, Addend add,
                                               Row& row) const {
    const int64_t o = b * p.out_bstride + static_cast<int64_t>(r) * p.ldo;
    if (kind() == kEpiSwiglu) {
      // gate at column c (even), up at c + 1: out[r, c / 2] (N is even: ok1 always holds).
      v0 *= p.alpha, v1 *= p.alpha;
      const float s = v0 / (1.f + expf(-v0));
      store(o + c / 2, s * v1);
      return;
    }
    if (kind() == kEpiAccumulate) {  // out is f32 (host-checked): out + alpha·v, out read by addend()
      const float s0 = add.a0 + v0 * p.alpha, s1 = add.a1 + v1 * p.alpha;
      if (ok1) store_pair(o + c, s0, s1);
      else store(o + c, s0);
      return;
    }
    const float2 v = value_plus(b, r, c, v0, v1, ok1, add, row);
    if (ok1) store_pair(o + c, v.x, v.y);
    else store(o + c, v.x);
  }

  // The quad merge of the kernel: by kind.
  __device__ __forceinline__ Row merge(Row x, Row y) const {
    return kind() == kEpiRowLse ? lse_merge(x, y) : sum_merge(x, y);
  }
  __device__ __forceinline__ bool reduces_rows() const { return kind() == kEpiRowLse || kind() == kEpiRowSumsq; }
  __device__ __forceinline__ void row_done(int b, int r, int tn, Row row) const {
    float v = row.a;
    if (kind() == kEpiRowLse) v = row.a == -INFINITY ? -INFINITY : row.a + logf(row.b);
    p.stats[b * p.stats_bstride + static_cast<int64_t>(r) * p.stats_ld + tn] = v;
  }
};

}  // namespace kiln::kernels::cuda::gemm_sm90
