// The NCCL backend with real processes, one GPU per rank (kiln launch; each rank takes the GPU of
// its LOCAL_RANK), at world sizes 1, 2, 4 and 8 where that many GPUs are visible (NCCL refuses
// two ranks of one communicator on one GPU, so a case skips, saying so, when there are fewer):
// every collective x NCCL dtype x reduction against a float64 reference (odd sizes, in place),
// send/recv, split, several operations in flight on two communicators; a rank that sleeps past
// the timeout (the others name the op and the rank, exit 70, write flight-recorder dumps that
// kiln comms analyze reads); a rank killed by SIGKILL under abort and under shrink (the survivors
// go on as a smaller communicator whose collectives are correct). The ranks are NcclRank.Run of
// this same program. Run on a machine with GPUs (scripts/gpu-dist-session does, per world size):
//   build/cuda/kiln_test_dist --gtest_filter='*NcclWorld*/np2'
// KILN_TEST_BACKEND=gloo runs every case over Gloo on CPU tensors instead (no GPU needed): how
// the cases themselves are checked on a CPU machine.
// KILN_NCCL_LOG_DIR=DIR keeps each fault case's launcher log folder under DIR (default: the test
// temp folder).
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include "kiln/core/device.h"
#include "kiln/ops/ops.h"
#include "tests/dist/dist_test_util.h"

using namespace kiln;
using namespace kiln::dist;
using namespace kiln::dist::test;

namespace {

// ---- the rank side ----

const DType kNcclReduceDtypes[] = {DType::f32, DType::bf16, DType::f16, DType::f64, DType::i32, DType::i64, DType::u8};
const ReduceOp kNcclOps[] = {ReduceOp::sum, ReduceOp::avg, ReduceOp::min, ReduceOp::max, ReduceOp::product};

// KILN_TEST_BACKEND=gloo runs the same rank cases over Gloo on CPU tensors: how the cases
// themselves (references, orders, expected messages) are checked on a machine without GPUs.
std::string backend() {
  const char* b = std::getenv("KILN_TEST_BACKEND");
  return b && *b ? b : "nccl";
}
Device my_gpu() { return backend() == "gloo" ? kCPU : cuda(DistEnv::from_env().local_rank); }

// Element i of rank r's input in case k: small integers, exact in every dtype and in every
// summation order. Products: 2 on one rank per element and +-1 elsewhere, so 8 ranks stay
// exact (and inside u8).
// The run's seed (KILN_TEST_SEED, fresh per test run) shifts every value.
int64_t seed() {
  const char* s = std::getenv("KILN_TEST_SEED");
  return s ? std::atoll(s) % 1000003 : 0;
}

double elem(int r, int w, int64_t i, int k, DType dt, ReduceOp op) {
  const int64_t h = (r * 37 + i * 13 + k * 5 + seed()) % 7;
  if (op == ReduceOp::product) {
    if ((i + k) % w == r) return 2;
    return dt == DType::u8 || h % 3 ? 1 : -1;
  }
  return dt == DType::u8 ? static_cast<double>(h % 4) : static_cast<double>(h - 3);
}

Tensor on_gpu(const std::vector<double>& v, DType dt) {
  return from_vector<double>(v, {static_cast<int64_t>(v.size())}).to(dt).to(my_gpu());
}

std::vector<double> inputs(int r, int w, int64_t from, int64_t n, int k, DType dt, ReduceOp op) {
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = elem(r, w, from + i, k, dt, op);
  return v;
}

// The serial float64 reduction over every rank of elements [from, from + n).
std::vector<double> reference(int w, int64_t from, int64_t n, int k, DType dt, ReduceOp op) {
  std::vector<double> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    double acc = elem(0, w, from + i, k, dt, op);
    for (int r = 1; r < w; ++r) {
      const double x = elem(r, w, from + i, k, dt, op);
      acc = op == ReduceOp::product ? acc * x : op == ReduceOp::min ? std::min(acc, x)
          : op == ReduceOp::max ? std::max(acc, x) : acc + x;
    }
    out[static_cast<size_t>(i)] = op == ReduceOp::avg ? acc / w : acc;
  }
  return out;
}

