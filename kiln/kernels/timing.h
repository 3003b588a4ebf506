// Device-side timing for benchmarks (bodies in cuda/timing.cu; CUDA builds only):
// time_ms runs f and returns the milliseconds between CUDA events recorded on the device's
// stream before and after it; synchronize waits for that stream.
#pragma once
#include <functional>

namespace kiln::kernels::cuda {
double time_ms(int device, const std::function<void()>& f);
void synchronize(int device);
}  // namespace kiln::kernels::cuda

// CUDA events for the profiler (kiln/core/profile.h), as opaque handles.
namespace kiln::kernels::cuda {
void* event_create();
void event_record(void* event, int device);  // on the device's stream
void event_synchronize(void* event);
float event_elapsed_ms(void* start, void* stop);
void event_destroy(void* event);
}  // namespace kiln::kernels::cuda
