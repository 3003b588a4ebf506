// The progress board (progress.h).
#include "kiln/dist/progress.h"

#include <cstdlib>
#include <sstream>
#include <thread>
#include <vector>

namespace kiln::dist {

void ProgressBoard::publish() {
  const int64_t s = started_, c = completed_;
  if (s == published_started_ && c == published_completed_) return;
  store_->set("progress/" + std::to_string(rank_), std::to_string(s) + "," + std::to_string(c));
  published_started_ = s;
  published_completed_ = c;
}

std::string ProgressBoard::not_joined(int64_t seq, Millis settle) {
  std::vector<int> missing;
  std::ostringstream detail;
  const auto deadline = std::chrono::steady_clock::now() + settle;
  while (true) {
    missing.clear();
    detail.str("");
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      int64_t started = 0;
      try {
        if (auto v = store_->try_get("progress/" + std::to_string(r))) started = std::atoll(v->c_str());
      } catch (const std::exception&) {
        return "(the store is unreachable: no word on the other ranks)";
      }
      if (started < seq) {
        missing.push_back(r);
        detail << (missing.size() > 1 ? ", " : "") << "rank " << r << " last started #" << started;
      }
    }
    if (missing.empty() || std::chrono::steady_clock::now() >= deadline) break;
    std::this_thread::sleep_for(Millis(50));
  }
  if (missing.empty()) return "every rank had started it (a peer died or stalled inside it)";
  std::ostringstream s;
  s << (missing.size() == 1 ? "rank " : "ranks ");
  for (size_t i = 0; i < missing.size(); ++i) s << (i ? ", " : "") << missing[i];
  s << (missing.size() == 1 ? " has" : " have") << " not joined it (" << detail.str() << ")";
  return s.str();
}

}  // namespace kiln::dist
