// FlexAttention tests: block-mask builder vs the element mask, the float64 reference vs finite
// differences, the CPU kernels vs the reference (output, lse, dq, dk, dv, d bias) for every mod
// and mask alone and combined, GQA, L != S, odd lengths, fully masked rows, bf16, bitwise
// determinism, non-contiguous inputs, the run-time MaskSpec path, bad input, and (with a GPU)
// the CUDA kernels and builder vs the CPU ones.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <initializer_list>
#include <string>
#include <tuple>
#include <utility>

#include "kiln/attention/flex_attention.h"
#include "kiln/attention/reference.h"
#include "kiln/core/device.h"
#include "kiln/core/kernel_registry.h"
#include "kiln/kernels/flex_files.h"
#include "kiln/ops/backward.h"
#include "tests/ops/harness.h"

using namespace kiln;
using namespace kiln::attention;
using kiln::kernels::FlexBackend;

namespace {

// A mask with fully masked rows: kv at least 3 behind the query (rows 0..2 see nothing).
struct Behind3 {
  KILN_HD bool operator()(int, int, int q, int kv) const { return kv <= q - 3; }
};
// Odd per-(b, h) pattern: head parity selects even/odd kv positions, plus the diagonal.
struct OddPattern {
  KILN_HD bool operator()(int b, int h, int q, int kv) const { return ((kv + h + b) % 2 == 0) || q == kv; }
};
// score * 2 with a q/kv dependent term (exercises dscore != 1 via softcap elsewhere).
struct TimesTwo {
  template <class T> KILN_HD T operator()(T s, int, int h, int q, int kv) const { return s * T(2) + T(0.01) * T(h); }
  template <class T> KILN_HD T dscore(T, int, int, int, int) const { return T(2); }
};

// score · 0.1·√(q − kv): finite where kv <= q only; its value and derivative are NaN off a causal
// mask (a masked pair's dS must be 0 whatever the derivative says there, as in PyTorch).
struct RootDistance {
  template <class T> KILN_HD T operator()(T s, int, int, int q, int kv) const { return s * dscore(s, 0, 0, q, kv); }
  template <class T> KILN_HD T dscore(T, int, int, int q, int kv) const { return T(0.1) * std::sqrt(T(q - kv)); }
};

struct Case {
  int64_t B = 1, Hq = 2, Hkv = 2, L = 37, S = 37, E = 16, Ev = 16, qblock = 16, kvblock = 16;
  DType dtype = DType::f32;
  bool mask_per_head = false;
};

Tensor make(const Shape& s, Generator& g, DType dt) { return randn(s, g, DType::f32).to(dt); }

double max_abs(const Tensor& a) {
  double m = 0;
  for (double x : a.to(DType::f64).to_vector<double>()) m = std::max(m, std::abs(x));
  return m;
}

// got (any dtype) against golden (f64). Everywhere: no NaN, an inf only where golden has the
// same inf. f32: within 2e-5 of golden's scale (its largest magnitude, at least 1); 16-bit: a
// mean error at most 1.1 × that of golden rounded to the same dtype, + 2e-3 of the mean
// magnitude (+ eps).
void expect_close_to_golden(const Tensor& got, const Tensor& golden, DType dt, const std::string& what) {
  const Tensor g64 = got.to(DType::f64), r64 = golden.to(DType::f64);
  if (dt == DType::f32) {
    const double scale = std::max(1.0, max_abs(golden));
    EXPECT_TRUE(test::all_close(g64, r64, {.atol = 2e-5 * scale, .nan_matches = false}, what));
    return;
  }
  // The elementwise part only places NaN and inf (atol inf); the mean below judges the values.
  ASSERT_TRUE(test::all_close(g64, r64, {.atol = INFINITY, .nan_matches = false}, what));
  const auto g = g64.to_vector<double>(), r = r64.to_vector<double>();
  const auto rounded = golden.to(dt).to(DType::f64).to_vector<double>();
  double e_kiln = 0, e_ref = 0, mag = 0;
  size_t n = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    if (std::isinf(r[i])) continue;
    e_kiln += std::abs(g[i] - r[i]);
    e_ref += std::abs(rounded[i] - r[i]);
    mag += std::abs(r[i]);
    ++n;
  }
  if (n == 0) return;
  e_kiln /= n, e_ref /= n, mag /= n;
  EXPECT_LE(e_kiln, 1.1 * e_ref + 2e-3 * mag + 1e-6) << what << ": mean error " << e_kiln << " vs same-dtype "
                                                      << e_ref << " (mean |golden| " << mag << ")";
}

struct Grads {
  Tensor out, lse, dq, dk, dv, dbias;
};

// Runs flex (CPU or CUDA) with autograd on q/k/v (and bias), with output and lse gradients;
// `backend`: the CUDA kernels required to run it (FlexOptions::backend).
template <class SM, class MM>
Grads run_flex(const Tensor& q, const Tensor& k, const Tensor& v, SM sm, const BlockMask<MM>& bm, const Tensor& dout,
               const Tensor& dlse, const Tensor& bias, FlexBackend backend = FlexBackend::automatic,
               std::optional<double> scale = std::nullopt) {
  Tensor qg = q.detach().requires_grad_(), kg = k.detach().requires_grad_(), vg = v.detach().requires_grad_();
  FlexOptions o;
  o.return_lse = true;
  o.backend = backend;
  o.scale = scale;
  Tensor bg;
  if (bias.defined()) o.bias = bg = bias.detach().requires_grad_();
  FlexResult r = flex_attention(qg, kg, vg, sm, bm, o);
  run_backward({r.out, r.lse}, {dout, dlse}, false);
  Grads g{r.out, r.lse, qg.grad(), kg.grad(), vg.grad(), bg.defined() ? bg.grad() : Tensor()};
  return g;
}

template <class SM, class MM>
void check_case(const Case& c, SM sm, MM mm, uint64_t seed = 1) {
  SCOPED_TRACE(testing::Message() << "B=" << c.B << " Hq=" << c.Hq << " Hkv=" << c.Hkv << " L=" << c.L << " S=" << c.S
                                  << " E=" << c.E << " Ev=" << c.Ev << " blocks=" << c.qblock << "x" << c.kvblock
                                  << " dtype=" << dtype_name(c.dtype));
  Generator gen(seed);
  Tensor q = make({c.B, c.Hq, c.L, c.E}, gen, c.dtype), k = make({c.B, c.Hkv, c.S, c.E}, gen, c.dtype),
         v = make({c.B, c.Hkv, c.S, c.Ev}, gen, c.dtype);
  Tensor dout = make({c.B, c.Hq, c.L, c.Ev}, gen, c.dtype), dlse = make({c.B, c.Hq, c.L}, gen, DType::f32);
  Tensor bias;
  if constexpr (is_learnable_v<SM>) bias = mul(randn({c.Hq, c.L + c.S - 1}, gen), 0.5);
  auto bm = create_block_mask(mm, c.mask_per_head ? c.B : 1, c.mask_per_head ? c.Hq : 1, c.L, c.S, c.qblock,
                              c.kvblock);
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.E));
  Grads g = run_flex(q, k, v, sm, bm, dout, dlse, bias);
  ReferenceResult ref = reference_flex_attention(q, k, v, sm, mm, scale, dout, dlse, bias);
  expect_close_to_golden(g.out, ref.out, c.dtype, "out");
  expect_close_to_golden(g.lse, ref.lse, DType::f32, "lse");
  expect_close_to_golden(g.dq, ref.dq, c.dtype, "dq");
  expect_close_to_golden(g.dk, ref.dk, c.dtype, "dk");
  expect_close_to_golden(g.dv, ref.dv, c.dtype, "dv");
  if constexpr (is_learnable_v<SM>) expect_close_to_golden(g.dbias, ref.dbias, c.dtype, "dbias");
}

}  // namespace

// ---------------- BlockMask ----------------

template <class MM>
void check_builder(MM mm, int64_t Bm, int64_t Hm, int64_t L, int64_t S, int64_t qb, int64_t kb) {
  SCOPED_TRACE(testing::Message() << "L=" << L << " S=" << S << " blocks " << qb << "x" << kb);
  auto bm = create_block_mask(mm, Bm, Hm, L, S, qb, kb);
  const Tensor dense_t = bm.materialize().to(DType::u8), tiles_t = bm.to_dense();
  auto dense = dense_t.to_vector<uint8_t>();
  auto tiles = tiles_t.to_vector<int32_t>();
  const int64_t nq = (L + qb - 1) / qb, nk = (S + kb - 1) / kb;
  ASSERT_EQ(static_cast<int64_t>(tiles.size()), Bm * Hm * nq * nk);
  int64_t empty = 0;
  for (int64_t g = 0; g < Bm * Hm; ++g)
    for (int64_t a = 0; a < nq; ++a)
      for (int64_t c = 0; c < nk; ++c) {
        int any = 0, all = 1;
        for (int64_t i = a * qb; i < std::min(L, (a + 1) * qb); ++i)
          for (int64_t j = c * kb; j < std::min(S, (c + 1) * kb); ++j) {
            bool x = dense[static_cast<size_t>((g * L + i) * S + j)];
            any |= x, all &= x;
          }
        const int expect = !any ? 0 : (all ? 2 : 1);
        empty += expect == 0;
        ASSERT_EQ(tiles[static_cast<size_t>((g * nq + a) * nk + c)], expect) << "tile " << g << "," << a << "," << c;
      }
  EXPECT_NEAR(bm.sparsity(), static_cast<double>(empty) / static_cast<double>(Bm * Hm * nq * nk), 1e-12);
  // The transposed lists hold the same tiles.
  const BlockLayout& l = bm.layout;
  auto qn = l.q_num_blocks.to_vector<int32_t>(), qi = l.q_indices.to_vector<int32_t>();
  auto fqn = l.full_q_num_blocks.to_vector<int32_t>(), fqi = l.full_q_indices.to_vector<int32_t>();
  const int64_t nq1 = l.q_indices.size(3);
  for (int64_t g = 0; g < Bm * Hm; ++g)
    for (int64_t c = 0; c < nk; ++c) {
      std::vector<int> seen(static_cast<size_t>(nq), 0);
      for (int32_t x = 0; x < qn[static_cast<size_t>(g * nk + c)]; ++x)
        seen[static_cast<size_t>(qi[static_cast<size_t>((g * nk + c) * nq1 + x)])] = 1;
      for (int32_t x = 0; x < fqn[static_cast<size_t>(g * nk + c)]; ++x)
        seen[static_cast<size_t>(fqi[static_cast<size_t>((g * nk + c) * nq1 + x)])] = 2;
      for (int64_t a = 0; a < nq; ++a)
        ASSERT_EQ(seen[static_cast<size_t>(a)], tiles[static_cast<size_t>((g * nq + a) * nk + c)])
            << "transposed tile " << g << "," << a << "," << c;
    }
  // O(number of blocks): 8 i32 index arrays of at most Bm·Hm·nQ·nKV entries each.
  EXPECT_LE(l.nbytes(), 4 * 8 * Bm * Hm * (nq + 1) * (nk + 1));
}

// The mask functors against their definitions (they are written branch-free for the kernels).
TEST(BlockMask, MaskModsMatchTheirDefinitions) {
  for (int w : {-3, 0, 1, 2, 256}) {
    const SlidingWindow m{w};
    for (int q = 0; q < 300; q += 7)
      for (int kv = 0; kv < 300; kv += 5)
        ASSERT_EQ(m(0, 0, q, kv), q >= kv && q - kv < w) << w << " " << q << " " << kv;
    EXPECT_EQ(m(0, 0, 2147483647, 0), w > 0 && 2147483647 < w);
    EXPECT_EQ(m(0, 0, 0, 2147483647), false);
  }
  for (int n : {0, 10}) {
    const PrefixLM m{n};
    for (int q = 0; q < 40; ++q)
      for (int kv = 0; kv < 40; ++kv) ASSERT_EQ(m(0, 0, q, kv), kv < n || q >= kv);
  }
}

TEST(BlockMask, BuilderMatchesElementMask) {
  std::vector<int32_t> docs(300);
  for (size_t i = 0; i < docs.size(); ++i) docs[i] = static_cast<int32_t>(i < 40 ? 0 : (i < 41 ? 1 : (i < 170 ? 2 : 3)));
  Document doc{docs.data(), docs.data()};
  for (auto [L, S, qb, kb] : std::vector<std::array<int64_t, 4>>{{129, 129, 16, 16}, {100, 37, 32, 8}, {1, 129, 128, 128},
                                                                   {257, 300, 128, 64}, {7, 7, 3, 2}}) {
    check_builder(NoMask{}, 1, 1, L, S, qb, kb);
    check_builder(Causal{}, 1, 1, L, S, qb, kb);
    check_builder(SlidingWindow{20}, 1, 1, L, S, qb, kb);
    check_builder(PrefixLM{10}, 1, 1, L, S, qb, kb);
    check_builder(doc, 1, 1, L, S, qb, kb);
    check_builder(and_masks(Causal{}, doc, SlidingWindow{50}), 1, 1, L, S, qb, kb);
    check_builder(or_masks(PrefixLM{5}, SlidingWindow{4}), 1, 1, L, S, qb, kb);
    check_builder(OddPattern{}, 2, 3, L, S, qb, kb);
  }
}

