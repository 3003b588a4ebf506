// CUDA bodies of copy/cast, fill, arange and the Philox draws (the same element functions as
// kernels/cpu/copy.cpp: cast_value from kernels/cast.h and philox_element from core/rng.h, so
// CPU and CUDA give the same bits), the batched block copy (2-D memcpys), and the synchronous
// host/device byte copies.
#include <cmath>

#include "kiln/core/profile.h"
#include "kiln/core/rng.h"
#include "kiln/kernels/cast.h"
#include "kiln/kernels/copy.h"
#include "kiln/kernels/cuda/indexing.cuh"

namespace kiln::kernels::cuda {

namespace {

// A cast of one element, for Map1 (indexing.cuh); FillOp also fills packs (NOTE [packed elementwise]).
template <class D, class S>
struct CastMath {
  __device__ D operator()(S s) const { return cast_value<D>(s); }
};

template <class T>
struct FillOp {
  T* d;
  T v;
  static constexpr int kVec = pack_elements(sizeof(T));
  __device__ void operator()(const int64_t* o) const { d[o[0]] = v; }
  bool packable() const { return pack_aligned<kVec>(d); }
  __device__ void packed(const int64_t* o) const {
    Pack<T, kVec> out;
#pragma unroll
    for (int k = 0; k < kVec; ++k) out.v[k] = v;
    store_pack(d, o[0], out);
  }
};

template <class T>
struct ArangeOp {
  T* d;
  double start, step;
  __device__ void operator()(const int64_t* o) const {
    // __dmul_rn keeps nvcc from fusing the multiply-add (the CPU rounds the product first).
    d[o[0]] = cast_value<T>(start + __dmul_rn(static_cast<double>(o[0]), step));
  }
};

template <class T>
struct UniformOp {
  T* d;
  uint64_t seed, offset;
  __device__ void operator()(const int64_t* o) const {
    Philox4 r = philox_element(seed, offset, static_cast<uint64_t>(o[0]));
    if constexpr (std::is_same_v<T, double>) d[o[0]] = uniform53(r.v[0], r.v[1]);
    else d[o[0]] = T(uniform_from_bits(r.v[0]));
  }
};

// Box-Muller in double exactly as the CPU body computes it. CUDA's double sqrt is correctly
// rounded like the host's; log and cos are accurate to within an ulp or two of glibc's, so the
// rounded f32/16-bit results match the CPU bit for bit except in rare double-rounding ties
// (tests/cuda compare f32 bits and report any mismatch count).
template <class T>
struct NormalOp {
  T* d;
  uint64_t seed, offset;
  __device__ void operator()(const int64_t* o) const {
    Philox4 r = philox_element(seed, offset, static_cast<uint64_t>(o[0]));
    double u1 = 1.0 - uniform53(r.v[0], r.v[1]);  // (0, 1]; exact either way (a power-of-two scale)
    double u2 = uniform53(r.v[2], r.v[3]);
    double z = __dmul_rn(sqrt(__dmul_rn(-2.0, log(u1))), cos(__dmul_rn(6.283185307179586, u2)));
    if constexpr (std::is_same_v<T, double>) d[o[0]] = z;
    else d[o[0]] = T(static_cast<float>(z));
  }
};

const Strides& contiguous_1d_strides() {
  static const Strides s{1};  // NOTE: a constant, shared by every flat launch
  return s;
}

void check_cuda_tensor(const Tensor& t, const char* op) {
  KILN_CHECK(t.is_cuda(), op, ": expected a CUDA tensor, got one on ", t.device().str());
}

}  // namespace

void copy_blocks(Device device, const std::vector<CopyBlock>& blocks) {
  cudaStream_t stream = cuda::stream(device.index);
  for (const CopyBlock& b : blocks) {
    if (b.rows == 0 || b.row_bytes == 0) continue;
    // One row: its pitch is its width (cudaMemcpy2D wants pitch >= width).
    const size_t dp = b.rows == 1 ? b.row_bytes : b.dst_pitch, sp = b.rows == 1 ? b.row_bytes : b.src_pitch;
    KILN_CUDA_CHECK(cudaMemcpy2DAsync(b.dst, dp, b.src, sp, static_cast<size_t>(b.row_bytes),
                                      static_cast<size_t>(b.rows), cudaMemcpyDeviceToDevice, stream));
  }
}

void copy(const Tensor& dst, const Tensor& src) {
  KILN_CHECK(dst.shape() == src.shape(), "copy: shapes ", dst.shape(), " and ", src.shape(), " differ");
  check_cuda_tensor(dst, "copy");
  KILN_CHECK(src.device() == dst.device(), "copy: source on ", src.device().str(), ", destination on ",
             dst.device().str(), " (move it with to(device) first)");
  if (dst.numel() == 0) return;
  cudaStream_t stream = cuda::stream(dst.device().index);
  if (dst.dtype() == src.dtype() && dst.is_contiguous() && src.is_contiguous()) {
    if (dst.data_ptr() != src.data_ptr())
      KILN_CUDA_CHECK(cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), dst.nbytes(), cudaMemcpyDeviceToDevice, stream));
    return;
  }
  if (is_storage_only(dst.dtype()) || is_storage_only(src.dtype())) {
    KILN_CHECK(dst.dtype() == src.dtype(), "copy: cannot cast between ", dtype_name(src.dtype()), " and ",
               dtype_name(dst.dtype()), " (storage-only format)");
    Map1<uint8_t, uint8_t, CastMath<uint8_t, uint8_t>> op{static_cast<uint8_t*>(dst.data_ptr()),
                                                          static_cast<const uint8_t*>(src.data_ptr()), {}};
    launch_elementwise<2>(dst.shape(), {&dst.strides(), &src.strides()}, op, stream, "copy");
    return;
  }
  dispatch_all(dst.dtype(), "copy", [&]<class D>() {
    dispatch_all(src.dtype(), "copy", [&]<class S>() {
      Map1<D, S, CastMath<D, S>> op{static_cast<D*>(dst.data_ptr()), static_cast<const S*>(src.data_ptr()), {}};
      launch_elementwise<2>(dst.shape(), {&dst.strides(), &src.strides()}, op, stream, "copy");
    });
  });
}

