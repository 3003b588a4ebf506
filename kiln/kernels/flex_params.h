// FlexAttention's kernel parameters, device-only (no host code: NVRTC compiles this header, see
// kernels/device_std.h): FlexBackend and FlexParams, the raw pointers and strides (elements) of
// q [B,Hq,L,E], k [B,Hkv,S,E], v [B,Hkv,S,Ev] (last dim contiguous, any b/h/seq strides), the
// contiguous outputs, the lse (f32, natural log, -inf on fully masked rows) and the block layout.
// The host entry points are in kernels/attention.h.
#pragma once
#include "kiln/core/macros.h"
#include "kiln/kernels/device_std.h"

namespace kiln::kernels {

// Which CUDA kernels run a FlexAttention call (FlexOptions::backend, like PyTorch's
// kernel_options["BACKEND"]). automatic: the fastest that applies (hopper, then sm80, then
// simt). The others are required: a call they do not apply to fails with the reason.
//   hopper: TMA + wgmma, warp-specialised (kernels/cuda/attention_*_wgmma.cuh)
//   sm80:   mma.sync tensor cores (attention_fwd_mma.cuh, attention_bwd_mma.cuh)
//   simt:   plain CUDA cores, every dtype, head dim and mod (attention_kernels.cuh)
enum class FlexBackend : uint8_t { automatic, hopper, sm80, simt };

struct FlexParams {
  int64_t B = 0, Hq = 0, Hkv = 0, L = 0, S = 0, E = 0, Ev = 0;
  float scale = 1.0f;
  FlexBackend backend = FlexBackend::automatic;  // CUDA only
  const void *q = nullptr, *k = nullptr, *v = nullptr;
  int64_t q_st[3] = {0, 0, 0}, k_st[3] = {0, 0, 0}, v_st[3] = {0, 0, 0};  // b, h, seq strides
  void* out = nullptr;        // [B, Hq, L, Ev] contiguous, input dtype
  float* lse = nullptr;       // [B, Hq, L] contiguous
  // backward
  const void* dout = nullptr;  // [B, Hq, L, Ev] contiguous, input dtype
  const float* dlse = nullptr; // [B, Hq, L] or null
  float* delta = nullptr;      // workspace [B, Hq, L]
  void *dq = nullptr, *dk = nullptr, *dv = nullptr;  // contiguous, input dtype
  float* dbias = nullptr;       // learnable table gradient [Hq, bias_row] (f32) or null
  float* dbias_partial = nullptr;  // workspace [B, Hq, nQ, bias_row] for the fixed-order reduction
  int64_t bias_row = 0;
  int32_t* tile_counters = nullptr;  // workspace (CUDA): the Hopper forward's tile counter [1], the backward's [2]
  // block layout (see kiln/attention/block_mask.h)
  const int32_t *kv_num = nullptr, *kv_idx = nullptr, *fkv_num = nullptr, *fkv_idx = nullptr;
  const int32_t *q_num = nullptr, *q_idx = nullptr, *fq_num = nullptr, *fq_idx = nullptr;
  int64_t Bm = 1, Hm = 1, nQ = 0, nKV = 0, QB = 128, KB = 128, nk1 = 1, nq1 = 1;

  struct BlockList {
    int32_t count;
    const int32_t* index;
  };
  // The KV blocks of mask row `row` (a Q block): partial ones (mask evaluated) or full ones.
  KILN_HD BlockList kv_blocks(int64_t row, bool partial) const {
    return {partial ? kv_num[row] : fkv_num[row], (partial ? kv_idx : fkv_idx) + row * nk1};
  }
  // The Q blocks of mask column `col` (a KV block), for the dK/dV pass.
  KILN_HD BlockList q_blocks(int64_t col, bool partial) const {
    return {partial ? q_num[col] : fq_num[col], (partial ? q_idx : fq_idx) + col * nq1};
  }
};

}  // namespace kiln::kernels
