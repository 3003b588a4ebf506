// Device-side timing for kernel code (bodies in cuda/timing.cu; CUDA builds only): time_ms runs
// f and returns the milliseconds between CUDA events recorded on the device's current stream
// before and after it; synchronize waits for that stream. Code above kernels/ times through the
// stream runtime's events (kiln/core/stream.h).
#pragma once
#include <functional>

namespace kiln::kernels::cuda {
double time_ms(int device, const std::function<void()>& f);
void synchronize(int device);
}  // namespace kiln::kernels::cuda

