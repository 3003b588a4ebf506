// The CUDA side of the JIT where it can run: NVRTC compiles the device-only kernel headers
// (kernels/flex_mods.h, flex_params.h, flex_tiles.h, cuda/mma.cuh, cuda/wgmma.cuh) and the
// generated tile classifier of a run-time mask and the Hopper flex kernels with run-time mods for
// sm_90a, with no GPU (skipped without libnvrtc); with a GPU, create_block_mask of a run-time mask
// on CUDA gives the CPU's tiles, and run-time mods give the CPU's results (SIMT kernels) or the
// built-in mods' bits (Hopper kernels).
#include <gtest/gtest.h>

#include "kiln/attention/flex_attention.h"
#include "kiln/attention/mods.h"
#include "kiln/attention/runtime_mods.h"
#include "kiln/core/device.h"
#include "kiln/core/error.h"
#include "kiln/core/stream.h"
#include "kiln/ops/ops.h"
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
  // The SIMT flex kernels of a run-time pair, forward and backward.
  const jit::ModSpec alibi{"score_mod", "score + slopes[h] * (kv_idx - q_idx)", "", {{"slopes", false, 1, false}}};
  // The SIMT flex kernels of a run-time pair, forward and backward, on every storage type
  // (bf16 / f16 as cuda_bf16.h's and cuda_fp16.h's types under NVRTC).
  for (const char* storage : {"f32", "bf16", "f16"})
    for (bool bwd : {false, true}) {
      const std::string src = jit::flex_cuda_source(alibi, mask, 128, bwd, storage);
      for (const std::string& name : jit::flex_cuda_kernels(bwd, false))  // the names the loaders ask for
        EXPECT_NE(src.find("__global__ void " + name + "("), std::string::npos) << name;
      EXPECT_GT(jit::compile_cuda({std::string("flex ") + storage, src, {"score_mod", "mask_mod"}}).image.size(), 1000u)
          << storage;
      EXPECT_NE(src.find(std::string(std::string(storage) == "f32" ? "128, float>" : std::string(storage) == "bf16"
                                                                       ? "128, __nv_bfloat16>"
                                                                       : "128, __half>")),
                std::string::npos)
          << src;
    }
  EXPECT_THROW(jit::flex_cuda_source(alibi, mask, 128, false, "f64"), Error);
  // A learnable capture adds the captured-gradient kernels to the backward.
  const jit::ModSpec learnable{"score_mod", "score + bias[h][kv_idx - q_idx + q_len - 1]", "",
                               {{"bias", false, 2, true}}};
  for (const char* storage : {"f32", "bf16"}) {
    const std::string src = jit::flex_cuda_source(learnable, mask, 128, true, storage);
    for (const std::string& name : jit::flex_cuda_kernels(true, true))
      EXPECT_NE(src.find("__global__ void " + name + "("), std::string::npos) << name;
    EXPECT_GT(jit::compile_cuda({std::string("flex learnable ") + storage, src, {"score_mod", "mask_mod"}}).image.size(),
              1000u);
  }
  EXPECT_EQ(jit::flex_cuda_source(alibi, mask, 128, true).find("kiln_flex_dcap"), std::string::npos);
  // A syntax error: NVRTC's message points into the expression; nothing cached.
  const jit::ModSpec bad{"mask_mod", "q_idx >= kv_idx kv_idx", "", {}};
  try {
    jit::compile_cuda({"bad classifier", jit::classify_cuda_source(bad), {"mask_mod"}});
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("mask_mod(1)"), std::string::npos) << e.what();
  }
}

