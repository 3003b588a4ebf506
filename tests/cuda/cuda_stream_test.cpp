// Streams on a real GPU: ops launch on the thread's current stream (a StreamGuard's, else the
// compute stream), the caching allocator pools blocks per stream, and a block recorded as used
// on another stream (Storage::record_stream) is not handed out again before that stream's work
// is done; the profiler's events time work on the current stream. Skipped without a GPU.
#include <random>

#include "kiln/core/allocator.h"
#include "kiln/core/profile.h"
#include "kiln/core/rng.h"
#include "kiln/core/stream.h"
#include "kiln/core/switches.h"
#include "tests/cuda/cuda_test_util.h"

using namespace kiln;
using namespace kiln::test;

namespace {
// Work that keeps the current stream busy for milliseconds: f32 products of 4096² (137 GFLOP
// each).
Tensor busy_work(const Tensor& x, int rounds) {
  Tensor y = x;
  for (int i = 0; i < rounds; ++i) y = matmul(y, x) * 1e-3;
  return y;
}
}  // namespace

TEST(CudaStreams, OpsRunOnTheGuardedStream) {
  KILN_SKIP_WITHOUT_CUDA();
  const Device d = gpu();
  Generator gen(static_cast<uint64_t>(std::random_device{}()));
  Tensor x = randn({4096, 4096}, gen, DType::f32, d);
  const Stream compute = get_stream(d, StreamKind::compute);
  const Stream side = get_stream(d, StreamKind::side);
  EXPECT_EQ(current_stream(d), compute);
  set_deterministic(true);  // the two runs below compare bits
  synchronize(compute);
  Tensor y;
  {
    StreamGuard on(side);
    EXPECT_EQ(current_stream(d), side);
    y = busy_work(x, 12);
    Event on_side, on_compute;
    on_side.record(side);
    on_compute.record(compute);
    EXPECT_FALSE(on_side.query()) << "the products should still be running on the side stream";
    EXPECT_TRUE(on_compute.query()) << "nothing was queued on the compute stream";
    synchronize(side);
  }
  EXPECT_EQ(current_stream(d), compute);
  // The same products on the compute stream give the same bits.
  Tensor z = busy_work(x, 12);
  set_deterministic(false);
  EXPECT_TRUE(same_bits(y.to(kCPU), z.to(kCPU), "products on the side and the compute stream"));
}

TEST(CudaStreams, BlocksAreReusedOnTheirOwnStreamAndRecordStreamDefersReuse) {
  KILN_SKIP_WITHOUT_CUDA();
  const Device d = gpu();
  const Stream compute = get_stream(d, StreamKind::compute);
  const Stream side = get_stream(d, StreamKind::side);
  const int64_t n = (3 << 20) / 4;  // 3 MiB of f32: a block of its own size class
  void* p = nullptr;
  {
    StreamGuard on(side);
    p = Tensor::empty({n}, DType::f32, d).data_ptr();  // freed at once: back to the side pool
  }
  {
    Tensor t = Tensor::empty({n}, DType::f32, d);  // the compute stream's pool has no such block
    EXPECT_NE(t.data_ptr(), p);
  }
  {
    StreamGuard on(side);
    EXPECT_EQ(Tensor::empty({n}, DType::f32, d).data_ptr(), p);
  }

  Generator gen(static_cast<uint64_t>(std::random_device{}()));
  Tensor x = randn({4096, 4096}, gen, DType::f32, d);
  synchronize(compute);
  Tensor a = Tensor::empty({n}, DType::f32, d);  // the compute stream's block
  void* pa = a.data_ptr();
  Tensor y;
  {
    StreamGuard on(side);
    wait_stream(side, compute);
    y = busy_work(x, 12);
    a.storage()->record_stream(side);  // the side stream's queued work uses a (as if it read it)
  }
  const int64_t pending_before = memory_stats(d).current_bytes;
  a = Tensor();  // freed while the side stream is still busy
  EXPECT_EQ(memory_stats(d).current_bytes, pending_before - n * 4);
  Tensor b = Tensor::empty({n}, DType::f32, d);  // kept: the pool then holds only a's block
  EXPECT_NE(b.data_ptr(), pa) << "a block used on the side stream was handed out before its work finished";
  synchronize(side);
  Tensor c = Tensor::empty({n}, DType::f32, d);
  EXPECT_EQ(c.data_ptr(), pa) << "the block should be back in the compute stream's pool once the side stream is done";
}

TEST(CudaStreams, TheProfilerTimesWorkOnTheCurrentStream) {
  KILN_SKIP_WITHOUT_CUDA();
  const Device d = gpu();
  Generator gen(static_cast<uint64_t>(std::random_device{}()));
  Tensor x = randn({4096, 4096}, gen, DType::f32, d);
  const Stream side = get_stream(d, StreamKind::side);
  profile::Profiler prof;
  {
    StreamGuard on(side);
    profile::Session s(prof);
    (void)busy_work(x, 10);
  }
  double matmul_ms = 0;
  int64_t matmuls = 0;
  for (const auto& e : profile::by_kernel(prof.entries())) {
    if (e.name.find("matmul") == std::string::npos && e.name.find("gemm") == std::string::npos) continue;
    EXPECT_TRUE(e.device_time) << e.name;
    matmul_ms += e.total_ms;
    matmuls += e.count;
  }
  EXPECT_GE(matmuls, 10) << prof.table();
  // Ten f32 products of 4096³ (1.4 TFLOP) take well over a millisecond on any GPU; events
  // recorded on a stream the work did not run on would time (almost) nothing.
  EXPECT_GT(matmul_ms, 1.0) << prof.table();
}