TEST(BlockMask, SparsityOfCausalAndErrors) {
  auto bm = create_block_mask(Causal{}, 1, 1, 1024, 1024);  // 8x8 tiles: 8 partial, 28 full, 28 empty
  EXPECT_NEAR(bm.sparsity(), 28.0 / 64.0, 1e-12);
  EXPECT_EQ(bm.layout.q_block, 128);
  EXPECT_THROW(create_block_mask(Causal{}, 1, 1, 10, 10, 0, 16), Error);
  EXPECT_THROW(create_block_mask(Causal{}, 0, 1, 10, 10), Error);
}

// Block sizes past int32 (INT64_MAX made the block counts overflow to 0 tiles: nothing computed,
// the output left unwritten), a block of 0 given to layout_from_classes (a division by zero)
// and null document pointers (a crash in the builder) fail, naming them; so does a hand-edited
// layout whose block counts do not tile L x S (it left rows unwritten).
TEST(BlockMask, BadBlockSizesTablesAndLayoutsNamed) {
  EXPECT_KILN_ERROR(create_block_mask(Causal{}, 1, 1, 37, 37, INT64_MAX, 16), "block sizes must be in [1, 2^31)",
                    "9223372036854775807");
  EXPECT_KILN_ERROR(create_block_mask(Causal{}, 1, 1, 10, 10, 16, -4), "block sizes must be in [1, 2^31)", "-4");
  // batch · heads · blocks overflowing int64 (undefined behaviour in the size product before)
  EXPECT_KILN_ERROR(create_block_mask(NoMask{}, int64_t{1} << 40, int64_t{1} << 40, 8, 8), "has too many elements");
  EXPECT_KILN_ERROR(layout_from_classes({}, 1, 1, 10, 10, 0, 16), "layout_from_classes: block sizes");
  EXPECT_KILN_ERROR(create_block_mask(Document{}, 1, 1, 8, 8), "Document mask", "null pointer");
  std::vector<int32_t> ids(8, 0);
  EXPECT_KILN_ERROR(create_block_mask(and_masks(Causal{}, or_masks(PrefixLM{2}, Document{ids.data(), nullptr})), 1, 1,
                                      8, 8),
                    "Document mask", "null pointer");
  Generator gen(2);
  Tensor q = randn({1, 1, 64, 16}, gen);
  auto bm = create_block_mask(Causal{}, 1, 1, 64, 64, 16, 16);
  bm.layout.q_block = 8;  // 4 blocks of 8 rows would leave rows 32..63 unwritten
  EXPECT_KILN_ERROR(flex_attention(q, q, q, NoScoreMod{}, bm), "4 x 4 blocks of 8 x 16", "L=64, S=64");
  // Hand-edited block tables: the kernels read them through raw pointers (segfaults, or silent
  // zeros for indices past the blocks); every edit below is an error naming the table.
  auto edited = [&](const std::function<void(BlockMask<Causal>&)>& edit, const char* needle) {
    auto m = create_block_mask(Causal{}, 1, 1, 64, 64, 16, 16);
    edit(m);
    EXPECT_KILN_ERROR(flex_attention(q, q, q, NoScoreMod{}, m), "flex_attention: block mask's", needle);
  };
  edited([](BlockMask<Causal>& m) { m.layout.kv_num_blocks.fill_(100000); }, "partial + ");
  edited([](BlockMask<Causal>& m) { m.layout.full_kv_num_blocks.fill_(-5); }, "partial + ");
  edited([](BlockMask<Causal>& m) { m.layout.kv_indices.fill_(1000000); }, "lists block 1000000, outside [0, 4)");
  edited([](BlockMask<Causal>& m) { m.layout.full_q_indices.fill_(-1); }, "q row");
  edited([](BlockMask<Causal>& m) { m.layout.q_num_blocks = zeros({1, 4, 4}, DType::i32); }, "q counts are [1, 4, 4]");
  edited([](BlockMask<Causal>& m) { m.layout.kv_indices = zeros({1, 1, 4, 2}, DType::i32); },
         "kv indices are [1, 1, 4, 2]");
  edited([](BlockMask<Causal>& m) { m.layout.kv_indices = m.layout.kv_indices.to(DType::i64); }, "contiguous i32");
  // (From a probe) a block listed twice in a row counted its tile twice (output off by 62 %), and
  // q tables that disagree with the kv tables gave a right output with dK off by 64 %.
  edited([](BlockMask<Causal>& m) { m.layout.full_kv_indices.data<int32_t>()[2 * 4 + 1] = 0; },
         "kv row 2 lists block 0 twice");
  edited([](BlockMask<Causal>& m) { m.layout.kv_num_blocks.data<int32_t>()[3] = 0; },
         "q tables list tile (q block 3, kv block 3) of group 0 as partial, its kv tables as empty");
  edited([](BlockMask<Causal>& m) { m.layout.full_q_num_blocks.fill_(0); }, "q tables list 4 tiles of group 0, its kv tables 10");
  // Tables changed in place between the forward and the backward: an error naming the block mask
  // (filled with -1e7 the backward segfaulted; counts raised to a valid value gave wrong dq).
  for (bool valid : {false, true}) {
    auto m = create_block_mask(Causal{}, 1, 1, 64, 64, 16, 16);
    Tensor qg = q.detach().requires_grad_();
    FlexResult r = flex_attention(qg, q, q, NoScoreMod{}, m);
    if (valid) m.layout.full_kv_num_blocks.fill_(0);
    else m.layout.kv_indices.fill_(-1e7);
    EXPECT_KILN_ERROR(sum(r.out).backward(), "flex_attention's block mask", "modified by an in-place operation");
  }
}

// ---------------- the float64 reference vs finite differences ----------------

TEST(FlexReference, GradientsMatchFiniteDifferences) {
  Generator gen(7);
  const int64_t B = 1, Hq = 2, Hkv = 1, L = 5, S = 6, E = 3;
  Tensor q = randn({B, Hq, L, E}, gen, DType::f64), k = randn({B, Hkv, S, E}, gen, DType::f64),
         v = randn({B, Hkv, S, E}, gen, DType::f64);
  Tensor dout = randn({B, Hq, L, E}, gen, DType::f64), dlse = randn({B, Hq, L}, gen, DType::f64);
  Tensor bias = randn({Hq, L + S - 1}, gen, DType::f32);
  auto mm = or_masks(Behind3{}, PrefixLM{2});
  RelativePositionBias rb;
  const double scale = 0.7;
  auto loss = [&](const Tensor& qq, const Tensor& kk, const Tensor& vv, const Tensor& bb) {
    ReferenceResult r = reference_flex_attention(qq, kk, vv, rb, mm, scale, Tensor(), Tensor(), bb);
    auto o = r.out.to_vector<double>(), l = r.lse.to_vector<double>();
    auto go = dout.to_vector<double>(), gl = dlse.to_vector<double>();
    double s = 0;
    for (size_t i = 0; i < o.size(); ++i) s += o[i] * go[i];
    for (size_t i = 0; i < l.size(); ++i)
      if (std::isfinite(l[i])) s += l[i] * gl[i];
    return s;
  };
  ReferenceResult r = reference_flex_attention(q, k, v, rb, mm, scale, dout, dlse, bias);
  const double h = 1e-6;
  auto fd_check = [&](Tensor& t, const Tensor& grad, const char* name) {
    auto gv = grad.to(DType::f64).to_vector<double>();
    for (int64_t i = 0; i < t.numel(); ++i) {
      Tensor flat = t.view({t.numel()});
      const double x0 = flat.select(0, i).item();
      flat.select(0, i).fill_(x0 + h);
      const double up = loss(q, k, v, bias);
      flat.select(0, i).fill_(x0 - h);
      const double dn = loss(q, k, v, bias);
      flat.select(0, i).fill_(x0);
      EXPECT_NEAR((up - dn) / (2 * h), gv[static_cast<size_t>(i)], 2e-5) << name << "[" << i << "]";
    }
  };
  fd_check(q, r.dq, "dq");
  fd_check(k, r.dk, "dk");
  fd_check(v, r.dv, "dv");
  // bias is f32: use a bigger step and a looser tolerance.
  auto gb = r.dbias.to_vector<double>();
  for (int64_t i = 0; i < bias.numel(); i += 3) {
    Tensor flat = bias.view({bias.numel()});
    const double x0 = flat.select(0, i).item(), hb = 1e-2;
    flat.select(0, i).fill_(x0 + hb);
    const double up = loss(q, k, v, bias);
    flat.select(0, i).fill_(x0 - hb);
    const double dn = loss(q, k, v, bias);
    flat.select(0, i).fill_(x0);
    EXPECT_NEAR((up - dn) / (2 * hb), gb[static_cast<size_t>(i)], 2e-3) << "dbias[" << i << "]";
  }
}

// ---------------- CPU kernels vs the reference ----------------

TEST(FlexCpu, MasksAloneF32) {
  Case c;
  check_case(c, NoScoreMod{}, NoMask{});
  check_case(c, NoScoreMod{}, Causal{});
  check_case(c, NoScoreMod{}, SlidingWindow{9});
  check_case(c, NoScoreMod{}, PrefixLM{11});
  std::vector<int32_t> docs(37);
  for (int i = 0; i < 37; ++i) docs[static_cast<size_t>(i)] = i < 10 ? 0 : (i < 30 ? 1 : 2);
  check_case(c, NoScoreMod{}, Document{docs.data(), docs.data()});
  check_case(c, NoScoreMod{}, DocumentCausal{Causal{}, Document{docs.data(), docs.data()}});
  Case ph = c;
  ph.mask_per_head = true;
  ph.B = 2;
  check_case(ph, NoScoreMod{}, OddPattern{});
}

TEST(FlexCpu, ScoreModsAloneF32) {
  Case c;
  c.Hq = 4;
  std::vector<float> slopes(4);
  alibi_slopes(4, slopes.data());
  check_case(c, Alibi{slopes.data()}, NoMask{});
  check_case(c, Softcap{2.0f}, NoMask{});
  check_case(c, TimesTwo{}, NoMask{});
  check_case(c, RelativePositionBias{}, NoMask{});
}

TEST(FlexCpu, CombinedModsAndMasksF32) {
  Case c;
  c.Hq = 4, c.Hkv = 2, c.L = 45, c.S = 61;
  std::vector<float> slopes(4);
  alibi_slopes(4, slopes.data());
  std::vector<int32_t> docs(61);
  for (int i = 0; i < 61; ++i) docs[static_cast<size_t>(i)] = i / 13;
  Document doc{docs.data(), docs.data()};
  check_case(c, Alibi{slopes.data()}, and_masks(Causal{}, SlidingWindow{17}));
  check_case(c, Softcap{3.0f}, or_masks(PrefixLM{7}, SlidingWindow{5}));
  check_case(c, RelativePositionBias{}, and_masks(Causal{}, doc));
  check_case(c, RelativePositionBias{}, Causal{});
  check_case(c, Softcap{1.5f}, and_masks(doc, or_masks(Causal{}, PrefixLM{3})));
}

TEST(FlexCpu, GqaRatiosAndLengths) {
  for (int64_t ratio : {1, 2, 4}) {
    for (auto [L, S] : std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {1, 129}, {127, 129}, {129, 127}, {129, 129}}) {
      Case c;
      c.B = 2, c.Hkv = 1, c.Hq = ratio, c.L = L, c.S = S, c.E = 8, c.Ev = 12, c.qblock = 128, c.kvblock = 128;
      check_case(c, NoScoreMod{}, NoMask{}, static_cast<uint64_t>(L * 1000 + S + ratio));
      c.qblock = 32, c.kvblock = 64;
      check_case(c, NoScoreMod{}, Causal{}, static_cast<uint64_t>(L * 1000 + S + ratio));
    }
  }
}

TEST(FlexCpu, Length1000) {
  Case c;
  c.Hq = 1, c.Hkv = 1, c.L = 1000, c.S = 1000, c.E = 8, c.Ev = 8, c.qblock = 128, c.kvblock = 128;
  check_case(c, NoScoreMod{}, and_masks(Causal{}, SlidingWindow{200}));
}

