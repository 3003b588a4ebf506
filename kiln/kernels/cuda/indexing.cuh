// Strided elementwise launches for CUDA kernels: StridedIndexer<N> maps a flat element index
// of a shape to the element offsets of N operands (each with its own strides, 0 for broadcast
// dims), with sizes and strides passed by value (up to kMaxDims dims after coalescing); the
// division by each size is a multiply by a magic number (kernels/divmod.h) when the element
// count fits 31 bits, 64-bit division otherwise. The rank is a run-time value, so one kernel
// serves every rank.
// launch_elementwise<N>(shape, {strides...}, f, stream) runs f(offsets) for every element,
// with a flat fast path (offsets all equal to the index) when every operand is contiguous.
// `f` is a functor struct with `__device__ void operator()(const int64_t* off) const`.
// A functor may also process packs (NOTE [packed elementwise]): `static constexpr int kVec`,
// a host `bool packable() const` (its pointers aligned for packs of kVec elements) and
// `__device__ void packed(const int64_t* off) const` for the kVec consecutive elements at each
// operand's offset: contiguous operands, or strided ones whose innermost dim is contiguous.
//
// NOTE [packed elementwise] One element per thread keeps too few bytes in flight to fill HBM
// (a 16-bit element is a 2-byte load per thread), and the per-element functor's load, math and
// store cannot be reordered across elements (the output may alias an input). A pack is one
// 16-byte access per operand (8 bf16 or 4 f32 elements), loaded, computed and stored as a unit.
#pragma once
#include <array>
#include <concepts>
#include <cstdint>

#include "kiln/core/error.h"
#include "kiln/core/tensor.h"
#include "kiln/kernels/cuda/context.h"
#include "kiln/kernels/divmod.h"

namespace kiln::kernels::cuda {

inline constexpr int kMaxDims = 8;
inline constexpr int kElementwiseThreads = 256;

template <int N>
struct StridedIndexer {
  int ndim = 0;
  int64_t sizes[kMaxDims] = {};
  DivMod32 div32[kMaxDims] = {};  // sizes[d] as magic numbers (valid for the 31-bit path)
  int64_t strides[N][kMaxDims] = {};

  // Offsets of element `i` (row-major order over sizes).
  __device__ __forceinline__ void offsets(int64_t i, int64_t* off) const {
#pragma unroll
    for (int k = 0; k < N; ++k) off[k] = 0;
    for (int d = ndim - 1; d >= 0; --d) {
      int64_t s = sizes[d];
      int64_t idx = i % s;
      i /= s;
#pragma unroll
      for (int k = 0; k < N; ++k) off[k] += idx * strides[k][d];
    }
  }
  // The same for i < 2^31 (then every size is too): 32-bit division by magic numbers.
  __device__ __forceinline__ void offsets32(uint32_t i, int64_t* off) const {
#pragma unroll
    for (int k = 0; k < N; ++k) off[k] = 0;
    for (int d = ndim - 1; d >= 0; --d) {
      const uint32_t q = div32[d].div(i), idx = i - q * div32[d].d;
      i = q;
#pragma unroll
      for (int k = 0; k < N; ++k) off[k] += static_cast<int64_t>(idx) * strides[k][d];
    }
  }
  // Offsets of element i: i itself in every operand when all are contiguous (`flat`), else
  // offsets32 when the element count is below 2^31 (`small`), else offsets.
  __device__ __forceinline__ void offsets_at(int64_t i, bool flat, bool small, int64_t* off) const {
    if (flat) {
#pragma unroll
      for (int k = 0; k < N; ++k) off[k] = i;
    } else if (small) {
      offsets32(static_cast<uint32_t>(i), off);
    } else {
      offsets(i, off);
    }
  }
};

// Builds the indexer for `shape` with each operand's strides: drops size-1 dims and merges
// neighbouring dims that are contiguous with each other in every operand. Returns whether all
// operands are plain contiguous (flat index == offset).
template <int N>
bool make_indexer(const Shape& shape, const std::array<const Strides*, N>& strides, StridedIndexer<N>& ix) {
  int64_t sz[64];
  int64_t st[N][64];
  int nd = 0;
  KILN_CHECK(shape.size() <= 64, "cuda elementwise: too many dimensions (", shape.size(), ")");
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] == 1) continue;
    sz[nd] = shape[d];
    for (int k = 0; k < N; ++k) st[k][nd] = (*strides[k])[d];
    ++nd;
  }
  // Merge dim d into d-1 when stride[d-1] == stride[d] * size[d] for every operand.
  int m = 0;
  for (int d = 0; d < nd; ++d) {
    bool merge = m > 0;
    for (int k = 0; k < N && merge; ++k) merge = st[k][m - 1] == st[k][d] * sz[d];
    if (merge) {
      sz[m - 1] *= sz[d];
      for (int k = 0; k < N; ++k) st[k][m - 1] = st[k][d];
    } else {
      sz[m] = sz[d];
      for (int k = 0; k < N; ++k) st[k][m] = st[k][d];
      ++m;
    }
  }
  KILN_CHECK(m <= kMaxDims, "cuda elementwise: ", m, " dimensions after coalescing (at most ", kMaxDims,
             " supported), shape ", shape);
  ix.ndim = m;
  bool contiguous = true;
  for (int d = 0; d < m; ++d) {
    ix.sizes[d] = sz[d];
    if (sz[d] < (int64_t{1} << 31)) ix.div32[d] = DivMod32(static_cast<uint32_t>(sz[d]));
    for (int k = 0; k < N; ++k) ix.strides[k][d] = st[k][d];
  }
  // After coalescing, all-contiguous means one dim (or none) with unit strides.
  if (m > 1) contiguous = false;
  for (int k = 0; k < N && m == 1; ++k) contiguous = contiguous && st[k][0] == 1;
  return contiguous;
}

