// The CPU FlexAttention tile products (kernels/cpu/attention.cpp: register-blocked, with row and
// column tails) vs float64 loops, over shapes that hit the blocked part, the tails and both.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "kiln/core/rng.h"
#include "kiln/kernels/cpu/attention_impl.h"
#include "kiln/ops/ops.h"
#include "tests/expect.h"

using namespace kiln;
using namespace kiln::kernels::cpu::flex_detail;
using namespace kiln::test;

namespace {

// f32 tile products against float64: within 1e-4 · (1 + |want|).
constexpr Tol kTileTol = finite_only({1e-4, 1e-4});

std::vector<float> random_vec(int64_t n, Generator& gen) {
  Tensor t = randn({n}, gen, DType::f32);
  return std::vector<float>(t.data<float>(), t.data<float>() + n);
}

}  // namespace

TEST(FlexTiles, ProductsMatchFloat64) {
  Generator gen(11);
  for (int64_t m : {1, 4, 7, 9, 33})
    for (int64_t n : {1, 8, 16, 21, 32})
      for (int64_t nk : {1, 5, 16, 37}) {
        SCOPED_TRACE("m=" + std::to_string(m) + " n=" + std::to_string(n) + " nk=" + std::to_string(nk));
        const int64_t ld = nk + 3;  // a leading dimension wider than the tile
        // s = a · bt (a [m, n], bt [n, ld]); elements past nk must stay untouched.
        std::vector<float> a = random_vec(m * n, gen), bt = random_vec(n * ld, gen);
        std::vector<float> s(static_cast<size_t>(m * ld), 12345.0f);
        tile_abt(s.data(), ld, a.data(), m, n, bt.data(), nk);
        std::vector<float> got;
        std::vector<double> want;
        for (int64_t i = 0; i < m; ++i)
          for (int64_t j = 0; j < ld; ++j) {
            double acc = 0;
            for (int64_t e = 0; e < n; ++e) acc += static_cast<double>(a[i * n + e]) * bt[e * ld + j];
            got.push_back(s[i * ld + j]);
            want.push_back(j < nk ? acc : 12345.0);
          }
        EXPECT_TRUE(all_close(got, want, kTileTol, "tile_abt"));
        // acc [m, n] += w [m, ld] · x [nk, n]
        std::vector<float> w = random_vec(m * ld, gen), x = random_vec(nk * n, gen), acc0 = random_vec(m * n, gen);
        std::vector<float> acc = acc0;
        tile_ax(acc.data(), n, w.data(), ld, m, x.data(), nk);
        want.assign(acc0.begin(), acc0.end());
        for (int64_t r = 0; r < m; ++r)
          for (int64_t c = 0; c < nk; ++c)
            for (int64_t e = 0; e < n; ++e) want[r * n + e] += static_cast<double>(w[r * ld + c]) * x[c * n + e];
        EXPECT_TRUE(all_close(acc, want, kTileTol, "tile_ax"));
        // acc [nk, n] += wᵀ · x, w [m, ld], x [m, n]
        std::vector<float> x2 = random_vec(m * n, gen), acc1 = random_vec(nk * n, gen);
        acc = acc1;
        tile_atx(acc.data(), n, w.data(), ld, m, x2.data(), nk);
        want.assign(acc1.begin(), acc1.end());
        for (int64_t r = 0; r < m; ++r)
          for (int64_t c = 0; c < nk; ++c)
            for (int64_t e = 0; e < n; ++e) want[c * n + e] += static_cast<double>(w[r * ld + c]) * x2[r * n + e];
        EXPECT_TRUE(all_close(acc, want, kTileTol, "tile_atx"));
      }
}
