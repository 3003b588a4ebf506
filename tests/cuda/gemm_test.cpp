// kiln's GEMM (kernels/cuda/gemm/gemm.h) against a float64 CPU reference: every layout (nn, nt,
// tn, tt) × input dtype (bf16, f16) × epilogue × output dtype, on both backends (kiln's Hopper
// kernel and cuBLASLt + the epilogue pass), on shapes with 1, 7, 129 and 1000 and K not a
// multiple of the 64-wide K block, with padded (non-contiguous) leading dims and batches
// (broadcast too); bits equal run to run; the matmul op through the selection; auto's cache
// file; bad arguments. Each output element has its own error bound from the reference
// (f32 accumulation: 1e-5 · Σ|a||b| over K, plus one rounding of the output dtype), so a lost
// K block or a wrong column fails by orders of magnitude. Skipped without a GPU.
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <unistd.h>

#include "kiln/core/rng.h"
#include "kiln/kernels/cuda/gemm/gemm.h"
#include "tests/cuda/cuda_test_util.h"

using namespace kiln;
using namespace kiln::test;
namespace kg = kiln::kernels::gemm;

namespace {

// A random operand stored [batch, rows, ld] (ld ≥ cols; padded when `pad`), seen as
// [batch, rows, cols]; the same values on the CPU (f64 reference) and the GPU.
struct Operand {
  Tensor cpu, gpu;  // views [batch, rows, cols] (or [rows, cols] when batch == 0: broadcast)
  std::vector<double> v;
  int64_t rows = 0, cols = 0;
  bool batched = true;
  double at(int64_t b, int64_t r, int64_t c) const { return v[((batched ? b : 0) * rows + r) * cols + c]; }
};

Operand make_operand(Generator& gen, DType dt, int64_t batch, int64_t rows, int64_t cols, bool pad, double scale = 1.0) {
  Operand o;
  o.rows = rows, o.cols = cols, o.batched = batch > 0;
  const int64_t ld = pad ? (cols + 7) / 8 * 8 + 8 : cols;
  const int64_t nb = batch > 0 ? batch : 1;
  Tensor full = mul(randn({nb, rows, ld}, gen, DType::f64), scale).to(dt);
  Tensor g = full.to(gpu());
  o.cpu = full.narrow(2, 0, cols);
  o.gpu = g.narrow(2, 0, cols);
  if (batch == 0) o.cpu = o.cpu.select(0, 0), o.gpu = o.gpu.select(0, 0);
  o.v = o.cpu.to(DType::f64).contiguous().to_vector<double>();
  return o;
}

// x rounded to dt (to nearest even; through f32 first, as the kernel's f32 value is).
double round_to(double x, DType dt) {
  const float f = static_cast<float>(x);
  if (dt == DType::f16) return static_cast<double>(static_cast<_Float16>(f));
  if (dt != DType::bf16 || !std::isfinite(f)) return f;
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  bits = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  float r;
  std::memcpy(&r, &bits, 4);
  return r;
}

// The reference product P[b, r, c] = Σ_k A(r, k) B(k, c) and S = Σ_k |A||B|.
struct Reference {
  int64_t batch, m, n, k;
  std::vector<double> p, s;
  double P(int64_t b, int64_t r, int64_t c) const { return p[(b * m + r) * n + c]; }
  double S(int64_t b, int64_t r, int64_t c) const { return s[(b * m + r) * n + c]; }
};
Reference reference(const Operand& a, const Operand& b, bool ta, bool tb, int64_t batch) {
  Reference R;
  R.batch = batch;
  R.m = ta ? a.cols : a.rows, R.k = ta ? a.rows : a.cols, R.n = tb ? b.rows : b.cols;
  R.p.assign(batch * R.m * R.n, 0.0), R.s.assign(batch * R.m * R.n, 0.0);
  for (int64_t bi = 0; bi < batch; ++bi)
    for (int64_t r = 0; r < R.m; ++r)
      for (int64_t c = 0; c < R.n; ++c) {
        double acc = 0, sa = 0;
        for (int64_t q = 0; q < R.k; ++q) {
          const double x = ta ? a.at(bi, q, r) : a.at(bi, r, q), y = tb ? b.at(bi, c, q) : b.at(bi, q, c);
          acc += x * y, sa += std::fabs(x * y);
        }
        R.p[(bi * R.m + r) * R.n + c] = acc, R.s[(bi * R.m + r) * R.n + c] = sa;
      }
  return R;
}

double ulp_rel(DType t) { return t == DType::bf16 ? 1.0 / 256 : t == DType::f16 ? 1.0 / 2048 : 1.2e-7; }
constexpr double kAccRel = 1e-5;  // f32 accumulation error bound, relative to Σ|a||b|

struct Case {
  int64_t batch, m, n, k;
  bool broadcast_b;  // b 2-D, shared by the batch
};

const char* layout_name(bool ta, bool tb) { return ta ? (tb ? "tt" : "tn") : (tb ? "nt" : "nn"); }

// The kinds whose 16-bit tiles kiln's kernel may store by TMA (gemm_sm90::encode_output_map).
bool stageable(kg::Epilogue e, DType out_dt) {
  return out_dt != DType::f32 && e != kg::Epilogue::swiglu && e != kg::Epilogue::accumulate;
}

// Runs one (case, layout, dtype, epilogue, out dtype, backend) and checks every element
// (and row statistic) against the reference within its bound. Returns the output (for bits).
struct GemmRun {
  Tensor out, stats;
};
// out_pad: the output's extra columns (its leading dim; -1: 6 when pad, else 0). An out whose rows
// are 16-byte multiples apart (out_pad 8, N % 8 == 0) takes kiln's TMA-stored epilogue for the
// kinds that have one, unless direct_store.
GemmRun run_and_check(const Case& cs, bool ta, bool tb, DType dt, kg::Epilogue epi, DType out_dt, kg::Backend backend,
                  Generator& gen, bool pad, bool check = true, int tile_n = 0, bool direct_store = false,
                  int out_pad = -1) {
  if (out_pad < 0) out_pad = pad ? 6 : 0;
  const std::string what = std::string(kg::epilogue_name(epi)) + " " + layout_name(ta, tb) + " " + dtype_name(dt) +
                           ">" + dtype_name(out_dt) + " " + kg::backend_name(backend) + " m=" + std::to_string(cs.m) +
                           " n=" + std::to_string(cs.n) + " k=" + std::to_string(cs.k) +
                           " batch=" + std::to_string(cs.batch) + (pad ? " padded" : "") +
                           " out_pad=" + std::to_string(out_pad) + (tile_n ? " tile_n=" + std::to_string(tile_n) : "") +
                           (direct_store ? " direct" : "");
  const int64_t B = cs.batch;
  Operand a = ta ? make_operand(gen, dt, B, cs.k, cs.m, pad) : make_operand(gen, dt, B, cs.m, cs.k, pad);
  const int64_t bb = cs.broadcast_b ? 0 : B;
  Operand b = tb ? make_operand(gen, dt, bb, cs.n, cs.k, pad) : make_operand(gen, dt, bb, cs.k, cs.n, pad);
  const float alpha = epi == kg::Epilogue::none ? 0.75f : 1.0f;
  const int64_t ocols = epi == kg::Epilogue::swiglu ? cs.n / 2 : cs.n;

  kg::GemmProblem p;
  p.a = a.gpu, p.b = b.gpu, p.trans_a = ta, p.trans_b = tb;
  // out padded too (its own leading dim), NaN-poisoned; accumulate starts from random values.
  Operand init = make_operand(gen, DType::f32, B, cs.m, ocols, pad);
  Tensor out_full = full({B, cs.m, ocols + out_pad}, NAN, out_dt, gpu());
  p.out = out_full.narrow(2, 0, ocols);
  if (epi == kg::Epilogue::accumulate) p.out.copy_(init.gpu);
  kg::EpilogueArgs e;
  e.kind = epi, e.alpha = alpha;
  Operand bias, res;
  if (epi == kg::Epilogue::bias) {
    bias = make_operand(gen, out_dt, 1, 1, cs.n, false);
    e.bias = bias.gpu.select(0, 0).select(0, 0);
  }
  if (epi == kg::Epilogue::residual) {
    res = make_operand(gen, out_dt, B, cs.m, cs.n, pad);
    e.residual = res.gpu;
  }
  const int64_t tiles = kg::row_stat_tiles(cs.n);
  if (epi == kg::Epilogue::row_lse || epi == kg::Epilogue::row_sumsq) e.row_stats = full({B, cs.m, tiles}, NAN, DType::f32, gpu());
  kg::GemmOptions o;
  o.backend = backend;
  o.tile_n = tile_n;
  o.direct_store = direct_store;
  if (backend == kg::Backend::kiln) {  // the store path the case means to take
    // A TMA store needs 16-byte row strides, except where there is one row (one row of one batch:
    // no stride is used).
    const bool tma = stageable(epi, out_dt) && !direct_store && ((ocols + out_pad) % 8 == 0 || (cs.m == 1 && B == 1));
    EXPECT_EQ(kg::kiln_stores_by_tma(p, e, o), tma) << what;
  }
  kg::gemm(p, e, o);
  GemmRun result{p.out.to(kCPU), e.row_stats.defined() ? e.row_stats.to(kCPU) : Tensor()};
  if (!check) return result;
  const Reference R = reference(a, b, ta, tb, B);

  const std::vector<double> got = result.out.to(DType::f64).contiguous().to_vector<double>();
  const std::vector<double> st = result.stats.defined() ? result.stats.to(DType::f64).to_vector<double>() : std::vector<double>();
  const double ur = ulp_rel(out_dt);
  int64_t bad = 0;
  std::ostringstream first;
  auto expect = [&](double want, double g, double bound, const std::string& where) {
    if (std::isfinite(g) && std::fabs(g - want) <= bound) return;
    if (bad++ < 5) first << "  " << where << ": expected " << want << " got " << g << " (bound " << bound << ")\n";
  };
  for (int64_t bi = 0; bi < B; ++bi)
    for (int64_t r = 0; r < cs.m; ++r) {
      for (int64_t c = 0; c < ocols; ++c) {
        const std::string where = "[" + std::to_string(bi) + "," + std::to_string(r) + "," + std::to_string(c) + "]";
        const double g = got[(bi * cs.m + r) * ocols + c];
        if (epi == kg::Epilogue::swiglu) {
          const double gt = R.P(bi, r, 2 * c), up = R.P(bi, r, 2 * c + 1);
          const double eg = kAccRel * R.S(bi, r, 2 * c) + 1e-6, eu = kAccRel * R.S(bi, r, 2 * c + 1) + 1e-6;
          const double sg = gt / (1 + std::exp(-gt)), want = sg * up;
          expect(want, g, 1.1 * std::fabs(up) * eg + (std::fabs(sg) + eg) * eu + ur * std::fabs(want) + 1e-6, where);
          continue;
        }
        double want = alpha * R.P(bi, r, c);
        const double err = kAccRel * R.S(bi, r, c) + 1e-6;
        // cuBLASLt's BIAS epilogue rounds the product to the output type before it adds the bias
        // (seen on the H200: bf16 outputs up to 1.1 ulp off, every shape and layout): one more
        // rounding of the product in its bound. kiln's kernel adds the bias to the f32 accumulator.
        const double product_rounding = epi == kg::Epilogue::bias && backend != kg::Backend::kiln ? ur * std::fabs(want) : 0;
        if (epi == kg::Epilogue::bias) want += bias.at(0, 0, c);
        if (epi == kg::Epilogue::residual) want += res.at(bi, r, c);
        if (epi == kg::Epilogue::accumulate) want += init.at(bi, r, c);
        expect(want, g, err + ur * std::fabs(want) + product_rounding + 1e-6, where);
      }
      if (epi == kg::Epilogue::row_lse || epi == kg::Epilogue::row_sumsq) {
        for (int64_t t = 0; t < tiles; ++t) {
          double want = 0, bound = 1e-5;
          if (epi == kg::Epilogue::row_sumsq) {
            for (int64_t c = t * 128; c < std::min<int64_t>(cs.n, (t + 1) * 128); ++c) {
              const double v = round_to(R.P(bi, r, c), out_dt);
              const double e1 = kAccRel * R.S(bi, r, c) + ur * std::fabs(v) + 1e-6;
              want += v * v, bound += 2 * std::fabs(v) * e1 + e1 * e1;
            }
            bound += 1e-6 * want;
          } else {
            double mx = -INFINITY, emax = 0;
            for (int64_t c = t * 128; c < std::min<int64_t>(cs.n, (t + 1) * 128); ++c)
              mx = std::max(mx, R.P(bi, r, c)), emax = std::max(emax, kAccRel * R.S(bi, r, c));
            double sum = 0;
            for (int64_t c = t * 128; c < std::min<int64_t>(cs.n, (t + 1) * 128); ++c) sum += std::exp(R.P(bi, r, c) - mx);
            want = mx + std::log(sum);
            bound += emax + 1e-6 * std::fabs(want);
          }
          expect(want, st[(bi * cs.m + r) * tiles + t], bound,
                 "stats[" + std::to_string(bi) + "," + std::to_string(r) + "," + std::to_string(t) + "]");
        }
      }
    }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " elements out of bounds\n" << first.str();
  return result;
}

// The backends and kiln kernel variants each case runs: both tile widths with an out that TMA can
// store, 128 with an odd leading dim (direct stores), 128 with direct stores asked for (where the
// kind would stage), and cuBLASLt.
struct Variant {
  kg::Backend backend;
  int tile_n;
  bool direct_store;
  int out_pad;
};
std::vector<Variant> variants(kg::Epilogue e, DType out_dt) {
  std::vector<Variant> v = {{kg::Backend::kiln, 128, false, 8}, {kg::Backend::kiln, 256, false, 8},
                            {kg::Backend::kiln, 128, false, 6}};
  if (stageable(e, out_dt)) v.push_back({kg::Backend::kiln, 128, true, 8});
  v.push_back({kg::Backend::cublaslt, 0, false, 6});
  return v;
}

std::vector<DType> out_dtypes(kg::Epilogue e, DType dt) {
  if (e == kg::Epilogue::accumulate) return {DType::f32};
  if (e == kg::Epilogue::swiglu || e == kg::Epilogue::row_lse) return {dt};
  return {dt, DType::f32};
}

}  // namespace