// One kernel for both layouts (a uniform branch), to halve the instantiations. `small`: n < 2^31,
// so the strided offsets take the 32-bit path.
template <int N, class F>
__global__ void __launch_bounds__(kElementwiseThreads)
    elementwise_kernel(int64_t n, bool contiguous, bool small, StridedIndexer<N> ix, F f) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t off[N];
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    ix.offsets_at(i, contiguous, small, off);
    f(off);
  }
}

// A pack of V elements, loaded and stored as one aligned access (NOTE [packed elementwise]).
template <class T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};
template <int V, class T>
__device__ __forceinline__ Pack<T, V> load_pack(const T* p, int64_t i) {
  return *reinterpret_cast<const Pack<T, V>*>(p + i);
}
template <int V, class T>
__device__ __forceinline__ void store_pack(T* p, int64_t i, const Pack<T, V>& x) {
  *reinterpret_cast<Pack<T, V>*>(p + i) = x;
}
// Elements per pack for operands whose widest element is `bytes` bytes: 16 bytes of it.
inline constexpr int pack_elements(size_t bytes) { return bytes >= 16 ? 1 : static_cast<int>(16 / bytes); }
// Whether p may be read or written as packs of V elements of T.
template <int V, class T>
bool pack_aligned(const T* p) {
  return reinterpret_cast<uintptr_t>(p) % (sizeof(T) * V) == 0;
}

template <class F>
concept PackedFunctor = requires(const F& f) {
  { F::kVec } -> std::convertible_to<int>;
  { f.packable() } -> std::convertible_to<bool>;
};

// Elementwise maps with packs (NOTE [packed elementwise]): y = f(x) for launch_elementwise<2>,
// y = f(a, b) for launch_elementwise<3>; F is a functor type with a `__device__ Out
// operator()(In...) const` (the math of an op: unary_math, binary_math, cast_value, swiglu_math).
template <class Out, class In>
inline constexpr int kMapVec = pack_elements(sizeof(In) > sizeof(Out) ? sizeof(In) : sizeof(Out));

template <class Out, class In, class F>
struct Map1 {
  Out* y;
  const In* x;
  F f;
  static constexpr int kVec = kMapVec<Out, In>;
  __device__ void operator()(const int64_t* o) const { y[o[0]] = f(x[o[1]]); }
  bool packable() const { return pack_aligned<kVec>(y) && pack_aligned<kVec>(x); }
  __device__ void packed(const int64_t* o) const {
    const Pack<In, kVec> in = load_pack<kVec>(x, o[1]);
    Pack<Out, kVec> out;
#pragma unroll
    for (int k = 0; k < kVec; ++k) out.v[k] = f(in.v[k]);
    store_pack(y, o[0], out);
  }
};

