// CPU-only build: CudaGraph exists and every call says kiln was built without CUDA
// (kiln/core/cuda_graph.h).
#include "kiln/core/cuda_graph.h"
#include "kiln/core/error.h"

namespace kiln {

struct CudaGraph::Impl {};

CudaGraph::CudaGraph() : impl_(std::make_unique<Impl>()) {}
CudaGraph::~CudaGraph() = default;
void CudaGraph::capture_begin(const Device& device, const CudaGraph*) {
  fail("cuda graph: capture on ", device.str(), ": kiln was built without CUDA (configure with the 'cuda' preset)");
}
void CudaGraph::capture_end() { fail("cuda graph: kiln was built without CUDA"); }
void CudaGraph::capture_abort() noexcept {}
void CudaGraph::replay() { fail("cuda graph: kiln was built without CUDA"); }
bool CudaGraph::ready() const { return false; }
int64_t CudaGraph::num_nodes() const { return 0; }

}  // namespace kiln