// NaN in the inputs reaches the outputs of the rows whose kept scores it touches, as in PyTorch:
// a NaN query row (every score of the row NaN) gives that row NaN output and lse, a NaN key row
// the rows that keep it (causal: the rows at and after it); every other row is unchanged. (Before,
// such rows gave 0, as if fully masked, on CUDA and a finite value on the CPU, whose fast exp
// clamped NaN to 88.) The forward only: a NaN also spreads through the masked entries of a tile's
// gradient products (0 · NaN), on every path, as in PyTorch.
void check_nan_rows(Device dev, DType dt, int64_t E, int64_t block, FlexBackend backend) {
  SCOPED_TRACE(testing::Message() << dev.str() << " " << dtype_name(dt) << " E=" << E << " block=" << block);
  constexpr int64_t H = 2, L = 300, kNanQuery = 5, kNanKey = 200;  // query: head 1; key: head 0
  Generator gen(static_cast<uint64_t>(E + block));
  const Tensor q0 = make({1, H, L, E}, gen, DType::f32), k0 = make({1, H, L, E}, gen, DType::f32);
  const Tensor v = make({1, H, L, E}, gen, dt).to(dev);
  std::vector<float> qv = q0.to_vector<float>(), kv = k0.to_vector<float>();
  for (int64_t e = 0; e < E; ++e)
    qv[static_cast<size_t>((L + kNanQuery) * E + e)] = NAN, kv[static_cast<size_t>(kNanKey * E + e)] = NAN;
  const Tensor q = from_vector(qv, q0.shape()).to(dt).to(dev), k = from_vector(kv, k0.shape()).to(dt).to(dev);
  const auto bm = create_block_mask(Causal{}, 1, 1, L, L, block, block);
  const BlockMask<Causal> dbm{Causal{}, bm.layout.to(dev)};
  FlexOptions o;
  o.return_lse = true;
  o.backend = backend;
  const FlexResult r = flex_attention(q, k, v, NoScoreMod{}, dbm, o);
  const FlexResult clean = flex_attention(q0.to(dt).to(dev), k0.to(dt).to(dev), v, NoScoreMod{}, dbm, o);
  const std::vector<float> out = r.out.to(kCPU).to(DType::f32).to_vector<float>();
  const std::vector<float> lse = r.lse.to(kCPU).to_vector<float>();
  for (int64_t h = 0; h < H; ++h)
    for (int64_t i = 0; i < L; ++i) {
      const bool nan_row = h == 0 ? i >= kNanKey : i == kNanQuery;
      const size_t row = static_cast<size_t>(h * L + i);
      ASSERT_EQ(std::isnan(lse[row]), nan_row) << "lse of head " << h << " row " << i << ": " << lse[row];
      for (int64_t e = 0; e < E; ++e)
        ASSERT_EQ(std::isnan(out[row * static_cast<size_t>(E) + static_cast<size_t>(e)]), nan_row)
            << "out of head " << h << " row " << i << " column " << e;
    }
  // The other rows as without the NaN inputs (the NaN key is masked for head 0's rows before it).
  auto rows = [](const Tensor& t, int64_t h, int64_t i0, int64_t i1) {
    return t.slice(1, h, h + 1).slice(2, i0, i1).to(kCPU).to(DType::f64).contiguous();
  };
  expect_close_to_golden(rows(r.out, 0, 0, kNanKey), rows(clean.out, 0, 0, kNanKey), dt,
                         "head 0 rows before the NaN key");
  expect_close_to_golden(rows(r.out, 1, kNanQuery + 1, L), rows(clean.out, 1, kNanQuery + 1, L), dt,
                         "head 1 rows after it");
}

TEST(FlexCpu, FullyMaskedRowsGiveZeroAndNoNaN) {
  Case c;
  c.L = 20, c.S = 20, c.qblock = 4, c.kvblock = 8;
  check_case(c, NoScoreMod{}, Behind3{});
  check_case(c, RelativePositionBias{}, Behind3{});
  // Explicitly: rows 0..2 give out 0, lse −inf, dq 0.
  Generator gen(3);
  Tensor q = randn({1, 1, 20, 16}, gen), k = randn({1, 1, 20, 16}, gen), v = randn({1, 1, 20, 16}, gen);
  auto bm = create_block_mask(Behind3{}, 1, 1, 20, 20, 4, 8);
  Grads g = run_flex(q, k, v, NoScoreMod{}, bm, randn({1, 1, 20, 16}, gen), zeros({1, 1, 20}), Tensor());
  auto o = g.out.to_vector<float>(), l = g.lse.to_vector<float>(), dq = g.dq.to_vector<float>();
  for (int i = 0; i < 3; ++i) {
    EXPECT_TRUE(std::isinf(l[static_cast<size_t>(i)]) && l[static_cast<size_t>(i)] < 0);
    for (int e = 0; e < 16; ++e) {
      EXPECT_EQ(o[static_cast<size_t>(i * 16 + e)], 0.0f);
      EXPECT_EQ(dq[static_cast<size_t>(i * 16 + e)], 0.0f);
    }
  }
  // A mask that hides everything.
  struct Nothing {
    KILN_HD bool operator()(int, int, int, int) const { return false; }
  };
  auto none = create_block_mask(Nothing{}, 1, 1, 20, 20, 4, 8);
  EXPECT_EQ(none.sparsity(), 1.0);
  Grads z = run_flex(q, k, v, NoScoreMod{}, none, ones({1, 1, 20, 16}), zeros({1, 1, 20}), Tensor());
  EXPECT_EQ(max_abs(z.out), 0.0);
  EXPECT_EQ(max_abs(z.dk), 0.0);
  EXPECT_EQ(max_abs(z.dv), 0.0);
}

// A score_mod whose derivative is NaN on masked pairs (inside partial tiles, blocks 8 and 16):
// the gradients stay finite and match the reference (0 · NaN made 272 of 320 dq values NaN).
TEST(FlexCpu, ScoreModDerivativeOffTheMaskIsIgnored) {
  Case c;
  c.L = 40, c.S = 40, c.qblock = 8, c.kvblock = 16;
  check_case(c, RootDistance{}, Causal{});
  check_case(c, RootDistance{}, SlidingWindow{9});
  c.dtype = DType::bf16;
  check_case(c, RootDistance{}, Causal{});
}

TEST(FlexCpu, NaNScoresGiveNaNRows) {
  for (DType dt : {DType::f32, DType::bf16}) check_nan_rows(kCPU, dt, 16, 64, FlexBackend::automatic);
}

TEST(FlexCpu, Bf16AndF16) {
  Case c;
  c.dtype = DType::bf16;
  c.Hq = 4, c.Hkv = 2, c.L = 70, c.S = 53, c.E = 32, c.Ev = 32, c.qblock = 32, c.kvblock = 16;
  std::vector<float> slopes(4);
  alibi_slopes(4, slopes.data());
  check_case(c, NoScoreMod{}, Causal{});
  check_case(c, Alibi{slopes.data()}, SlidingWindow{20});
  check_case(c, RelativePositionBias{}, PrefixLM{9});
  check_case(c, Softcap{2.0f}, NoMask{});
  c.dtype = DType::f16;
  check_case(c, NoScoreMod{}, Causal{});
}

TEST(FlexCpu, GradientsBitwiseDeterministic) {
  Generator gen(11);
  Tensor q = randn({2, 4, 150, 32}, gen), k = randn({2, 2, 150, 32}, gen), v = randn({2, 2, 150, 32}, gen);
  Tensor dout = randn({2, 4, 150, 32}, gen), dlse = randn({2, 4, 150}, gen), bias = randn({4, 299}, gen);
  auto bm = create_block_mask(SlidingWindow{40}, 1, 1, 150, 150, 32, 32);
  Grads a = run_flex(q, k, v, RelativePositionBias{}, bm, dout, dlse, bias);
  Grads b = run_flex(q, k, v, RelativePositionBias{}, bm, dout, dlse, bias);
  for (auto [x, y, name] : {std::tuple{a.out, b.out, "out"}, {a.dq, b.dq, "dq"}, {a.dk, b.dk, "dk"},
                            {a.dv, b.dv, "dv"}, {a.dbias, b.dbias, "dbias"}}) {
    ASSERT_EQ(x.nbytes(), y.nbytes());
    EXPECT_EQ(std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()), 0) << name;
  }
}

// The CPU backward's one-pass form (one task per (b, h_kv): P and dS once for dQ, dK and dV; taken
// when B · H_kv covers the threads) against the two-pass form (more threads than B · H_kv): the same
// bits for every output (each sums in the same order: the results do not depend on the thread
// count), and each form against the float64 reference.
TEST(FlexCpu, OnePassAndTwoPassBackwardsAgree) {
  KILN_TEST_GENERATOR(gen);
  const int omp_before = omp_get_max_threads();
  Tensor q = randn({2, 4, 70, 16}, gen), k = randn({2, 2, 70, 16}, gen), v = randn({2, 2, 70, 12}, gen);
  Tensor dout = randn({2, 4, 70, 12}, gen), dlse = randn({2, 4, 70}, gen), bias = randn({4, 139}, gen);
  auto bm = create_block_mask(and_masks(Causal{}, SlidingWindow{40}), 1, 1, 70, 70, 16, 32);
  omp_set_num_threads(1);  // B · H_kv = 4 tasks >= 1 thread: one pass
  Grads one = run_flex(q, k, v, RelativePositionBias{}, bm, dout, dlse, bias);
  omp_set_num_threads(8);  // 4 tasks < 8 threads: two passes
  Grads two = run_flex(q, k, v, RelativePositionBias{}, bm, dout, dlse, bias);
  omp_set_num_threads(omp_before);
  for (auto [x, y, name] : {std::tuple{one.out, two.out, "out"}, {one.dq, two.dq, "dq"}, {one.dk, two.dk, "dk"},
                            {one.dv, two.dv, "dv"}, {one.dbias, two.dbias, "dbias"}}) {
    ASSERT_EQ(x.nbytes(), y.nbytes());
    EXPECT_EQ(std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()), 0) << name;
  }
  ReferenceResult r = reference_flex_attention(q, k, v, RelativePositionBias{}, and_masks(Causal{}, SlidingWindow{40}),
                                               0.25, dout, dlse, bias);
  for (const Grads* g : {&one, &two}) {
    EXPECT_TRUE(kiln::test::all_close(g->dq, r.dq.to_vector<double>(), {1e-4, 1e-4}, "dq vs float64"));
    EXPECT_TRUE(kiln::test::all_close(g->dk, r.dk.to_vector<double>(), {1e-4, 1e-4}, "dk vs float64"));
    EXPECT_TRUE(kiln::test::all_close(g->dv, r.dv.to_vector<double>(), {1e-4, 1e-4}, "dv vs float64"));
    EXPECT_TRUE(kiln::test::all_close(g->dbias, r.dbias.to_vector<double>(), {1e-4, 1e-4}, "dbias vs float64"));
  }
}

TEST(FlexCpu, NonContiguousInputsAndScale) {
  Generator gen(5);
  // [B, L, H, E] storage viewed as [B, H, L, E].
  Tensor q = randn({2, 33, 3, 16}, gen).transpose(1, 2), k = randn({2, 40, 3, 16}, gen).transpose(1, 2),
         v = randn({2, 40, 3, 8}, gen).transpose(1, 2);
  auto bm = create_block_mask(Causal{}, 1, 1, 33, 40, 16, 16);
  FlexOptions o;
  o.scale = 0.3;
  o.return_lse = true;
  FlexResult r = flex_attention(q, k, v, NoScoreMod{}, bm, o);
  ReferenceResult ref = reference_flex_attention(q, k, v, NoScoreMod{}, Causal{}, 0.3);
  expect_close_to_golden(r.out, ref.out, DType::f32, "out");
  expect_close_to_golden(r.lse, ref.lse, DType::f32, "lse");
}

TEST(FlexCpu, RuntimeMaskSpecMatchesTemplates) {
  Generator gen(9);
  Tensor q = randn({1, 2, 100, 16}, gen), k = randn({1, 2, 100, 16}, gen), v = randn({1, 2, 100, 16}, gen);
  for (const char* spec : {"none", "causal", "window:13", "document:30"}) {
    MaskSpec ms = parse_mask_spec(spec, 100);
    ms.block_size = 32;
    AnyBlockMask m = create_block_mask(ms, 100, 100);
    FlexResult r = flex_attention(q, k, v, m);
    std::vector<int32_t> docs(100);
    for (int i = 0; i < 100; ++i) docs[static_cast<size_t>(i)] = i / 30;
    Tensor got = r.out;
    ReferenceResult ref;
    const double sc = 0.25;
    if (ms.kind == MaskSpec::Kind::none) ref = reference_flex_attention(q, k, v, NoScoreMod{}, NoMask{}, sc);
    if (ms.kind == MaskSpec::Kind::causal) ref = reference_flex_attention(q, k, v, NoScoreMod{}, Causal{}, sc);
    if (ms.kind == MaskSpec::Kind::sliding_window)
      ref = reference_flex_attention(q, k, v, NoScoreMod{}, SlidingWindow{13}, sc);
    if (ms.kind == MaskSpec::Kind::document)
      ref = reference_flex_attention(q, k, v, NoScoreMod{}, DocumentCausal{Causal{}, Document{docs.data(), docs.data()}},
                                     sc);
    expect_close_to_golden(got, ref.out, DType::f32, spec);
  }
  EXPECT_THROW(parse_mask_spec("window:0", 10), Error);
  EXPECT_THROW(parse_mask_spec("blob", 10), Error);
}