TEST(Gemm, EveryLayoutDtypeEpilogueMatchesFloat64) {
  KILN_SKIP_WITHOUT_CUDA();
  const bool have_kiln = kiln_gemm_available();
  Generator gen(34);
  // 1, 7, 129, 1000; K = 1, 65, 200, 1000 (not multiples of 64), tails in M and N.
  // An odd N (131: the last column alone, odd leading dims of out) for every epilogue but swiglu.
  const std::vector<Case> cases = {{1, 1, 2, 1, false},     {1, 7, 130, 65, false},  {1, 129, 258, 200, false},
                                   {1, 1000, 136, 7, false}, {2, 130, 200, 96, false}, {3, 65, 66, 70, true},
                                   {2, 70, 131, 130, false}};
  for (const Case& cs : cases)
    for (int layout = 0; layout < 4; ++layout)
      for (DType dt : {DType::bf16, DType::f16})
        for (kg::Epilogue epi : kg::kAllEpilogues)
          for (DType odt : out_dtypes(epi, dt))
            for (const Variant& v : variants(epi, odt)) {
              if (epi == kg::Epilogue::swiglu && cs.n % 2 != 0) continue;
              if (v.backend == kg::Backend::kiln && !have_kiln) continue;
              run_and_check(cs, layout & 2, layout & 1, dt, epi, odt, v.backend, gen, /*pad=*/true, true, v.tile_n,
                            v.direct_store, v.out_pad);
            }
  ASSERT_TRUE(have_kiln) << "kiln's kernel did not run (needs an sm_90 GPU)";
}

