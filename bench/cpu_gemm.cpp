// bench_cpu_gemm: kiln's own f32 CPU product (kernels/cpu/sgemm.h) against the BLAS's cblas_sgemm
// on the same operands, in alternation (kiln, BLAS, kiln, ...) so that a shared machine's
// changing load falls on both. Default shapes: every product of a `small`-preset training step
// (1024 tokens, hidden 128, kv 64, SwiGLU 352, vocabulary 259) in the layout the trainer calls it
// (NT forward, NN dX, TN dW); --shape M,N,K --layout nn|nt|tn|tt runs one. One JSON object per
// case on stdout (us_median of each, GFLOP/s, speedup: the median of the per-pair time ratios
// BLAS / kiln, max_abs_diff between the two), a table on stderr. Threads: OMP_NUM_THREADS.
//
// Usage: bench_cpu_gemm [--shape M,N,K --layout L] [--iters N]
#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kiln/kernels/blas_core.h"
#include "kiln/kernels/blas_threads.h"
#include "kiln/kernels/cpu/sgemm.h"

using kiln::kernels::cpu::own_sgemm;
using kiln::kernels::cpu::SgemmIsa;
using kiln::kernels::cpu::SgemmProblem;

namespace {

struct Case {
  int64_t m, n, k;
  std::string layout;  // "nt": a row-major, b transposed
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

void run(const Case& c, int iters, SgemmIsa isa) {
  const bool ta = c.layout[0] == 't', tb = c.layout[1] == 't';
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  std::vector<float> a(static_cast<size_t>(c.m * c.k)), b(static_cast<size_t>(c.k * c.n));
  std::vector<float> c_kiln(static_cast<size_t>(c.m * c.n)), c_blas(c_kiln.size());
  for (float& v : a) v = normal(rng);
  for (float& v : b) v = normal(rng);
  SgemmProblem p;
  p.m = c.m, p.n = c.n, p.k = c.k, p.trans_a = ta, p.trans_b = tb;
  p.a = a.data(), p.lda = ta ? c.m : c.k, p.b = b.data(), p.ldb = tb ? c.k : c.n, p.c = c_kiln.data(), p.ldc = c.n;
  const auto blas = [&] {
    cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, int(c.m), int(c.n),
                int(c.k), 1.0f, a.data(), int(p.lda), b.data(), int(p.ldb), 0.0f, c_blas.data(), int(c.n));
  };
  using clock = std::chrono::steady_clock;
  // A batch of calls per sample, about 2 ms of work, so the clock's resolution does not count.
  const int batch = static_cast<int>(std::clamp<double>(2e6 / (2.0 * c.m * c.n * c.k / 300.0), 1, 1000));
  const auto time_batch = [&](auto&& f) {
    const auto t0 = clock::now();
    for (int i = 0; i < batch; ++i) f();
    return std::chrono::duration<double, std::micro>(clock::now() - t0).count() / batch;
  };
  for (int w = 0; w < 3; ++w) own_sgemm(p, isa), blas();
  std::vector<double> tk, tb_, ratio;
  for (int i = 0; i < iters; ++i) {
    const double k_us = time_batch([&] { own_sgemm(p, isa); });
    const double b_us = time_batch(blas);
    tk.push_back(k_us), tb_.push_back(b_us), ratio.push_back(b_us / k_us);
  }
  double diff = 0;
  for (size_t i = 0; i < c_kiln.size(); ++i) diff = std::max(diff, double(std::fabs(c_kiln[i] - c_blas[i])));
  const double flop = 2.0 * c.m * c.n * c.k, km = median(tk), bm = median(tb_);
  std::printf("{\"bench\":\"cpu_gemm\",\"isa\":\"%s\",\"m\":%lld,\"n\":%lld,\"k\":%lld,\"layout\":\"%s\","
              "\"threads\":%d,\"kiln_us_median\":%.2f,\"blas_us_median\":%.2f,\"kiln_gflops\":%.1f,"
              "\"blas_gflops\":%.1f,\"speedup\":%.3f,\"max_abs_diff\":%.3g}\n",
              kiln::kernels::cpu::own_sgemm_isa_name(isa), (long long)c.m, (long long)c.n, (long long)c.k,
              c.layout.c_str(), omp_get_max_threads(), km, bm,
              flop / km / 1e3, flop / bm / 1e3, median(ratio), diff);
  std::fprintf(stderr, "%6lld %6lld %6lld %s  kiln %8.1f us %6.1f GFLOP/s   BLAS %8.1f us %6.1f GFLOP/s   x%.2f\n",
               (long long)c.m, (long long)c.n, (long long)c.k, c.layout.c_str(), km, flop / km / 1e3, bm,
               flop / bm / 1e3, median(ratio));
}

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr,
               "bench_cpu_gemm: %s\nusage: bench_cpu_gemm [--shape M,N,K --layout nn|nt|tn|tt] [--iters N] "
               "[--isa avx512|avx2]\n",
               why);
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  kiln::kernels::cpu::own_blas_threads();
  kiln::kernels::cpu::own_blas_core();  // the kernels the `kiln` program would have OpenBLAS use
  if (!kiln::kernels::cpu::own_sgemm_supported()) {
    std::fprintf(stderr, "bench_cpu_gemm: this CPU has neither AVX-512F nor AVX2 and FMA, so kiln's f32 product is "
                         "not used here\n");
    return 0;
  }
  SgemmIsa isa = SgemmIsa::best;
  std::vector<Case> cases;
  Case one{0, 0, 0, "nt"};
  int iters = 21;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) usage(("missing the value of " + a).c_str());
    const std::string v = argv[++i];
    if (a == "--shape") {
      long long m, n, k;
      if (std::sscanf(v.c_str(), "%lld,%lld,%lld", &m, &n, &k) != 3 || m < 1 || n < 1 || k < 1)
        usage(("--shape wants M,N,K (positive), got " + v).c_str());
      one.m = m, one.n = n, one.k = k;
    } else if (a == "--layout") {
      if (v != "nn" && v != "nt" && v != "tn" && v != "tt") usage(("--layout wants nn, nt, tn or tt, got " + v).c_str());
      one.layout = v;
    } else if (a == "--isa") {
      if (v != "avx512" && v != "avx2") usage(("--isa wants avx512 or avx2, got " + v).c_str());
      isa = v == "avx2" ? SgemmIsa::avx2 : SgemmIsa::avx512;
      if (!kiln::kernels::cpu::own_sgemm_supported(isa)) usage(("this CPU does not run --isa " + v).c_str());
    } else if (a == "--iters") {
      iters = std::atoi(v.c_str());
      if (iters < 1) usage("--iters wants a positive count");
    } else {
      usage(("unknown option " + a).c_str());
    }
  }
  if (one.m) {
    cases.push_back(one);
  } else {  // the small preset's step: forward (nt), dX (nn), dW (tn) of q, k/v, o, gate/up, down, the head
    for (auto [n, k] : {std::pair{128, 128}, {64, 128}, {352, 128}, {128, 352}, {259, 128}}) {
      cases.push_back({1024, n, k, "nt"});
      cases.push_back({1024, k, n, "nn"});
      cases.push_back({n, k, 1024, "tn"});
    }
  }
  for (const Case& c : cases) run(c, iters, isa);
  return 0;
}
