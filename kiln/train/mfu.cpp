// FLOPs per token, device peaks and the CPU estimate (see mfu.h).
#include "kiln/train/mfu.h"

#include <omp.h>

#include <cstdio>
#include <fstream>
#include <sstream>

#include "kiln/core/device_info.h"
#include "kiln/kernels/cpu/isa/isa.h"
#include "kiln/telemetry/host.h"

namespace kiln::train {

double flops_per_token(const nn::LlamaConfig& c, int64_t num_parameters, int64_t seq) {
  return 6.0 * static_cast<double>(num_parameters) +
         12.0 * static_cast<double>(c.num_hidden_layers) * static_cast<double>(c.hidden_size) * static_cast<double>(seq);
}

double cpuinfo_ghz(const std::string& cpuinfo) {
  const std::optional<double> mhz = telemetry::parse_cpuinfo_mhz(cpuinfo);
  return mhz ? *mhz / 1000.0 : 0.0;
}

double known_gpu_peak_tflops(const std::string& name, DType compute) {
  // Dense (no sparsity) peaks from NVIDIA's data sheets: {name part, bf16/f16, f32 (no TF32)}.
  struct Row {
    const char* part;
    double half, single;
  };
  static const Row kRows[] = {
      {"H200", 989.4, 66.9}, {"H100 SXM", 989.4, 66.9}, {"H100 80GB HBM3", 989.4, 66.9},
      {"H100 PCIe", 756.0, 51.2}, {"H100 NVL", 835.0, 60.0}, {"GH200", 989.4, 66.9},
      {"A100", 312.0, 19.5}, {"L40S", 362.1, 91.6}, {"A10G", 70.0, 31.2},
  };
  for (const Row& r : kRows)
    if (name.find(r.part) != std::string::npos) return compute == DType::f32 ? r.single : r.half;
  return 0;
}

PeakFlops peak_flops(Device device, DType compute, double given) {
  PeakFlops p;
  if (given > 0) {
    p.tflops = given;
    p.source = "--peak-tflops";
    return p;
  }
  if (device.is_cuda()) {
    for (const DeviceInfo& d : list_cuda_devices()) {
      if (d.device != device) continue;
      p.tflops = known_gpu_peak_tflops(d.name, compute);
      if (p.tflops > 0) p.source = d.name + " (" + dtype_name(compute) + " dense, data sheet)";
    }
    return p;  // an unknown GPU: no peak unless --peak-tflops
  }
  // The CPU: an estimate from the threads kiln uses, the clock /proc/cpuinfo reports and the
  // vector units' FMA throughput (two pipes of `lanes` f32 multiply-adds per cycle).
  const auto& f = kernels::cpu::isa::cpu_features();
  const int bits = f.avx512f ? 512 : f.vector_bits > 0 ? f.vector_bits : 128;
  // kiln's CPU kernels compute in f32 whatever the storage dtype (bf16 is widened)
  const double lanes = bits / 32.0;
  const double flop_per_cycle = 2 /* pipes */ * lanes * 2 /* multiply + add */;
  const std::optional<std::string> info = telemetry::read_text_file("/proc/cpuinfo");
  const double ghz = info ? cpuinfo_ghz(*info) : 0.0;
  if (ghz <= 0) return p;
  const int threads = omp_get_max_threads();
  p.tflops = threads * ghz * 1e9 * flop_per_cycle / 1e12;
  p.estimate = true;
  char buf[160];
  std::snprintf(buf, sizeof buf, "estimate: %d threads x %.2f GHz x %.0f FLOP/cycle (%d-bit FMA, 2 pipes)", threads,
                ghz, flop_per_cycle, bits);
  p.source = buf;
  return p;
}

}  // namespace kiln::train