void nccl_reductions(Communicator& c) {
  const int R = c.rank(), W = c.size();
  const int64_t sizes[] = {0, 1, 7, 33, 40001};
  int k = 0;
  for (DType dt : kNcclReduceDtypes)
    for (ReduceOp op : kNcclOps) {
      if (op == ReduceOp::avg && !is_floating(dt)) continue;
      for (int64_t n : sizes) {
        ++k;
        const std::string tag = std::string(dtype_name(dt)) + " " + reduce_op_name(op) + " n=" + std::to_string(n);
        Tensor t = on_gpu(inputs(R, W, 0, n, k, dt, op), dt);
        c.all_reduce(t, op)->wait();
        EXPECT_TRUE(matches_reference(t, reference(W, 0, n, k, dt, op), dt, "all_reduce " + tag));
        // reduce_scatter: rank R keeps elements [R n, (R + 1) n) of the W n reduced; then in place.
        const std::vector<double> want = reference(W, R * n, n, k, dt, op);
        Tensor out = Tensor::empty({n}, dt, my_gpu());
        c.reduce_scatter_single(out, on_gpu(inputs(R, W, 0, W * n, k, dt, op), dt), op)->wait();
        EXPECT_TRUE(matches_reference(out, want, dt, "reduce_scatter " + tag));
        Tensor whole = on_gpu(inputs(R, W, 0, W * n, k, dt, op), dt);
        Tensor mine = whole.narrow(0, R * n, n);
        c.reduce_scatter_single(mine, whole, op)->wait();
        EXPECT_TRUE(matches_reference(mine, want, dt, "reduce_scatter in place " + tag));
      }
    }
}

void nccl_data_movement(Communicator& c) {
  const int R = c.rank(), W = c.size();
  const DType dtypes[] = {DType::f32, DType::bf16, DType::f16, DType::f64, DType::i32,
                          DType::i64, DType::u8, DType::i16, DType::i8, DType::boolean};
  const int64_t sizes[] = {0, 1, 7, 33, 40001};
  int k = 0;
  for (DType dt : dtypes)
    for (int64_t n : sizes) {
      ++k;
      const std::string tag = std::string(dtype_name(dt)) + " n=" + std::to_string(n);
      // Values of (sender, receiver, element), in range for every dtype.
      auto vals = [&](int from, int to, int64_t m) {
        std::vector<double> v(static_cast<size_t>(m));
        for (int64_t i = 0; i < m; ++i)
          v[static_cast<size_t>(i)] = dt == DType::boolean ? (from + to + i + k + seed()) % 2 : (from * 7 + to * 3 + i + k + seed()) % 17;
        return v;
      };
      std::vector<double> gathered, sent, received;
      for (int j = 0; j < W; ++j) {
        const auto g = vals(j, 0, n), s = vals(R, j, n), r = vals(j, R, n);
        gathered.insert(gathered.end(), g.begin(), g.end());
        sent.insert(sent.end(), s.begin(), s.end());
        received.insert(received.end(), r.begin(), r.end());
      }
      Tensor out = Tensor::empty({W * n}, dt, my_gpu());
      c.all_gather_single(out, on_gpu(vals(R, 0, n), dt))->wait();
      EXPECT_TRUE(matches_reference(out, gathered, dt, "all_gather " + tag));
      Tensor in_place = on_gpu(std::vector<double>(static_cast<size_t>(W * n), 0.0), dt);
      in_place.narrow(0, R * n, n).copy_(on_gpu(vals(R, 0, n), dt));
      c.all_gather_single(in_place, in_place.narrow(0, R * n, n))->wait();
      EXPECT_TRUE(matches_reference(in_place, gathered, dt, "all_gather in place " + tag));
      Tensor a2a = Tensor::empty({W * n}, dt, my_gpu());
      c.all_to_all_single(a2a, on_gpu(sent, dt))->wait();
      EXPECT_TRUE(matches_reference(a2a, received, dt, "all_to_all " + tag));
      Tensor b = on_gpu(R == W - 1 ? vals(W - 1, 0, n) : std::vector<double>(static_cast<size_t>(n), 0.0), dt);
      c.broadcast(b, W - 1)->wait();
      EXPECT_TRUE(matches_reference(b, vals(W - 1, 0, n), dt, "broadcast " + tag));
    }
  // send / recv around the ring: even ranks send first, odd ranks receive first (a ring of
  // blocking point-to-point kernels in one order on every rank would deadlock).
  if (W > 1 && W % 2 == 0) {
    Tensor s = on_gpu(inputs(R, W, 0, 1001, 99, DType::f32, ReduceOp::sum), DType::f32);
    Tensor r = Tensor::empty({1001}, DType::f32, my_gpu());
    if (R % 2 == 0) {
      c.send(s, (R + 1) % W)->wait();
      c.recv(r, (R + W - 1) % W)->wait();
    } else {
      c.recv(r, (R + W - 1) % W)->wait();
      c.send(s, (R + 1) % W)->wait();
    }
    EXPECT_TRUE(matches_reference(r, inputs((R + W - 1) % W, W, 0, 1001, 99, DType::f32, ReduceOp::sum), DType::f32,
                                  "send/recv"));
  }
  c.barrier()->wait();
}

