// Device-side timing for benchmarks (bodies in cuda/timing.cu; CUDA builds only):
// time_ms runs f and returns the milliseconds between CUDA events recorded on the device's
// stream before and after it; synchronize waits for that stream.
#pragma once
#include <functional>

namespace kiln::kernels::cuda {
double time_ms(int device, const std::function<void()>& f);
void synchronize(int device);
}  // namespace kiln::kernels::cuda
