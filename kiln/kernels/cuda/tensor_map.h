// Host encoding of TMA tensor maps (CUtensorMap) for the Hopper kernels (wgmma.cuh): a strided
// [B, H, rows, cols] tensor of 16-bit elements read in 128-byte-swizzled boxes.
#pragma once
#include <cuda.h>

#include <cstdint>

namespace kiln::kernels::cuda::wgmma {

// Encodes a tensor map of the 16-bit tensor at `base` with dims [B, H, rows, cols] (cols
// contiguous; element strides st_b, st_h, st_row) read in boxes of 64 columns × box_rows rows,
// 128-byte swizzled (NOTE [swizzled tiles for wgmma and TMA] in wgmma.cuh). Rows beyond `rows`
// read as zeros. Returns false when the layout cannot be described (a stride that is zero, as in
// a broadcast view, negative, not a multiple of 16 bytes or ≥ 2^40 bytes; no driver entry point):
// the caller then uses another kernel.
bool encode_tensor_map_16bit(CUtensorMap* map, bool is_bf16, const void* base, int64_t B, int64_t H, int64_t rows,
                             int64_t cols, int64_t st_b, int64_t st_h, int64_t st_row, int box_rows);

}  // namespace kiln::kernels::cuda::wgmma
