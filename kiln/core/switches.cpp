// The runtime switches of kiln/core/switches.h: two process-wide atomics, the poison fill's
// first value read from KILN_FILL_UNINITIALIZED once.
#include "kiln/core/switches.h"

#include <atomic>
#include <cstdlib>
#include <string>

namespace kiln {
namespace {

// NOTE: process-wide switches (switches.h says why), each a function-local static so that it
// exists before any static initialiser reads it.
std::atomic<bool>& deterministic_switch() {
  static std::atomic<bool> on{false};
  return on;
}

std::atomic<bool>& fill_switch() {
  static std::atomic<bool> on{[] {
    const char* v = std::getenv("KILN_FILL_UNINITIALIZED");
    return v != nullptr && *v != '\0' && std::string(v) != "0";
  }()};
  return on;
}

}  // namespace

bool deterministic() { return deterministic_switch().load(std::memory_order_relaxed); }
void set_deterministic(bool on) { deterministic_switch().store(on, std::memory_order_relaxed); }

bool fill_uninitialized_memory() { return fill_switch().load(std::memory_order_relaxed); }
void set_fill_uninitialized_memory(bool on) { fill_switch().store(on, std::memory_order_relaxed); }

uint8_t uninitialized_fill_byte(DType dtype) {
  if (dtype == DType::boolean) return 0x01;
  // All bits set is a NaN in every floating format kiln has (f64 … f8_e5m2); integers get a
  // large positive value (0x7F7F…), which indexes out of range as PyTorch's maximum does.
  return is_floating(dtype) || is_storage_only(dtype) ? 0xFF : 0x7F;
}

}  // namespace kiln
