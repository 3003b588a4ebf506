// Kernel entry points for copies, casts, fills and random draws (bodies in cpu/copy.cpp and
// cuda/copy.cu). dst and src have the same shape and device; strides are arbitrary; dtypes
// may differ (the copy casts through float/double/int64 as the types require).
#pragma once
#include <cstdint>
#include <vector>

#include "kiln/core/tensor.h"

namespace kiln::kernels {

// One block of a batched same-dtype copy: `rows` runs of `row_bytes` bytes, consecutive runs
// `dst_pitch` / `src_pitch` bytes apart (a contiguous range is one row). No destination overlaps
// any source or another destination.
struct CopyBlock {
  void* dst = nullptr;
  const void* src = nullptr;
  int64_t rows = 0, row_bytes = 0, dst_pitch = 0, src_pitch = 0;
};

namespace cpu {
// Every block's bytes in one parallel pass (pieces of at most 64 KiB over the threads).
void copy_blocks(Device device, const std::vector<CopyBlock>& blocks);
void copy(const Tensor& dst, const Tensor& src);
void fill(const Tensor& dst, double value);
void arange(const Tensor& dst, double start, double step);  // dst contiguous 1-D
void rand_uniform(const Tensor& dst, uint64_t seed, uint64_t offset);  // dst contiguous
void rand_normal(const Tensor& dst, uint64_t seed, uint64_t offset);   // dst contiguous
}  // namespace cpu
namespace cuda {
// One cudaMemcpy2DAsync per block on the device's stream.
void copy_blocks(Device device, const std::vector<CopyBlock>& blocks);
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
