// The NCCL world communicator in a build without CUDA.
#include "kiln/dist/backends.h"

namespace kiln::dist {

std::shared_ptr<Communicator> new_nccl_world(std::shared_ptr<Store>, const DistEnv&, const std::string&,
                                             CommOptions) {
  fail("nccl backend: kiln was built without CUDA (use the gloo backend, or the cuda preset)");
}

}  // namespace kiln::dist