void fill(const Tensor& dst, double value) {
  check_cuda_tensor(dst, "fill");
  cudaStream_t stream = cuda::stream(dst.device().index);
  dispatch_all(dst.dtype(), "fill", [&]<class T>() {
    FillOp<T> op{static_cast<T*>(dst.data_ptr()), cast_value<T>(value)};
    launch_elementwise<1>(dst.shape(), {&dst.strides()}, op, stream, "fill");
  });
}

void arange(const Tensor& dst, double start, double step) {
  check_cuda_tensor(dst, "arange");
  KILN_CHECK(dst.dim() == 1 && dst.is_contiguous(), "arange: destination must be contiguous 1-D");
  cudaStream_t stream = cuda::stream(dst.device().index);
  dispatch_all(dst.dtype(), "arange", [&]<class T>() {
    ArangeOp<T> op{static_cast<T*>(dst.data_ptr()), start, step};
    launch_elementwise<1>({dst.numel()}, {&contiguous_1d_strides()}, op, stream, "arange");
  });
}

void rand_uniform(const Tensor& dst, uint64_t seed, uint64_t offset) {
  check_cuda_tensor(dst, "rand");
  KILN_CHECK(dst.is_contiguous(), "rand: destination must be contiguous");
  cudaStream_t stream = cuda::stream(dst.device().index);
  dispatch_floating(dst.dtype(), "rand", [&]<class T>() {
    UniformOp<T> op{static_cast<T*>(dst.data_ptr()), seed, offset};
    launch_elementwise<1>({dst.numel()}, {&contiguous_1d_strides()}, op, stream, "rand");
  });
}

void rand_normal(const Tensor& dst, uint64_t seed, uint64_t offset) {
  check_cuda_tensor(dst, "randn");
  KILN_CHECK(dst.is_contiguous(), "randn: destination must be contiguous");
  cudaStream_t stream = cuda::stream(dst.device().index);
  dispatch_floating(dst.dtype(), "randn", [&]<class T>() {
    NormalOp<T> op{static_cast<T*>(dst.data_ptr()), seed, offset};
    launch_elementwise<1>({dst.numel()}, {&contiguous_1d_strides()}, op, stream, "randn");
  });
}

void copy_host_to_device(void* dst, const void* src, size_t nbytes, int device) {
  if (nbytes == 0) return;
  cudaStream_t s = cuda::stream(device);
  // A CUDA graph would read the host buffer again at every replay, after its owner freed it.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  KILN_CUDA_CHECK(cudaStreamIsCapturing(s, &capture));
  KILN_CHECK(capture == cudaStreamCaptureStatusNone, "copy to cuda:", device, " (", nbytes,
             " bytes from host memory) while the stream is captured into a CUDA graph: a graph cannot hold a copy "
             "from a host buffer that is freed after it");
  // From pageable host memory the call returns once the source is staged (no wait for the
  // device), so the host buffer may be freed right after: no stream synchronisation needed.
  KILN_CUDA_CHECK(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyHostToDevice, s));
}

void copy_device_to_host(void* dst, const void* src, size_t nbytes, int device) {
  if (nbytes == 0) return;
  cudaStream_t s = cuda::stream(device);
  profile::count_sync("copy_device_to_host");
  KILN_CUDA_CHECK(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDeviceToHost, s));
  KILN_CUDA_CHECK(cudaStreamSynchronize(s));
  check_deferred_errors(device);
}

void copy_device_to_device(void* dst, int dst_device, const void* src, int src_device, size_t nbytes) {
  if (nbytes == 0) return;
  // Both streams drained first: the source may still be written by work queued on its device.
  profile::count_sync("copy_device_to_device (peer)");
  KILN_CUDA_CHECK(cudaStreamSynchronize(cuda::stream(src_device)));
  cudaStream_t s = cuda::stream(dst_device);
  KILN_CUDA_CHECK(cudaMemcpyPeerAsync(dst, dst_device, src, src_device, nbytes, s));
  KILN_CUDA_CHECK(cudaStreamSynchronize(s));
}

}  // namespace kiln::kernels::cuda