TEST(FlexCpu, DenseOpsReferencePathAgrees) {
  Generator gen(13);
  Tensor q = randn({1, 2, 50, 16}, gen), k = randn({1, 2, 50, 16}, gen), v = randn({1, 2, 50, 16}, gen);
  auto bm = create_block_mask(SlidingWindow{10}, 1, 1, 50, 50, 16, 16);
  Tensor mf = bm.materialize().to(DType::f32).view({50, 50});
  Tensor drop = eq(mf, zeros({50, 50}));
  Tensor dout = randn({1, 2, 50, 16}, gen);
  Tensor q1 = q.detach().requires_grad_(), q2 = q.detach().requires_grad_();
  Tensor a = dense_attention_ops(q1, k, v, drop, 0.25);
  Tensor b = flex_attention(q2, k, v, NoScoreMod{}, bm).out;
  a.backward(dout);
  b.backward(dout);
  ReferenceResult ref = reference_flex_attention(q, k, v, NoScoreMod{}, SlidingWindow{10}, 0.25, dout);
  expect_close_to_golden(a, ref.out, DType::f32, "dense ops out");
  expect_close_to_golden(b, ref.out, DType::f32, "flex out");
  expect_close_to_golden(q1.grad(), ref.dq, DType::f32, "dense ops dq");
  expect_close_to_golden(q2.grad(), ref.dq, DType::f32, "flex dq");
}

TEST(FlexCpu, BadInputNamesTheArgument) {
  Generator gen(1);
  Tensor q = randn({1, 3, 8, 16}, gen), k = randn({1, 2, 8, 16}, gen), v = randn({1, 2, 8, 16}, gen);
  auto bm = create_block_mask(Causal{}, 1, 1, 8, 8);
  try {
    flex_attention(q, k, v, NoScoreMod{}, bm);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("multiple of kv heads"), std::string::npos) << e.what();
  }
  Tensor q2 = randn({1, 2, 9, 16}, gen);
  EXPECT_THROW(flex_attention(q2, k, v, NoScoreMod{}, bm), Error);  // L mismatch with the mask
  EXPECT_THROW(flex_attention(q.to(DType::f64), k.to(DType::f64), v.to(DType::f64), NoScoreMod{}, bm), Error);
  Tensor q3 = randn({1, 2, 8, 16}, gen);
  EXPECT_THROW(flex_attention(q3, k, v, RelativePositionBias{}, bm), Error);  // no bias table
}

TEST(FlexCpu, BackendOptionIsCheckedAndNamed) {
  EXPECT_EQ(parse_flex_backend("auto"), FlexBackend::automatic);
  EXPECT_EQ(parse_flex_backend("hopper"), FlexBackend::hopper);
  EXPECT_EQ(parse_flex_backend("sm90"), FlexBackend::hopper);
  EXPECT_EQ(parse_flex_backend("sm80"), FlexBackend::sm80);
  EXPECT_EQ(parse_flex_backend("simt"), FlexBackend::simt);
  for (FlexBackend b : {FlexBackend::automatic, FlexBackend::hopper, FlexBackend::sm80, FlexBackend::simt})
    EXPECT_EQ(parse_flex_backend(flex_backend_name(b)), b);
  EXPECT_KILN_ERROR(parse_flex_backend("fa3", "--backend"), "--backend: 'fa3'", "auto, hopper, sm80 or simt");
  // A CUDA kernel family asked for on CPU tensors: an error that says so.
  Generator gen(3);
  Tensor q = randn({1, 1, 8, 16}, gen), k = randn({1, 1, 8, 16}, gen), v = randn({1, 1, 8, 16}, gen);
  auto bm = create_block_mask(Causal{}, 1, 1, 8, 8);
  FlexOptions o;
  o.backend = FlexBackend::sm80;
  EXPECT_KILN_ERROR(flex_attention(q, k, v, NoScoreMod{}, bm, o), "backend sm80");
}

// On the CPU a block longer than the sequence is one tile of the sequence's length: blocks of
// 2^20 (whose tile buffers asked for 2^40 floats a thread: std::bad_alloc in a parallel region,
// so std::terminate) give the bits of the default block, forward and backward.
TEST(FlexCpu, BlocksLongerThanTheSequence) {
  Generator gen(4);
  Tensor q = randn({2, 4, 37, 16}, gen), k = randn({2, 2, 37, 16}, gen), v = randn({2, 2, 37, 12}, gen);
  Tensor dout = randn({2, 4, 37, 12}, gen), dlse = randn({2, 4, 37}, gen), bias = randn({4, 73}, gen);
  const auto mm = and_masks(Causal{}, SlidingWindow{20});
  const Grads a = run_flex(q, k, v, RelativePositionBias{}, create_block_mask(mm, 1, 1, 37, 37), dout, dlse, bias);
  const Grads b = run_flex(q, k, v, RelativePositionBias{}, create_block_mask(mm, 1, 1, 37, 37, 1 << 20, 1 << 20),
                           dout, dlse, bias);
  for (auto [x, y, name] : {std::tuple{a.out, b.out, "out"}, {a.lse, b.lse, "lse"}, {a.dq, b.dq, "dq"},
                            {a.dk, b.dk, "dk"}, {a.dv, b.dv, "dv"}, {a.dbias, b.dbias, "dbias"}}) {
    ASSERT_EQ(x.nbytes(), y.nbytes()) << name;
    EXPECT_EQ(std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()), 0) << name;
  }
}

// Parameters that made every score NaN, ±inf or 0 (silently: outputs of 0, NaN or uniform
// weights) or crashed (a null ALiBi table) fail, naming them; their legal neighbours still run.
TEST(FlexCpu, BadScaleAndScoreModParametersNamed) {
  Generator gen(6);
  Tensor q = randn({1, 2, 8, 16}, gen), k = randn({1, 2, 8, 16}, gen), v = randn({1, 2, 8, 16}, gen);
  auto bm = create_block_mask(Causal{}, 1, 1, 8, 8);
  for (double sc : {double(NAN), double(INFINITY), -double(INFINITY), 1e300}) {
    FlexOptions o;
    o.scale = sc;
    EXPECT_KILN_ERROR(flex_attention(q, k, v, NoScoreMod{}, bm, o), "options.scale must be finite");
  }
  EXPECT_KILN_ERROR(flex_attention(q, k, v, Softcap{0.0f}, bm), "Softcap.cap", "got 0");
  EXPECT_KILN_ERROR(flex_attention(q, k, v, Softcap{NAN}, bm), "Softcap.cap", "nan");
  EXPECT_KILN_ERROR(flex_attention(q, k, v, Softcap{INFINITY}, bm), "Softcap.cap", "inf");
  // 1/cap is inf in f32 below ~2.9e-39: a score of 0 gave a NaN row (0 · inf).
  EXPECT_KILN_ERROR(flex_attention(q, k, v, Softcap{1e-39f}, bm), "Softcap.cap", "reciprocal");
  expect_close_to_golden(flex_attention(q, k, v, Softcap{1e-37f}, bm).out,
                         reference_flex_attention(q, k, v, Softcap{1e-37f}, Causal{}, 0.25).out, DType::f32,
                         "softcap 1e-37");
  EXPECT_KILN_ERROR(flex_attention(q, k, v, Alibi{}, bm), "Alibi.slopes is null");
  // A negative cap is the same function as its absolute value.
  expect_close_to_golden(flex_attention(q, k, v, Softcap{-2.0f}, bm).out,
                         reference_flex_attention(q, k, v, Softcap{2.0f}, Causal{}, 0.25).out, DType::f32,
                         "softcap -2");
  // Head dims of 0: E = 0 had no default scale (1/sqrt(0) made every score NaN, the output 0),
  // Ev = 0 returned an lse of −inf on every row, and the CPU kernels indexed empty tile rows.
  Tensor q0 = randn({1, 2, 8, 0}, gen), k0 = randn({1, 2, 8, 0}, gen), v0 = randn({1, 2, 8, 0}, gen);
  FlexOptions one;
  one.scale = 1.0;
  EXPECT_KILN_ERROR(flex_attention(q0, k0, v, NoScoreMod{}, bm), "head dims must be >= 1", "E=0", "Ev=16");
  EXPECT_KILN_ERROR(flex_attention(q0, k0, v, NoScoreMod{}, bm, one), "head dims must be >= 1", "E=0");
  FlexOptions with_lse;
  with_lse.return_lse = true;
  EXPECT_KILN_ERROR(flex_attention(q, k, v0, NoScoreMod{}, bm, with_lse), "head dims must be >= 1", "Ev=0");
  // No kv heads: named as such (it said "query heads 0 must be a multiple of kv heads 0").
  Tensor none = randn({1, 0, 8, 16}, gen);
  EXPECT_KILN_ERROR(flex_attention(none, none, none, NoScoreMod{}, bm), "k and v need at least one head");
}

// flex_attention's backward reads its output gradients through raw pointers: root gradients of
// the wrong shape given to run_backward were read past their end (garbage or a crash); the
// engine now checks every root's gradient.
TEST(FlexCpu, BackwardChecksTheGradientShapes) {
  Generator gen(8);
  Tensor q = randn({1, 2, 8, 16}, gen).requires_grad_(), k = randn({1, 2, 8, 16}, gen), v = randn({1, 2, 8, 16}, gen);
  auto bm = create_block_mask(Causal{}, 1, 1, 8, 8);
  FlexOptions o;
  o.return_lse = true;
  FlexResult r = flex_attention(q, k, v, NoScoreMod{}, bm, o);
  EXPECT_KILN_ERROR(run_backward({r.out}, {randn({1, 2, 4, 16}, gen)}, false), "gradient 0 has shape [1, 2, 4, 16]",
                    "[1, 2, 8, 16]");
  r = flex_attention(q, k, v, NoScoreMod{}, bm, o);
  EXPECT_KILN_ERROR(run_backward({r.out, r.lse}, {randn({1, 2, 8, 16}, gen), randn({3}, gen)}, false),
                    "gradient 1 has shape [3]", "[1, 2, 8]");
}

// The run-time masks' bad input, named: numbers out of range (window:1e20 parsed as INT64_MAX),
// a negative seq_len (std::length_error from a vector of 2^64 ids), document ids unset, of
// another shape or length, floating (truncated: 0.5 and 0.7 were one document) or i64 past
// int32 (wrapped into another document). i64 ids in range still work.
TEST(FlexCpu, RuntimeMaskSpecBadInputNamed) {
  MaskSpec odd;
  odd.kind = static_cast<MaskSpec::Kind>(9);  // fell through every switch: an empty layout
  EXPECT_KILN_ERROR(create_block_mask(odd, 10, 10), "MaskSpec kind=9 is not one of: none, causal");
  EXPECT_KILN_ERROR(parse_mask_spec("window:99999999999999999999", 10), "window:99999999999999999999", "out of range");
  EXPECT_KILN_ERROR(parse_mask_spec("document:4", -1), "seq_len must be in [0, 2^31)", "-1");
  EXPECT_KILN_ERROR(create_block_mask(parse_mask_spec("window:3000000000", 10), 10, 10),
                    "window must be in [1, 2^31)", "3000000000");
  MaskSpec s;
  s.block_size = 0;  // checked before either builder (the GPU one divided by it) runs
  EXPECT_KILN_ERROR(create_block_mask(s, 8, 8), "create_block_mask: block sizes must be in [1, 2^31)", "got 0, 0");
  if (cuda_device_count() > 0)
    EXPECT_KILN_ERROR(create_block_mask(s, 8, 8, Device::parse("cuda:0")), "block sizes must be in [1, 2^31)");
  s.block_size = kDefaultBlockSize;
  s.kind = MaskSpec::Kind::document;
  EXPECT_KILN_ERROR(create_block_mask(s, 8, 8), "document_ids is not set");
  s.document_ids = from_vector(std::vector<float>{0, 0.5f, 0.7f, 1, 1.2f, 1.9f, 2, 2}, {8});
  EXPECT_KILN_ERROR(create_block_mask(s, 8, 8), "integer ids", "got f32 [8]");
  s.document_ids = zeros({2, 8}, DType::i32);
  EXPECT_KILN_ERROR(create_block_mask(s, 8, 8), "got i32 [2, 8]");
  s.document_ids = zeros({4}, DType::i32);
  EXPECT_KILN_ERROR(create_block_mask(s, 8, 8), "[>= 8]", "got i32 [4]");
  s.document_ids = from_vector(std::vector<int64_t>{0, 0, 0, 1, 1, 1, int64_t{1} << 32, int64_t{1} << 32}, {8});
  EXPECT_KILN_ERROR(create_block_mask(s, 8, 8), "document id 4294967296 does not fit i32");
  s.document_ids = from_vector(std::vector<int64_t>{0, 0, 0, 1, 1, 1, 2, 2}, {8});
  Generator gen(10);
  Tensor q = randn({1, 1, 8, 16}, gen), k = randn({1, 1, 8, 16}, gen), v = randn({1, 1, 8, 16}, gen);
  std::vector<int32_t> ids{0, 0, 0, 1, 1, 1, 2, 2};
  const DocumentCausal doc{Causal{}, Document{ids.data(), ids.data()}};
  expect_close_to_golden(flex_attention(q, k, v, create_block_mask(s, 8, 8)).out,
                         reference_flex_attention(q, k, v, NoScoreMod{}, doc, 0.25).out, DType::f32,
                         "i64 document ids");
}