void nccl_in_flight(Communicator& world) {
  const int R = world.rank(), W = world.size();
  std::vector<int> reversed;
  for (int r = W - 1; r >= 0; --r) reversed.push_back(r);
  auto other = world.split(reversed, "reversed");
  EXPECT_EQ(other->rank(), W - 1 - R);
  std::vector<Tensor> a, b;
  std::vector<WorkPtr> works;
  for (int i = 0; i < 8; ++i) {
    a.push_back(on_gpu(std::vector<double>(4099, R + i), DType::f32));
    works.push_back(world.all_reduce(a.back(), ReduceOp::sum));
    b.push_back(on_gpu(std::vector<double>(5, other->rank() * 10 + i), DType::i64));
    works.push_back(other->all_reduce(b.back(), ReduceOp::max));
  }
  for (auto& w : works) w->wait();
  for (int i = 0; i < 8; ++i) {
    EXPECT_TRUE(
        matches_reference(a[i], std::vector<double>(4099, W * (W - 1) / 2.0 + W * i), DType::f32, "in flight world"));
    EXPECT_TRUE(matches_reference(b[i], std::vector<double>(5, (W - 1) * 10 + i), DType::i64, "in flight reversed"));
  }
  // Two disjoint groups split under one name (the even ranks and the odd ones).
  std::vector<int> parity;
  double want = 0;
  for (int r = R % 2; r < W; r += 2) parity.push_back(r), want += r;
  auto sub = world.split(parity, "parity");
  EXPECT_EQ(sub->rank(), R / 2);
  Tensor t = on_gpu({static_cast<double>(R)}, DType::f64);
  sub->all_reduce(t, ReduceOp::sum)->wait();
  EXPECT_TRUE(matches_reference(t, {want}, DType::f64, "split by parity"));
  world.barrier()->wait();
}

// Rank 1 sleeps past the timeout, or dies by SIGKILL, at all_reduce #4 of 'world'. #1 is a warm-up
// with a long timeout of its own: NCCL connects its peers in the first operation, and the
// operation's clock runs meanwhile.
void nccl_fault(Communicator& world, bool kill_it) {
  Tensor warm = on_gpu({1.0}, DType::f32);
  world.all_reduce(warm, ReduceOp::sum, CallOptions{Millis(120000)})->wait();
  for (int i = 1; i <= 3; ++i) {
    if (world.rank() == 1 && i == 3) {
      if (kill_it) kill(getpid(), SIGKILL);
      std::this_thread::sleep_for(std::chrono::seconds(15));
      return;
    }
    Tensor t = on_gpu({1.0, 2.0, 3.0}, DType::f32);
    try {
      world.all_reduce(t, ReduceOp::sum)->wait();
    } catch (const PeerLost& e) {
      std::printf("PeerLost: %s\n", e.what());
      auto next = e.communicator();
      std::printf("survivor: old rank %d new rank %d of %d generation %d\n", world.rank(), next->rank(),
                  next->size(), next->generation());
      for (int j = 0; j < 3; ++j) {
        Tensor u = on_gpu({static_cast<double>(next->rank()), 1.0}, DType::f64);
        next->all_reduce(u, ReduceOp::sum)->wait();
        const int n = next->size();
        EXPECT_TRUE(matches_reference(u, {n * (n - 1) / 2.0, static_cast<double>(n)}, DType::f64, "after shrink"));
      }
      EXPECT_THROW(world.barrier(), PeerLost) << "the old communicator accepted an op";
      std::printf("survivor ok\n");
      std::fflush(stdout);
      return;
    }
  }
}

