// Kernel lab: C = A·Bᵀ (the forward x·Wᵀ, "nt"), bf16 in, f32 accumulate, bf16 out.
//   dev_gemm [version] [M N K]     (default: every version, 4096 4096 4096)
// Version 1: naive SIMT, one thread per output element (the floor).
// Version 2: kiln's Hopper GEMM (kiln/kernels/cuda/gemm/sm90_gemm.cuh through gemm.h, backend
//            kiln), 128 × 128 tiles.
// Version 3: the same with 128 × 256 tiles (m64n256k16 wgmma, 4 stages).
// Version 4: cuBLASLt through kiln's planner (gemm.h, backend cublaslt).
// Each version is validated against a float64 CPU reference on 4096 sampled elements (bound:
// 1e-5 · Σ|a||b| + one bf16 rounding) before it is timed (CUDA events, median of 20 after 5).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "kiln/core/rng.h"
#include "kiln/kernels/cuda/context.h"
#include "kiln/kernels/cuda/gemm/gemm.h"
#include "kiln/kernels/timing.h"
#include "kiln/ops/ops.h"

using namespace kiln;
namespace kg = kiln::kernels::gemm;

__global__ void gemm_naive(const __nv_bfloat16* a, const __nv_bfloat16* b, __nv_bfloat16* c, int m, int n, int k) {
  const int col = blockIdx.x * blockDim.x + threadIdx.x, row = blockIdx.y * blockDim.y + threadIdx.y;
  if (row >= m || col >= n) return;
  float acc = 0.f;
  for (int q = 0; q < k; ++q) acc += __bfloat162float(a[row * k + q]) * __bfloat162float(b[col * k + q]);
  c[row * n + col] = __float2bfloat16_rn(acc);
}

int main(int argc, char** argv) {
  const int only = argc > 1 ? std::atoi(argv[1]) : 0;
  const int64_t m = argc > 4 ? std::atoll(argv[2]) : 4096, n = argc > 4 ? std::atoll(argv[3]) : 4096,
                k = argc > 4 ? std::atoll(argv[4]) : 4096;
  if (cuda_device_count() == 0) {
    std::fprintf(stderr, "dev_gemm: no CUDA device\n");
    return 1;
  }
  Generator gen(1);
  const Device dev = cuda(0);
  Tensor a = randn({m, k}, gen, DType::f32, dev).to(DType::bf16);
  Tensor b = mul(randn({n, k}, gen, DType::f32, dev), 1.0 / std::sqrt(static_cast<double>(k))).to(DType::bf16);
  const std::vector<double> av = a.to(kCPU).to(DType::f64).to_vector<double>(),
                            bv = b.to(kCPU).to(DType::f64).to_vector<double>();
  const double flops = 2.0 * m * n * k;
  int failures = 0;
  for (int version = 1; version <= 4; ++version) {
    if (only && version != only) continue;
    Tensor c = zeros({m, n}, DType::bf16, dev);
    std::function<void()> run;
    const char* name = "";
    if (version == 1) {
      name = "naive SIMT";
      run = [&] {
        const dim3 block(16, 16), grid(static_cast<unsigned>((n + 15) / 16), static_cast<unsigned>((m + 15) / 16));
        gemm_naive<<<grid, block, 0, kernels::cuda::stream(0)>>>(
            static_cast<const __nv_bfloat16*>(a.data_ptr()), static_cast<const __nv_bfloat16*>(b.data_ptr()),
            static_cast<__nv_bfloat16*>(c.data_ptr()), static_cast<int>(m), static_cast<int>(n), static_cast<int>(k));
      };
    } else {
      name = version == 2 ? "kiln sm90 128x128" : version == 3 ? "kiln sm90 128x256" : "cuBLASLt";
      kg::GemmOptions o;
      o.backend = version < 4 ? kg::Backend::kiln : kg::Backend::cublaslt;
      o.tile_n = version == 2 ? 128 : version == 3 ? 256 : 0;
      std::string why;
      if (version < 4 && !kg::kiln_supported({a, b, c, false, true}, {}, &why)) {
        std::printf("version %d (%s): does not apply to %lldx%lldx%lld: %s\n", version, name, static_cast<long long>(m),
                    static_cast<long long>(n), static_cast<long long>(k), why.c_str());
        continue;
      }
      run = [&, o] { kg::gemm({a, b, c, false, true}, {}, o); };
    }
    run();
    // Validation on sampled elements.
    const std::vector<double> cv = c.to(kCPU).to(DType::f64).to_vector<double>();
    int bad = 0;
    for (int s = 0; s < 4096; ++s) {
      const int64_t r = (s * 2654435761ll) % m, col = (s * 40503ll + 7) % n;
      double want = 0, mag = 0;
      for (int64_t q = 0; q < k; ++q) want += av[r * k + q] * bv[col * k + q], mag += std::fabs(av[r * k + q] * bv[col * k + q]);
      if (!(std::fabs(cv[r * n + col] - want) <= 1e-5 * mag + std::fabs(want) / 256 + 1e-6)) ++bad;
    }
    if (bad) {
      std::printf("version %d (%s): WRONG at %d of 4096 sampled elements\n", version, name, bad);
      ++failures;
      continue;
    }
    for (int i = 0; i < 5; ++i) run();
    std::vector<double> t;
    for (int i = 0; i < 20; ++i) t.push_back(kernels::cuda::time_ms(0, run));
    std::sort(t.begin(), t.end());
    const double ms = t[t.size() / 2];
    std::printf("version %d (%s): %lldx%lldx%lld  %.4f ms  %.1f TFLOP/s  (validated)\n", version, name,
                static_cast<long long>(m), static_cast<long long>(n), static_cast<long long>(k), ms,
                flops / (ms * 1e-3) / 1e12);
  }
  return failures ? 1 : 0;
}
