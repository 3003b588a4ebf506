// The CUDA side of the JIT where it can run: NVRTC compiles the device-only kernel headers
// (kernels/flex_mods.h, flex_params.h, flex_tiles.h, cuda/mma.cuh, cuda/wgmma.cuh) and the
// generated tile classifier of a run-time mask for sm_90a, with no GPU (skipped without
// libnvrtc); with a GPU, create_block_mask of a run-time mask on CUDA gives the CPU's tiles.
#include <gtest/gtest.h>

#include "kiln/attention/flex_attention.h"
#include "kiln/attention/runtime_mods.h"
#include "kiln/core/device.h"
#include "kiln/core/error.h"
#include "kiln/jit/cuda_backend.h"
#include "kiln/jit/flex_source.h"
#include "tests/jit/jit_test_util.h"
#include "tests/ops/harness.h"

using namespace kiln;

namespace {

TEST(JitNvrtc, DeviceOnlyHeadersCompile) {
  std::string why;
  if (!jit::nvrtc(&why)) GTEST_SKIP() << "no NVRTC here: " << why;
  if (jit::cuda_include_dir().empty()) GTEST_SKIP() << "no CUDA toolkit headers (cuda_fp16.h) for NVRTC";
  test::TempDir dir;
  test::ScopedEnv env("KILN_CACHE_DIR", dir.path.c_str());
  const jit::CompileRequest headers{"device-only headers", R"(
#include "kiln/kernels/flex_mods.h"
#include "kiln/kernels/flex_params.h"
#include "kiln/kernels/flex_tiles.h"
#include "kiln/kernels/cuda/mma.cuh"
#include "kiln/kernels/cuda/wgmma.cuh"
#include "kiln/jit/expr_prelude.h"
using namespace kiln::attention;
extern "C" __global__ void probe(kiln::kernels::FlexParams p, float* out, unsigned char* cls) {
  const AndMask<Causal, SlidingWindow> m{Causal{}, SlidingWindow{4}};
  const kiln::jit::expr::Dual<float> d(out[0], 1.0f);
  out[threadIdx.x] = Softcap{}(out[threadIdx.x], 0, 0, 0, 0) + Alibi{p.lse}(1.f, 0, 0, 1, 2) + tanh(d).d;
  cls[threadIdx.x] = static_cast<unsigned char>(classify_tile(m, 0, 0, 0, 8, 0, 8));
}
)", {}};
  const jit::Cubin c = jit::compile_cuda(headers);
  EXPECT_GT(c.image.size(), 1000u);
  EXPECT_TRUE(jit::compile_cuda(headers).from_cache);
  // The generated classifier of a run-time mask with a capture.
  const jit::ModSpec mask{"mask_mod", "q_idx >= kv_idx && doc[q_idx] == doc[kv_idx]", "", {{"doc", true, 1, false}}};
  EXPECT_GT(jit::compile_cuda({"classifier", jit::classify_cuda_source(mask), {"mask_mod"}}).image.size(), 1000u);
  // A syntax error: NVRTC's message points into the expression; nothing cached.
  const jit::ModSpec bad{"mask_mod", "q_idx >= kv_idx kv_idx", "", {}};
  try {
    jit::compile_cuda({"bad classifier", jit::classify_cuda_source(bad), {"mask_mod"}});
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("mask_mod(1)"), std::string::npos) << e.what();
  }
}

TEST(JitNvrtc, RuntimeMaskOnTheGpuMatchesTheCpu) {
  if (cuda_device_count() == 0)
    GTEST_SKIP() << "no CUDA device (the lead runs this on the H200: ctest -R JitNvrtc)";
  test::use_shared_jit_cache();
  std::vector<int32_t> ids(300);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>(i / 70);
  const Tensor doc = from_vector(ids, {300});
  const std::string expr = "q_idx >= kv_idx && doc[q_idx] == doc[kv_idx]";
  const auto cpu = attention::create_block_mask(attention::RuntimeMaskMod{expr, {{"doc", doc}}}, 1, 1, 300, 300, 32, 32);
  const auto gpu = attention::create_block_mask(attention::RuntimeMaskMod{expr, {{"doc", doc.to(cuda(0))}}},
                                                1, 1, 300, 300, 32, 32, cuda(0));
  test::expect_same_bits(cpu.layout.to_dense(), gpu.layout.to(kCPU).to_dense(), "tile classes");
}

}  // namespace
