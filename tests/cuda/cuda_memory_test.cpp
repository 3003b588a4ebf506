// The CUDA caching allocator on a real GPU: exact current/peak counters (requested bytes) for a
// known sequence, reuse without cudaMalloc in a steady-state loop, empty_cache, and the
// device queries (device count, list_cuda_devices, contexts).
#include "kiln/core/allocator.h"
#include "kiln/core/device_info.h"
#include "kiln/core/rng.h"
#include "tests/cuda/cuda_test_util.h"

using namespace kiln;
using namespace kiln::test;

TEST(CudaMemory, KnownSequenceGivesExactCounters) {
  KILN_SKIP_WITHOUT_CUDA();
  const Device d = gpu();
  MemoryStats s0 = memory_stats(d);
  reset_peak_memory_stats(d);
  {
    Tensor a = Tensor::empty({1000}, DType::f32, d);     // 4000 bytes
    Tensor b = Tensor::empty({3, 333}, DType::bf16, d);  // 1998 bytes
    MemoryStats s = memory_stats(d);
    EXPECT_EQ(s.current_bytes - s0.current_bytes, 5998);
    EXPECT_EQ(s.peak_bytes - s0.current_bytes, 5998);
    EXPECT_EQ(s.num_allocs - s0.num_allocs, 2);
    EXPECT_GE(s.reserved_bytes, s.current_bytes);
    a = Tensor();
    s = memory_stats(d);
    EXPECT_EQ(s.current_bytes - s0.current_bytes, 1998);
    EXPECT_EQ(s.peak_bytes - s0.current_bytes, 5998);
    Tensor c = Tensor::empty({10}, DType::i64, d);  // 80 bytes
    s = memory_stats(d);
    EXPECT_EQ(s.current_bytes - s0.current_bytes, 2078);
    EXPECT_EQ(s.peak_bytes - s0.current_bytes, 5998);
  }
  EXPECT_EQ(memory_stats(d).current_bytes, s0.current_bytes);
  // A view shares storage: no allocation.
  Tensor x = Tensor::empty({64, 64}, DType::f32, d);
  int64_t allocs = memory_stats(d).num_allocs;
  Tensor v = x.t().slice(0, 1, 9);
  EXPECT_EQ(memory_stats(d).num_allocs, allocs);
}

TEST(CudaMemory, SteadyStateLoopMakesNoSystemAllocations) {
  KILN_SKIP_WITHOUT_CUDA();
  const Device d = gpu();
  Generator gen(1);
  Tensor w = randn({256, 512}, gen, DType::f32, d).requires_grad_();
  auto step = [&] {
    Tensor x = randn({64, 256}, gen, DType::f32, d);
    Tensor loss = sum(softmax(silu(matmul(x, w)), -1));
    loss.backward();
    w.grad().zero_();
  };
  step();
  step();
  MemoryStats warm = memory_stats(d);
  for (int i = 0; i < 20; ++i) step();
  MemoryStats after = memory_stats(d);
  EXPECT_EQ(after.num_system_allocs, warm.num_system_allocs) << "cudaMalloc called in the steady state";
  EXPECT_EQ(after.reserved_bytes, warm.reserved_bytes);
  EXPECT_EQ(after.current_bytes, warm.current_bytes);
  EXPECT_GT(after.num_allocs, warm.num_allocs);
}

TEST(CudaMemory, EmptyCacheReleasesCachedBlocks) {
  KILN_SKIP_WITHOUT_CUDA();
  const Device d = gpu();
  empty_cache(d);
  MemoryStats s0 = memory_stats(d);
  { Tensor big = Tensor::empty({64 << 20}, DType::u8, d); }
  MemoryStats cached = memory_stats(d);
  EXPECT_EQ(cached.current_bytes, s0.current_bytes);
  EXPECT_EQ(cached.reserved_bytes - s0.reserved_bytes, 64 << 20);
  EXPECT_EQ(cached.num_system_allocs - s0.num_system_allocs, 1);
  { Tensor again = Tensor::empty({64 << 20}, DType::u8, d); }  // reused
  EXPECT_EQ(memory_stats(d).num_system_allocs, cached.num_system_allocs);
  empty_cache(d);
  EXPECT_EQ(memory_stats(d).reserved_bytes, s0.reserved_bytes);
}

TEST(CudaMemory, OutOfMemoryIsAnError) {
  KILN_SKIP_WITHOUT_CUDA();
  const Device d = gpu();
  MemoryStats s0 = memory_stats(d);
  try {
    Tensor huge = Tensor::empty({int64_t(1) << 50}, DType::u8, d);  // 1 PiB
    FAIL() << "expected kiln::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("out of memory"), std::string::npos) << e.what();
  }
  EXPECT_EQ(memory_stats(d).current_bytes, s0.current_bytes);
  // The device still works afterwards.
  EXPECT_EQ(ones({3}, DType::f32, d).to_vector<float>(), (std::vector<float>{1, 1, 1}));
}

TEST(CudaDevices, ListAndCount) {
  int n = cuda_device_count();
#ifdef KILN_CUDA
  EXPECT_TRUE(cuda_built());
#else
  EXPECT_FALSE(cuda_built());
  EXPECT_EQ(n, 0);  // the CPU-only build (core/cuda/runtime_stub.cpp)
#endif
  auto devs = list_cuda_devices();
  EXPECT_EQ(static_cast<int>(devs.size()), n);
  for (const auto& info : devs) {
    EXPECT_TRUE(info.device.is_cuda());
    EXPECT_FALSE(info.name.empty());
    EXPECT_GT(info.memory_total_bytes, 0);
    ASSERT_TRUE(info.compute_capability.has_value());
    EXPECT_GE(std::stoi(*info.compute_capability), 90) << "kiln's kernels target sm_90a";
  }
  if (n == 0) {
    EXPECT_THROW(zeros({2}, DType::f32, gpu()), Error);
  }
}