// A run-time document mask passed as a temporary: the recorded backward's mask_mod points into
// the mask's ids, which the backward now keeps alive (it read them freed: wrong gradients).
TEST(FlexCpu, TemporaryDocumentMaskOutlivesTheCall) {
  const int64_t L = 300;
  Generator gen(12);
  Tensor q = randn({1, 2, L, 16}, gen), k = randn({1, 2, L, 16}, gen), v = randn({1, 2, L, 16}, gen),
         dout = randn({1, 2, L, 16}, gen);
  Tensor qg = q.detach().requires_grad_(), kg = k.detach().requires_grad_(), vg = v.detach().requires_grad_();
  Tensor out = flex_attention(qg, kg, vg, create_block_mask(parse_mask_spec("document:50", L), L, L)).out;
  std::vector<Tensor> reuse;  // would take the freed ids' memory, with other ids
  for (int i = 0; i < 8; ++i) reuse.push_back(full({L}, 1000 + i, DType::i32));
  out.backward(dout);
  std::vector<int32_t> ids(static_cast<size_t>(L));
  for (int64_t i = 0; i < L; ++i) ids[static_cast<size_t>(i)] = static_cast<int32_t>(i / 50);
  const ReferenceResult ref = reference_flex_attention(
      q, k, v, NoScoreMod{}, DocumentCausal{Causal{}, Document{ids.data(), ids.data()}}, 0.25, dout);
  expect_close_to_golden(qg.grad(), ref.dq, DType::f32, "dq");
  expect_close_to_golden(kg.grad(), ref.dk, DType::f32, "dk");
  expect_close_to_golden(vg.grad(), ref.dv, DType::f32, "dv");
}

// ---------------- CUDA ----------------

// Runs the library masks on the GPU and compares with the CPU kernels (same dtype) and the
// float64 reference; messages name the mask, dtype, shape and tensor that disagree.
TEST(FlexCuda, MatchesCpuAndReference) {
  KILN_SKIP_WITHOUT_CUDA();
  const Device gpu = Device::parse("cuda:0");
  struct Shp {
    int64_t B, Hq, Hkv, L, S, E;
  };
  for (Shp sh : {Shp{1, 2, 2, 1, 1, 64}, Shp{1, 2, 1, 127, 129, 64}, Shp{2, 4, 2, 129, 129, 128},
                 Shp{1, 4, 1, 300, 300, 64}}) {
    for (const char* spec : {"none", "causal", "window:37", "document:50"}) {
      for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
        SCOPED_TRACE(testing::Message() << spec << " " << dtype_name(dt) << " B=" << sh.B << " Hq=" << sh.Hq
                                        << " Hkv=" << sh.Hkv << " L=" << sh.L << " S=" << sh.S << " E=" << sh.E);
        Generator gen(static_cast<uint64_t>(sh.L + sh.E));
        Tensor q = make({sh.B, sh.Hq, sh.L, sh.E}, gen, dt), k = make({sh.B, sh.Hkv, sh.S, sh.E}, gen, dt),
               v = make({sh.B, sh.Hkv, sh.S, sh.E}, gen, dt), dout = make({sh.B, sh.Hq, sh.L, sh.E}, gen, dt);
        MaskSpec ms = parse_mask_spec(spec, std::max(sh.L, sh.S));
        AnyBlockMask cm = create_block_mask(ms, sh.L, sh.S, kCPU), gm = create_block_mask(ms, sh.L, sh.S, gpu);
        {  // the GPU builder equals the CPU one
          auto a = cm.layout.to_dense().to_vector<int32_t>(), b = gm.layout.to_dense().to_vector<int32_t>();
          ASSERT_EQ(a, b) << "GPU block mask differs from the CPU one";
        }
        auto run = [&](const AnyBlockMask& m, Device d) {
          Tensor qg = q.to(d).detach().requires_grad_(), kg = k.to(d).detach().requires_grad_(),
                 vg = v.to(d).detach().requires_grad_();
          FlexOptions o;
          o.return_lse = true;
          FlexResult r = flex_attention(qg, kg, vg, m, o);
          r.out.backward(dout.to(d));
          return Grads{r.out.to(kCPU), r.lse.to(kCPU), qg.grad().to(kCPU), kg.grad().to(kCPU), vg.grad().to(kCPU), {}};
        };
        Grads c = run(cm, kCPU), g = run(gm, gpu), g2 = run(gm, gpu);
        for (auto [x, y, name] : {std::tuple{g.out, c.out, "out"}, {g.lse, c.lse, "lse"}, {g.dq, c.dq, "dq"},
                                  {g.dk, c.dk, "dk"}, {g.dv, c.dv, "dv"}})
        {
          const std::string what = std::string("gpu vs cpu ") + name;
          if (dt == DType::f32 || std::string(name) == "lse") {
            expect_close_to_golden(x, y.to(DType::f64), DType::f32, what);
          } else {  // both 16-bit: mean difference within a fraction of a 16-bit ulp of the magnitude
            auto a = x.to(DType::f64).to_vector<double>(), b = y.to(DType::f64).to_vector<double>();
            double diff = 0, mag = 0;
            for (size_t i = 0; i < a.size(); ++i) {
              ASSERT_FALSE(std::isnan(a[i])) << what << " NaN at " << i;
              diff += std::abs(a[i] - b[i]), mag += std::abs(b[i]);
            }
            EXPECT_LE(diff, 5e-3 * mag + 1e-6 * a.size()) << what << ": mean diff " << diff / a.size()
                                                          << " mean |cpu| " << mag / a.size();
          }
        }
        for (auto [x, y, name] : {std::tuple{g.dq, g2.dq, "dq"}, {g.dk, g2.dk, "dk"}, {g.dv, g2.dv, "dv"}})
          EXPECT_EQ(std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()), 0) << "GPU " << name << " not bitwise reproducible";
      }
    }
  }
}

// ---------------- CUDA backward (tensor-core kernels) ----------------

namespace {

// Mean |got − golden| and mean |golden| over the finite golden entries (got must be NaN-free).
std::pair<double, double> mean_error(const Tensor& got, const Tensor& golden, const std::string& what) {
  auto g = got.to(DType::f64).to_vector<double>(), r = golden.to(DType::f64).to_vector<double>();
  double e = 0, mag = 0;
  size_t n = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    EXPECT_FALSE(std::isnan(g[i])) << what << " NaN at " << i;
    if (!std::isfinite(r[i])) continue;
    e += std::abs(g[i] - r[i]), mag += std::abs(r[i]), ++n;
  }
  return n ? std::pair{e / n, mag / n} : std::pair{0.0, 0.0};
}

// The CUDA kernels that must run a 16-bit or f32 call with head dims E = Ev and BlockMask blocks
// of `block` (docs/attention.md): hopper for blocks that are multiples of 128, sm80 for multiples
// of 64, simt otherwise or when a row of q, k or v is not 16-byte aligned; at E = Ev = 256 the
// forward's sm80 (blocks multiples of 64) and the backward's simt. The tests require it
// (FlexOptions::backend), so a kernel that silently fell back would fail them.
FlexBackend backend_for(const Tensor& q, const Tensor& k, const Tensor& v, int64_t block) {
  auto aligned = [](const Tensor& t) { return t.stride(0) % 8 == 0 && t.stride(1) % 8 == 0 && t.stride(2) % 8 == 0; };
  const int64_t E = q.size(3);
  const bool dim_256 = E == 256;  // the mma.sync kernels only
  if ((q.dtype() != DType::bf16 && q.dtype() != DType::f16) || E != v.size(3) || (E != 64 && E != 128 && !dim_256) ||
      !aligned(q) || !aligned(k) || !aligned(v))
    return FlexBackend::simt;
  if (dim_256) return block % 64 == 0 ? FlexBackend::sm80 : FlexBackend::simt;
  return block % 128 == 0 ? FlexBackend::hopper : block % 64 == 0 ? FlexBackend::sm80 : FlexBackend::simt;
}

// One backward case on the GPU (the tensor-core path applies: 16-bit, E = Ev ∈ {64, 128, 256},
// blocks of 64 or 128, aligned rows) against the CPU kernels (same dtype) and the float64 reference:
// mean |golden − gpu| ≤ 1.1 × mean |golden − cpu| + 2e-3 × mean |golden|; rows the mask empties
// give dq = 0 and lse = −inf; two GPU runs give bitwise equal dq / dk / dv. host_mm evaluates on
// the CPU, dev_mm is the same mask with device pointers. strided: q/k/v are [B, L, H, E] storage
// viewed as [B, H, L, E]. scale: the softmax scale (default 1/√E). Returns the number of empty
// (b, h, row) rows.
template <class MM>
int64_t check_backward_mma(int64_t B, int64_t Hq, int64_t Hkv, int64_t L, int64_t S, int64_t E, int64_t block, DType dt,
                        MM host_mm, MM dev_mm, bool strided, uint64_t seed,
                        std::optional<double> scale = std::nullopt) {
  SCOPED_TRACE(testing::Message() << "B=" << B << " Hq=" << Hq << " Hkv=" << Hkv << " L=" << L << " S=" << S
                                  << " E=" << E << " block=" << block << " " << dtype_name(dt)
                                  << (strided ? " strided" : ""));
  const Device gpu = Device::parse("cuda:0");
  Generator gen(seed);
  auto input = [&](Device d, const Tensor& storage) {
    return strided ? storage.to(d).transpose(1, 2) : storage.to(d);
  };
  Tensor qs = strided ? make({B, L, Hq, E}, gen, dt) : make({B, Hq, L, E}, gen, dt);
  Tensor ks = strided ? make({B, S, Hkv, E}, gen, dt) : make({B, Hkv, S, E}, gen, dt);
  Tensor vs = strided ? make({B, S, Hkv, E}, gen, dt) : make({B, Hkv, S, E}, gen, dt);
  Tensor dout = make({B, Hq, L, E}, gen, dt), dlse = make({B, Hq, L}, gen, DType::f32);
  Tensor q = input(kCPU, qs), k = input(kCPU, ks), v = input(kCPU, vs);
  auto bm = create_block_mask(host_mm, 1, 1, L, S, block, block);
  BlockMask<MM> gbm{dev_mm, bm.layout.to(gpu)};

  Grads c = run_flex(q, k, v, NoScoreMod{}, bm, dout, dlse, Tensor(), FlexBackend::automatic, scale);
  auto on_gpu = [&] {
    const Tensor qd = input(gpu, qs), kd = input(gpu, ks), vd = input(gpu, vs);
    Grads g = run_flex(qd, kd, vd, NoScoreMod{}, gbm, dout.to(gpu), dlse.to(gpu), Tensor(),
                       backend_for(qd, kd, vd, block), scale);
    return Grads{g.out.to(kCPU), g.lse.to(kCPU), g.dq.to(kCPU), g.dk.to(kCPU), g.dv.to(kCPU), {}};
  };
  Grads g = on_gpu(), g2 = on_gpu();
  ReferenceResult ref = reference_flex_attention(q, k, v, NoScoreMod{}, host_mm,
                                                 scale.value_or(1.0 / std::sqrt(static_cast<double>(E))), dout, dlse);

  expect_close_to_golden(g.out, ref.out, dt, "gpu out");
  expect_close_to_golden(g.lse, ref.lse, DType::f32, "gpu lse");
  for (auto [got, cpu, golden, name] : {std::tuple{g.dq, c.dq, ref.dq, "dq"}, {g.dk, c.dk, ref.dk, "dk"},
                                        {g.dv, c.dv, ref.dv, "dv"}}) {
    expect_close_to_golden(got, golden, dt, std::string("gpu ") + name);
    const auto [e_gpu, mag] = mean_error(got, golden, std::string("gpu ") + name);
    const auto [e_cpu, mag_cpu] = mean_error(cpu, golden, std::string("cpu ") + name);
    EXPECT_LE(e_gpu, 1.1 * e_cpu + 2e-3 * mag + 1e-6)
        << name << ": gpu mean error " << e_gpu << " vs cpu " << e_cpu << " (mean |golden| " << mag << ")";
  }
  // Rows the mask empties: lse −inf, dq exactly 0.
  auto lse = g.lse.to_vector<float>();
  auto dq = g.dq.to(DType::f32).to_vector<float>();
  int64_t empty = 0;
  for (int64_t r = 0; r < B * Hq * L; ++r) {
    const int64_t i = r % L;
    bool any = false;
    for (int64_t j = 0; j < S && !any; ++j) any = host_mm(0, 0, int(i), int(j));
    if (any) continue;
    ++empty;
    EXPECT_TRUE(std::isinf(lse[static_cast<size_t>(r)]) && lse[static_cast<size_t>(r)] < 0) << "row " << r;
    for (int64_t e = 0; e < E; ++e) EXPECT_EQ(dq[static_cast<size_t>(r * E + e)], 0.0f) << "dq row " << r;
  }
  for (auto [x, y, name] : {std::tuple{g.dq, g2.dq, "dq"}, {g.dk, g2.dk, "dk"}, {g.dv, g2.dv, "dv"}}) {
    EXPECT_TRUE(x.nbytes() == y.nbytes() && std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()) == 0)
        << "GPU " << name << " not bitwise reproducible";
  }
  return empty;  // rows (over b, h) the mask empties
}

