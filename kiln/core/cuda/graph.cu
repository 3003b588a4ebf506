// CudaGraph over the CUDA runtime's stream capture (kiln/core/cuda_graph.h): the capture in
// relaxed mode on the device's current stream, the caching allocator's private pool for it
// (NOTE [graph pools]), instantiation, replay and teardown.
#include <atomic>

#include "kiln/core/allocator.h"
#include "kiln/core/caching_allocator.h"
#include "kiln/core/cuda/runtime.h"
#include "kiln/core/cuda_graph.h"
#include "kiln/core/error.h"
#include "kiln/core/stream.h"

namespace kiln {

namespace {

CachingAllocator& caching_allocator(int device) {
  auto* a = dynamic_cast<CachingAllocator*>(&cuda_caching_allocator(device));
  KILN_CHECK(a != nullptr, "cuda graph: device ", device, "'s allocator is not kiln's caching allocator");
  return *a;
}

// Pool ids are never used twice in a process (a released pool's live blocks still name theirs).
uint64_t next_pool_id() {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(1);
}

// A graph pool of the caching allocator, released when the last graph holding it goes.
struct PoolLease {
  int device = 0;
  uint64_t id = 0;
  PoolLease(int d, uint64_t i) : device(d), id(i) {}
  ~PoolLease() {
    try {
      caching_allocator(device).release_pool(id);
    } catch (...) {  // a destructor path: the memory stays with the allocator
    }
  }
  PoolLease(const PoolLease&) = delete;
  PoolLease& operator=(const PoolLease&) = delete;
};

}  // namespace

struct CudaGraph::Impl {
  Device device;
  cudaStream_t stream = nullptr;  // the captured stream
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  std::shared_ptr<PoolLease> pool;  // the graph's allocator pool (shared with graphs captured into it)
  bool capturing = false;

  void set_device() const { core_cuda::check(cudaSetDevice(device.index), "cudaSetDevice (cuda graph)"); }
  // Destroys the graph; its pool's cached blocks go back to the system (the allocator waits for
  // the device first), its live ones to the allocator's pools when their tensors are freed.
  void destroy() noexcept {
    if (exec) (void)cudaGraphExecDestroy(exec);
    if (graph) (void)cudaGraphDestroy(graph);
    exec = nullptr;
    graph = nullptr;
    pool.reset();  // the last graph of the pool gives it back
  }
};

CudaGraph::CudaGraph() : impl_(std::make_unique<Impl>()) {}

CudaGraph::~CudaGraph() {
  capture_abort();
  impl_->destroy();
}

void CudaGraph::capture_begin(const Device& device, const CudaGraph* share_pool_of) {
  Impl& g = *impl_;
  KILN_CHECK(device.is_cuda(), "cuda graph: capture_begin on ", device.str(), " (a CUDA device is needed)");
  KILN_CHECK(!g.capturing, "cuda graph: capture_begin while this graph is already capturing");
  KILN_CHECK(share_pool_of != this, "cuda graph: a graph cannot share its own pool");
  std::shared_ptr<PoolLease> shared;
  if (share_pool_of) {
    shared = share_pool_of->impl_->pool;
    KILN_CHECK(shared && share_pool_of->impl_->device == device, "cuda graph: capture_begin shares the pool of a "
               "graph that is not captured on ", device.str());
  }
  g.destroy();
  g.device = device;
  g.set_device();
  g.stream = static_cast<cudaStream_t>(current_stream(device).native());
  KILN_CHECK(g.stream != nullptr, "cuda graph: ", device.str(),
             "'s current stream is the legacy default stream, which cannot be captured");
  CachingAllocator& alloc = caching_allocator(device.index);
  g.pool = shared ? shared : std::make_shared<PoolLease>(device.index, next_pool_id());
  alloc.begin_allocate_to_pool(g.pool->id);
  const cudaError_t e = cudaStreamBeginCapture(g.stream, cudaStreamCaptureModeRelaxed);
  if (e != cudaSuccess) {
    alloc.end_allocate_to_pool();
    g.destroy();
    (void)cudaGetLastError();
    core_cuda::check(e, "cudaStreamBeginCapture");
  }
  g.capturing = true;
}

void CudaGraph::capture_end() {
  Impl& g = *impl_;
  KILN_CHECK(g.capturing, "cuda graph: capture_end without capture_begin");
  g.set_device();
  g.capturing = false;
  cudaGraph_t graph = nullptr;
  const cudaError_t e = cudaStreamEndCapture(g.stream, &graph);
  caching_allocator(g.device.index).end_allocate_to_pool();
  if (e != cudaSuccess || graph == nullptr) {
    if (graph) (void)cudaGraphDestroy(graph);
    (void)cudaGetLastError();
    g.destroy();
    fail("cuda graph: the capture failed: ", cudaGetErrorName(e), " (", cudaGetErrorString(e),
         "): something in it made the host wait for the device or used a stream it did not join");
  }
  g.graph = graph;
  const cudaError_t ie = cudaGraphInstantiateWithFlags(&g.exec, graph, 0);
  if (ie != cudaSuccess) {
    (void)cudaGetLastError();
    g.exec = nullptr;
    g.destroy();
    core_cuda::check(ie, "cudaGraphInstantiate");
  }
}

void CudaGraph::capture_abort() noexcept {
  Impl& g = *impl_;
  if (!g.capturing) return;
  g.capturing = false;
  (void)cudaSetDevice(g.device.index);
  cudaGraph_t graph = nullptr;
  (void)cudaStreamEndCapture(g.stream, &graph);  // invalidated captures return an error: ignored
  if (graph) (void)cudaGraphDestroy(graph);
  (void)cudaGetLastError();
  try {
    caching_allocator(g.device.index).end_allocate_to_pool();
  } catch (...) {
  }
  g.destroy();
}

void CudaGraph::replay() {
  Impl& g = *impl_;
  KILN_CHECK(g.exec != nullptr, "cuda graph: replay before a capture ended");
  g.set_device();
  auto s = static_cast<cudaStream_t>(current_stream(g.device).native());
  core_cuda::check(cudaGraphLaunch(g.exec, s), "cudaGraphLaunch");
}

bool CudaGraph::ready() const { return impl_->exec != nullptr; }

int64_t CudaGraph::num_nodes() const {
  if (!impl_->graph) return 0;
  size_t n = 0;
  core_cuda::check(cudaGraphGetNodes(impl_->graph, nullptr, &n), "cudaGraphGetNodes");
  return static_cast<int64_t>(n);
}

}  // namespace kiln