// The built-in Hopper kernel templates (attention_fwd_wgmma.cuh, attention_bwd_wgmma.cuh) compile
// under NVRTC with generated functors: every kernel a call can ask for has a symbol, and a second
// compile is a cache hit that gives the same symbols.
TEST(JitNvrtc, HopperKernelsCompileWithRunTimeMods) {
  std::string why;
  if (!jit::nvrtc(&why)) GTEST_SKIP() << "no NVRTC here: " << why;
  if (jit::cuda_include_dir().empty()) GTEST_SKIP() << "no CUDA toolkit headers (cuda_fp16.h) for NVRTC";
  test::TempDir dir;
  test::ScopedEnv env("KILN_CACHE_DIR", dir.path.c_str());
  const jit::ModSpec alibi{"score_mod", "score + slopes[h] * (kv_idx - q_idx)", "", {{"slopes", false, 1, false}}};
  const jit::ModSpec doc{"mask_mod", "q_idx >= kv_idx && doc[q_idx] == doc[kv_idx]", "", {{"doc", true, 1, false}}};
  const jit::ModSpec none{"score_mod", "score", "", {}};
  struct Case {
    const jit::ModSpec* score;
    const char* storage;
    int head_dim;
    bool backward;
  };
  for (const Case& c : {Case{&alibi, "bf16", 128, false}, Case{&alibi, "bf16", 128, true}, Case{&none, "f16", 64, true},
                        Case{&none, "bf16", 64, false}}) {
    const std::string label = std::string(c.storage) + " D=" + std::to_string(c.head_dim) + (c.backward ? " bwd" : " fwd");
    jit::CompileRequest req{"hopper " + label, jit::flex_hopper_source(*c.score, doc, c.storage),
                            {"score_mod", "mask_mod"}, jit::flex_hopper_kernels(c.head_dim, c.backward, c.storage)};
    ASSERT_EQ(req.name_expressions.size(), c.backward ? 2u : 1u) << label;
    const jit::Cubin first = jit::compile_cuda(req);
    EXPECT_FALSE(first.from_cache) << label;
    EXPECT_GT(first.image.size(), 10000u) << label;
    ASSERT_EQ(first.lowered_names.size(), req.name_expressions.size()) << label;
    for (const auto& n : first.lowered_names)
      EXPECT_NE(n.find(c.backward ? "flex_bwd_wgmma_kernel" : "flex_fwd_wgmma_kernel"), std::string::npos) << n;
    if (c.backward) {
      EXPECT_NE(first.lowered_names[0], first.lowered_names[1]) << label;
    }
    const jit::Cubin again = jit::compile_cuda(req);
    EXPECT_TRUE(again.from_cache) << label;
    EXPECT_EQ(again.lowered_names, first.lowered_names) << label;
  }
  EXPECT_THROW(jit::flex_hopper_source(alibi, doc, "f32"), Error);
  EXPECT_THROW(jit::flex_hopper_kernels(256, false, "bf16"), Error);
}