TEST(Gemm, ContiguousOddLeadingDimsFallBackToCublasLt) {
  KILN_SKIP_WITHOUT_CUDA();
  Generator gen(35);
  // K = 7 contiguous: rows 14 bytes apart, which TMA cannot read. kiln refuses with the reason,
  // auto and cublaslt run it.
  kg::GemmProblem p;
  p.a = randn({129, 7}, gen, DType::bf16, gpu()), p.b = randn({7, 1000}, gen, DType::bf16, gpu());
  p.out = zeros({129, 1000}, DType::bf16, gpu());
  std::string why;
  EXPECT_FALSE(kg::kiln_supported(p, {}, &why));
  EXPECT_NE(why.find("16 bytes"), std::string::npos) << why;
  kg::GemmOptions o;
  o.backend = kg::Backend::kiln;
  EXPECT_THROW(kg::gemm(p, {}, o), Error);
  for (kg::Backend be : {kg::Backend::automatic, kg::Backend::cublaslt})
    for (int layout = 0; layout < 4; ++layout)
      run_and_check({1, 129, 1000, 7, false}, layout & 2, layout & 1, DType::bf16, kg::Epilogue::bias, DType::bf16, be,
                    gen, /*pad=*/false);
}

TEST(Gemm, BitsEqualRunToRun) {
  KILN_SKIP_WITHOUT_CUDA();
  if (!kiln_gemm_available()) GTEST_SKIP() << "needs an sm_90 GPU";
  for (kg::Epilogue epi : kg::kAllEpilogues) {
    const DType odt = epi == kg::Epilogue::accumulate ? DType::f32 : DType::bf16;
    for (const Variant& v : variants(epi, odt)) {
      const std::string what = std::string(kg::epilogue_name(epi)) + " " + kg::backend_name(v.backend) + " " +
                               std::to_string(v.tile_n) + (v.direct_store ? " direct" : "") + " out_pad " +
                               std::to_string(v.out_pad);
      Generator g1(7), g2(7);
      GemmRun r1 = run_and_check({2, 300, 520, 1100, false}, false, true, DType::bf16, epi, odt, v.backend, g1, true, false,
                                 v.tile_n, v.direct_store, v.out_pad);
      GemmRun r2 = run_and_check({2, 300, 520, 1100, false}, false, true, DType::bf16, epi, odt, v.backend, g2, true, false,
                                 v.tile_n, v.direct_store, v.out_pad);
      EXPECT_TRUE(same_bits(r2.out, r1.out, "out " + what));
      if (r1.stats.defined()) {
        EXPECT_TRUE(same_bits(r2.stats, r1.stats, "stats " + what));
      }
    }
  }
}