// ---- the test side ----

// Why n ranks cannot run here, or "" when they can.
std::string missing_gpus([[maybe_unused]] int n) {
  if (backend() == "gloo") return have_gloo() ? "" : "KILN_TEST_BACKEND=gloo: built without Gloo";
#ifndef KILN_CUDA
  return "built without CUDA: the NCCL backend is not in this build";
#else
  const int have = cuda_device_count();
  if (have >= n) return "";
  return std::to_string(n) + " ranks need " + std::to_string(n) + " GPUs, " + std::to_string(have) +
         " visible (NCCL refuses two ranks of one communicator on one GPU)";
#endif
}
#define KILN_SKIP_WITHOUT_GPUS(n)                                \
  if (const std::string why = missing_gpus(n); !why.empty()) { \
    GTEST_SKIP() << why;                                         \
  }

std::string log_dir(const std::string& name, int n) {
  const char* keep = std::getenv("KILN_NCCL_LOG_DIR");
  const std::string d = (keep && *keep ? std::string(keep) + "/" : ::testing::TempDir()) + "nccl_" + name + "_np" +
                        std::to_string(n);
  run_command("rm -rf '" + d + "' && mkdir -p '" + d + "'");
  return d;
}

RunResult run_nccl_ranks(int n, const std::string& worker, const std::string& env, const std::string& flags,
                         int deadline_s = 180) {
  const std::string seed = std::to_string(std::random_device{}() % 1000003);
  return run_command("env NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 KILN_TEST_BACKEND=" + backend() + " KILN_TEST_SEED=" + seed +
                         " KILN_TEST_NCCL_WORKER=" + worker + " " + env +
                         " " + kiln_cli() +
                         " launch --nproc-per-node " + std::to_string(n) + " --master-port 0 --term-grace 2 " + flags +
                         " -- " + self_exe() + " --gtest_filter=NcclRank.Run --gtest_brief=1",
                     deadline_s);
}

std::string world_name(const ::testing::TestParamInfo<int>& p) { return "np" + std::to_string(p.param); }

// A fault case at n ranks: the launcher's log folder (fresh) and the job's result.
struct FaultRun {
  std::string dir;
  RunResult r;
};
FaultRun run_fault(const std::string& name, int n, const std::string& worker, const std::string& timeout_ms,
                   const std::string& flags = "") {
  FaultRun f;
  f.dir = log_dir(name, n);
  f.r = run_nccl_ranks(n, worker, "KILN_TEST_TIMEOUT_MS=" + timeout_ms, flags + " --log-dir " + f.dir);
  return f;
}

}  // namespace

TEST(NcclRank, Run) {
  const char* which = std::getenv("KILN_TEST_NCCL_WORKER");
  if (!which) GTEST_SKIP() << "runs only as a rank of a multi-process NCCL test";
  const std::string mode = which;
  CommOptions o;
  const char* ms = std::getenv("KILN_TEST_TIMEOUT_MS");
  o.timeout = Millis(ms ? std::atoi(ms) : 60000);
  o.watchdog_interval = Millis(2);  // Work::wait returns on the watchdog's tick
  o.shrink_window = Millis(2000);
  auto world = init_world(backend(), "world", o);
  std::printf("seed %lld\n", static_cast<long long>(seed()));
  if (mode == "collectives") nccl_reductions(*world), nccl_data_movement(*world);
  else if (mode == "in_flight") nccl_in_flight(*world);
  else if (mode == "sleeper" || mode == "killed") nccl_fault(*world, mode == "killed");
  else FAIL() << "unknown KILN_TEST_NCCL_WORKER " << mode;
}

class NcclWorld : public ::testing::TestWithParam<int> {};

