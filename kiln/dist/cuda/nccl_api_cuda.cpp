// The real NcclApi (over nccl.h) and CudaApi (over kiln's stream registry, kiln/core/stream.h:
// collectives run on the device's communication stream after the caller's current stream), and
// the NCCL world communicator. CUDA build only (a `cuda/` folder); nccl_world_stub.cpp stands in
// elsewhere.
#include <cuda_runtime.h>
#include <nccl.h>

#include <cstring>

#include "kiln/core/stream.h"
#include "kiln/dist/backends.h"
#include "kiln/dist/nccl_backend.h"

namespace kiln::dist {
namespace {

ncclComm_t native(NcclCommHandle c) { return reinterpret_cast<ncclComm_t>(c); }
cudaStream_t native(CudaStreamHandle s) { return reinterpret_cast<cudaStream_t>(s); }
NcclResult ours(ncclResult_t r) { return static_cast<NcclResult>(static_cast<int>(r)); }

ncclDataType_t native(NcclDtype d) {
  switch (d) {
    case NcclDtype::i8: return ncclInt8;
    case NcclDtype::u8: return ncclUint8;
    case NcclDtype::i32: return ncclInt32;
    case NcclDtype::u32: return ncclUint32;
    case NcclDtype::i64: return ncclInt64;
    case NcclDtype::u64: return ncclUint64;
    case NcclDtype::f16: return ncclFloat16;
    case NcclDtype::f32: return ncclFloat32;
    case NcclDtype::f64: return ncclFloat64;
    case NcclDtype::bf16: return ncclBfloat16;
  }
  return ncclUint8;
}

ncclRedOp_t native(NcclRedOp op) {
  switch (op) {
    case NcclRedOp::sum: return ncclSum;
    case NcclRedOp::prod: return ncclProd;
    case NcclRedOp::max: return ncclMax;
    case NcclRedOp::min: return ncclMin;
    case NcclRedOp::avg: return ncclAvg;
  }
  return ncclSum;
}

class RealNccl : public NcclApi {
 public:
  int version() override {
    int v = 0;
    ncclGetVersion(&v);
    return v;
  }
  const char* error_string(NcclResult r) override { return ncclGetErrorString(static_cast<ncclResult_t>(r)); }
  std::string last_error(NcclCommHandle c) override {
    const char* s = ncclGetLastError(native(c));
    return s ? s : "";
  }
  NcclResult get_unique_id(NcclUniqueIdBytes* id) override {
    static_assert(sizeof(ncclUniqueId) == sizeof(id->bytes), "NCCL_UNIQUE_ID_BYTES changed");
    ncclUniqueId u;
    const ncclResult_t r = ncclGetUniqueId(&u);
    std::memcpy(id->bytes, &u, sizeof u);
    return ours(r);
  }
  NcclResult comm_init_rank_config(NcclCommHandle* comm, int nranks, const NcclUniqueIdBytes& id, int rank,
                                   const NcclCommConfig& cfg) override {
    ncclUniqueId u;
    std::memcpy(&u, id.bytes, sizeof u);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = cfg.blocking ? 1 : 0;
    config.commName = cfg.name.c_str();
    ncclComm_t c = nullptr;
    const ncclResult_t r = ncclCommInitRankConfig(&c, nranks, u, rank, &config);
    *comm = reinterpret_cast<NcclCommHandle>(c);
    return ours(r);
  }
  NcclResult comm_get_async_error(NcclCommHandle c, NcclResult* st) override {
    ncclResult_t s = ncclSuccess;
    const ncclResult_t r = ncclCommGetAsyncError(native(c), &s);
    *st = ours(s);
    return ours(r);
  }
  NcclResult comm_finalize(NcclCommHandle c) override { return ours(ncclCommFinalize(native(c))); }
  NcclResult comm_destroy(NcclCommHandle c) override { return ours(ncclCommDestroy(native(c))); }
  NcclResult comm_abort(NcclCommHandle c) override { return ours(ncclCommAbort(native(c))); }
  NcclResult comm_split(NcclCommHandle c, int color, int key, NcclCommHandle* out, const NcclCommConfig& cfg) override {
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = cfg.blocking ? 1 : 0;
    config.commName = cfg.name.c_str();
    ncclComm_t n = nullptr;
    const ncclResult_t r = ncclCommSplit(native(c), color, key, &n, &config);
    *out = reinterpret_cast<NcclCommHandle>(n);
    return ours(r);
  }
  bool has_shrink() override {
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 27, 0)
    return version() >= NCCL_VERSION(2, 27, 0);  // the library loaded, not only the header
#else
    return false;
#endif
  }
  NcclResult comm_shrink(NcclCommHandle c, const std::vector<int>& exclude, NcclCommHandle* out,
                         const NcclCommConfig& cfg, bool abort_ongoing) override {
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 27, 0)
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = cfg.blocking ? 1 : 0;
    config.commName = cfg.name.c_str();
    std::vector<int> ex = exclude;
    ncclComm_t n = nullptr;
    const ncclResult_t r = ncclCommShrink(native(c), ex.data(), static_cast<int>(ex.size()), &n, &config,
                                          abort_ongoing ? NCCL_SHRINK_ABORT : NCCL_SHRINK_DEFAULT);
    *out = reinterpret_cast<NcclCommHandle>(n);
    return ours(r);
#else
    return NcclResult::invalid_usage;
#endif
  }
  NcclResult all_reduce(const void* s, void* r, size_t n, NcclDtype dt, NcclRedOp op, NcclCommHandle c,
                        CudaStreamHandle st) override {
    return ours(ncclAllReduce(s, r, n, native(dt), native(op), native(c), native(st)));
  }
  NcclResult all_gather(const void* s, void* r, size_t n, NcclDtype dt, NcclCommHandle c, CudaStreamHandle st) override {
    return ours(ncclAllGather(s, r, n, native(dt), native(c), native(st)));
  }
  NcclResult reduce_scatter(const void* s, void* r, size_t n, NcclDtype dt, NcclRedOp op, NcclCommHandle c,
                            CudaStreamHandle st) override {
    return ours(ncclReduceScatter(s, r, n, native(dt), native(op), native(c), native(st)));
  }
  NcclResult broadcast(const void* s, void* r, size_t n, NcclDtype dt, int root, NcclCommHandle c,
                       CudaStreamHandle st) override {
    return ours(ncclBroadcast(s, r, n, native(dt), root, native(c), native(st)));
  }
  NcclResult send(const void* b, size_t n, NcclDtype dt, int peer, NcclCommHandle c, CudaStreamHandle st) override {
    return ours(ncclSend(b, n, native(dt), peer, native(c), native(st)));
  }
  NcclResult recv(void* b, size_t n, NcclDtype dt, int peer, NcclCommHandle c, CudaStreamHandle st) override {
    return ours(ncclRecv(b, n, native(dt), peer, native(c), native(st)));
  }
  NcclResult group_start() override { return ours(ncclGroupStart()); }
  NcclResult group_end() override { return ours(ncclGroupEnd()); }
};