// Block-sparse a (GemmProblem::a_nonzero, the fused loss's gradient filter): zero 64 × 64 blocks
// of op(a), flagged 0, are skipped with the same bits as the dense product; a block holding one
// large entry is flagged and multiplied; a tile row whose every block is zero gives the
// epilogue a zero product (out = 0, out = residual, out += 0). Both orientations of a (nn and
// tn: d_hidden and d_weight), M, N and K tails, both tile widths; cuBLASLt ignores the flags.
TEST(Gemm, BlockSparseASkipsZeroBlocksWithTheDenseBits) {
  KILN_SKIP_WITHOUT_CUDA();
  if (!kiln_gemm_available()) GTEST_SKIP() << "needs an sm_90 GPU";
  // 16-byte rows in both orientations (TMA): M, N, K multiples of 8; tails in M (296 = 2·128 + 40) and K (712).
  const int64_t M = 296, N = 200, K = 712, mb = kg::sparse_blocks(M), kb = kg::sparse_blocks(K);
  Generator gen(36);
  for (bool trans_a : {false, true}) {
    // op(a) [M, K] on the CPU, blocks zeroed: every block of rows 128-319 (tile row 1 whole, and
    // row block 4), a checkerboard elsewhere; row block 4's block (4, 6) given back one entry.
    std::vector<float> av = randn({M, K}, gen, DType::f32).to_vector<float>();
    std::vector<uint8_t> flags(static_cast<size_t>(mb * kb), 1);
    for (int64_t i = 0; i < mb; ++i)
      for (int64_t j = 0; j < kb; ++j) {
        const bool zero = (i >= 2 && i <= 4) || (i + j) % 2 == 0;
        if (!zero) continue;
        for (int64_t r = 64 * i; r < std::min(M, 64 * i + 64); ++r)
          for (int64_t c = 64 * j; c < std::min(K, 64 * j + 64); ++c) av[r * K + c] = 0.f;
        flags[i * kb + j] = (i == 0 && j == 4) ? 1 : 0;  // flagged nonzero though zero: allowed
      }
    av[(64 * 4 + 5) * K + 64 * 6 + 3] = 40.f;  // block (4, 6) was zeroed: one large entry, flagged
    flags[4 * kb + 6] = 1;
    // a on the device (op(a)'s values; [K, M] for tn), and flags on the device: for tn the same
    // flags with other strides (as the fused loss's d_weight has them).
    auto operand = [&](const std::vector<float>& values) {
      const Tensor t = from_vector<float>(values, {M, K});
      return (trans_a ? t.transpose(0, 1).contiguous() : t).to(DType::bf16).to(gpu());
    };
    auto device_flags = [&](const std::vector<uint8_t>& f) {
      const Tensor t = from_vector<uint8_t>(f, {mb, kb});
      return trans_a ? t.transpose(0, 1).contiguous().to(gpu()).transpose(0, 1) : t.to(gpu());
    };
    const Tensor a = operand(av), b = randn({K, N}, gen, DType::bf16, gpu()), nz = device_flags(flags);
    if (trans_a) {
      EXPECT_EQ(nz.stride(0), 1);
    }
    for (kg::Epilogue epi : {kg::Epilogue::none, kg::Epilogue::residual, kg::Epilogue::accumulate})
      for (int tile_n : {128, 256}) {
        const std::string what = std::string(trans_a ? "tn " : "nn ") + kg::epilogue_name(epi) + " tile " +
                                 std::to_string(tile_n);
        const DType odt = epi == kg::Epilogue::accumulate ? DType::f32 : DType::bf16;
        Tensor start = randn({M, N}, gen, odt, gpu());
        kg::EpilogueArgs e;
        e.kind = epi;
        if (epi == kg::Epilogue::residual) e.residual = start;
        kg::GemmOptions o;
        o.backend = kg::Backend::kiln;
        o.tile_n = tile_n;
        auto product = [&](const Tensor& a_, const Tensor& flags_, kg::Backend be) {
          kg::GemmProblem p;
          p.a = a_, p.b = b, p.trans_a = trans_a;
          p.out = epi == kg::Epilogue::accumulate ? start.clone() : full({M, N}, NAN, odt, gpu());
          p.a_nonzero = flags_;
          kg::GemmOptions q = o;
          q.backend = be;
          kg::gemm(p, e, q);
          return p.out.to(kCPU);
        };
        const Tensor dense = product(a, Tensor(), kg::Backend::kiln), sparse = product(a, nz, kg::Backend::kiln);
        EXPECT_TRUE(same_bits(sparse, dense, what));
        // Rows 128-255 (a tile row with every block zero): the epilogue of a zero product.
        const Tensor rows = sparse.narrow(0, 128, 128).to(DType::f64);
        const Tensor want = epi == kg::Epilogue::none ? zeros({128, N}, DType::f64)
                                                      : start.to(kCPU).narrow(0, 128, 128).to(DType::f64);
        EXPECT_TRUE(same_bits(rows, want, "zero tile row " + what));
        // Row 261 holds the large entry (its only nonzero): block (4, 6) was multiplied there.
        const double got261 = sparse.to(DType::f64).narrow(0, 261, 1).to_vector<double>()[0];
        const double start261 = epi == kg::Epilogue::none ? 0.0 : start.to(kCPU).to(DType::f64).narrow(0, 261, 1).to_vector<double>()[0];
        EXPECT_GT(std::abs(got261 - start261), 0.0) << what;
        if (tile_n == 128 && epi == kg::Epilogue::none) {
          // The flags are obeyed: block (0, 1) holds values but is flagged zero (block (1, 1) is
          // zero and flagged so), so the first tile row's K block 1 is skipped: the product of a
          // with block (0, 1) zeroed, bit for bit.
          std::vector<float> zv = av;
          for (int64_t r = 0; r < 64; ++r)
            for (int64_t c = 64; c < 128; ++c) zv[r * K + c] = 0.f;
          std::vector<uint8_t> lie = flags;
          lie[0 * kb + 1] = 0;
          const Tensor skipped = product(a, device_flags(lie), kg::Backend::kiln);
          EXPECT_TRUE(same_bits(skipped, product(operand(zv), Tensor(), kg::Backend::kiln),
                                "a block flagged zero is skipped " + what));
          EXPECT_FALSE(same_bits(skipped, dense, "")) << "block (0, 1) was multiplied " << what;
        }
        if (tile_n == 128) {  // cuBLASLt computes every block: the same product within rounding
          const Tensor lt = product(a, nz, kg::Backend::cublaslt);
          EXPECT_LE(amax(abs(sub(lt.to(DType::f64), dense.to(DType::f64)))).item(),
                    0.1 + 0.02 * amax(abs(dense.to(DType::f64))).item()) << what;
        }
      }
  }
  // Flags of the wrong shape or dtype are refused, naming a_nonzero.
  kg::GemmProblem p;
  p.a = zeros({M, K}, DType::bf16, gpu()), p.b = zeros({K, N}, DType::bf16, gpu()), p.out = zeros({M, N}, DType::bf16, gpu());
  for (const Tensor& bad : {zeros({mb + 1, kb}, DType::u8, gpu()), zeros({mb, kb}, DType::f32, gpu())}) {
    p.a_nonzero = bad;
    try {
      kg::gemm(p, {});
      ADD_FAILURE() << "bad a_nonzero accepted";
    } catch (const Error& err) {
      EXPECT_NE(std::string(err.what()).find("a_nonzero"), std::string::npos) << err.what();
    }
  }
}

