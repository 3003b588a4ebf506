// copy_many (FSDP's batched copy-in / copy-out): against copy_ pair by pair on fresh random
// values, destinations poisoned, for contiguous ranges, 2-D views with contiguous rows cut out of
// wider buffers (as the all-gather buffer's [ranks, slice] columns), odd sizes, empty pairs, and
// pairs larger than the 64 KiB pieces so the parallel split runs (a row of 300,001 bytes cut into
// pieces that are not a multiple of the element); pairs that need copy_ (a cast, a strided
// non-2-D view) in the same call, the batchable ones in one kernel call (the profiler counts);
// version bumps; and bad input named by its pair.
#include <functional>

#include "kiln/core/profile.h"
#include "tests/ops/harness.h"

using namespace kiln;
using namespace kiln::test;

namespace {

Tensor random_of(const Shape& s, DType dt, Generator& gen, Device dev) { return randn(s, gen, DType::f32, dev).to(dt); }

// Copies compare equal value for value (==: NaN fails, -0 equals +0).
constexpr Tol kEqual{.nan_matches = false};

}  // namespace

TEST(CopyMany, EveryPairEqualsCopyPairByPair) {
  for (Device dev : test_devices()) {
    KILN_TEST_GENERATOR(gen);
    SCOPED_TRACE(dev.str());
    std::vector<Tensor> dsts, srcs, wants;
    auto add = [&](const Tensor& d, const Tensor& s) {
      dsts.push_back(d);
      srcs.push_back(s);
      wants.push_back(s.to(d.dtype()).contiguous());
    };
    // contiguous ranges of every size class, f32 and bf16
    for (int64_t n : {1, 3, 17, 129, 1000, 75001}) {
      add(Tensor::empty({n}, DType::f32, dev), random_of({n}, DType::f32, gen, dev));
      add(Tensor::empty({n}, DType::bf16, dev), random_of({n}, DType::bf16, gen, dev));
    }
    // rows of a [ranks, slice] buffer <-> a contiguous parameter, both ways
    Tensor flat = random_of({3, 1000}, DType::f32, gen, dev);
    add(Tensor::empty({3, 129}, DType::f32, dev), flat.narrow(1, 17, 129));
    Tensor into = Tensor::empty({3, 1000}, DType::f32, dev);
    into.fill_(0.0);
    Tensor cols = into.narrow(1, 500, 333);
    add(cols, random_of({3, 333}, DType::f32, gen, dev));
    // one row longer than several 64 KiB pieces, not a multiple of them
    Tensor wide = random_of({2, 160000}, DType::f16, gen, dev);
    add(Tensor::empty({2, 150000}, DType::f16, dev), wide.narrow(1, 1, 150000));
    // empty pairs, a cast and a transposed view (copy_ takes those)
    add(Tensor::empty({0}, DType::f32, dev), Tensor::empty({0}, DType::f32, dev));
    add(Tensor::empty({0, 7}, DType::f32, dev), random_of({3, 7}, DType::f32, gen, dev).narrow(0, 1, 0));
    add(Tensor::empty({5, 9}, DType::f32, dev), random_of({5, 9}, DType::bf16, gen, dev));
    add(Tensor::empty({4, 6}, DType::f32, dev), random_of({6, 4}, DType::f32, gen, dev).transpose(0, 1));
    std::vector<uint64_t> versions;
    for (const Tensor& d : dsts) versions.push_back(d.version());
    profile::Profiler prof;
    {
      profile::Session on(prof);
      copy_many(dsts, srcs);
    }
    // One batched call for every same-dtype pair; copy_ only for the cast and the transposed view.
    int64_t batched = 0, single = 0;
    for (const auto& e : prof.entries()) {
      if (e.name == "copy_blocks") batched += e.count;
      if (e.name == "copy") single += e.count;
    }
    EXPECT_EQ(batched, 1);
    EXPECT_EQ(single, 2);
    for (size_t i = 0; i < dsts.size(); ++i) {
      EXPECT_TRUE(all_close(dsts[i], wants[i], kEqual, "pair " + std::to_string(i)));
      EXPECT_GT(dsts[i].version(), versions[i]) << "pair " << i << ": copy_many must bump the version as copy_ does";
    }
    // the columns around the written ones of `into` stay as they were
    EXPECT_TRUE(
        all_close(into.narrow(1, 0, 500), zeros({3, 500}, DType::f32, dev), kEqual, "left of the written columns"));
    EXPECT_TRUE(
        all_close(into.narrow(1, 833, 167), zeros({3, 167}, DType::f32, dev), kEqual, "right of the written columns"));
  }
}

TEST(CopyMany, BadInputNamesThePair) {
  Tensor a = zeros({4}), b = zeros({5});
  auto message = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(message([&] { copy_many({a, a}, {a}); }).find("2 destinations and 1 sources"), std::string::npos);
  EXPECT_NE(message([&] { copy_many({a, a}, {a, b}); }).find("pair 1: shapes [4] and [5] differ"), std::string::npos);
  EXPECT_NE(message([&] { copy_many({a}, {Tensor()}); }).find("pair 0 has an undefined tensor"), std::string::npos);
  Tensor leaf = zeros({4});
  leaf.requires_grad_(true);
  EXPECT_NE(message([&] { copy_many({leaf}, {a}); }).find("in-place operation"), std::string::npos);
  EXPECT_NE(message([&] { copy_many({a}, {leaf}); }).find("the source requires grad"), std::string::npos);
}
