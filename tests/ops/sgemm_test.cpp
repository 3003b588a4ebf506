// Tests of kiln's own f32 CPU product (kernels/cpu/sgemm.h) against a float64 loop reference:
// every layout, shapes that leave partial tiles, K blocks and column blocks, padded leading
// dimensions, beta 0 over a NaN-poisoned c and beta != 0, nothing written outside c, and the same
// bits at every thread count, run to run and on both instruction sets. Each test runs every set
// this CPU has (AVX-512, AVX2) and is skipped (with a message) where it has neither.
#include <omp.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kiln/kernels/cpu/sgemm.h"
#include "tests/ops/harness.h"

using namespace kiln;
using kiln::kernels::cpu::own_sgemm;
using kiln::kernels::cpu::own_sgemm_isa_name;
using kiln::kernels::cpu::own_sgemm_supported;
using kiln::kernels::cpu::SgemmIsa;
using kiln::kernels::cpu::SgemmProblem;

namespace {

// The instruction sets of kiln's product this CPU runs.
std::vector<SgemmIsa> sets_here() {
  std::vector<SgemmIsa> sets;
  for (SgemmIsa isa : {SgemmIsa::avx512, SgemmIsa::avx2})
    if (own_sgemm_supported(isa)) sets.push_back(isa);
  return sets;
}
#define KILN_SKIP_WITHOUT_OWN_SGEMM() \
  if (sets_here().empty())             \
  GTEST_SKIP() << "this CPU has neither AVX-512F nor AVX2 and FMA: kiln's f32 product is not used here"

// One product's operands, stored as the kernel reads them (a [k, lda] when transposed, else
// [m, lda]; b likewise), with leading dimensions padded past the minimum by `pad`, and c inside a
// frame of sentinels: c's rows are ldc = n + pad long and one row of sentinels lies above and below.
struct Operands {
  SgemmProblem p;
  std::vector<float> a, b, c_frame;
  int64_t frame_offset = 0;
  void point() { p.a = a.data(), p.b = b.data(), p.c = c_frame.data() + frame_offset; }  // after a copy
};

Operands make(int64_t m, int64_t n, int64_t k, bool ta, bool tb, int64_t pad, float beta, std::mt19937_64& rng) {
  Operands o;
  std::normal_distribution<float> normal;
  SgemmProblem& p = o.p;
  p.m = m, p.n = n, p.k = k, p.trans_a = ta, p.trans_b = tb, p.beta = beta;
  p.lda = (ta ? m : k) + pad, p.ldb = (tb ? k : n) + pad, p.ldc = n + pad;
  o.a.resize(static_cast<size_t>((ta ? k : m) * p.lda));
  o.b.resize(static_cast<size_t>((tb ? n : k) * p.ldb));
  for (float& v : o.a) v = normal(rng);
  for (float& v : o.b) v = normal(rng);
  o.c_frame.assign(static_cast<size_t>((m + 2) * p.ldc), 1234.5f);
  o.frame_offset = p.ldc;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j)
      o.c_frame[static_cast<size_t>(o.frame_offset + i * p.ldc + j)] =
          beta == 0.0f ? std::numeric_limits<float>::quiet_NaN() : normal(rng);
  o.point();
  return o;
}

float at_a(const Operands& o, int64_t i, int64_t q) {
  return o.p.trans_a ? o.a[static_cast<size_t>(q * o.p.lda + i)] : o.a[static_cast<size_t>(i * o.p.lda + q)];
}
float at_b(const Operands& o, int64_t q, int64_t j) {
  return o.p.trans_b ? o.b[static_cast<size_t>(j * o.p.ldb + q)] : o.b[static_cast<size_t>(q * o.p.ldb + j)];
}

// Runs the product on `isa` and checks every element of c against float64, within k-term f32
// summation's bound (k + 2 roundings of terms no larger than sum |a||b| + |beta c|), and that no
// sentinel moved.
void check(Operands o, const char* what, SgemmIsa isa) {
  SCOPED_TRACE(::testing::Message() << own_sgemm_isa_name(isa) << ", " << what << ": m=" << o.p.m << " n=" << o.p.n
                                    << " k=" << o.p.k << " trans_a=" << o.p.trans_a << " trans_b=" << o.p.trans_b
                                    << " ldc=" << o.p.ldc << " beta=" << o.p.beta);
  o.point();
  const std::vector<float> before = o.c_frame;
  own_sgemm(o.p, isa);
  const double eps = std::numeric_limits<float>::epsilon();
  int64_t bad = 0;
  for (int64_t i = 0; i < o.p.m; ++i)
    for (int64_t j = 0; j < o.p.n; ++j) {
      double ref = 0, mag = 0;
      for (int64_t q = 0; q < o.p.k; ++q) {
        const double t = double(at_a(o, i, q)) * double(at_b(o, q, j));
        ref += t;
        mag += std::fabs(t);
      }
      const size_t at = static_cast<size_t>(o.frame_offset + i * o.p.ldc + j);
      if (o.p.beta != 0.0f) {
        ref += double(o.p.beta) * before[at];
        mag += std::fabs(double(o.p.beta) * before[at]);
      }
      const double got = o.c_frame[at];
      if (!(std::fabs(got - ref) <= double(o.p.k + 2) * eps * mag + 1e-30) && bad++ < 5)
        ADD_FAILURE() << "c[" << i << ", " << j << "] = " << got << ", float64 " << ref;
    }
  EXPECT_EQ(bad, 0);
  for (size_t at = 0; at < o.c_frame.size(); ++at) {
    const int64_t row = static_cast<int64_t>(at) / o.p.ldc - 1, col = static_cast<int64_t>(at) % o.p.ldc;
    if (row < 0 || row >= o.p.m || col >= o.p.n) {
      ASSERT_EQ(o.c_frame[at], 1234.5f) << "written outside c at " << at;
    }
  }
}

}  // namespace