TEST(Gemm, TmaStoredTilesEqualDirectStores) {
  KILN_SKIP_WITHOUT_CUDA();
  if (!kiln_gemm_available()) GTEST_SKIP() << "needs an sm_90 GPU";
  // The same values leave either way: the staged tile (rounded in the same place) and the
  // registers' stores give the same bits, tails in M and N (300 × 520) and a batch included.
  for (kg::Epilogue epi : kg::kAllEpilogues)
    for (DType odt : {DType::bf16, DType::f16}) {
      if (!stageable(epi, odt)) continue;
      for (int tile_n : {128, 256}) {
        const std::string what = std::string(kg::epilogue_name(epi)) + " " + dtype_name(odt) + " " + std::to_string(tile_n);
        Generator g1(11), g2(11);
        GemmRun tma = run_and_check({2, 300, 520, 1100, false}, false, true, odt, epi, odt, kg::Backend::kiln, g1, true,
                                    false, tile_n, false, 8);
        GemmRun direct = run_and_check({2, 300, 520, 1100, false}, false, true, odt, epi, odt, kg::Backend::kiln, g2, true,
                                       false, tile_n, true, 8);
        EXPECT_TRUE(same_bits(direct.out, tma.out, "out " + what));
        if (tma.stats.defined()) {
          EXPECT_TRUE(same_bits(direct.stats, tma.stats, "stats " + what));
        }
      }
    }
}