class RealCuda : public CudaApi {
 public:
  CudaStreamHandle comm_stream(int device) override {
    return static_cast<CudaStreamHandle>(get_stream(cuda(device), StreamKind::communication).native());
  }
  CudaStreamHandle caller_stream(int device) override {
    return static_cast<CudaStreamHandle>(current_stream(cuda(device)).native());
  }
  CudaEventHandle event_create(int device) override {
    return static_cast<CudaEventHandle>(api()->create_event(device, /*timing=*/false));
  }
  void event_destroy(CudaEventHandle e) override {
    if (e) api()->destroy_event(e);
  }
  void event_record(CudaEventHandle e, CudaStreamHandle s) override { api()->record_event(e, s); }
  bool event_query(CudaEventHandle e) override { return api()->event_done(e); }
  void stream_wait_event(CudaStreamHandle s, CudaEventHandle e) override { api()->stream_wait_event(s, e); }

 private:
  static StreamApi* api() {
    StreamApi* a = cuda_stream_api();
    KILN_CHECK(a != nullptr, "nccl backend: no CUDA stream API in this build");
    return a;
  }
};

}  // namespace

std::shared_ptr<Communicator> new_nccl_world(std::shared_ptr<Store> store, const DistEnv& env, const std::string& name,
                                             CommOptions options) {
  const int n = cuda_device_count();
  KILN_CHECK(n > 0, "nccl backend: no CUDA device visible (use the gloo backend on the CPU)");
  KILN_CHECK(env.local_rank < n, "nccl backend: LOCAL_RANK=", env.local_rank, " but only ", n,
             " CUDA device(s) are visible (one GPU per rank: NCCL refuses two ranks on one GPU)");
  const cudaError_t e = cudaSetDevice(env.local_rank);
  KILN_CHECK(e == cudaSuccess, "nccl backend: cudaSetDevice(", env.local_rank, "): ", cudaGetErrorString(e));
  NcclBackendOptions b;
  b.device = env.local_rank;
  return new_nccl_communicator(std::make_shared<RealNccl>(), std::make_shared<RealCuda>(), std::move(store), env.rank,
                               env.world_size, name, options, b);
}

}  // namespace kiln::dist
