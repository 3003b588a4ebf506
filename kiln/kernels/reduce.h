// Reduction kernels over the rows of a contiguous [rows, cols] matrix: the ops front end moves
// the reduced dims last and makes the input contiguous first. Each row is reduced by one
// thread (CPU) or one block (CUDA) in a fixed order, so results are deterministic. Sums of
// f32 and 16-bit inputs accumulate in f64 on CPU and f32 (fixed tree) on CUDA.
#pragma once
#include <cstdint>
#include "kiln/core/tensor.h"

namespace kiln::kernels {

enum class ReduceOp : uint8_t { sum, max };

namespace cpu {
void reduce_rows(ReduceOp op, const Tensor& out, const Tensor& in);
// values[r] = max of row r, indices[r] (i64) = its first position.
void max_rows_index(const Tensor& values, const Tensor& indices, const Tensor& in);
}  // namespace cpu
namespace cuda {
void reduce_rows(ReduceOp op, const Tensor& out, const Tensor& in);
void max_rows_index(const Tensor& values, const Tensor& indices, const Tensor& in);
}  // namespace cuda

}  // namespace kiln::kernels