TEST(Gemm, RowStatsCombineToTheWholeRow) {
  KILN_SKIP_WITHOUT_CUDA();
  Generator gen(36);
  const int64_t m = 33, n = 1000, k = 64;
  Tensor a = randn({m, k}, gen, DType::bf16, gpu()), b = randn({n, k}, gen, DType::bf16, gpu());
  const bool have_kiln = kiln_gemm_available();
  for (kg::Backend be : {kg::Backend::kiln, kg::Backend::cublaslt})
    for (kg::Epilogue epi : {kg::Epilogue::row_lse, kg::Epilogue::row_sumsq}) {
      if (be == kg::Backend::kiln && !have_kiln) continue;
      kg::GemmProblem p{a, b, zeros({m, n}, DType::f32, gpu()), false, true};
      kg::EpilogueArgs e;
      e.kind = epi;
      e.row_stats = zeros({1, m, kg::row_stat_tiles(n)}, DType::f32, gpu());
      kg::GemmOptions opt;
      opt.backend = be;
      kg::gemm(p, e, opt);
      Tensor whole = zeros({1, m}, DType::f32, gpu());
      kg::combine_row_stats(whole, e.row_stats, epi);
      const std::vector<double> o = p.out.to(kCPU).to(DType::f64).to_vector<double>();
      std::vector<double> w(m);
      for (int64_t r = 0; r < m; ++r) {
        double mx = -INFINITY, acc = 0;
        for (int64_t c = 0; c < n; ++c) mx = std::max(mx, o[r * n + c]);
        for (int64_t c = 0; c < n; ++c) {
          const double v = o[r * n + c];
          acc += epi == kg::Epilogue::row_lse ? std::exp(v - mx) : v * v;
        }
        w[r] = epi == kg::Epilogue::row_lse ? mx + std::log(acc) : acc;
      }
      Tensor want = from_vector<double>(w, {1, m});
      EXPECT_TRUE(all_close(whole, want.to(DType::f32), {1e-4, 1e-5},
                            std::string(kg::epilogue_name(epi)) + " " + kg::backend_name(be)));
    }
}

