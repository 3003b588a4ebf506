// The Gloo backend's constructor in a build without Gloo (Debian: libgloo-dev).
#include "kiln/dist/backends.h"

namespace kiln::dist {

std::shared_ptr<Communicator> new_gloo_communicator(std::shared_ptr<Store>, int, int, const std::string&,
                                                    CommOptions) {
  fail("gloo backend: kiln was built without Gloo (install Debian's libgloo-dev and rebuild)");
}

}  // namespace kiln::dist
