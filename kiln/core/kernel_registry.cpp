// KernelRegistry: lookups with the dtype / head-dim wildcards, single-flight get_or_make, and the
// static registrars of build-time kernels.
#include "kiln/core/kernel_registry.h"

#include <algorithm>
#include <condition_variable>
#include <exception>

#include "kiln/core/error.h"

namespace kiln {

std::string KernelKey::str() const {
  return family + "/" + device + "/" + dtypes + "/" + std::to_string(head_dim) + "/" + mods + "/" + options;
}

size_t KernelRegistry::Hash::operator()(const KernelKey& k) const {
  return std::hash<std::string>{}(k.str());
}

struct KernelRegistry::Pending {
  bool done = false;
  std::exception_ptr error;
  KernelEntry entry;
  std::condition_variable cv;
};

KernelRegistry& KernelRegistry::global() {
  static KernelRegistry* r = new KernelRegistry();  // never destroyed: entries outlive static teardown
  return *r;
}

void KernelRegistry::add(const KernelKey& key, KernelEntry entry) {
  KILN_CHECK(entry.fn != nullptr, "kernel registry: a null entry point for ", key.str());
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(key);
  if (it != entries_.end()) {
    KILN_CHECK(it->second.fn == entry.fn, "kernel registry: two bodies for ", key.str(), " (", it->second.origin,
               " and ", entry.origin, ")");
    return;
  }
  entries_.emplace(key, std::move(entry));
}

std::optional<KernelEntry> KernelRegistry::find(const KernelKey& key) const {
  std::lock_guard<std::mutex> lock(mu_);
  KernelKey k = key;
  for (int wild = 0; wild < 4; ++wild) {
    k.dtypes = (wild & 1) ? "*" : key.dtypes;
    k.head_dim = (wild & 2) ? 0 : key.head_dim;
    auto it = entries_.find(k);
    if (it != entries_.end()) return it->second;
  }
  return std::nullopt;
}

KernelEntry KernelRegistry::get_or_make(const KernelKey& key, const std::function<KernelEntry()>& make) {
  if (auto e = find(key)) return *e;
  std::shared_ptr<Pending> pending;
  {
    std::unique_lock<std::mutex> lock(mu_);
    auto it = pending_.find(key);
    if (it == pending_.end()) {
      pending = std::make_shared<Pending>();
      pending_.emplace(key, pending);
    } else {
      pending = it->second;
      pending->cv.wait(lock, [&] { return pending->done; });
      if (pending->error) std::rethrow_exception(pending->error);
      return pending->entry;
    }
  }
  KernelEntry made;
  std::exception_ptr error;
  try {
    made = make();
    KILN_CHECK(made.fn != nullptr, "kernel registry: making ", key.str(), " gave no entry point");
  } catch (...) {
    error = std::current_exception();
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!error) entries_.emplace(key, made);
    pending->done = true;
    pending->error = error;
    pending->entry = made;
    pending_.erase(key);
  }
  pending->cv.notify_all();
  if (error) std::rethrow_exception(error);
  return made;
}

std::vector<KernelKey> KernelRegistry::keys(const std::string& family) const {
  std::vector<KernelKey> out;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [k, e] : entries_)
      if (k.family == family) out.push_back(k);
  }
  std::sort(out.begin(), out.end(), [](const KernelKey& a, const KernelKey& b) { return a.str() < b.str(); });
  return out;
}

void KernelRegistry::remove_if_origin(const std::string& prefix) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = entries_.begin(); it != entries_.end();)
    it = it->second.origin.rfind(prefix, 0) == 0 ? entries_.erase(it) : std::next(it);
}

KernelRegistrar::KernelRegistrar(KernelKey key, const void* fn, const char* origin) {
  KernelRegistry::global().add(key, KernelEntry{fn, nullptr, origin});
}

}  // namespace kiln