TEST(Gemm, MatmulOpTakesTheSelectedBackend) {
  KILN_SKIP_WITHOUT_CUDA();
  Generator gen(37);
  for (kg::Backend be : {kg::Backend::kiln, kg::Backend::cublaslt, kg::Backend::automatic}) {
    kg::set_default_backend(be);
    Tensor a = randn({3, 129, 200}, gen, DType::bf16), b = randn({200, 72}, gen, DType::bf16);
    Tensor want = matmul(a.to(DType::f64), b.to(DType::f64));
    Tensor got = matmul(a.to(gpu()), b.to(gpu()));
    EXPECT_TRUE(all_close(got, want.to(DType::bf16), {5e-2, 2e-2}, std::string("matmul ") + kg::backend_name(be)));
  }
  kg::clear_default_backend();
}

TEST(Gemm, AutoMeasuresOnceAndWritesTheCacheFile) {
  KILN_SKIP_WITHOUT_CUDA();
  if (!kiln_gemm_available()) GTEST_SKIP() << "needs an sm_90 GPU";
  // The cache folder is read when a device's cache is first made: this test owns the process's
  // first auto choice only if it runs first, so it checks the file wherever KILN_CACHE_DIR points.
  const char* env = std::getenv("KILN_CACHE_DIR");
  Generator gen(38);
  kg::GemmProblem p;
  p.a = randn({517, 264}, gen, DType::bf16, gpu()), p.b = randn({264, 392}, gen, DType::bf16, gpu());
  p.out = zeros({517, 392}, DType::bf16, gpu());
  kg::GemmOptions o;
  o.backend = kg::Backend::automatic;
  const kg::Backend c1 = kg::chosen_backend(p, {}, o), c2 = kg::chosen_backend(p, {}, o);
  EXPECT_TRUE(c1 == kg::Backend::kiln || c1 == kg::Backend::cublaslt);
  EXPECT_EQ(c1, c2);
  if (env && *env) {
    std::ifstream in(std::string(env) + "/gemm_choices.tsv");
    std::stringstream s;
    s << in.rdbuf();
    EXPECT_NE(s.str().find(kg::problem_key(p, {})), std::string::npos) << s.str();
  }
}

