// The rank side of the multi-process tests: DistWorker.Run does nothing in a plain test run;
// started by kiln launch with KILN_TEST_WORKER=<case> it runs that case as one rank and fails
// (non-zero exit) on any mismatch. Inputs are small integers (exact in every dtype, so every
// summation order gives the same bits) generated from (rank, op, size), so each rank computes
// the serial float64 reference of all ranks itself.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include "kiln/dist/backends.h"
#include "kiln/ops/ops.h"
#include "tests/dist/dist_test_util.h"

using namespace kiln;
using namespace kiln::dist;
using kiln::dist::test::matches_reference;

namespace {

const DType kReduceDtypes[] = {DType::f32, DType::bf16, DType::f16, DType::f64, DType::i32, DType::i64, DType::u8};
const ReduceOp kOps[] = {ReduceOp::sum, ReduceOp::avg, ReduceOp::min, ReduceOp::max, ReduceOp::product};

// Element i of rank r's input for case k: small integers, non-negative for u8, in {1, 2, -1}
// for products so 4 ranks stay exact.
double value(int r, int64_t i, int k, DType dt, ReduceOp op) {
  const int64_t h = (r * 131 + i * 29 + k * 7) % 7;
  if (op == ReduceOp::product) return dt == DType::u8 ? 1 + h % 2 : (h % 3 == 2 ? -1 : 1 + h % 2);
  return dt == DType::u8 ? static_cast<double>(h % 4) : static_cast<double>(h - 3);
}

Tensor make(const std::vector<double>& v, DType dt) {
  return from_vector<double>(v, {static_cast<int64_t>(v.size())}).to(dt);
}

std::vector<double> input_of(int r, int64_t n, int k, DType dt, ReduceOp op) {
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = value(r, i, k, dt, op);
  return v;
}

double reduce_ref(const std::vector<double>& xs, ReduceOp op) {
  double acc = xs[0];
  for (size_t i = 1; i < xs.size(); ++i) {
    if (op == ReduceOp::sum || op == ReduceOp::avg) acc += xs[i];
    if (op == ReduceOp::product) acc *= xs[i];
    if (op == ReduceOp::min) acc = std::min(acc, xs[i]);
    if (op == ReduceOp::max) acc = std::max(acc, xs[i]);
  }
  return op == ReduceOp::avg ? acc / static_cast<double>(xs.size()) : acc;
}

// `p2p_tensors` gets the send / recv tensors, which the caller checks no thread of the
// communicator still holds once it is destroyed.
void run_collectives(Communicator& c, std::vector<Tensor>& p2p_tensors) {
  const int R = c.rank(), W = c.size();
  const int64_t sizes[] = {0, 1, 7, 33};
  int k = 0;
  for (DType dt : kReduceDtypes)
    for (ReduceOp op : kOps) {
      if (op == ReduceOp::avg && !is_floating(dt)) continue;
      for (int64_t n : sizes) {
        ++k;
        const std::string tag = std::string(dtype_name(dt)) + " " + reduce_op_name(op) + " n=" + std::to_string(n);
        // all_reduce, in place.
        Tensor t = make(input_of(R, n, k, dt, op), dt);
        std::vector<double> want(static_cast<size_t>(n));
        for (int64_t i = 0; i < n; ++i) {
          std::vector<double> xs;
          for (int r = 0; r < W; ++r) xs.push_back(value(r, i, k, dt, op));
          want[static_cast<size_t>(i)] = reduce_ref(xs, op);
        }
        c.all_reduce(t, op)->wait();
        EXPECT_TRUE(matches_reference(t, want, dt, "all_reduce " + tag));
        // reduce_scatter_single: input of W*n, output n; and in place (output = this rank's chunk).
        Tensor in = make(input_of(R, W * n, k, dt, op), dt);
        std::vector<double> rs(static_cast<size_t>(n));
        for (int64_t i = 0; i < n; ++i) {
          std::vector<double> xs;
          for (int r = 0; r < W; ++r) xs.push_back(value(r, R * n + i, k, dt, op));
          rs[static_cast<size_t>(i)] = reduce_ref(xs, op);
        }
        Tensor out = Tensor::empty({n}, dt);
        c.reduce_scatter_single(out, in, op)->wait();
        EXPECT_TRUE(matches_reference(out, rs, dt, "reduce_scatter " + tag));
        Tensor in2 = make(input_of(R, W * n, k, dt, op), dt);
        Tensor view = in2.narrow(0, R * n, n);
        c.reduce_scatter_single(view, in2, op)->wait();
        EXPECT_TRUE(matches_reference(view, rs, dt, "reduce_scatter in place " + tag));
      }
    }
  // all_gather_single, all_to_all_single, broadcast for every dtype (no reduction).
  const DType all_dtypes[] = {DType::f32, DType::bf16, DType::f16, DType::f64, DType::i32,
                              DType::i64, DType::u8, DType::i16, DType::i8, DType::boolean};
  for (DType dt : all_dtypes)
    for (int64_t n : sizes) {
      ++k;
      const std::string tag = std::string(dtype_name(dt)) + " n=" + std::to_string(n);
      auto vals = [&](int r, int64_t m) {
        std::vector<double> v(static_cast<size_t>(m));
        for (int64_t i = 0; i < m; ++i)
          v[static_cast<size_t>(i)] = dt == DType::boolean ? (r + i) % 2 : (r * 5 + i + k) % 11;
        return v;
      };
      std::vector<double> gathered;
      for (int r = 0; r < W; ++r) {
        auto v = vals(r, n);
        gathered.insert(gathered.end(), v.begin(), v.end());
      }
      Tensor out = Tensor::empty({W * n}, dt);
      c.all_gather_single(out, make(vals(R, n), dt))->wait();
      EXPECT_TRUE(matches_reference(out, gathered, dt, "all_gather " + tag));
      Tensor out2 = make(std::vector<double>(static_cast<size_t>(W * n), 0.0), dt);
      out2.narrow(0, R * n, n).copy_(make(vals(R, n), dt));
      c.all_gather_single(out2, out2.narrow(0, R * n, n))->wait();
      EXPECT_TRUE(matches_reference(out2, gathered, dt, "all_gather in place " + tag));
      // all_to_all with equal chunks: chunk j of rank i holds (i, j)-dependent values.
      auto a2a = [&](int from, int to, int64_t m) {
        std::vector<double> v(static_cast<size_t>(m));
        for (int64_t i = 0; i < m; ++i) v[static_cast<size_t>(i)] = dt == DType::boolean ? (from + to + i) % 2 : (from * 3 + to * 5 + i) % 13;
        return v;
      };
      std::vector<double> send, want;
      for (int j = 0; j < W; ++j) {
        auto s = a2a(R, j, n), r = a2a(j, R, n);
        send.insert(send.end(), s.begin(), s.end());
        want.insert(want.end(), r.begin(), r.end());
      }
      Tensor a_out = Tensor::empty({W * n}, dt);
      c.all_to_all_single(a_out, make(send, dt))->wait();
      EXPECT_TRUE(matches_reference(a_out, want, dt, "all_to_all " + tag));
      // Uneven all_to_all: rank i sends (i + j + n) % 3 elements to rank j.
      std::vector<int64_t> in_splits, out_splits;
      std::vector<double> us, uw;
      for (int j = 0; j < W; ++j) {
        const int64_t s = (R + j + n) % 3, r = (j + R + n) % 3;
        in_splits.push_back(s);
        out_splits.push_back(r);
        auto sv = a2a(R, j, s), rv = a2a(j, R, r);
        us.insert(us.end(), sv.begin(), sv.end());
        uw.insert(uw.end(), rv.begin(), rv.end());
      }
      Tensor u_out = Tensor::empty({static_cast<int64_t>(uw.size())}, dt);
      c.all_to_all_single(u_out, make(us, dt), out_splits, in_splits)->wait();
      EXPECT_TRUE(matches_reference(u_out, uw, dt, "all_to_all uneven " + tag));
      // broadcast from the last rank.
      Tensor b = R == W - 1 ? make(vals(W - 1, n), dt) : make(std::vector<double>(static_cast<size_t>(n), 0.0), dt);
      c.broadcast(b, W - 1)->wait();
      EXPECT_TRUE(matches_reference(b, vals(W - 1, n), dt, "broadcast " + tag));
    }
  // send / recv around a ring, and a barrier.
  if (W > 1) {
    Tensor s = make(input_of(R, 5, 99, DType::f32, ReduceOp::sum), DType::f32);
    Tensor r = Tensor::empty({5}, DType::f32);
    auto ws = c.send(s, (R + 1) % W);
    auto wr = c.recv(r, (R + W - 1) % W);
    ws->wait();
    wr->wait();
    EXPECT_TRUE(
        matches_reference(r, input_of((R + W - 1) % W, 5, 99, DType::f32, ReduceOp::sum), DType::f32, "send/recv"));
    p2p_tensors = {s, r};
  }
  c.barrier()->wait();
}

// Several operations in flight at once, then all waited for; two communicators interleaved.
void run_in_flight(Communicator& world) {
  const int R = world.rank(), W = world.size();
  auto other = world.split([&] {
    std::vector<int> all;
    for (int r = W - 1; r >= 0; --r) all.push_back(r);  // reversed: new rank = W-1-R
    return all;
  }(), "reversed");
  EXPECT_EQ(other->rank(), W - 1 - R);
  EXPECT_EQ(other->size(), W);
  std::vector<Tensor> ts, os;
  std::vector<WorkPtr> works;
  for (int i = 0; i < 8; ++i) {
    ts.push_back(make(std::vector<double>(9, R + i), DType::f32));
    works.push_back(world.all_reduce(ts.back(), ReduceOp::sum));
    os.push_back(make(std::vector<double>(3, other->rank() * 10 + i), DType::i64));
    works.push_back(other->all_reduce(os.back(), ReduceOp::max));
  }
  for (auto& w : works) w->wait();
  for (int i = 0; i < 8; ++i) {
    EXPECT_TRUE(
        matches_reference(ts[i], std::vector<double>(9, W * (W - 1) / 2.0 + W * i), DType::f32, "in flight world"));
    EXPECT_TRUE(matches_reference(os[i], std::vector<double>(3, (W - 1) * 10 + i), DType::i64, "in flight reversed"));
    EXPECT_TRUE(works[2 * i]->is_completed());
  }
  // split into two disjoint groups under one name, the even ranks and the odd ones: each group
  // meets its own members (in the store too) and reduces only their values.
  std::vector<int> parity;
  for (int r = R % 2; r < W; r += 2) parity.push_back(r);
  auto sub = world.split(parity, "parity");
  EXPECT_EQ(sub->rank(), R / 2);
  EXPECT_EQ(sub->size(), static_cast<int>(parity.size()));
  Tensor t = make({static_cast<double>(R)}, DType::f64);
  sub->all_reduce(t, ReduceOp::sum)->wait();
  double want = 0;
  for (int r : parity) want += r;
  EXPECT_TRUE(matches_reference(t, {want}, DType::f64, "split by parity"));
  world.barrier()->wait();
}

// Bad input: each error names the op, the argument and the values, and the communicator stays
// usable: a correct all_reduce (and, every few errors, an all_gather) runs after every refusal.
void run_bad_input(Communicator& c) {
  const int W = c.size();
  const std::string w = std::to_string(W);
  int checked = 0;
  auto expect_error = [&](auto&& f, const std::string& what) {
    try {
      f();
      ADD_FAILURE() << "no error; expected one containing: " << what;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
    Tensor ok = make({1.0, 2.0}, DType::f32);
    c.all_reduce(ok, ReduceOp::sum)->wait();
    EXPECT_TRUE(matches_reference(ok, {1.0 * W, 2.0 * W}, DType::f32, "usable after the error '" + what + "'"));
    if (++checked % 4 == 0) {
      Tensor out = Tensor::empty({W}, DType::i64);
      c.all_gather_single(out, make({static_cast<double>(c.rank())}, DType::i64))->wait();
      std::vector<double> want;
      for (int r = 0; r < W; ++r) want.push_back(r);
      EXPECT_TRUE(matches_reference(out, want, DType::i64, "all_gather after the error '" + what + "'"));
    }
  };
  Tensor i16 = Tensor::empty({4}, DType::i16);
  expect_error([&] { c.all_reduce(i16, ReduceOp::sum); },
               "all_reduce: dtype i16 cannot be reduced (expected f32, bf16, f16, f64, i32, i64 or u8)");
  expect_error([&] { c.reduce_scatter_single(Tensor::empty({1}, DType::boolean), Tensor::empty({W}, DType::boolean),
                                             ReduceOp::max); },
               "reduce_scatter_single: dtype bool cannot be reduced");
  expect_error([&] { c.all_reduce(Tensor::empty({4}, DType::i32), ReduceOp::avg); },
               "all_reduce: avg of dtype i32 (avg needs a floating dtype");
  // Sizes that do not divide: the op, the argument, both counts and the world size.
  expect_error([&] { c.reduce_scatter_single(Tensor::empty({2}), Tensor::empty({2 * W + 1}), ReduceOp::sum); },
               "reduce_scatter_single: input has " + std::to_string(2 * W + 1) + " elements; expected world size " + w +
                   " x output's 2" + (W > 1 ? " (the input does not divide by the world size)" : ""));
  expect_error([&] { c.all_gather_single(Tensor::empty({W + 1}), Tensor::empty({1})); },
               "all_gather_single: output has " + std::to_string(W + 1) + " elements; expected world size " + w +
                   " x input's 1");
  expect_error([&] { c.all_gather_single(Tensor::empty({W}, DType::bf16), Tensor::empty({1})); },
               "all_gather_single: output dtype bf16 differs from input dtype f32");
  if (W > 1)
    expect_error([&] { c.all_to_all_single(Tensor::empty({W}), Tensor::empty({W + 1})); },
                 "all_to_all_single: input has " + std::to_string(W + 1) + " elements, not divisible by the world size " + w);
  expect_error([&] { c.all_to_all_single(Tensor::empty({W}), Tensor::empty({W}), {}, std::vector<int64_t>(W + 1, 1)); },
               "all_to_all_single: input splits has " + std::to_string(W + 1) + " entries (expected the world size " +
                   w + ")");
  expect_error([&] { c.all_reduce(Tensor::empty({2, 3}).t(), ReduceOp::sum); },
               "all_reduce: tensor of shape [3, 2] is not contiguous");
  expect_error([&] { c.all_reduce(Tensor(), ReduceOp::sum); }, "all_reduce: tensor is an undefined tensor");
  expect_error([&] { c.broadcast(Tensor::empty({2}), W); }, "broadcast: root=" + w + " out of range [0, " + w + ")");
  expect_error([&] { c.recv(Tensor::empty({2}), -1); }, "recv: src=-1 out of range [0, " + w + ")");
  expect_error([&] { c.all_reduce(Tensor::empty({2}), ReduceOp::sum, CallOptions{Millis(0)}); },
               "all_reduce: timeout 0 ms must be positive");
  expect_error([&] { c.split({c.rank(), c.rank()}, "twice"); }, "appears twice");
  if (W > 1) expect_error([&] { c.send(Tensor::empty({2}), c.rank()); }, "send: dst=" + std::to_string(c.rank()) + " is this rank");
  // A tensor on the wrong device for the backend (only where a CUDA device exists).
  if (cuda_device_count() > 0)
    expect_error([&] { c.all_reduce(Tensor::empty({2}, DType::f32, cuda(0)), ReduceOp::sum); },
                 "all_reduce: tensor is on cuda:0; the gloo backend takes CPU tensors");
}

// Rank 1 dies by SIGKILL while the others wait in all_reduce #3 with a 20 s timeout: its TCP
// connections close at once (in the shared-memory segment, its pid is gone), so each survivor's
// op must fail (not time out) within 2 s; the
// victim prints when it dies and the survivors when they saw it (Unix seconds, one clock). abort_process is off (the Work raises) so they can.
void run_dead_peer(Communicator& world) {
  for (int i = 1; i <= 3; ++i) {
    if (world.rank() == 1 && i == 3) {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the others are waiting in #3
      std::printf("killed at %.3f\n", std::chrono::duration<double>(
                                           std::chrono::system_clock::now().time_since_epoch()).count());
      std::fflush(stdout);
      kill(getpid(), SIGKILL);
    }
    Tensor t = make({1.0, 2.0, 3.0}, DType::f32);
    const auto t0 = std::chrono::steady_clock::now();
    try {
      world.all_reduce(t, ReduceOp::sum)->wait();
    } catch (const Error& e) {
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const double at = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
      std::printf("dead peer detected at %.3f, %.3f s into op %d: %s\n", at, s, i, e.what());
      std::fflush(stdout);
      return;
    }
  }
  ADD_FAILURE() << "no op failed although rank 1 was killed";
}

// Ranks calling different ops of the same count in the shared-memory segment (rank 0 an
// all_reduce, the others an all_gather): every rank's op fails naming the other's call, rather
// than mixing data. abort_process is off, so the Works raise.
void run_mixed_ops(Communicator& world) {
  Tensor t = make({1, 2, 3, 4, 5, 6, 7, 8}, DType::f32);
  Tensor out = Tensor::empty({8 * world.size()}, DType::f32);
  try {
    if (world.rank() == 0) world.all_reduce(t, ReduceOp::sum)->wait();
    else world.all_gather_single(out, t)->wait();
    ADD_FAILURE() << "rank " << world.rank() << ": mismatched ops did not fail";
  } catch (const Error& e) {
    const std::string want = world.rank() == 0 ? "shared-memory all_reduce: rank 1 called it with 8 elements of 4 bytes"
                                               : "shared-memory all_gather: rank 0 called it with 8 elements of 4 bytes";
    EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    std::printf("mixed ops failed as expected\n");
  }
}

}  // namespace

TEST(DistWorker, Run) {
  const char* which = std::getenv("KILN_TEST_WORKER");
  if (!which) GTEST_SKIP() << "runs only as a rank of a multi-process test";
  const std::string mode = which;
  CommOptions o;
  o.timeout = Millis(std::atoi(std::getenv("KILN_TEST_TIMEOUT_MS") ? std::getenv("KILN_TEST_TIMEOUT_MS") : "20000"));
  o.shrink_window = Millis(1500);
  if (mode == "dead_peer" || mode == "mixed_ops") o.abort_process = false;
  auto world = init_world("gloo", "world", o);
  if (mode == "collectives") {
    std::vector<Tensor> p2p;
    run_collectives(*world, p2p);
    world.reset();
    for (const Tensor& t : p2p) EXPECT_EQ(t.storage().use_count(), 1) << "a send / recv tensor outlives its communicator";
  }
  else if (mode == "in_flight") run_in_flight(*world);
  else if (mode == "bad_input") run_bad_input(*world);
  else if (mode == "dead_peer") run_dead_peer(*world);
  else if (mode == "mixed_ops") run_mixed_ops(*world);
  else if (mode == "sleeper" || mode == "killed") {
    // Rank 1 sleeps past the timeout (or dies by SIGKILL) at the third all_reduce.
    for (int i = 1; i <= 3; ++i) {
      if (world->rank() == 1 && i == 3) {
        if (mode == "killed") kill(getpid(), SIGKILL);
        std::this_thread::sleep_for(std::chrono::seconds(8));
        return;
      }
      Tensor t = make({1.0, 2.0, 3.0}, DType::f32);
      auto work = world->all_reduce(t, ReduceOp::sum);
      try {
        work->wait();
      } catch (const PeerLost& e) {
        std::printf("PeerLost: %s\n", e.what());
        auto next = e.communicator();
        std::printf("survivor: old rank %d new rank %d of %d generation %d\n", world->rank(), next->rank(),
                    next->size(), next->generation());
        // The survivors' next collectives are correct.
        for (int j = 0; j < 3; ++j) {
          Tensor u = make({static_cast<double>(next->rank()), 1.0}, DType::f64);
          next->all_reduce(u, ReduceOp::sum)->wait();
          const int n = next->size();
          EXPECT_TRUE(matches_reference(u, {n * (n - 1) / 2.0, static_cast<double>(n)}, DType::f64, "after shrink"));
        }
        // The old communicator raises at once.
        try {
          world->barrier();
          ADD_FAILURE() << "the old communicator accepted an op";
        } catch (const PeerLost&) {
        }
        std::printf("survivor ok\n");
        return;
      } catch (const CommTimeout& e) {
        std::printf("CommTimeout: %s\n", e.what());
        return;
      }
      std::fflush(stdout);
    }
  } else {
    FAIL() << "unknown KILN_TEST_WORKER " << mode;
  }
}