// The forward on the GPU (q/k/v already there, any strides; gpu_mm with device pointers), for
// each BlockMask block size, vs the CPU kernel (host copies, host_mm) and the float64 reference:
// the GPU's mean output error is at most 1.1 × the CPU kernel's + a small epsilon, lse matches
// to f32 accuracy, and rows the mask empties give output 0 and lse −inf (never NaN).
template <class MM>
void check_cuda_forward(const Tensor& qg, const Tensor& kg, const Tensor& vg, MM host_mm, MM gpu_mm,
                        std::initializer_list<int64_t> blocks, const std::string& what) {
  const DType dt = qg.dtype();
  const Tensor q = qg.to(kCPU), k = kg.to(kCPU), v = vg.to(kCPU);
  const int64_t L = q.size(2), S = k.size(2), Ev = v.size(3);
  FlexOptions o;
  o.return_lse = true;
  const FlexResult c = flex_attention(q, k, v, NoScoreMod{}, create_block_mask(host_mm, 1, 1, L, S), o);
  const ReferenceResult ref =
      reference_flex_attention(q, k, v, NoScoreMod{}, host_mm, 1.0 / std::sqrt(static_cast<double>(q.size(3))));
  const auto [e_cpu, mag] = mean_error(c.out, ref.out, what + " cpu out");
  auto lv = ref.lse.to_vector<double>();
  for (int64_t block : blocks) {
    SCOPED_TRACE(what + " block=" + std::to_string(block));
    auto bm = create_block_mask(host_mm, 1, 1, L, S, block, block);
    const BlockMask<MM> gbm{gpu_mm, bm.layout.to(qg.device())};
    FlexOptions og = o;
    og.backend = backend_for(qg, kg, vg, block);
    const FlexResult g = flex_attention(qg, kg, vg, NoScoreMod{}, gbm, og);
    const Tensor gout = g.out.to(kCPU), glse = g.lse.to(kCPU);
    ASSERT_EQ(gout.shape(), ref.out.shape());
    const double e_gpu = mean_error(gout, ref.out, "gpu out").first;
    EXPECT_LE(e_gpu, 1.1 * e_cpu + 2e-3 * mag + 1e-6) << "mean |golden - gpu| " << e_gpu << " vs |golden - cpu| "
                                                      << e_cpu << " (mean |golden| " << mag << ")";
    expect_close_to_golden(gout, ref.out, dt, "gpu out vs golden");
    expect_close_to_golden(glse, ref.lse, DType::f32, "gpu lse vs golden");
    expect_close_to_golden(glse, c.lse.to(DType::f64), DType::f32, "gpu lse vs cpu");
    // Emptied rows: exactly 0 and −inf.
    auto ov = gout.to(DType::f32).to_vector<float>();
    for (size_t r = 0; r < lv.size(); ++r) {
      if (!std::isinf(lv[r])) continue;
      for (int64_t e = 0; e < Ev; ++e) {
        ASSERT_EQ(ov[r * static_cast<size_t>(Ev) + static_cast<size_t>(e)], 0.0f) << "masked row " << r;
      }
    }
  }
}

}  // namespace

// The tensor-core forwards (bf16/f16, E = Ev ∈ {64, 128}): block size 128 runs the Hopper kernel
// (kernels/cuda/attention_fwd_wgmma.cuh), block size 64 the mma.sync one (attention_fwd_mma.cuh);
// and their fallbacks: L = S = 1000 and L ≠ S, GQA 4, block sizes 64 and 128, rows a document
// mask empties, q as a transposed view, a q whose rows are not 16-byte aligned (SIMT fallback),
// B = 2 with per-(b, h) K/V offsets.
TEST(FlexCuda, ForwardTensorCoresMatchCpuAndReference) {
  KILN_SKIP_WITHOUT_CUDA();
  const Device gpu = Device::parse("cuda:0");
  for (DType dt : {DType::bf16, DType::f16}) {
    const std::string dn = dtype_name(dt);
    Generator gen(dt == DType::bf16 ? 21 : 22);
    auto on_gpu = [&](const Shape& s) { return make(s, gen, dt).to(gpu); };
    // L = S = 1000, GQA 4, causal and sliding window, blocks 128 and 64, E = 128 and 64.
    for (int64_t E : {128, 64}) {
      Tensor q = on_gpu({1, 4, 1000, E}), k = on_gpu({1, 1, 1000, E}), v = on_gpu({1, 1, 1000, E});
      const std::string at = dn + " E=" + std::to_string(E);
      check_cuda_forward(q, k, v, Causal{}, Causal{}, {128, 64}, "L=S=1000 GQA4 causal " + at);
      check_cuda_forward(q, k, v, SlidingWindow{256}, SlidingWindow{256}, {128, 64}, "L=S=1000 GQA4 window:256 " + at);
    }
    // L ≠ S (200 vs 1000 and 1000 vs 200), B = 2, GQA 2, no mask / prefix LM.
    {
      Tensor q = on_gpu({2, 4, 200, 128}), k = on_gpu({2, 2, 1000, 128}), v = on_gpu({2, 2, 1000, 128});
      check_cuda_forward(q, k, v, NoMask{}, NoMask{}, {128}, "L=200 S=1000 B=2 none " + dn);
      check_cuda_forward(q, k, v, PrefixLM{300}, PrefixLM{300}, {64}, "L=200 S=1000 B=2 prefix:300 " + dn);
      Tensor q2 = on_gpu({2, 4, 1000, 64}), k2 = on_gpu({2, 2, 200, 64}), v2 = on_gpu({2, 2, 200, 64});
      check_cuda_forward(q2, k2, v2, Causal{}, Causal{}, {64}, "L=1000 S=200 B=2 causal " + dn);
    }
    // Tiny and tail shapes: L = 1 (one row of a 128-row CTA), S = 1 and S = 64 (a single
    // 64-key sub-tile: the pipeline's prologue only), L = 129 / S = 7 (tails on both sides).
    for (int64_t E : {128, 64}) {
      const std::string at = dn + " E=" + std::to_string(E);
      using Sz = std::pair<int64_t, int64_t>;
      for (auto [L, S] : std::vector<Sz>{{1, 1}, {1, 300}, {129, 64}, {129, 7}}) {
        Tensor q = on_gpu({1, 2, L, E}), k = on_gpu({1, 1, S, E}), v = on_gpu({1, 1, S, E});
        const std::string sz = " L=" + std::to_string(L) + " S=" + std::to_string(S) + " ";
        check_cuda_forward(q, k, v, NoMask{}, NoMask{}, {128, 64}, "tiny none" + sz + at);
        check_cuda_forward(q, k, v, Causal{}, Causal{}, {128}, "tiny causal" + sz + at);
      }
    }
    // Rows the mask empties: document ids on the q side that no key has (every 7th query and
    // the first 70), causal within documents of 97 tokens; L = S = 1000.
    {
      std::vector<int32_t> qd(1000), kd(1000);
      for (int i = 0; i < 1000; ++i) {
        kd[static_cast<size_t>(i)] = i / 97;
        qd[static_cast<size_t>(i)] = (i % 7 == 3 || i < 70) ? -1 : i / 97;
      }
      Tensor qd_c = from_vector(qd, {1000}), kd_c = from_vector(kd, {1000});
      Tensor qd_g = qd_c.to(gpu), kd_g = kd_c.to(gpu);
      const DocumentCausal host{Causal{}, Document{qd_c.data<int32_t>(), kd_c.data<int32_t>()}};
      const DocumentCausal dev{Causal{}, Document{qd_g.data<int32_t>(), kd_g.data<int32_t>()}};
      Tensor q = on_gpu({1, 2, 1000, 128}), k = on_gpu({1, 2, 1000, 128}), v = on_gpu({1, 2, 1000, 128});
      check_cuda_forward(q, k, v, host, dev, {128, 64}, "emptied rows " + dn);
    }
    // More (query tile, b, h) tiles than the H200 has SMs (2 × 8 × 18 = 288), so CTAs of the
    // persistent Hopper forward walk several tiles, some of them empty: the documents leave query
    // tiles 3 and 10 with no key (ids no key has); blocks 128 and 256.
    {
      constexpr int64_t n = 2304;
      std::vector<int32_t> qd(n), kd(n);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t tile = i / 128;
        kd[static_cast<size_t>(i)] = static_cast<int32_t>(i / 300);
        qd[static_cast<size_t>(i)] = (tile == 3 || tile == 10) ? -1 : static_cast<int32_t>(i / 300);
      }
      Tensor qd_c = from_vector(qd, {n}), kd_c = from_vector(kd, {n});
      Tensor qd_g = qd_c.to(gpu), kd_g = kd_c.to(gpu);
      const DocumentCausal host{Causal{}, Document{qd_c.data<int32_t>(), kd_c.data<int32_t>()}};
      const DocumentCausal dev{Causal{}, Document{qd_g.data<int32_t>(), kd_g.data<int32_t>()}};
      Tensor q = on_gpu({2, 8, n, 64}), k = on_gpu({2, 2, n, 64}), v = on_gpu({2, 2, n, 64});
      check_cuda_forward(q, k, v, host, dev, {128, 256}, "multi-tile persistent " + dn);
    }
    // Non-contiguous q, k, v: [B, L, H, E] storage viewed as [B, H, L, E]; then a q whose row
    // stride (E + 4) is not a multiple of 8 elements (not 16-byte aligned: SIMT fallback).
    {
      Tensor q = on_gpu({1, 1000, 4, 128}).transpose(1, 2), k = on_gpu({1, 1000, 2, 128}).transpose(1, 2),
             v = on_gpu({1, 1000, 2, 128}).transpose(1, 2);
      check_cuda_forward(q, k, v, SlidingWindow{256}, SlidingWindow{256}, {128}, "transposed q/k/v window " + dn);
      Tensor qm = on_gpu({1, 4, 300, 68}).narrow(3, 0, 64), km = on_gpu({1, 2, 300, 64}), vm = on_gpu({1, 2, 300, 64});
      check_cuda_forward(qm, km, vm, Causal{}, Causal{}, {64}, "misaligned q (fallback) " + dn);
    }
  }
}

