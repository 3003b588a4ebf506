// CPU bodies of the row reductions.
#include "kiln/kernels/reduce.h"

#include <limits>

#include "kiln/kernels/cpu/loops.h"

namespace kiln::kernels::cpu {

void reduce_rows(ReduceOp op, const Tensor& out, const Tensor& in) {
  const int64_t rows = out.numel();
  const int64_t cols = rows ? in.numel() / rows : 0;
  dispatch_all(in.dtype(), "reduce", [&]<class T>() {
    if constexpr (std::is_same_v<T, bool>) {
      fail("sum/max: reductions over bool tensors are not supported");
    } else {
      using A = std::conditional_t<std::is_floating_point_v<acc_t<T>>, double, int64_t>;
      const T* x = static_cast<const T*>(in.data_ptr());
      T* y = static_cast<T*>(out.data_ptr());
      parallel_for(rows, std::max<int64_t>(1, kParallelGrain / std::max<int64_t>(cols, 1)), [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; ++r) {
          const T* row = x + r * cols;
          if (op == ReduceOp::sum) {
            A acc = 0;
            for (int64_t c = 0; c < cols; ++c) acc += static_cast<A>(static_cast<acc_t<T>>(row[c]));
            y[r] = T(static_cast<acc_t<T>>(acc));
          } else {
            KILN_CHECK(cols > 0, "amax: cannot reduce over an empty dimension");
            acc_t<T> m = static_cast<acc_t<T>>(row[0]);
            for (int64_t c = 1; c < cols; ++c) {
              acc_t<T> v = static_cast<acc_t<T>>(row[c]);
              if (v > m || v != v) m = v;
              if (m != m) break;
            }
            y[r] = T(m);
          }
        }
      });
    }
  });
}

void max_rows_index(const Tensor& values, const Tensor& indices, const Tensor& in) {
  const int64_t rows = values.numel();
  const int64_t cols = rows ? in.numel() / rows : 0;
  KILN_CHECK(cols > 0 || rows == 0, "max: cannot reduce over an empty dimension");
  int64_t* idx = static_cast<int64_t*>(indices.data_ptr());
  dispatch_all(in.dtype(), "max", [&]<class T>() {
    const T* x = static_cast<const T*>(in.data_ptr());
    T* y = static_cast<T*>(values.data_ptr());
    parallel_for(rows, 1, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const T* row = x + r * cols;
        acc_t<T> m = static_cast<acc_t<T>>(row[0]);
        int64_t k = 0;
        for (int64_t c = 1; c < cols; ++c) {
          acc_t<T> v = static_cast<acc_t<T>>(row[c]);
          if (m != m) break;
          if (v > m || v != v) {
            m = v;
            k = c;
          }
        }
        y[r] = row[k];
        idx[r] = k;
      }
    });
  });
}

}  // namespace kiln::kernels::cpu