// A library pair written as run-time expressions runs the very kernels of the built-in pair on
// the Hopper path (the same templates, instantiated by NVRTC): output, lse and gradients carry the
// built-in call's bits, forward and backward: causal, a sliding window, ALiBi with causal.
TEST(JitNvrtc, HopperRunTimeModsGiveTheBuiltinBits) {
  if (cuda_device_count() == 0)
    GTEST_SKIP() << "no CUDA device (the lead runs this on the H200: ctest -R JitNvrtc)";
  test::use_shared_jit_cache();
  KILN_TEST_GENERATOR(gen);
  const int64_t B = 1, Hq = 4, Hkv = 2, L = 640, D = 128, BS = 128;
  Tensor slopes = Tensor::empty({Hq}, DType::f32);
  attention::alibi_slopes(static_cast<int>(Hq), slopes.data<float>());
  const Tensor slopes_gpu = slopes.to(cuda(0));
  for (DType dt : {DType::bf16, DType::f16}) {
    Tensor q = randn({B, Hq, L, D}, gen).to(dt).to(cuda(0)), k = randn({B, Hkv, L, D}, gen).to(dt).to(cuda(0)),
           v = randn({B, Hkv, L, D}, gen).to(dt).to(cuda(0)), dout = randn({B, Hq, L, D}, gen).to(dt).to(cuda(0));
    auto run = [&](auto&& call) {
      Tensor qd = q.detach().requires_grad_(true), kd = k.detach().requires_grad_(true), vd = v.detach().requires_grad_(true);
      attention::FlexOptions opt;
      opt.return_lse = true;
      opt.backend = kernels::FlexBackend::hopper;
      auto r = call(qd, kd, vd, opt);
      r.out.backward(dout);
      return std::vector<Tensor>{r.out.to(kCPU), r.lse.to(kCPU), qd.grad().to(kCPU), kd.grad().to(kCPU),
                                 vd.grad().to(kCPU)};
    };
    const char* names[] = {"out", "lse", "dq", "dk", "dv"};
    auto expect_same = [&](const std::vector<Tensor>& a, const std::vector<Tensor>& b, const std::string& what) {
      for (size_t i = 0; i < a.size(); ++i)
        EXPECT_TRUE(test::same_bits(a[i], b[i], (what + " " + dtype_name(dt) + " " + names[i]).c_str()));
    };
    auto causal = attention::create_block_mask(attention::Causal{}, 1, 1, L, L, BS, BS);
    causal.layout = causal.layout.to(cuda(0));
    const auto rcausal = attention::create_block_mask(attention::RuntimeMaskMod{"q_idx >= kv_idx"}, 1, 1, L, L, BS, BS,
                                                      cuda(0));
    expect_same(run([&](auto& q, auto& k, auto& v, auto& o) {
                  return attention::flex_attention(q, k, v, attention::NoScoreMod{}, causal, o);
                }),
                run([&](auto& q, auto& k, auto& v, auto& o) {
                  return attention::flex_attention(q, k, v, attention::RuntimeScoreMod{}, rcausal, o);
                }),
                "causal");
    auto window = attention::create_block_mask(attention::SlidingWindow{200}, 1, 1, L, L, BS, BS);
    window.layout = window.layout.to(cuda(0));
    const auto rwindow = attention::create_block_mask(
        attention::RuntimeMaskMod{"q_idx >= kv_idx && q_idx - kv_idx < 200"}, 1, 1, L, L, BS, BS, cuda(0));
    // Pairs the build instantiates for CUDA (the kernel registry): the window alone, ALiBi with
    // the causal mask.
    expect_same(run([&](auto& q, auto& k, auto& v, auto& o) {
                  return attention::flex_attention(q, k, v, attention::NoScoreMod{}, window, o);
                }),
                run([&](auto& q, auto& k, auto& v, auto& o) {
                  return attention::flex_attention(q, k, v, attention::RuntimeScoreMod{}, rwindow, o);
                }),
                "window");
    expect_same(run([&](auto& q, auto& k, auto& v, auto& o) {
                  return attention::flex_attention(q, k, v, attention::Alibi{slopes_gpu.data<float>()}, causal, o);
                }),
                run([&](auto& q, auto& k, auto& v, auto& o) {
                  return attention::flex_attention(
                      q, k, v, attention::RuntimeScoreMod{"score + slopes[h] * (kv_idx - q_idx)", {{"slopes", slopes_gpu}}},
                      rcausal, o);
                }),
                "alibi+causal");
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
  EXPECT_TRUE(test::same_bits(cpu.layout.to_dense(), gpu.layout.to(kCPU).to_dense(), "tile classes"));
}

// A run-time pair on the GPU (the NVRTC SIMT kernels, f32) against the same pair on the CPU:
// output, lse and gradients within f32 rounding (the GPU's exp differs), fully masked rows 0.
TEST(JitNvrtc, RuntimeModsOnTheGpuMatchTheCpu) {
  if (cuda_device_count() == 0)
    GTEST_SKIP() << "no CUDA device (the lead runs this on the H200: ctest -R JitNvrtc)";
  test::use_shared_jit_cache();
  KILN_TEST_GENERATOR(gen);
  const int64_t B = 2, H = 2, L = 77, E = 32;
  Tensor slopes = mul(rand({H}, gen), 0.2);
  const attention::RuntimeScoreMod sm_cpu{"score + slopes[h] * (kv_idx - q_idx)", {{"slopes", slopes}}};
  const attention::RuntimeScoreMod sm_gpu{"score + slopes[h] * (kv_idx - q_idx)", {{"slopes", slopes.to(cuda(0))}}};
  const attention::RuntimeMaskMod mm{"kv_idx <= q_idx - 2 && q_idx - kv_idx < 40"};
  Tensor q = randn({B, H, L, E}, gen), k = randn({B, H, L, E}, gen), v = randn({B, H, L, E}, gen),
         dout = randn({B, H, L, E}, gen);
  auto run = [&](Device d, const attention::RuntimeScoreMod& sm) {
    Tensor qd = q.to(d).detach().requires_grad_(true), kd = k.to(d).detach().requires_grad_(true),
           vd = v.to(d).detach().requires_grad_(true);
    attention::FlexOptions opt;
    opt.return_lse = true;
    auto r = attention::flex_attention(qd, kd, vd, sm, attention::create_block_mask(mm, 1, 1, L, L, 32, 32, d), opt);
    r.out.backward(dout.to(d));
    return std::vector<Tensor>{r.out.to(kCPU), r.lse.to(kCPU), qd.grad().to(kCPU), kd.grad().to(kCPU),
                               vd.grad().to(kCPU)};
  };
  const auto c = run(kCPU, sm_cpu), g = run(cuda(0), sm_gpu);
  const char* names[] = {"out", "lse", "dq", "dk", "dv"};
  for (size_t i = 0; i < c.size(); ++i) EXPECT_TRUE(test::all_close(g[i], c[i], {2e-5, 2e-4}, names[i]));
}

// A learnable captured table on the GPU (the generated dcap kernels) against the CPU's run-time
// kernels: the same output and gradients, the table's included, within f32 rounding.
TEST(JitNvrtc, CapturedGradientOnTheGpuMatchesTheCpu) {
  if (cuda_device_count() == 0)
    GTEST_SKIP() << "no CUDA device (the lead runs this on the H200: ctest -R JitNvrtc)";
  test::use_shared_jit_cache();
  KILN_TEST_GENERATOR(gen);
  const int64_t B = 2, H = 2, L = 53, E = 16;
  const Tensor bias0 = mul(randn({H, 2 * L - 1}, gen), 0.3);
  const attention::RuntimeMaskMod mm{"q_idx >= kv_idx"};
  Tensor q = randn({B, H, L, E}, gen), k = randn({B, H, L, E}, gen), v = randn({B, H, L, E}, gen),
         dout = randn({B, H, L, E}, gen);
  auto run = [&](Device d) {
    Tensor bias = bias0.to(d).detach().requires_grad_(true);
    const attention::RuntimeScoreMod sm{"score + bias[h][kv_idx - q_idx + q_len - 1]", {{"bias", bias}}};
    Tensor qd = q.to(d).detach().requires_grad_(true), kd = k.to(d).detach().requires_grad_(true),
           vd = v.to(d).detach().requires_grad_(true);
    auto r = attention::flex_attention(qd, kd, vd, sm, attention::create_block_mask(mm, 1, 1, L, L, 16, 16, d));
    r.out.backward(dout.to(d));
    return std::vector<Tensor>{r.out.to(kCPU), qd.grad().to(kCPU), kd.grad().to(kCPU), vd.grad().to(kCPU),
                               bias.grad().to(kCPU)};
  };
  const auto c = run(kCPU), g = run(cuda(0));
  const char* names[] = {"out", "dq", "dk", "dv", "dbias"};
  for (size_t i = 0; i < c.size(); ++i) EXPECT_TRUE(test::all_close(g[i], c[i], {3e-5, 3e-4}, names[i]));
  // deterministic: a second run gives the same bits
  EXPECT_TRUE(test::same_bits(run(cuda(0))[4], g[4], "dbias run to run"));
}

// The same pair on 16-bit storage (the NVRTC kernels on __nv_bfloat16 / __half, f32 math), on a
// stream that is not the device's compute stream (the launches follow the thread's current
// stream, with no device synchronisation): against the CPU's run-time kernels on the same
// 16-bit inputs, within the storage's rounding.
TEST(JitNvrtc, RuntimeModsOn16BitStorageOnTheCurrentStreamMatchTheCpu) {
  if (cuda_device_count() == 0)
    GTEST_SKIP() << "no CUDA device (the lead runs this on the H200: ctest -R JitNvrtc)";
  test::use_shared_jit_cache();
  KILN_TEST_GENERATOR(gen);
  const int64_t B = 1, Hq = 4, Hkv = 2, L = 70, E = 24;
  Tensor slopes = mul(rand({Hq}, gen), 0.2);
  const std::string expr = "score + slopes[h] * (kv_idx - q_idx)";
  const attention::RuntimeMaskMod mm{"q_idx >= kv_idx && q_idx - kv_idx < 33"};
  for (DType dt : {DType::bf16, DType::f16}) {
    Tensor q = randn({B, Hq, L, E}, gen).to(dt), k = randn({B, Hkv, L, E}, gen).to(dt),
           v = randn({B, Hkv, L, E}, gen).to(dt), dout = randn({B, Hq, L, E}, gen).to(dt);
    auto run = [&](Device d) {
      const attention::RuntimeScoreMod sm{expr, {{"slopes", slopes.to(d)}}};
      // detach: on the CPU, to() returns the tensor itself, which the first run then leaves with a grad
      Tensor qd = q.to(d).detach().requires_grad_(true), kd = k.to(d).detach().requires_grad_(true),
             vd = v.to(d).detach().requires_grad_(true);
      attention::FlexOptions opt;
      opt.return_lse = true;
      auto r = attention::flex_attention(qd, kd, vd, sm, attention::create_block_mask(mm, 1, 1, L, L, 32, 32, d), opt);
      r.out.backward(dout.to(d));
      return std::vector<Tensor>{r.out.to(kCPU).to(DType::f32), r.lse.to(kCPU), qd.grad().to(kCPU).to(DType::f32),
                                 kd.grad().to(kCPU).to(DType::f32), vd.grad().to(kCPU).to(DType::f32)};
    };
    const auto c = run(kCPU);
    std::vector<Tensor> g;
    {
      const Stream side = get_stream(cuda(0), StreamKind::side);
      StreamGuard guard(side);
      g = run(cuda(0));
    }
    const char* names[] = {"out", "lse", "dq", "dk", "dv"};
    for (size_t i = 0; i < c.size(); ++i)
      EXPECT_TRUE(test::all_close(g[i], c[i], {3e-2, 3e-2}, (std::string(dtype_name(dt)) + " " + names[i]).c_str()));
  }
}

}  // namespace
