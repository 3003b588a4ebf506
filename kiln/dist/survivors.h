// How the survivors of a failed communicator agree on who is alive, through the store: each
// announces itself under the communicator's generation, waits up to `window` for the others
// (or for a decision already made), proposes the set it saw, and one compare_set keeps the first
// proposal, which every survivor then follows. Used by the shrink policy of both backends.
#pragma once
#include <vector>

#include "kiln/dist/store.h"

namespace kiln::dist {

struct SurvivorDecision {
  std::vector<int> members;  // old ranks that go on, ascending: new rank = index
  std::vector<int> lost;     // old ranks left out
  int new_rank = -1;         // this rank's place in members
};

// Throws when this rank is not among the decided members (it arrived too late).
SurvivorDecision agree_on_survivors(Store& store, int generation, int rank, int size, Millis window,
                                    const std::string& comm_name);

}  // namespace kiln::dist
