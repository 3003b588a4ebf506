// CPU loop helpers: parallel_for over index ranges (OpenMP, fixed static partition so results
// do not depend on scheduling) and for_each_strided, which walks N operands of one shape with
// their own strides (0 for broadcast dims), with a flat fast path when all are contiguous and,
// otherwise, merged dims and a tight loop over the innermost one.
#pragma once
#include <omp.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

#include "kiln/core/tensor.h"

namespace kiln::kernels::cpu {

inline constexpr int64_t kParallelGrain = 32768;  // elements below which a loop stays serial

// Calls body(begin, end) over [0, n) split into contiguous static chunks.
template <class F>
void parallel_for(int64_t n, int64_t grain, F&& body) {
  if (n <= 0) return;
  int threads = omp_get_max_threads();
  if (n <= grain || threads <= 1 || omp_in_parallel()) {
    body(int64_t{0}, n);
    return;
  }
  int64_t chunks = std::min<int64_t>(threads, (n + grain - 1) / grain);
#pragma omp parallel for schedule(static) num_threads(static_cast<int>(chunks))
  for (int64_t c = 0; c < chunks; ++c) {
    int64_t b = n * c / chunks, e = n * (c + 1) / chunks;
    body(b, e);
  }
}

// Walks every element of `shape`; f(offsets) gets each operand's element offset.
template <size_t N, class F>
void for_each_strided(const Shape& shape, const std::array<Strides, N>& strides, F&& f) {
  const int64_t n = shape_numel(shape);
  if (n == 0) return;
  const Strides contig = contiguous_strides(shape);
  bool all_contig = true;
  for (size_t k = 0; k < N; ++k) {
    for (size_t d = 0; d < shape.size(); ++d)
      if (shape[d] != 1 && strides[k][d] != contig[d]) all_contig = false;
  }
  if (all_contig) {
    parallel_for(n, kParallelGrain, [&](int64_t b, int64_t e) {
      std::array<int64_t, N> off;
      for (int64_t i = b; i < e; ++i) {
        off.fill(i);
        f(off);
      }
    });
    return;
  }
  // Strided: drop size-1 dims and merge neighbours that are contiguous for every operand, then
  // walk the innermost dim in a tight loop and carry into the outer dims once per row.
  Shape sh;
  std::array<Strides, N> st;
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] == 1) continue;
    bool merge = !sh.empty();
    for (size_t k = 0; k < N && merge; ++k) merge = st[k].back() == strides[k][d] * shape[d];
    if (merge) {
      sh.back() *= shape[d];
      for (size_t k = 0; k < N; ++k) st[k].back() = strides[k][d];
    } else {
      sh.push_back(shape[d]);
      for (size_t k = 0; k < N; ++k) st[k].push_back(strides[k][d]);
    }
  }
  if (sh.empty()) {  // a single element
    std::array<int64_t, N> off{};
    f(off);
    return;
  }
  const int outer_nd = static_cast<int>(sh.size()) - 1;
  const int64_t inner = sh.back();
  std::array<int64_t, N> inner_st;
  for (size_t k = 0; k < N; ++k) inner_st[k] = st[k].back();
  parallel_for(n, kParallelGrain, [&](int64_t b, int64_t e) {
    std::vector<int64_t> idx(static_cast<size_t>(std::max(outer_nd, 1)), 0);
    std::array<int64_t, N> base{};
    int64_t rem = b / inner, j = b % inner;
    for (int d = outer_nd - 1; d >= 0; --d) {
      const size_t du = static_cast<size_t>(d);
      idx[du] = rem % sh[du];
      rem /= sh[du];
      for (size_t k = 0; k < N; ++k) base[k] += idx[du] * st[k][du];
    }
    for (int64_t i = b; i < e;) {
      const int64_t jn = std::min(inner, j + (e - i));
      std::array<int64_t, N> off;
      for (int64_t jj = j; jj < jn; ++jj) {
        for (size_t k = 0; k < N; ++k) off[k] = base[k] + jj * inner_st[k];
        f(off);
      }
      i += jn - j;
      j = 0;
      for (int d = outer_nd - 1; d >= 0; --d) {
        const size_t du = static_cast<size_t>(d);
        if (++idx[du] < sh[du]) {
          for (size_t k = 0; k < N; ++k) base[k] += st[k][du];
          break;
        }
        for (size_t k = 0; k < N; ++k) base[k] -= (sh[du] - 1) * st[k][du];
        idx[du] = 0;
      }
    }
  });
}

}  // namespace kiln::kernels::cpu