TEST(OwnSgemm, EveryLayoutAndTileEdgeMatchesFloat64) {
  KILN_SKIP_WITHOUT_OWN_SGEMM();
  KILN_TEST_GENERATOR(gen);
  std::mt19937_64 rng(gen_seed);
  struct Case { int64_t m, n, k; };
  // 14 x 32 tiles (AVX-512): rows 1, 13-15, 29; columns 1, 16, 17, 31-33. 6 x 16 (AVX2): rows 5-7,
  // 13; columns 7-9, 15-17, 31-33. k one step, past a K block (385), three uneven blocks, and a K
  // block's tail that is no multiple of 8 or 16 (the packing's transposes: 5, 17, 20); a product
  // past the 1024-column block.
  for (Case c : {Case{1, 1, 1}, Case{13, 17, 5}, Case{14, 32, 16}, Case{15, 33, 17}, Case{29, 31, 385},
                 Case{45, 16, 1000}, Case{3, 2100, 20}, Case{128, 64, 128}, Case{5, 7, 9}, Case{7, 9, 263},
                 Case{6, 15, 8}, Case{12, 8, 31}})
    for (int layout = 0; layout < 4; ++layout)
      for (int64_t pad : {0, 3})
        for (SgemmIsa isa : sets_here())
          check(make(c.m, c.n, c.k, layout & 2, layout & 1, pad, 0.0f, rng), "beta 0", isa);
}

TEST(OwnSgemm, BetaAddsToWhatCHolds) {
  KILN_SKIP_WITHOUT_OWN_SGEMM();
  KILN_TEST_GENERATOR(gen);
  std::mt19937_64 rng(gen_seed);
  for (SgemmIsa isa : sets_here()) {
    for (float beta : {1.0f, 0.5f, -2.0f})
      for (int layout = 0; layout < 4; ++layout) {
        check(make(30, 50, 400, layout & 2, layout & 1, 1, beta, rng), "beta", isa);  // two K blocks: the second adds
        check(make(7, 9, 3, layout & 2, layout & 1, 0, beta, rng), "beta, small", isa);
      }
    // A weight gradient's shape on two threads: split over its four K blocks, the parts and beta · c
    // added afterwards.
    const int omp_before = omp_get_max_threads();
    omp_set_num_threads(2);
    for (float beta : {0.0f, 1.0f, 0.5f})
      check(make(128, 64, 1024, true, false, 2, beta, rng), "beta, split over K", isa);
    omp_set_num_threads(omp_before);
  }
}

// The same bits at 1, 2 and 3 threads, run to run, and on each instruction set this CPU has (the
// AVX-512 set's bits were checked against the AVX2 set's where a CPU has both).
TEST(OwnSgemm, BitsDoNotDependOnThreadsRunOrSet) {
  KILN_SKIP_WITHOUT_OWN_SGEMM();
  KILN_TEST_GENERATOR(gen);
  std::mt19937_64 rng(gen_seed);
  const int omp_before = omp_get_max_threads();
  for (int layout = 0; layout < 4; ++layout) {
    // Split over 1, 2, 3 threads; 1024 K steps in four blocks (a weight gradient's K split on two).
    for (const Operands& o : {make(301, 200, 700, layout & 2, layout & 1, 0, 0.0f, rng),
                              make(130, 70, 1024, layout & 2, layout & 1, 0, 0.0f, rng)}) {
      std::vector<std::vector<float>> results;
      std::vector<std::string> names;
      for (SgemmIsa isa : sets_here())
        for (int threads : {1, 2, 3, 3}) {
          omp_set_num_threads(threads);
          Operands run = o;
          run.point();
          own_sgemm(run.p, isa);
          results.push_back(run.c_frame);
          names.push_back(std::string(own_sgemm_isa_name(isa)) + " on " + std::to_string(threads) + " threads");
        }
      for (size_t r = 1; r < results.size(); ++r)
        EXPECT_EQ(std::memcmp(results[0].data(), results[r].data(), results[0].size() * sizeof(float)), 0)
            << "layout " << layout << ", m=" << o.p.m << ": " << names[r] << " differs from " << names[0];
    }
  }
  omp_set_num_threads(omp_before);
}

TEST(OwnSgemm, RefusesAnEmptyInnerDimension) {
  KILN_SKIP_WITHOUT_OWN_SGEMM();
  SgemmProblem p;
  p.m = 2, p.n = 2, p.k = 0;
  for (SgemmIsa isa : sets_here()) EXPECT_THROW(own_sgemm(p, isa), Error);
}

TEST(OwnSgemm, RefusesASetThisCpuLacks) {
  if (sets_here().size() == 2) GTEST_SKIP() << "this CPU runs both sets: none to refuse";
  SgemmProblem p;
  p.m = p.n = p.k = 1;
  for (SgemmIsa isa : {SgemmIsa::avx512, SgemmIsa::avx2})
    if (!own_sgemm_supported(isa)) {
      try {
        own_sgemm(p, isa);
        ADD_FAILURE() << (isa == SgemmIsa::avx512 ? "AVX-512" : "AVX2") << ", which this CPU lacks: no error";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("this one has none"), std::string::npos) << e.what();
      }
    }
}