template <class Out, class In, class F>
struct Map2 {
  Out* y;
  const In* a;
  const In* b;
  F f;
  static constexpr int kVec = kMapVec<Out, In>;
  __device__ void operator()(const int64_t* o) const { y[o[0]] = f(a[o[1]], b[o[2]]); }
  bool packable() const { return pack_aligned<kVec>(y) && pack_aligned<kVec>(a) && pack_aligned<kVec>(b); }
  __device__ void packed(const int64_t* o) const {
    const Pack<In, kVec> u = load_pack<kVec>(a, o[1]), w = load_pack<kVec>(b, o[2]);
    Pack<Out, kVec> out;
#pragma unroll
    for (int k = 0; k < kVec; ++k) out.v[k] = f(u.v[k], w.v[k]);
    store_pack(y, o[0], out);
  }
};

// Packs of F::kVec elements (NOTE [packed elementwise]): `flat` (every operand contiguous) in
// order, the last n % kVec elements one by one; else along the innermost dim, which every
// operand has at stride 1 and whose size is a multiple of kVec (packs_along_inner_dim).
template <int N, class F>
__global__ void __launch_bounds__(kElementwiseThreads)
    elementwise_packed_kernel(int64_t n, bool flat, bool small, StridedIndexer<N> ix, F f) {
  constexpr int V = F::kVec;
  const int64_t packs = n / V;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t off[N];
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; p < packs; p += step) {
    ix.offsets_at(p * V, flat, small, off);
    f.packed(off);
  }
  if (flat && blockIdx.x == 0 && threadIdx.x < n - packs * V) {
#pragma unroll
    for (int k = 0; k < N; ++k) off[k] = packs * V + threadIdx.x;
    f(off);
  }
}

// Whether the strided operands of `ix` can be walked in packs of V along their innermost dim:
// stride 1 there in every operand, a size that is a multiple of V, and every other stride a
// multiple of V (so each pack starts aligned when the base pointers are).
template <int N>
bool packs_along_inner_dim(const StridedIndexer<N>& ix, int V) {
  if (ix.ndim == 0 || ix.sizes[ix.ndim - 1] % V != 0) return false;
  for (int k = 0; k < N; ++k) {
    if (ix.strides[k][ix.ndim - 1] != 1) return false;
    for (int d = 0; d + 1 < ix.ndim; ++d)
      if (ix.strides[k][d] % V != 0) return false;
  }
  return true;
}

// Grid size for n elements: enough blocks to fill the GPU a few times over, grid-stride beyond.
inline unsigned elementwise_blocks(int64_t n) {
  int64_t blocks = (n + kElementwiseThreads - 1) / kElementwiseThreads;
  return static_cast<unsigned>(blocks < 65536 ? blocks : 65536);
}

template <int N, class F>
void launch_elementwise(const Shape& shape, const std::array<const Strides*, N>& strides, const F& f,
                        cudaStream_t stream, const char* name) {
  const int64_t n = shape_numel(shape);
  if (n == 0) return;
  StridedIndexer<N> ix;
  const bool contiguous = make_indexer<N>(shape, strides, ix);
  const bool small = n < (int64_t{1} << 31);
  if constexpr (PackedFunctor<F>) {
    if (F::kVec > 1 && f.packable() && (contiguous || packs_along_inner_dim(ix, F::kVec))) {
      const int64_t packs = n / F::kVec;
      elementwise_packed_kernel<N, F><<<elementwise_blocks(packs > 0 ? packs : 1), kElementwiseThreads, 0, stream>>>(
          n, contiguous, small, ix, f);
      KILN_CUDA_CHECK_LAUNCH(name);
      return;
    }
  }
  elementwise_kernel<N, F><<<elementwise_blocks(n), kElementwiseThreads, 0, stream>>>(n, contiguous, small, ix, f);
  KILN_CUDA_CHECK_LAUNCH(name);
}

}  // namespace kiln::kernels::cuda
