// tensor_map.h: encoding TMA tensor maps (cuTensorMapEncodeTiled,
// reached through the runtime's driver entry point so that kiln does not link libcuda itself).
#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <algorithm>

#include "kiln/kernels/cuda/tensor_map.h"

namespace kiln::kernels::cuda::wgmma {
namespace {

PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  // Process-wide: the driver's function pointer is looked up once.
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      p = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

}  // namespace

bool encode_tensor_map_16bit(CUtensorMap* map, bool is_bf16, const void* base, int64_t B, int64_t H, int64_t rows,
                             int64_t cols, int64_t st_b, int64_t st_h, int64_t st_row, int box_rows) {
  auto fn = encode_fn();
  if (fn == nullptr || B <= 0 || H <= 0 || rows <= 0 || cols <= 0) return false;
  // Dims innermost first; strides in bytes for dims 1..3. A dimension of extent 1 is never
  // stepped, so any legal stride will do (a broadcast stride of 0 is not legal).
  cuuint64_t dims[4] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows), static_cast<cuuint64_t>(H),
                        static_cast<cuuint64_t>(B)};
  const int64_t ext[3] = {rows, H, B};
  const int64_t st[3] = {st_row, st_h, st_b};
  cuuint64_t strides[3];
  int64_t prev = cols * 2;
  for (int i = 0; i < 3; ++i) {
    int64_t s = st[i] * 2;
    if (ext[i] == 1) s = std::max<int64_t>(16, (prev + 15) / 16 * 16);
    if (s <= 0 || s % 16 != 0 || s >= (int64_t{1} << 40)) return false;
    strides[i] = static_cast<cuuint64_t>(s);
    if (ext[i] > (int64_t{1} << 62) / s) return false;  // the tensor spans more bytes than int64 holds
    prev = s * ext[i];
  }
  cuuint32_t box[4] = {64, static_cast<cuuint32_t>(box_rows), 1, 1};
  cuuint32_t estr[4] = {1, 1, 1, 1};
  const CUresult r = fn(map, is_bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4,
                        const_cast<void*>(base), dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
                        CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS;
}

}  // namespace kiln::kernels::cuda::wgmma
