// Kernel entry points for copies, casts, fills and random draws (bodies in cpu/copy.cpp and
// cuda/copy.cu). dst and src have the same shape and device; strides are arbitrary; dtypes
// may differ (the copy casts through float/double/int64 as the types require).
#pragma once
#include <cstdint>

#include "kiln/core/tensor.h"

namespace kiln::kernels {
namespace cpu {
void copy(const Tensor& dst, const Tensor& src);
void fill(const Tensor& dst, double value);
void arange(const Tensor& dst, double start, double step);  // dst contiguous 1-D
void rand_uniform(const Tensor& dst, uint64_t seed, uint64_t offset);  // dst contiguous
void rand_normal(const Tensor& dst, uint64_t seed, uint64_t offset);   // dst contiguous
}  // namespace cpu
namespace cuda {
void copy(const Tensor& dst, const Tensor& src);
void fill(const Tensor& dst, double value);
void arange(const Tensor& dst, double start, double step);
void rand_uniform(const Tensor& dst, uint64_t seed, uint64_t offset);
void rand_normal(const Tensor& dst, uint64_t seed, uint64_t offset);
// Contiguous byte copies between host and device memory (synchronous).
void copy_host_to_device(void* dst, const void* src, size_t nbytes, int device);
void copy_device_to_host(void* dst, const void* src, size_t nbytes, int device);
void copy_device_to_device(void* dst, int dst_device, const void* src, int src_device, size_t nbytes);
}  // namespace cuda
}  // namespace kiln::kernels
