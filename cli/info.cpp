// `kiln info [--json]`: version, build options, devices with their memory, threads and BLAS.
#include <omp.h>

#include <cstdio>
#include <sstream>

#include "cli/args.h"
#include "cli/commands.h"
#include "kiln/core/device_info.h"
#include "kiln/io/json.h"
#include "kiln/kernels/blas_core.h"
#include "kiln/kernels/cpu/isa/isa.h"
#include "kiln/kernels/cpu/sgemm.h"

namespace kiln::cli {

int run_info(const Args& args) {
  bool as_json = false;
  ArgParser p("info", "Print kiln's version, build options, the devices it sees (with memory), its\n"
                      "thread count, the BLAS library in use (and OpenBLAS's kernel core), the f32 GEMM in use (kiln's AVX-512\n"
                      "kernel or the BLAS: KILN_CPU_GEMM=auto|kiln|blas), the CPU's vector features and the kernel set and\n"
                      "vector length kiln uses on it (aarch64: SVE or NEON, KILN_CPU_ISA=neon forces NEON).");
  p.flag("--json", &as_json, "print one JSON object instead of text");
  if (!p.parse(args)) return 0;

  std::vector<DeviceInfo> devices = list_devices();
  json::Value doc = json::Value::object();
  doc["version"] = KILN_VERSION;
  doc["build_type"] = KILN_BUILD_TYPE;
  doc["cuda_built"] = cuda_built();
  doc["blas"] = KILN_BLAS_NAME;
  const std::string blas_core = kernels::cpu::blas_core_name();  // main chose it (kernels/blas_core.h)
  if (!blas_core.empty()) doc["blas_core"] = blas_core;
  // f32 products on the CPU: kiln's AVX-512 or AVX2 kernel, or the BLAS (KILN_CPU_GEMM, kernels/cpu/sgemm.h)
  const std::string cpu_gemm = kernels::cpu::own_sgemm_chosen()
                                   ? std::string("kiln (") + kernels::cpu::own_sgemm_isa_name() + ")"
                                   : std::string(KILN_BLAS_NAME);
  doc["cpu_gemm"] = cpu_gemm;
  doc["threads"] = static_cast<int64_t>(omp_get_max_threads());
  const kernels::cpu::isa::CpuFeatures& cpu = kernels::cpu::isa::cpu_features();
  json::Value cj = json::Value::object();
  cj["arch"] = cpu.arch;
  cj["features"] = kernels::cpu::isa::feature_list(cpu);
  cj["kernels"] = cpu.kernels;
  cj["vector_bits"] = static_cast<int64_t>(cpu.vector_bits);
  cj["sve_bits"] = static_cast<int64_t>(cpu.sve_bits);
  if (!cpu.forced.empty()) cj["forced"] = cpu.forced;
  doc["cpu"] = std::move(cj);
  json::Value devs = json::Value::array();
  for (const auto& d : devices) {
    json::Value o = json::Value::object();
    o["device"] = d.device.str();
    o["name"] = d.name;
    o["memory_total_bytes"] = d.memory_total_bytes;
    if (d.compute_capability) o["compute_capability"] = *d.compute_capability;
    devs.push_back(std::move(o));
  }
  doc["devices"] = std::move(devs);
  if (as_json) {
    std::printf("%s\n", doc.dump().c_str());
    return 0;
  }
  std::printf("kiln %s (%s build, CUDA %s)\n", KILN_VERSION, KILN_BUILD_TYPE, cuda_built() ? "on" : "off");
  std::printf("threads: %d   BLAS: %s%s%s   f32 GEMM: %s\n", omp_get_max_threads(), KILN_BLAS_NAME,
              blas_core.empty() ? "" : ", core ", blas_core.c_str(), cpu_gemm.c_str());
  std::printf("cpu: %s (%s); kernels %s, %d-bit vectors", cpu.arch.c_str(),
              kernels::cpu::isa::feature_list(cpu).c_str(), cpu.kernels.c_str(), cpu.vector_bits);
  if (cpu.sve_bits) std::printf("; SVE length %d bits", cpu.sve_bits);
  if (!cpu.forced.empty()) std::printf("; KILN_CPU_ISA=%s", cpu.forced.c_str());
  std::printf("\n");
  std::printf("devices:\n");
  for (const auto& d : devices)
    std::printf("  %-8s %-32s %8.1f GiB%s\n", d.device.str().c_str(), d.name.c_str(),
                static_cast<double>(d.memory_total_bytes) / (1024.0 * 1024 * 1024),
                d.compute_capability ? (" sm_" + *d.compute_capability).c_str() : "");
  if (!cuda_built()) std::printf("  (built without CUDA: configure with the 'cuda' preset for GPUs)\n");
  return 0;
}

}  // namespace kiln::cli
