// The real NCCL backend at world size 1 on one GPU: every operation runs on the device's
// communication stream and is checked against its input (the reduction of one rank), for every
// reducible dtype; split; and the communicator is finalized cleanly. Skips, saying why, in a
// build without CUDA or on a machine without a GPU. Run on the GPU machine:
//   ctest --test-dir build/cuda -R NcclGpu --output-on-failure
#include <gtest/gtest.h>

#include "kiln/core/device.h"
#include "kiln/dist/backends.h"
#include "kiln/ops/ops.h"

using namespace kiln;
using namespace kiln::dist;

TEST(NcclGpu, SingleRankEveryOperation) {
#ifndef KILN_CUDA
  GTEST_SKIP() << "built without CUDA: the NCCL backend is not in this build";
#else
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device visible";
  StoreServerOptions so;
  so.token = "nccl-test";
  so.quiet = true;
  StoreServer server(so);
  auto store = std::make_shared<TcpStore>("127.0.0.1", server.port(), "nccl-test");
  DistEnv env;  // rank 0 of 1, GPU 0
  CommOptions opt;
  opt.timeout = std::chrono::seconds(60);
  opt.watchdog_interval = std::chrono::milliseconds(5);
  opt.abort_process = false;
  auto c = new_nccl_world(store, env, "gpu_world", opt);
  ASSERT_EQ(c->size(), 1);
  const DType dtypes[] = {DType::f32, DType::bf16, DType::f16, DType::f64, DType::i32, DType::i64, DType::u8};
  const ReduceOp ops[] = {ReduceOp::sum, ReduceOp::avg, ReduceOp::min, ReduceOp::max, ReduceOp::product};
  for (DType dt : dtypes)
    for (ReduceOp op : ops) {
      if (op == ReduceOp::avg && !is_floating(dt)) continue;
      std::vector<double> v;
      for (int i = 0; i < 37; ++i) v.push_back(i % 5);
      const Tensor host = from_vector<double>(v, {37}).to(dt);
      Tensor t = host.to(cuda(0));
      c->all_reduce(t, op)->wait();
      EXPECT_EQ(t.to(kCPU).to(DType::f64).to_vector<double>(), host.to(DType::f64).to_vector<double>())
          << dtype_name(dt) << " " << reduce_op_name(op);
      Tensor out = Tensor::empty({37}, dt, cuda(0));
      c->reduce_scatter_single(out, host.to(cuda(0)), op)->wait();
      EXPECT_EQ(out.to(kCPU).to(DType::f64).to_vector<double>(), host.to(DType::f64).to_vector<double>());
    }
  const Tensor src = arange(0.0, 64.0, 1.0, DType::f32).to(cuda(0));
  Tensor g = Tensor::empty({64}, DType::f32, cuda(0));
  c->all_gather_single(g, src)->wait();
  EXPECT_EQ(g.to(kCPU).to_vector<float>(), src.to(kCPU).to_vector<float>());
  Tensor a = Tensor::empty({64}, DType::f32, cuda(0));
  c->all_to_all_single(a, src)->wait();
  EXPECT_EQ(a.to(kCPU).to_vector<float>(), src.to(kCPU).to_vector<float>());
  Tensor b = src.clone();
  c->broadcast(b, 0)->wait();
  EXPECT_EQ(b.to(kCPU).to_vector<float>(), src.to(kCPU).to_vector<float>());
  c->barrier()->wait();
  auto solo = c->split({0}, "solo");
  Tensor s = src.clone();
  solo->all_reduce(s, ReduceOp::max)->wait();
  EXPECT_EQ(s.to(kCPU).to_vector<float>(), src.to(kCPU).to_vector<float>());
  // Several in flight, then waited.
  std::vector<Tensor> ts;
  std::vector<WorkPtr> ws;
  for (int i = 0; i < 8; ++i) {
    ts.push_back(src.clone());
    ws.push_back(c->all_reduce(ts.back(), ReduceOp::sum));
  }
  for (auto& w : ws) w->wait();
  for (auto& t : ts) EXPECT_EQ(t.to(kCPU).to_vector<float>(), src.to(kCPU).to_vector<float>());
#endif
}
