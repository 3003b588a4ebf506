// CPU bodies of copy/cast, the batched block copy, fill, arange and the Philox draws.
#include "kiln/kernels/copy.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kiln/core/rng.h"
#include "kiln/kernels/cast.h"
#include "kiln/kernels/cpu/isa/isa.h"  // the SVE casts on aarch64, nothing on x86
#include "kiln/kernels/cpu/loops.h"

namespace kiln::kernels::cpu {

void copy_blocks(Device, const std::vector<CopyBlock>& blocks) {
  constexpr int64_t kPiece = 64 << 10;
  struct Piece {
    char* dst;
    const char* src;
    int64_t bytes;
  };
  std::vector<Piece> pieces;
  int64_t total = 0;
  for (const CopyBlock& b : blocks) {
    total += b.rows * b.row_bytes;
    for (int64_t r = 0; r < b.rows; ++r)
      for (int64_t o = 0; o < b.row_bytes; o += kPiece)
        pieces.push_back({static_cast<char*>(b.dst) + r * b.dst_pitch + o,
                          static_cast<const char*>(b.src) + r * b.src_pitch + o, std::min(kPiece, b.row_bytes - o)});
  }
  // Less than 256 KiB in all stays on one thread (a parallel region costs more than it saves).
  const auto n = static_cast<int64_t>(pieces.size());
  parallel_for(n, total < (256 << 10) ? n : 1, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const Piece& p = pieces[static_cast<size_t>(i)];
      std::memcpy(p.dst, p.src, static_cast<size_t>(p.bytes));
    }
  });
}

void copy(const Tensor& dst, const Tensor& src) {
  KILN_CHECK(dst.shape() == src.shape(), "copy: shapes ", dst.shape(), " and ", src.shape(), " differ");
  if (dst.numel() == 0) return;
  if (dst.dtype() == src.dtype() && dst.is_contiguous() && src.is_contiguous()) {
    if (dst.data_ptr() != src.data_ptr()) std::memmove(dst.data_ptr(), src.data_ptr(), dst.nbytes());
    return;
  }
  if (is_storage_only(dst.dtype()) || is_storage_only(src.dtype())) {
    KILN_CHECK(dst.dtype() == src.dtype(), "copy: cannot cast between ", dtype_name(src.dtype()), " and ",
               dtype_name(dst.dtype()), " (storage-only format)");
    auto* d = static_cast<uint8_t*>(dst.data_ptr());
    const auto* s = static_cast<const uint8_t*>(src.data_ptr());
    for_each_strided<2>(dst.shape(), {dst.strides(), src.strides()},
                        [&](const std::array<int64_t, 2>& o) { d[o[0]] = s[o[1]]; });
    return;
  }
#if KILN_ISA_SEAMS
  // Contiguous f32 <-> bf16 (mixed precision's casts) through the SVE set when it is in use.
  if (const auto* k = isa::sve(); k && dst.is_contiguous() && src.is_contiguous()) {
    const bool down = dst.dtype() == DType::bf16 && src.dtype() == DType::f32;
    if (down || (dst.dtype() == DType::f32 && src.dtype() == DType::bf16)) {
      isa::count_sve_call();
      parallel_for(dst.numel(), kParallelGrain, [&](int64_t b, int64_t e) {
        if (down)
          k->f32_to_bf16(static_cast<uint16_t*>(dst.data_ptr()) + b, static_cast<const float*>(src.data_ptr()) + b, e - b);
        else
          k->bf16_to_f32(static_cast<float*>(dst.data_ptr()) + b, static_cast<const uint16_t*>(src.data_ptr()) + b, e - b);
      });
      return;
    }
  }
#endif
  dispatch_all(dst.dtype(), "copy", [&]<class D>() {
    dispatch_all(src.dtype(), "copy", [&]<class S>() {
      D* d = static_cast<D*>(dst.data_ptr());
      const S* s = static_cast<const S*>(src.data_ptr());
      for_each_strided<2>(dst.shape(), {dst.strides(), src.strides()},
                          [&](const std::array<int64_t, 2>& o) { d[o[0]] = cast_value<D>(s[o[1]]); });
    });
  });
}

void fill(const Tensor& dst, double value) {
  dispatch_all(dst.dtype(), "fill", [&]<class T>() {
    T v = cast_value<T>(value);
    T* d = static_cast<T*>(dst.data_ptr());
    for_each_strided<1>(dst.shape(), {dst.strides()}, [&](const std::array<int64_t, 1>& o) { d[o[0]] = v; });
  });
}

void arange(const Tensor& dst, double start, double step) {
  dispatch_all(dst.dtype(), "arange", [&]<class T>() {
    T* d = static_cast<T*>(dst.data_ptr());
    for (int64_t i = 0; i < dst.numel(); ++i) d[i] = cast_value<T>(start + static_cast<double>(i) * step);
  });
}

void rand_uniform(const Tensor& dst, uint64_t seed, uint64_t offset) {
  dispatch_floating(dst.dtype(), "rand", [&]<class T>() {
    T* d = static_cast<T*>(dst.data_ptr());
    parallel_for(dst.numel(), 4096, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        Philox4 r = philox_element(seed, offset, static_cast<uint64_t>(i));
        if constexpr (std::is_same_v<T, double>) d[i] = uniform53(r.v[0], r.v[1]);
        else d[i] = T(uniform_from_bits(r.v[0]));
      }
    });
  });
}

void rand_normal(const Tensor& dst, uint64_t seed, uint64_t offset) {
  dispatch_floating(dst.dtype(), "randn", [&]<class T>() {
    T* d = static_cast<T*>(dst.data_ptr());
    parallel_for(dst.numel(), 4096, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        Philox4 r = philox_element(seed, offset, static_cast<uint64_t>(i));
        double u1 = 1.0 - uniform53(r.v[0], r.v[1]);  // (0, 1]
        double u2 = uniform53(r.v[2], r.v[3]);
        double z = std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
        if constexpr (std::is_same_v<T, double>) d[i] = z;
        else d[i] = T(static_cast<float>(z));
      }
    });
  });
}

}  // namespace kiln::kernels::cpu