TEST_P(NcclWorld, EveryCollectiveAndDtypeMatchesSerialReference) {
  KILN_SKIP_WITHOUT_GPUS(GetParam());
  const auto r = run_nccl_ranks(GetParam(), "collectives", "", "");
  EXPECT_EQ(r.status, 0) << r.output;
}

TEST_P(NcclWorld, OpsInFlightOnTwoCommunicatorsAndSplit) {
  KILN_SKIP_WITHOUT_GPUS(GetParam());
  const auto r = run_nccl_ranks(GetParam(), "in_flight", "", "");
  EXPECT_EQ(r.status, 0) << r.output;
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, NcclWorld, ::testing::Values(1, 2, 4, 8), world_name);

class NcclWorldFaults : public ::testing::TestWithParam<int> {};

TEST_P(NcclWorldFaults, SleeperTimesOutNamingOpAndRankAndAnalyzeFindsIt) {
  KILN_SKIP_WITHOUT_GPUS(GetParam());
  const auto t0 = std::chrono::steady_clock::now();
  const auto [dir, r] = run_fault("sleeper", GetParam(), "sleeper", "3000");
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_TRUE(contains(r.output, "all_reduce #4 of 'world' (3 elements of f32) timed out after 3000 ms")) << r.output;
  EXPECT_TRUE(contains(r.output, "rank 1 has not joined it")) << r.output;
  EXPECT_TRUE(contains(r.output, "exit code 70")) << r.output;
  EXPECT_TRUE(contains(r.output, "flight recorder: " + dir + "/kiln_fr_rank0.json")) << r.output;
  EXPECT_LT(secs, 3 + 2 + 25) << r.output;  // NCCL's init and the launcher's stop included
  const auto a = run_command(kiln_cli() + " comms analyze " + dir, 30);
  EXPECT_EQ(a.status, 1) << a.output;
  EXPECT_TRUE(contains(a.output, "all_reduce #4 of 'world'")) << a.output;
}

TEST_P(NcclWorldFaults, KilledRankUnderAbortExitsNamingTheOp) {
  KILN_SKIP_WITHOUT_GPUS(GetParam());
  // NCCL may see the dead peer only at the timeout: 1.5 s (+ the abort) keeps that inside the 3 s
  // the launcher gives survivors to report before it stops them.
  const auto [dir, r] = run_fault("abort", GetParam(), "killed", "1500");
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_TRUE(contains(r.output, "policy abort: exiting with status 70")) << r.output;
  EXPECT_TRUE(contains(r.output, "signal 9 (SIGKILL)") || contains(r.output, "exit code 70")) << r.output;
  EXPECT_TRUE(contains(r.output, "of 'world' (3 elements of f32)")) << r.output;
  EXPECT_TRUE(contains(r.output, "kiln launch: the job failed")) << r.output;
  EXPECT_TRUE(contains(r.output, "(flight recorder: " + dir + "/kiln_fr_rank")) << r.output;
}

TEST_P(NcclWorldFaults, KilledRankUnderShrinkSurvivorsContinue) {
  KILN_SKIP_WITHOUT_GPUS(GetParam());
  const int n = GetParam();
  const auto [dir, r] = run_fault("shrink", n, "killed", "5000", "--policy shrink");
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "policy shrink: continuing")) << r.output;
  EXPECT_TRUE(contains(r.output, "[rank 0] survivor: old rank 0 new rank 0 of " + std::to_string(n - 1) +
                                     " generation 1"))
      << r.output;
  if (n > 2) {
    EXPECT_TRUE(contains(r.output, "[rank " + std::to_string(n - 1) + "] survivor: old rank " + std::to_string(n - 1) +
                                       " new rank " + std::to_string(n - 2) + " of " + std::to_string(n - 1)))
        << r.output;
  }
  size_t ok = 0;
  for (size_t p = 0; (p = r.output.find("survivor ok", p)) != std::string::npos; ++p) ++ok;
  EXPECT_EQ(ok, static_cast<size_t>(n - 1)) << r.output;
  EXPECT_TRUE(contains(run_command("cat " + dir + "/rank0.jsonl").output, "\"event\":\"shrink\"")) << r.output;
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, NcclWorldFaults, ::testing::Values(2, 4, 8), world_name);