TEST(FlexCuda, BackwardMmaMatchesCpuAndReference) {
  KILN_SKIP_WITHOUT_CUDA();
  const Device gpu = Device::parse("cuda:0");
  const DType bf = DType::bf16, hf = DType::f16;
  // GQA ratios 1 / 2 / 4, blocks 64 (the mma.sync backward) / 128 (the Hopper backward,
  // kernels/cuda/attention_bwd_wgmma.cuh), E 64 / 128, L == S and L != S.
  check_backward_mma<Causal>(1, 2, 2, 1000, 1000, 64, 64, bf, {}, {}, false, 1);
  check_backward_mma<SlidingWindow>(1, 4, 2, 1000, 1000, 128, 128, bf, {100}, {100}, true, 2);
  check_backward_mma<SlidingWindow>(2, 2, 1, 1000, 1000, 128, 64, hf, {37}, {37}, false, 3);
  check_backward_mma<Causal>(1, 4, 1, 200, 1000, 64, 128, bf, {}, {}, true, 4);
  check_backward_mma<PrefixLM>(1, 4, 4, 1000, 200, 64, 64, bf, {50}, {50}, false, 5);
  // Tiny and tail shapes (one step, one row; 128-row dQ CTAs at E = 64 with block 128).
  check_backward_mma<Causal>(1, 2, 1, 1, 1, 64, 128, bf, {}, {}, false, 6);
  check_backward_mma<NoMask>(1, 2, 2, 1, 129, 128, 128, hf, {}, {}, false, 7);
  check_backward_mma<Causal>(1, 2, 1, 129, 64, 64, 128, bf, {}, {}, true, 8);
  check_backward_mma<NoMask>(1, 2, 1, 129, 7, 64, 64, hf, {}, {}, false, 9);
  // Blocks of 256 (two 128-row tiles per block; at S = 300 the last block's second key tile lies
  // wholly past S).
  check_backward_mma<Causal>(1, 2, 1, 300, 300, 128, 256, bf, {}, {}, false, 10);
  check_backward_mma<SlidingWindow>(1, 4, 2, 700, 700, 64, 256, hf, {200}, {200}, true, 11);
  // Scales other than 1/√E, negative and zero included (the Hopper backward's identity path
  // takes any scale into its exponent and applies it to dK and dQ at the end).
  for (double sc : {0.3, -0.2, 0.0}) {
    SCOPED_TRACE(testing::Message() << "scale=" << sc);
    check_backward_mma<Causal>(1, 2, 1, 300, 300, 128, 128, bf, {}, {}, false, 12, sc);
    check_backward_mma<SlidingWindow>(1, 2, 2, 257, 257, 64, 128, hf, {60}, {60}, false, 13, sc);
  }
  // Causal documents with query rows that belong to no key document (their rows are empty):
  // documents of 150 tokens; queries 0..9 and 500..519 get ids no key has (and with L > S, the
  // queries of documents that start after the last key).
  using DocCase = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, DType>;  // L S Hq Hkv E block dt
  for (auto [L, S, Hq, Hkv, E, block, dt] : std::vector<DocCase>{
           {200, 1000, 4, 1, 128, 64, bf}, {1000, 200, 2, 1, 64, 128, hf}, {1000, 1000, 4, 2, 128, 128, bf}}) {
    std::vector<int32_t> qd(static_cast<size_t>(L)), kd(static_cast<size_t>(S));
    for (int64_t i = 0; i < L; ++i)
      qd[static_cast<size_t>(i)] = (i < 10 || (i >= 500 && i < 520)) ? -1 : static_cast<int32_t>(i / 150);
    for (int64_t j = 0; j < S; ++j) kd[static_cast<size_t>(j)] = int32_t(j / 150);
    Tensor qdg = from_vector(qd, {L}, gpu), kdg = from_vector(kd, {S}, gpu);
    DocumentCausal host{Causal{}, Document{qd.data(), kd.data()}};
    DocumentCausal dev{Causal{}, Document{qdg.data<int32_t>(), kdg.data<int32_t>()}};
    const auto seed = static_cast<uint64_t>(L + S + E);
    EXPECT_GT(check_backward_mma(2, Hq, Hkv, L, S, E, block, dt, host, dev, false, seed), 0);
  }
  // More tiles than an H100 / H200 has SMs (2 × 8 × 18 = 288 per pass), so the CTAs of the
  // persistent Hopper backward walk several tiles each, alternating their two resident buffers.
  // Documents of 300 tokens, and ids that leave query tiles 3 and 9 and key tiles 8 and 12 with
  // nothing to attend: walks with no steps between walks with steps (their results are zeros,
  // stored like any other). n = 2300 ends in a partial tile, which the dQ pass takes first and
  // the dK/dV pass last.
  {
    constexpr int64_t n = 2300;
    std::vector<int32_t> qd(n), kd(n);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t tile = i / 128;
      qd[static_cast<size_t>(i)] = (tile == 3 || tile == 9) ? -1 : static_cast<int32_t>(i / 300);
      kd[static_cast<size_t>(i)] = (tile == 8 || tile == 12) ? -2 : static_cast<int32_t>(i / 300);
    }
    Tensor qdg = from_vector(qd, {n}, gpu), kdg = from_vector(kd, {n}, gpu);
    DocumentCausal host{Causal{}, Document{qd.data(), kd.data()}};
    DocumentCausal dev{Causal{}, Document{qdg.data<int32_t>(), kdg.data<int32_t>()}};
    EXPECT_GT(check_backward_mma(2, 8, 8, n, n, 64, 128, bf, host, dev, false, 14), 0);
  }
  // The same at E = 128 (the dK/dV pass's one-step-at-a-time loop) with GQA (2 query heads a kv
  // head) and a partial last tile: 9 × 8 × 2 = 144 dK/dV tiles, 288 dQ tiles; and a window (136 each).
  check_backward_mma<Causal>(2, 16, 8, 1100, 1100, 128, 128, hf, {}, {}, false, 15);
  check_backward_mma<SlidingWindow>(1, 8, 8, 2100, 2100, 128, 128, bf, {256}, {256}, false, 16);
  // 640 tiles a pass (B = 2, 64 heads, 5 row tiles a head): ~5 tiles per CTA on 132 SMs, so
  // each resident buffer is taken three times (its res_empty completes twice, parity 0 then 1);
  // documents of 200 tokens with query tile 2 and key tile 1 left empty (walks with no steps
  // between walks with steps), at E = 64 and at E = 128 (the dK/dV pass's one-step loop).
  {
    constexpr int64_t n = 640;
    std::vector<int32_t> qd(n), kd(n);
    for (int64_t i = 0; i < n; ++i) {
      qd[static_cast<size_t>(i)] = i / 128 == 2 ? -1 : static_cast<int32_t>(i / 200);
      kd[static_cast<size_t>(i)] = i / 128 == 1 ? -2 : static_cast<int32_t>(i / 200);
    }
    Tensor qdg = from_vector(qd, {n}, gpu), kdg = from_vector(kd, {n}, gpu);
    DocumentCausal host{Causal{}, Document{qd.data(), kd.data()}};
    DocumentCausal dev{Causal{}, Document{qdg.data<int32_t>(), kdg.data<int32_t>()}};
    EXPECT_GT(check_backward_mma(2, 64, 64, n, n, 64, 128, bf, host, dev, false, 17), 0);
    EXPECT_GT(check_backward_mma(2, 64, 32, n, n, 128, 128, hf, host, dev, false, 18), 0);
  }
  // No lse gradient (return_lse = false: the backward gets dlse = null, as a model's attention
  // does): GPU (the Hopper backward) against the CPU kernel on the same inputs.
  {
    Generator gen(19);
    const int64_t L = 300, H = 4, E = 128;
    Tensor q = make({1, H, L, E}, gen, bf), k = make({1, H, L, E}, gen, bf), v = make({1, H, L, E}, gen, bf),
           dout = make({1, H, L, E}, gen, bf);
    auto run = [&](Device d) {
      Tensor qg = q.to(d).detach().requires_grad_(), kg = k.to(d).detach().requires_grad_(),
             vg = v.to(d).detach().requires_grad_();
      FlexOptions o;
      o.backend = d.is_cuda() ? FlexBackend::hopper : FlexBackend::automatic;
      const auto bm = create_block_mask(Causal{}, 1, 1, L, L, 128, 128);
      FlexResult r = flex_attention(qg, kg, vg, NoScoreMod{}, BlockMask<Causal>{Causal{}, bm.layout.to(d)}, o);
      r.out.backward(dout.to(d));
      return std::vector<Tensor>{qg.grad().to(kCPU), kg.grad().to(kCPU), vg.grad().to(kCPU)};
    };
    const std::vector<Tensor> c = run(kCPU), g = run(gpu);
    for (size_t t = 0; t < 3; ++t) {
      const auto [e, mag] = mean_error(g[t], c[t].to(DType::f64), "gpu vs cpu, no dlse");
      EXPECT_LE(e, 5e-3 * mag + 1e-6) << "gradient " << t << ": mean |gpu - cpu| " << e << ", mean |cpu| " << mag;
    }
  }
}

// The Hopper kernels walk their tiles head-major once one head's row tiles fill the GPU
// (tile_rank in kernels/cuda/attention_fwd_wgmma.cuh), heads fastest otherwise; every other case
// here has far fewer tiles than SMs. L = S = 128 · 160 + 77 (161 row tiles a head, more than the
// SMs of any Hopper part) with a sliding window and GQA 2 takes the head-major order in the
// forward and both backward passes, and ends on a partial tile: output, lse and gradients
// against the CPU kernel run in f32 on the same bf16 inputs (a tile walked for the wrong
// (b, head) or left out moves the mean error far past the rounding's).
TEST(FlexCuda, HeadMajorTileOrderMatchesCpu) {
  KILN_SKIP_WITHOUT_CUDA();
  const Device gpu = Device::parse("cuda:0");
  const int64_t B = 1, Hq = 2, Hkv = 1, L = 128 * 160 + 77, E = 64;
  const DType bf = DType::bf16;
  Generator gen(21);
  const Tensor q = make({B, Hq, L, E}, gen, bf), k = make({B, Hkv, L, E}, gen, bf), v = make({B, Hkv, L, E}, gen, bf);
  const Tensor dout = make({B, Hq, L, E}, gen, bf), dlse = make({B, Hq, L}, gen, DType::f32);
  const SlidingWindow mm{100};
  auto bm = create_block_mask(mm, 1, 1, L, L);
  const BlockMask<SlidingWindow> gbm{mm, bm.layout.to(gpu)};
  const Grads c = run_flex(q.to(DType::f32), k.to(DType::f32), v.to(DType::f32), NoScoreMod{}, bm,
                           dout.to(DType::f32), dlse, Tensor());
  const Grads g = run_flex(q.to(gpu), k.to(gpu), v.to(gpu), NoScoreMod{}, gbm, dout.to(gpu), dlse.to(gpu), Tensor(),
                           FlexBackend::hopper);
  expect_close_to_golden(g.lse.to(kCPU), c.lse.to(DType::f64), DType::f32, "lse");
  for (auto [got, want, name] : {std::tuple{g.out, c.out, "out"}, {g.dq, c.dq, "dq"}, {g.dk, c.dk, "dk"},
                                 {g.dv, c.dv, "dv"}}) {
    const Tensor gh = got.to(kCPU), golden = want.to(DType::f64);
    expect_close_to_golden(gh, golden, bf, name);
    // And element by element: one 128-row tile missed or misplaced among the 161 · 2 barely
    // moves a mean, but its elements are off by their own size (bf16 rounding: 0.4 %).
    const auto gv = gh.to(DType::f64).to_vector<double>(), wv = golden.to_vector<double>();
    double worst = 0;
    for (size_t i = 0; i < gv.size(); ++i) worst = std::max(worst, std::abs(gv[i] - wv[i]));
    EXPECT_LE(worst, 0.02 * max_abs(golden)) << name << ": worst error " << worst;
  }
}

// Head dims up to 256 (Gemma's 256, and E != Ev) on the SIMT kernels, forward and backward, and
// E = Ev = 256 on the mma.sync ones (the forward, and the backward with its two column CTAs per
// tile), against the CPU kernel and the float64 reference, with bitwise equal gradients across
// runs; past 256 the CUDA path is an error naming the limit.
TEST(FlexCuda, HeadDimsUpTo256) {
  KILN_SKIP_WITHOUT_CUDA();
  const Device gpu = Device::parse("cuda:0");
  auto check = [&]<class MM>(int64_t Hq, int64_t Hkv, int64_t L, int64_t S, int64_t E, int64_t Ev, DType dt, MM mm) {
    SCOPED_TRACE(testing::Message() << dtype_name(dt) << " Hq=" << Hq << " Hkv=" << Hkv << " L=" << L << " S=" << S
                                    << " E=" << E << " Ev=" << Ev);
    Generator gen(static_cast<uint64_t>(E + Ev + L));
    const Tensor q = make({1, Hq, L, E}, gen, dt), k = make({1, Hkv, S, E}, gen, dt);
    const Tensor v = make({1, Hkv, S, Ev}, gen, dt), dout = make({1, Hq, L, Ev}, gen, dt);
    const Tensor dlse = make({1, Hq, L}, gen, DType::f32);
    const BlockMask<MM> bm = create_block_mask(mm, 1, 1, L, S);
    const BlockMask<MM> gbm{mm, bm.layout.to(gpu)};
    const Grads cpu = run_flex(q, k, v, NoScoreMod{}, bm, dout, dlse, Tensor());
    auto on_gpu = [&] {  // the SIMT kernels required: the ones that must take these head dims
      const Grads g = run_flex(q.to(gpu), k.to(gpu), v.to(gpu), NoScoreMod{}, gbm, dout.to(gpu), dlse.to(gpu), Tensor(),
                               FlexBackend::simt);
      return Grads{g.out.to(kCPU), g.lse.to(kCPU), g.dq.to(kCPU), g.dk.to(kCPU), g.dv.to(kCPU), {}};
    };
    const Grads g = on_gpu(), g2 = on_gpu();
    const ReferenceResult ref =
        reference_flex_attention(q, k, v, NoScoreMod{}, mm, 1.0 / std::sqrt(static_cast<double>(E)), dout, dlse);
    expect_close_to_golden(g.lse, ref.lse, DType::f32, "gpu lse");
    for (auto [got, on_cpu, golden, name] : {std::tuple{g.out, cpu.out, ref.out, "out"}, {g.dq, cpu.dq, ref.dq, "dq"},
                                             {g.dk, cpu.dk, ref.dk, "dk"}, {g.dv, cpu.dv, ref.dv, "dv"}}) {
      expect_close_to_golden(got, golden, dt, std::string("gpu ") + name);
      const auto [e_gpu, mag] = mean_error(got, golden, std::string("gpu ") + name);
      const double e_cpu = mean_error(on_cpu, golden, std::string("cpu ") + name).first;
      EXPECT_LE(e_gpu, 1.1 * e_cpu + 2e-3 * mag + 1e-6) << name << ": gpu mean error " << e_gpu << " vs cpu " << e_cpu;
    }
    for (auto [x, y, name] : {std::tuple{g.dq, g2.dq, "dq"}, {g.dk, g2.dk, "dk"}, {g.dv, g2.dv, "dv"}})
      EXPECT_EQ(std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()), 0) << "GPU " << name << " not reproducible";
  };
  check(2, 1, 129, 129, 256, 256, DType::bf16, Causal{});
  check(1, 1, 130, 130, 256, 256, DType::f32, Causal{});
  check(2, 2, 70, 90, 256, 200, DType::f32, SlidingWindow{37});
  check(4, 2, 33, 33, 192, 256, DType::f16, NoMask{});
  // The forward at E = Ev = 256 on the mma.sync kernel (64-row CTAs), blocks of 128 and 64, GQA 2,
  // lengths that end in partial tiles, a row-strided view.
  for (DType dt : {DType::bf16, DType::f16}) {
    Generator g(static_cast<uint64_t>(dt == DType::bf16 ? 31 : 32));
    const Tensor q = make({1, 4, 300, 256}, g, dt).to(gpu), k = make({1, 2, 300, 256}, g, dt).to(gpu),
                 v = make({1, 2, 300, 256}, g, dt).to(gpu);
    const std::string dn = dtype_name(dt);
    check_cuda_forward(q, k, v, Causal{}, Causal{}, {128, 64}, "E=256 causal " + dn);
    check_cuda_forward(q, k, v, SlidingWindow{70}, SlidingWindow{70}, {64}, "E=256 window " + dn);
    auto strided = [&](int64_t len) { return make({1, len, 2, 256}, g, dt).to(gpu).transpose(1, 2); };
    const Tensor qs = strided(129), ks = strided(77), vs = strided(77);
    check_cuda_forward(qs, ks, vs, NoMask{}, NoMask{}, {128}, "E=256 strided L=129 S=77 " + dn);
  }
  // The mma.sync backward at E = 256: GQA 2 with causal blocks of 128, a window with blocks of
  // 64 and L != S, rows in [B, L, H, E] storage; lengths that end in partial tiles.
  const DType bf = DType::bf16, hf = DType::f16;
  EXPECT_EQ(check_backward_mma(1, 4, 2, 300, 300, 256, 128, bf, Causal{}, Causal{}, false, 51), 0);
  EXPECT_EQ(check_backward_mma(2, 2, 2, 200, 333, 256, 64, hf, SlidingWindow{70}, SlidingWindow{70}, false, 52), 0);
  EXPECT_EQ(check_backward_mma(1, 2, 1, 129, 77, 256, 64, bf, NoMask{}, NoMask{}, true, 53), 0);
  Generator gen(3);
  const Tensor q = make({1, 1, 8, 257}, gen, DType::f32).to(gpu), v = make({1, 1, 8, 16}, gen, DType::f32).to(gpu);
  const auto bm = create_block_mask(Causal{}, 1, 1, 8, 8);
  const BlockMask<Causal> gbm{Causal{}, bm.layout.to(gpu)};
  EXPECT_KILN_ERROR(flex_attention(q, q, v, NoScoreMod{}, gbm), "flex_attention (CUDA): head dims up to 256",
                    "got E=257, Ev=16");
}

