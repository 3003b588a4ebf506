// kiln's own interfaces to NCCL and to the CUDA calls the NCCL backend makes, with opaque
// handles (no nccl.h or CUDA headers here), after torchcomms' NcclApi / CudaApi: the backend
// (nccl_backend.h) is host code over these, so every fault path (an async error, a call that
// stays ncclInProgress forever, abort, a NCCL without ncclCommShrink) is unit-tested with fakes
// in the CPU build. The real implementations are in kiln/dist/cuda/ (CUDA build only).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace kiln::dist {

// The values of ncclResult_t.
enum class NcclResult : int {
  success = 0, unhandled_cuda_error = 1, system_error = 2, internal_error = 3, invalid_argument = 4,
  invalid_usage = 5, remote_error = 6, in_progress = 7,
};
enum class NcclDtype : uint8_t { i8, u8, i32, u32, i64, u64, f16, f32, f64, bf16 };
enum class NcclRedOp : uint8_t { sum, prod, max, min, avg };

struct NcclCommOpaque;
struct CudaStreamOpaque;
struct CudaEventOpaque;
using NcclCommHandle = NcclCommOpaque*;
using CudaStreamHandle = CudaStreamOpaque*;
using CudaEventHandle = CudaEventOpaque*;

struct NcclUniqueIdBytes {
  char bytes[128];  // NCCL_UNIQUE_ID_BYTES
};

struct NcclCommConfig {
  bool blocking = false;  // kiln always asks for nonblocking communicators (abort needs them)
  std::string name;
};

class NcclApi {
 public:
  virtual ~NcclApi() = default;
  virtual int version() = 0;  // ncclGetVersion: 22803 for 2.28.3
  virtual const char* error_string(NcclResult r) = 0;
  virtual std::string last_error(NcclCommHandle comm) = 0;
  virtual NcclResult get_unique_id(NcclUniqueIdBytes* id) = 0;
  virtual NcclResult comm_init_rank_config(NcclCommHandle* comm, int nranks, const NcclUniqueIdBytes& id, int rank,
                                           const NcclCommConfig& config) = 0;
  virtual NcclResult comm_get_async_error(NcclCommHandle comm, NcclResult* async_error) = 0;
  virtual NcclResult comm_finalize(NcclCommHandle comm) = 0;
  virtual NcclResult comm_destroy(NcclCommHandle comm) = 0;
  virtual NcclResult comm_abort(NcclCommHandle comm) = 0;
  virtual NcclResult comm_split(NcclCommHandle comm, int color, int key, NcclCommHandle* out,
                                const NcclCommConfig& config) = 0;
  // Whether this NCCL has ncclCommShrink (2.27 and later, checked at run time).
  virtual bool has_shrink() = 0;
  virtual NcclResult comm_shrink(NcclCommHandle comm, const std::vector<int>& exclude, NcclCommHandle* out,
                                 const NcclCommConfig& config, bool abort_ongoing) = 0;
  virtual NcclResult all_reduce(const void* send, void* recv, size_t count, NcclDtype dt, NcclRedOp op,
                                NcclCommHandle comm, CudaStreamHandle stream) = 0;
  virtual NcclResult all_gather(const void* send, void* recv, size_t send_count, NcclDtype dt, NcclCommHandle comm,
                                CudaStreamHandle stream) = 0;
  virtual NcclResult reduce_scatter(const void* send, void* recv, size_t recv_count, NcclDtype dt, NcclRedOp op,
                                    NcclCommHandle comm, CudaStreamHandle stream) = 0;
  virtual NcclResult broadcast(const void* send, void* recv, size_t count, NcclDtype dt, int root,
                               NcclCommHandle comm, CudaStreamHandle stream) = 0;
  virtual NcclResult send(const void* buf, size_t count, NcclDtype dt, int peer, NcclCommHandle comm,
                          CudaStreamHandle stream) = 0;
  virtual NcclResult recv(void* buf, size_t count, NcclDtype dt, int peer, NcclCommHandle comm,
                          CudaStreamHandle stream) = 0;
  virtual NcclResult group_start() = 0;
  virtual NcclResult group_end() = 0;
};

class CudaApi {
 public:
  virtual ~CudaApi() = default;
  // The stream the backend enqueues collectives on (the device's communication stream).
  virtual CudaStreamHandle comm_stream(int device) = 0;
  // The stream the caller's kernels run on now (current_stream), which the collective waits for.
  virtual CudaStreamHandle caller_stream(int device) = 0;
  virtual CudaEventHandle event_create(int device) = 0;
  virtual void event_destroy(CudaEventHandle e) = 0;
  virtual void event_record(CudaEventHandle e, CudaStreamHandle s) = 0;
  virtual bool event_query(CudaEventHandle e) = 0;  // done; throws kiln::Error on a CUDA error
  virtual void stream_wait_event(CudaStreamHandle s, CudaEventHandle e) = 0;
};

}  // namespace kiln::dist
