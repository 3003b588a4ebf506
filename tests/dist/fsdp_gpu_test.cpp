// FSDP on GPUs over NCCL. One GPU, in this process: a one-rank NCCL world runs fully_shard on
// CUDA tensors with the bits of the unsharded CUDA run, and bf16 gathers with f32 reductions
// stay close to it. Two GPUs (where visible), real processes through kiln launch: the ranks
// (FsdpWorker.Run, KILN_FSDP_BACKEND=nccl) follow the unsharded single-GPU run. Skips, saying
// why, in a build without CUDA or with too few GPUs. On the GPU machine:
//   build/cuda/kiln_test_dist --gtest_filter='FsdpGpu.*'
#include <algorithm>
#include <cmath>
#include <filesystem>

#include <gtest/gtest.h>

#include "kiln/core/device.h"
#include "kiln/dist/store.h"
#include "kiln/parallel/dcp.h"
#include "kiln/io/safetensors.h"
#include "tests/dist/dist_test_util.h"
#include "tests/dist/fsdp_harness.h"

using namespace kiln;
using namespace kiln::parallel;
using namespace kiln::parallel::test;

#ifdef KILN_CUDA
namespace {
struct NcclWorldOfOne {
  dist::test::LocalStore local{"fsdp-gpu"};
  std::shared_ptr<dist::Communicator> comm;
  NcclWorldOfOne() {
    dist::CommOptions opt;
    opt.timeout = std::chrono::seconds(60);
    opt.abort_process = false;
    comm = dist::new_nccl_world(local.store, dist::DistEnv{}, "fsdp_gpu", opt);
  }
};
}  // namespace
#endif

TEST(FsdpGpu, OneGpuIsBitwiseTheUnshardedRunAndBf16StaysClose) {
#ifndef KILN_CUDA
  GTEST_SKIP() << "built without CUDA: the NCCL backend is not in this build";
#else
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device visible";
  set_deterministic(true);
  const RunResult ref = train_plain(3, 2, tiny_config(), cuda(0));
  NcclWorldOfOne w;
  ShardedRun run = make_sharded(w.comm, {}, tiny_config(), cuda(0));
  const std::vector<double> losses = train_sharded(run, 0, 3, 2);
  for (size_t i = 0; i < losses.size(); ++i) EXPECT_EQ(losses[i], ref.losses[i]) << "step " << i;
  for (const auto& [n, t] : ref.params) {
    const Tensor got = run.fsdp->full_tensor(n).to(kCPU);
    EXPECT_EQ(got.to_vector<float>(), t.to_vector<float>()) << n;
  }
  EXPECT_EQ(run.fsdp->stats().gathered_bytes, 0);
  // A sharded checkpoint over NCCL (its all-or-nothing flags are CUDA tensors: a CPU flag was
  // refused by the NCCL backend at the end of every `kiln train --device cuda` of several ranks).
  const std::string ck_root = dist::test::fresh_test_dir("gpu_ckpt"), ck = ck_root + "/step-3";
  save_checkpoint(ck, *run.fsdp, *run.opt);
  const std::vector<std::pair<std::string, Tensor>> saved = load_full(ck);
  for (const auto& [n, t] : ref.params) {
    auto it = std::find_if(saved.begin(), saved.end(), [&](const auto& e) { return e.first == n; });
    ASSERT_NE(it, saved.end()) << "the checkpoint lacks " << n;
    EXPECT_EQ(it->second.to(kCPU).to_vector<float>(), t.to_vector<float>()) << "saved " << n;
  }
  std::filesystem::remove_all(ck_root);
  FsdpOptions o;
  o.mixed_precision.param_dtype = DType::bf16;
  o.mixed_precision.reduce_dtype = DType::f32;
  ShardedRun mp = make_sharded(w.comm, o, tiny_config(), cuda(0));
  const std::vector<double> mp_losses = train_sharded(mp, 0, 3, 1);
  for (size_t i = 0; i < mp_losses.size(); ++i)
    EXPECT_NEAR(mp_losses[i], ref.losses[i], 3e-2 * std::abs(ref.losses[i])) << "bf16 step " << i;
  set_deterministic(false);
#endif
}

TEST(FsdpGpu, TwoGpusFollowTheUnshardedRun) {
#ifndef KILN_CUDA
  GTEST_SKIP() << "built without CUDA: the NCCL backend is not in this build";
#else
  if (cuda_device_count() < 2) GTEST_SKIP() << "fewer than 2 CUDA devices visible";
  const std::string out = ::testing::TempDir() + "kiln_fsdp_gpu2";
  std::filesystem::remove_all(out);
  std::filesystem::create_directories(out);
  const auto r = dist::test::run_command(
      "env KILN_FSDP_CASE=train KILN_FSDP_BACKEND=nccl KILN_FSDP_STEPS=4 KILN_FSDP_OUT=" + out + " " +
          dist::test::kiln_cli() + " launch --nproc-per-node 2 --master-port 0 --term-grace 1 -- " +
          dist::test::self_exe() + " --gtest_filter=FsdpWorker.Run --gtest_brief=1",
      180);
  ASSERT_EQ(r.status, 0) << r.output;
  const RunResult ref = train_plain(4, 1, tiny_config(), cuda(0));
  io::TensorMap got = io::load_safetensors(out + "/train.safetensors");
  io::materialize(got);
  for (const auto& [n, t] : got) {
    if (n == "losses") {
      const auto g = t.to_vector<double>();
      for (size_t i = 0; i < g.size(); ++i) EXPECT_NEAR(g[i], ref.losses[i], 1e-5 * std::abs(ref.losses[i])) << i;
      continue;
    }
    for (const auto& [rn, rt] : ref.params)
      if (rn == n) {
        const auto a = t.to_vector<float>(), b = rt.to_vector<float>();
        double worst = 0;
        for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(static_cast<double>(a[i]) - b[i]));
        EXPECT_LE(worst, 1e-5) << n;
      }
  }
#endif
}
