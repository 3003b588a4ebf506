// BlockMask tile classes and the tile classifier, device-only (no host code: NVRTC compiles this
// header, see kernels/device_std.h): the CPU and GPU BlockMask builders (attention/block_mask.h,
// kernels/cuda/attention_kernels.cuh) and the JIT's mask kernels classify tiles with it.
#pragma once
#include "kiln/core/macros.h"
#include "kiln/kernels/device_std.h"

namespace kiln::attention {

// Tile classes as produced by the builders (to_dense() reports them too).
enum class BlockKind : uint8_t { empty = 0, partial = 1, full = 2 };

// Classifies one tile by evaluating every in-range element (exact for any mask_mod).
template <class M>
KILN_HD BlockKind classify_tile(const M& m, int b, int h, int64_t q0, int64_t q1, int64_t k0, int64_t k1) {
  bool any = false, all = true;
  for (int64_t q = q0; q < q1; ++q)
    for (int64_t k = k0; k < k1; ++k) {
      bool keep = m(b, h, static_cast<int>(q), static_cast<int>(k));
      any = any || keep;
      all = all && keep;
    }
  return !any ? BlockKind::empty : (all ? BlockKind::full : BlockKind::partial);
}

}  // namespace kiln::attention