TEST(Gemm, BadArgumentsAreErrors) {
  KILN_SKIP_WITHOUT_CUDA();
  auto z = [](const Shape& s, DType t = DType::bf16) { return zeros(s, t, gpu()); };
  auto expect_error = [](const kg::GemmProblem& p, const kg::EpilogueArgs& e, const std::string& msg) {
    try {
      kg::gemm(p, e);
      ADD_FAILURE() << "no error, expected '" << msg << "'";
    } catch (const Error& err) {
      EXPECT_NE(std::string(err.what()).find(msg), std::string::npos) << err.what();
    }
  };
  expect_error({z({4, 8}), z({9, 8}), z({4, 8})}, {}, "inner dims differ (a gives K=8, b gives 9)");
  expect_error({z({4, 8}, DType::f32), z({8, 8}, DType::f32), z({4, 8}, DType::f32)}, {}, "must both be bf16 or both f16");
  expect_error({z({4, 8}), z({8, 8}), z({4, 8}, DType::f16)}, {}, "out must be bf16 or f32");
  expect_error({z({4, 8}), z({8, 8}), z({4, 7})}, {}, "out is [4, 7], expected [4, 8]");
  kg::EpilogueArgs sw;
  sw.kind = kg::Epilogue::swiglu;
  expect_error({z({4, 8}), z({8, 7}), z({4, 3})}, sw, "swiglu needs an even N");
  kg::EpilogueArgs acc;
  acc.kind = kg::Epilogue::accumulate;
  expect_error({z({4, 8}), z({8, 8}), z({4, 8})}, acc, "accumulate needs an f32 out");
  kg::EpilogueArgs bias;
  bias.kind = kg::Epilogue::bias;
  bias.bias = z({7});
  expect_error({z({4, 8}), z({8, 8}), z({4, 8})}, bias, "bias must be a contiguous [8] bf16 tensor");
  kg::EpilogueArgs lse;
  lse.kind = kg::Epilogue::row_lse;
  expect_error({z({4, 8}), z({8, 8}), z({4, 8})}, lse, "row_stats must be a contiguous f32 [1, 4, 1] tensor");
  expect_error({zeros({4, 8}, DType::bf16), z({8, 8}), z({4, 8})}, {}, "operands must be on one CUDA device");
}
