// Model FLOPs utilisation for `kiln train --profile`: the model's training FLOPs per token,
// the device's peak, and MFU = flops_per_token x tokens/s / peak.
//
// FLOPs per token (PaLM's appendix B, the formula issue 35 measures torch.compile by):
// 6 x parameters (a multiply-add per weight forward, two backward) + 12 x layers x hidden x
// sequence (the attention scores and their weighted sum, forward and backward, causal masking
// not subtracted). Parameters are num_parameters(): a tied embedding once.
//
// The peak is --peak-tflops when given; else, for a CUDA device whose name kiln knows, its dense
// tensor-core peak for the compute dtype (H100 / H200 SXM: 989 TFLOP/s bf16, the figure the
// issue's targets use); else, on the CPU, an estimate: threads x clock x FLOPs per cycle of the
// vector units (2 FMA pipes x lanes x 2), said to be one. Unknown GPUs have no peak (no MFU).
#pragma once
#include <string>

#include "kiln/core/device.h"
#include "kiln/core/dtype.h"
#include "kiln/nn/llama.h"

namespace kiln::train {

double flops_per_token(const nn::LlamaConfig& c, int64_t num_parameters, int64_t seq);

// The fraction of the peak that `tokens_per_s` tokens of `flops_per_token` each use.
inline double mfu(double flops_per_token, double tokens_per_s, double peak_tflops) {
  return peak_tflops > 0 ? flops_per_token * tokens_per_s / (peak_tflops * 1e12) : 0.0;
}

struct PeakFlops {
  double tflops = 0;   // 0: unknown
  std::string source;  // "--peak-tflops", "NVIDIA H200 (bf16 dense)", "estimate: 2 threads x 3.0 GHz x 32 FLOP/cycle"
  bool estimate = false;
};
// `given` > 0: that. Else the device's, as above.
PeakFlops peak_flops(Device device, DType compute, double given);

// Parses "cpu MHz" lines of /proc/cpuinfo text: their mean in GHz, 0 when none.
double cpuinfo_ghz(const std::string& cpuinfo);
// The peak of a CUDA device by its name for a dtype (TFLOP/s, dense); 0 when kiln does not know it.
double known_gpu_peak_tflops(const std::string& name, DType compute);

}  // namespace kiln::train