// check_nan_rows on each CUDA forward: the Hopper one (bf16, E = 64 and 128, blocks of 128), the
// mma.sync one (blocks of 64, and E = 256) and the SIMT one (f32).
TEST(FlexCuda, NaNScoresGiveNaNRows) {
  KILN_SKIP_WITHOUT_CUDA();
  const Device gpu = Device::parse("cuda:0");
  check_nan_rows(gpu, DType::bf16, 64, 128, FlexBackend::hopper);
  check_nan_rows(gpu, DType::bf16, 128, 128, FlexBackend::hopper);
  check_nan_rows(gpu, DType::f16, 128, 64, FlexBackend::sm80);
  check_nan_rows(gpu, DType::bf16, 256, 128, FlexBackend::sm80);
  check_nan_rows(gpu, DType::f32, 64, 128, FlexBackend::simt);
}

// FlexOptions::backend on the GPU: a required kernel family that does not apply fails with
// what it needs (hopper for f32; sm80 for blocks of 32); simt runs a shape the tensor-core
// kernels would take (bf16, E = 128, block 128) and agrees with them and with the reference.
TEST(FlexCuda, BackendOptionRequiresOrFails) {
  KILN_SKIP_WITHOUT_CUDA();
  const Device gpu = Device::parse("cuda:0");
  Generator gen(41);
  auto expect_refusal = [&](DType dt, int64_t block, FlexBackend b, const std::string& needs) {
    Tensor q = make({1, 2, 256, 64}, gen, dt).to(gpu), k = make({1, 2, 256, 64}, gen, dt).to(gpu),
           v = make({1, 2, 256, 64}, gen, dt).to(gpu);
    const BlockMask<Causal> bm{Causal{}, create_block_mask(Causal{}, 1, 1, 256, 256, block, block).layout.to(gpu)};
    FlexOptions o;
    o.backend = b;
    SCOPED_TRACE(flex_backend_name(b));
    EXPECT_KILN_ERROR(flex_attention(q, k, v, NoScoreMod{}, bm, o), needs.c_str());
  };
  expect_refusal(DType::f32, 128, FlexBackend::hopper, "needs hopper: bf16 or f16");
  expect_refusal(DType::bf16, 32, FlexBackend::sm80, "needs sm80: bf16 or f16");
  expect_refusal(DType::bf16, 64, FlexBackend::hopper, "multiples of 128");

  Tensor q = make({1, 2, 300, 128}, gen, DType::bf16), k = make({1, 2, 300, 128}, gen, DType::bf16),
         v = make({1, 2, 300, 128}, gen, DType::bf16), dout = make({1, 2, 300, 128}, gen, DType::bf16),
         dlse = make({1, 2, 300}, gen, DType::f32);
  auto bm = create_block_mask(Causal{}, 1, 1, 300, 300);
  const BlockMask<Causal> gbm{Causal{}, bm.layout.to(gpu)};
  const ReferenceResult ref = reference_flex_attention(q, k, v, NoScoreMod{}, Causal{}, 1.0 / std::sqrt(128.0), dout, dlse);
  for (FlexBackend b : {FlexBackend::simt, FlexBackend::hopper}) {
    SCOPED_TRACE(flex_backend_name(b));
    Grads g = run_flex(q.to(gpu), k.to(gpu), v.to(gpu), NoScoreMod{}, gbm, dout.to(gpu), dlse.to(gpu), Tensor(), b);
    expect_close_to_golden(g.out.to(kCPU), ref.out, DType::bf16, "out");
    expect_close_to_golden(g.dq.to(kCPU), ref.dq, DType::bf16, "dq");
    expect_close_to_golden(g.dk.to(kCPU), ref.dk, DType::bf16, "dk");
    expect_close_to_golden(g.dv.to(kCPU), ref.dv, DType::bf16, "dv");
  }
}

// The library's score mods on the GPU (ALiBi, soft-capping: tensor cores in 16 bits; the
// learnable relative-position bias: its table gradient on the SIMT path) vs the float64
// reference, no mask and causal, and bits equal across two runs: f32 and bf16 with 64-blocks
// (SIMT, mma.sync), and the Hopper kernels (blocks of 128, required) at E = 64 and 128 in bf16
// and f16, where the dK/dV pass at E = 128 takes its one-step loop and the dQ pass its resident
// rows from registers.
// sm runs on the GPU, sm_host in the reference (they differ when the functor holds a table).
template <class SM>
void check_cuda_score_mod(SM sm, SM sm_host, const char* name) {
  const Device gpu = Device::parse("cuda:0");
  struct Config {
    int64_t L, E, block;
    FlexBackend backend;
    std::vector<DType> dtypes;
  };
  std::vector<Config> configs{{129, 64, 64, FlexBackend::automatic, {DType::f32, DType::bf16}}};
  if constexpr (!is_learnable_v<SM>)  // a learnable table's gradient runs on the SIMT path only
    for (int64_t E : {64, 128}) configs.push_back({257, E, 128, FlexBackend::hopper, {DType::bf16, DType::f16}});
  for (const Config& cfg : configs)
    for (bool causal : {false, true})
      for (DType dt : cfg.dtypes) {
        SCOPED_TRACE(testing::Message() << name << (causal ? " causal " : " no mask ") << dtype_name(dt) << " E="
                                        << cfg.E << " block=" << cfg.block << " " << flex_backend_name(cfg.backend));
        const int64_t B = 2, Hq = 4, Hkv = 2, L = cfg.L, S = cfg.L, E = cfg.E;
        Generator gen(11);
        Tensor q = make({B, Hq, L, E}, gen, dt), k = make({B, Hkv, S, E}, gen, dt), v = make({B, Hkv, S, E}, gen, dt);
        Tensor dout = make({B, Hq, L, E}, gen, dt), dlse = make({B, Hq, L}, gen, DType::f32);
        Tensor bias;
        if constexpr (is_learnable_v<SM>) bias = mul(randn({Hq, L + S - 1}, gen), 0.5);
        auto run = [&](auto mm) {
          auto bm = create_block_mask(mm, 1, 1, L, S, cfg.block, cfg.block);
          bm.layout = bm.layout.to(gpu);
          auto once = [&] {
            return run_flex(q.to(gpu), k.to(gpu), v.to(gpu), sm, bm, dout.to(gpu), dlse.to(gpu),
                            bias.defined() ? bias.to(gpu) : Tensor(), cfg.backend);
          };
          Grads g = once();
          ReferenceResult ref =
              reference_flex_attention(q, k, v, sm_host, mm, 1.0 / std::sqrt(double(E)), dout, dlse, bias);
          Grads g2 = once();
          expect_close_to_golden(g.out.to(kCPU), ref.out, dt, "out");
          expect_close_to_golden(g.lse.to(kCPU), ref.lse, DType::f32, "lse");
          expect_close_to_golden(g.dq.to(kCPU), ref.dq, dt, "dq");
          expect_close_to_golden(g.dk.to(kCPU), ref.dk, dt, "dk");
          expect_close_to_golden(g.dv.to(kCPU), ref.dv, dt, "dv");
          std::vector<std::tuple<Tensor, Tensor, const char*>> same{
              {g.dq, g2.dq, "dq"}, {g.dk, g2.dk, "dk"}, {g.dv, g2.dv, "dv"}};
          if constexpr (is_learnable_v<SM>) {
            expect_close_to_golden(g.dbias.to(kCPU), ref.dbias, dt, "dbias");
            same.emplace_back(g.dbias, g2.dbias, "dbias");
          }
          for (auto& [x, y, what] : same) {
            Tensor a = x.to(kCPU), b = y.to(kCPU);
            EXPECT_EQ(std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()), 0) << what << " not bitwise reproducible";
          }
        };
        if (causal) run(Causal{});
        else run(NoMask{});
      }
}

TEST(FlexCuda, ScoreModsMatchReference) {
  KILN_SKIP_WITHOUT_CUDA();
  Tensor slopes = Tensor::empty({4}, DType::f32, kCPU);
  alibi_slopes(4, slopes.data<float>());
  Tensor slopes_gpu = slopes.to(Device::parse("cuda:0"));
  check_cuda_score_mod(Alibi{slopes_gpu.data<float>()}, Alibi{slopes.data<float>()}, "alibi");
  check_cuda_score_mod(Softcap{2.0f}, Softcap{2.0f}, "softcap");
  check_cuda_score_mod(RelativePositionBias{}, RelativePositionBias{}, "relative bias");
}

// The GPU BlockMask builder (create_block_mask of a MaskSpec on a CUDA device: the classifier
// each instantiation file registers in the kernel registry) gives the CPU builder's tiles.
TEST(FlexCuda, GpuBlockMaskBuilderMatchesTheCpu) {
  KILN_SKIP_WITHOUT_CUDA();
  const Device gpu = Device::parse("cuda:0");
  for (int64_t L : {1, 127, 300, 1000}) {
    for (int64_t bs : {64, 128}) {
      for (const char* text : {"none", "causal", "window:37", "document:50"}) {
        SCOPED_TRACE(testing::Message() << text << " L=" << L << " block " << bs);
        MaskSpec on_gpu = parse_mask_spec(text, L, gpu), on_cpu = parse_mask_spec(text, L);
        on_gpu.block_size = on_cpu.block_size = bs;
        const Tensor want = create_block_mask(on_cpu, L, L).layout.to_dense();
        const AnyBlockMask got = create_block_mask(on_gpu, L, L, gpu);
        ASSERT_TRUE(got.layout.device().is_cuda());
        EXPECT_EQ(got.layout.to(kCPU).to_dense().to_vector<int32_t>(), want.to_vector<int32_t>());
      }
    }
  }
}

// Every built-in CUDA pair is in the registry when the program starts, GPU or not: the
// instantiation files register themselves and only flex_files.cpp names them, so a static link
// that dropped them (flex_files.cpp's references folded away at -O2) left a Release build with no
// CUDA FlexAttention kernel at all; this checks the link itself, without a device.
TEST(FlexCudaRegistry, EveryBuiltinFileIsLinkedAndRegistered) {
  if (kernels::cuda::flex_builtin_files() == 0) GTEST_SKIP() << "kiln was built without CUDA";
  auto has = [](const KernelKey& want) {
    for (const KernelKey& k : KernelRegistry::global().keys(want.family))
      if (k.device == want.device && k.mods == want.mods) return true;
    return false;
  };
  for (const char* family : {"flex_forward", "flex_backward"}) {
    SCOPED_TRACE(family);
    EXPECT_TRUE(has(kernels::flex_key<NoScoreMod, NoMask>(family, "cuda")));
    EXPECT_TRUE(has(kernels::flex_key<NoScoreMod, Causal>(family, "cuda")));
    EXPECT_TRUE(has(kernels::flex_key<NoScoreMod, SlidingWindow>(family, "cuda")));
    EXPECT_TRUE(has(kernels::flex_key<NoScoreMod, DocumentCausal>(family, "cuda")));
    EXPECT_TRUE(has(kernels::flex_key<Alibi, Causal>(family, "cuda")));
    EXPECT_TRUE(has(kernels::flex_key<Softcap, Causal>(family, "cuda")));
    EXPECT_TRUE(has(kernels::flex_key<RelativePositionBias, Causal>(family, "cuda")));
  }
  for (const KernelKey& k : {kernels::flex_key<NoScoreMod, Causal>(kernels::kFlexClassifyFamily, "cuda"),
                             kernels::flex_key<NoScoreMod, SlidingWindow>(kernels::kFlexClassifyFamily, "cuda"),
                             kernels::flex_key<NoScoreMod, DocumentCausal>(kernels::kFlexClassifyFamily, "cuda")})
    EXPECT_TRUE(has(k)) << k.family << " " << k.mods;
}
