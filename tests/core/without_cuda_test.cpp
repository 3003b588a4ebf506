// A build without CUDA: the CUDA-only entry points the front ends call directly (their bodies in
// kernels/cuda/direct_stub.cpp) and the GPU BlockMask builder say that kiln was built without
// CUDA, by name, instead of failing to link or crashing. Skipped in a CUDA build (the real
// bodies run there, under tests/cuda).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "kiln/attention/flex_attention.h"
#include "kiln/core/device.h"
#include "kiln/core/error.h"
#include "kiln/kernels/copy.h"
#include "kiln/kernels/flex_files.h"
#include "kiln/kernels/lce.h"
#include "kiln/kernels/nn.h"
#include "kiln/ops/ops.h"

using namespace kiln;

namespace {
template <class F>
void expect_no_cuda(F&& f, const std::string& name) {
  try {
    f();
    ADD_FAILURE() << name << ": expected kiln::Error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(name), std::string::npos) << msg;
    EXPECT_NE(msg.find("built without CUDA"), std::string::npos) << msg;
  }
}
}  // namespace

TEST(WithoutCuda, CudaOnlyEntryPointsNameThemselvesAndTheMissingBuild) {
  if (cuda_built()) GTEST_SKIP() << "a CUDA build has the real bodies";
  EXPECT_EQ(kernels::cuda::flex_builtin_files(), 0);
  std::vector<char> host(16), other(16);
  expect_no_cuda([&] { kernels::cuda::copy_host_to_device(other.data(), host.data(), 16, 0); },
                 "copy_host_to_device");
  expect_no_cuda([&] { kernels::cuda::copy_device_to_host(host.data(), other.data(), 16, 0); },
                 "copy_device_to_host");
  expect_no_cuda([&] { kernels::cuda::copy_device_to_device(other.data(), 0, host.data(), 1, 16); },
                 "copy_device_to_device");
  Tensor ids = zeros({4}, DType::i64);
  expect_no_cuda([&] { kernels::cuda::defer_range_check(ids, 0, 3, -100, "ids", ""); }, "defer_range_check");
  Tensor x = ones({3}, DType::f32);
  expect_no_cuda([&] { kernels::cuda::lce_scale(x, ones({}, DType::f32)); }, "lce_scale");
  // The front ends never get there: a GPU tensor cannot be made, and the GPU BlockMask builder
  // finds no registered body.
  EXPECT_THROW(x.to(cuda(0)), Error);
  attention::MaskSpec causal;
  causal.kind = attention::MaskSpec::Kind::causal;
  expect_no_cuda([&] { (void)attention::create_block_mask(causal, 256, 256, cuda(0)); }, "create_block_mask");
}
