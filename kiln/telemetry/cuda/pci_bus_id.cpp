// cuda_pci_bus_id (CUDA build): the PCI bus id the CUDA runtime gives kiln's cuda:N, which is how
// telemetry finds the same GPU in NVML (NVML ignores CUDA_VISIBLE_DEVICES and orders by PCI).
// Needs no CUDA context.
#include <cuda_runtime.h>

#include "kiln/telemetry/nvml.h"

namespace kiln::telemetry {

std::string cuda_pci_bus_id(int cuda_index) {
  char buf[32] = {};
  if (cudaDeviceGetPCIBusId(buf, static_cast<int>(sizeof buf), cuda_index) != cudaSuccess) {
    cudaGetLastError();  // clear the error so that later CUDA calls do not report it
    return {};
  }
  return std::string(buf);
}

}  // namespace kiln::telemetry
