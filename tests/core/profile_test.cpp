// The op-level profiler: counts per kernel call, backward labels, the switch, per-kernel totals, table (the JSON is
// train::profile_to_json, tested in tests/train).
#include <gtest/gtest.h>

#include "kiln/core/error.h"
#include "kiln/core/profile.h"
#include "kiln/ops/ops.h"

namespace kiln {
namespace {

int64_t count_of(const std::vector<profile::Entry>& es, const std::string& name) {
  for (const auto& e : es)
    if (e.name == name) return e.count;
  return 0;
}

TEST(Profile, CountsKernelCallsAndLabelsBackward) {
  Generator gen(7);
  Tensor a = randn({7, 5}, gen).requires_grad_(true);
  Tensor b = randn({5, 3}, gen);
  profile::Profiler prof;
  {
    profile::Session on(prof);
    Tensor c = matmul(a, b);
    Tensor s = sum(c);
    s.backward();
  }
  auto es = prof.entries();
  EXPECT_EQ(count_of(es, "gemm"), 1);  // the forward matmul
  int64_t backward_gemms = 0;
  for (const auto& e : es) {
    EXPECT_GT(e.count, 0);
    EXPECT_GE(e.total_ms, 0.0);
    EXPECT_FALSE(e.device_time);  // CPU: wall time
    if (e.name.rfind("backward:", 0) == 0 && e.name.size() > 5 && e.name.substr(e.name.size() - 5) == "/gemm")
      backward_gemms += e.count;
  }
  EXPECT_EQ(backward_gemms, 1);  // dA = dC Bᵀ (B needs no gradient)
  EXPECT_EQ(prof.total_syncs(), 0);
  // nothing recorded once the session is over
  Tensor d = matmul(a, b);
  EXPECT_EQ(count_of(prof.entries(), "gemm"), 1);
  auto ks = profile::by_kernel(es);  // "gemm" and "backward:<node>/gemm" fold into "gemm"
  EXPECT_EQ(count_of(ks, "gemm"), 1 + backward_gemms);
  for (const auto& k : ks) EXPECT_EQ(k.name.find('/'), std::string::npos) << k.name;
  for (size_t i = 1; i < ks.size(); ++i) EXPECT_GE(ks[i - 1].total_ms, ks[i].total_ms);
  EXPECT_NE(prof.table().find("gemm"), std::string::npos);
  prof.reset();
  EXPECT_TRUE(prof.entries().empty());
}

TEST(Profile, OneSessionAtATimeAndCountsSyncs) {
  profile::Profiler p1, p2;
  profile::Session on(p1);
  EXPECT_THROW(profile::Session again(p2), Error);
  EXPECT_EQ(profile::active(), &p1);
  profile::count_sync("test");
  profile::count_sync("test");
  EXPECT_EQ(p1.total_syncs(), 2);
  EXPECT_EQ(p1.syncs().at("test"), 2);
}

TEST(Profile, OffByDefault) { EXPECT_EQ(profile::active(), nullptr); }

}  // namespace
}  // namespace kiln
