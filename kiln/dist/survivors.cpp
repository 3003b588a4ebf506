// The survivors' agreement (survivors.h).
#include "kiln/dist/survivors.h"

#include <algorithm>
#include <sstream>
#include <thread>

namespace kiln::dist {

SurvivorDecision agree_on_survivors(Store& store, int generation, int rank, int size, Millis window,
                                    const std::string& comm_name) {
  const std::string base = "shrink/" + std::to_string(generation);
  store.set(base + "/alive/" + std::to_string(rank), "1");
  const auto deadline = std::chrono::steady_clock::now() + window;
  std::vector<int> alive;
  while (true) {
    alive.clear();
    for (int r = 0; r < size; ++r)
      if (store.check({base + "/alive/" + std::to_string(r)})) alive.push_back(r);
    if (static_cast<int>(alive.size()) == size || std::chrono::steady_clock::now() >= deadline) break;
    if (store.try_get(base + "/decision")) break;
    std::this_thread::sleep_for(Millis(50));
  }
  std::string proposal;
  for (int r : alive) proposal += (proposal.empty() ? "" : ",") + std::to_string(r);
  const std::string decision = store.compare_set(base + "/decision", "", proposal);
  SurvivorDecision d;
  std::stringstream ss(decision);
  for (std::string tok; std::getline(ss, tok, ',');) d.members.push_back(std::atoi(tok.c_str()));
  const auto me = std::find(d.members.begin(), d.members.end(), rank);
  KILN_CHECK(me != d.members.end(), "rank ", rank, " was dropped from '", comm_name, "' at generation ", generation,
             ": the survivors [", decision, "] decided without it");
  d.new_rank = static_cast<int>(me - d.members.begin());
  for (int r = 0; r < size; ++r)
    if (std::find(d.members.begin(), d.members.end(), r) == d.members.end()) d.lost.push_back(r);
  return d;
}

}  // namespace kiln::dist
