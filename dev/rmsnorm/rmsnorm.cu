// Kernel lab: RMSNorm forward and backward at memory speed, bf16.
//   dev_rmsnorm [version] [rows d]     (default: every version, 16384 4096)
// Version 1: forward, a warp per row in 16-byte packs (the scheme of kernels/cuda/nn.cu's general kernel).
// Version 2: forward, kiln's fast kernel (kernels/cuda/rmsnorm.cu: a block per row, the row in registers).
// Version 3: backward (dx, dweight), kiln's fast kernel.
// The ceiling: a device-to-device copy of the same bytes, timed in the same run. Each version is
// validated against a float64 CPU reference on 64 sampled rows first.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#include "kiln/core/rng.h"
#include "kiln/kernels/copy.h"
#include "kiln/kernels/cuda/context.h"
#include "kiln/kernels/cuda/rmsnorm.h"
#include "kiln/kernels/timing.h"
#include "kiln/ops/ops.h"

using namespace kiln;
namespace rn = kiln::kernels::cuda::rmsnorm;

__global__ void rmsnorm_warp_per_row(__nv_bfloat16* y, float* rstd, const __nv_bfloat16* x, const __nv_bfloat16* w,
                                     int rows, int d, float eps) {
  const int lane = threadIdx.x & 31, row = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  if (row >= rows) return;
  const uint4* xr = reinterpret_cast<const uint4*>(x + static_cast<int64_t>(row) * d);
  float ss = 0.f;
  for (int i = lane; i < d / 8; i += 32) {
    const uint4 v = xr[i];
    const __nv_bfloat16* e = reinterpret_cast<const __nv_bfloat16*>(&v);
    for (int k = 0; k < 8; ++k) ss += __bfloat162float(e[k]) * __bfloat162float(e[k]);
  }
  for (int m = 16; m > 0; m >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, m);
  const float rs = 1.f / sqrtf(ss / d + eps);
  if (lane == 0) rstd[row] = rs;
  for (int i = lane; i < d / 8; i += 32) {
    const uint4 v = xr[i], wv = reinterpret_cast<const uint4*>(w)[i];
    uint4 o;
    const __nv_bfloat16 *e = reinterpret_cast<const __nv_bfloat16*>(&v), *we = reinterpret_cast<const __nv_bfloat16*>(&wv);
    __nv_bfloat16* oe = reinterpret_cast<__nv_bfloat16*>(&o);
    for (int k = 0; k < 8; ++k) oe[k] = __float2bfloat16_rn(__bfloat162float(e[k]) * rs * __bfloat162float(we[k]));
    reinterpret_cast<uint4*>(y + static_cast<int64_t>(row) * d)[i] = o;
  }
}

double median_ms(const std::function<void()>& f) {
  for (int i = 0; i < 5; ++i) f();
  std::vector<double> t;
  for (int i = 0; i < 30; ++i) t.push_back(kernels::cuda::time_ms(0, f));
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

int main(int argc, char** argv) {
  const int only = argc > 1 ? std::atoi(argv[1]) : 0;
  const int64_t rows = argc > 3 ? std::atoll(argv[2]) : 16384, d = argc > 3 ? std::atoll(argv[3]) : 4096;
  if (cuda_device_count() == 0 || d % 8 != 0) {
    std::fprintf(stderr, "dev_rmsnorm: needs a CUDA device and d a multiple of 8\n");
    return 1;
  }
  const float eps = 1e-5f;
  Generator gen(2);
  const Device dev = cuda(0);
  Tensor x = randn({rows, d}, gen, DType::f32, dev).to(DType::bf16), w = randn({d}, gen, DType::f32, dev).to(DType::bf16);
  Tensor g = randn({rows, d}, gen, DType::f32, dev).to(DType::bf16);
  Tensor y = zeros({rows, d}, DType::bf16, dev), rstd = zeros({rows}, DType::f32, dev);
  Tensor dx = zeros({rows, d}, DType::bf16, dev), dw = zeros({d}, DType::bf16, dev), copy = zeros({rows, d}, DType::bf16, dev);
  const std::vector<double> xv = x.to(kCPU).to(DType::f64).to_vector<double>(), wv = w.to(kCPU).to(DType::f64).to_vector<double>();
  const double bytes = 2.0 * rows * d * 2;  // read x, write y (the copy moves the same)
  const double copy_ms = median_ms([&] {
    cudaMemcpyAsync(copy.data_ptr(), x.data_ptr(), rows * d * 2, cudaMemcpyDeviceToDevice, kernels::cuda::stream(0));
  });
  std::printf("device copy: %.4f ms  %.0f GB/s (the ceiling)\n", copy_ms, bytes / (copy_ms * 1e-3) / 1e9);
  auto validate = [&]() {
    const std::vector<double> yv = y.to(kCPU).to(DType::f64).to_vector<double>();
    int bad = 0;
    for (int s = 0; s < 64; ++s) {
      const int64_t r = (s * 2654435761ll) % rows;
      double ss = 0;
      for (int64_t c = 0; c < d; ++c) ss += xv[r * d + c] * xv[r * d + c];
      const double rs = 1 / std::sqrt(ss / d + eps);
      for (int64_t c = 0; c < d; ++c)
        if (std::fabs(yv[r * d + c] - xv[r * d + c] * rs * wv[c]) > 1e-2 * (1 + std::fabs(xv[r * d + c] * rs * wv[c]))) ++bad;
    }
    return bad;
  };
  int failures = 0;
  for (int version = 1; version <= 3; ++version) {
    if (only && version != only) continue;
    std::function<void()> run;
    double moved = bytes;
    const char* name = "";
    if (version == 1) {
      name = "forward, warp per row";
      run = [&] {
        rmsnorm_warp_per_row<<<static_cast<unsigned>((rows * 32 + 255) / 256), 256, 0, kernels::cuda::stream(0)>>>(
            static_cast<__nv_bfloat16*>(y.data_ptr()), rstd.data<float>(), static_cast<const __nv_bfloat16*>(x.data_ptr()),
            static_cast<const __nv_bfloat16*>(w.data_ptr()), static_cast<int>(rows), static_cast<int>(d), eps);
      };
    } else if (version == 2) {
      name = "forward, kiln fast kernel";
      run = [&] { rn::forward(y, rstd, x, w, eps); };
    } else {
      name = "backward, kiln fast kernel (dx, dweight)";
      rn::forward(y, rstd, x, w, eps);
      run = [&] { rn::backward(dx, dw, g, x, w, rstd); };
      moved = 3.0 * rows * d * 2;  // read x and dy, write dx
    }
    kernels::cuda::fill(y, 0.0);
    run();
    if (version < 3 && validate() != 0) {
      std::printf("version %d (%s): WRONG\n", version, name);
      ++failures;
      continue;
    }
    const double ms = median_ms(run);
    std::printf("version %d (%s): %lldx%lld  %.4f ms  %.0f GB/s  %.1f%% of the copy's\n", version, name,
                static_cast<long long>(rows), static_cast<long long>(d), ms, moved / (ms * 1e-3) / 1e9,
                100.0 * (moved / ms) / (bytes / copy_ms));
  }
  return failures ? 1 : 0;
}
