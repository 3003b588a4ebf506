// cuda_pci_bus_id without CUDA: no runtime to ask, so NVML devices are found by index.
#include "kiln/telemetry/nvml.h"

namespace kiln::telemetry {

std::string cuda_pci_bus_id(int) { return {}; }

}  // namespace kiln::telemetry
