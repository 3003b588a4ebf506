// KernelRegistry: the table of compiled kernel entry points, keyed by (family, device, dtypes,
// head dim, mods, options). Build-time instantiations register into it at static
// initialisation (KernelRegistrar: the CUDA FlexAttention files, kernels/cuda/attention_*.cu);
// the JIT (kiln/jit/) fills it on a miss (get_or_make); the front ends look kernels up here
// instead of keeping lists of what exists. It lives in core/ because it is a plain table of
// type-erased pointers that every layer above may read or fill: it knows no kernel, device API
// or dtype. An entry's pointer is cast back to its family's signature by the family's caller
// (kernels/attention.h: FlexEntry); `keep` holds the module the code lives in (a JIT shared
// object or CUDA library) for as long as the entry exists.
//
// The one process-wide registry (KernelRegistry::global) is a registry-kind global: kernels
// are process-wide code, as the dynamic loader's own table is. Thread-safe.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace kiln {

struct KernelKey {
  std::string family;   // e.g. "flex_forward", "flex_backward", "flex_classify"
  std::string device;   // "cpu" or "cuda"
  std::string dtypes;   // e.g. "f32"; "*": the entry dispatches on dtype itself
  int64_t head_dim = 0; // 0: any (the entry dispatches on head dim itself)
  std::string mods;     // the mods' canonical names, or a JIT source's digest
  std::string options;  // anything else the code was specialised for ("" when nothing)

  std::string str() const;  // "family/device/dtypes/head_dim/mods/options", for messages
  bool operator==(const KernelKey&) const = default;
};

struct KernelEntry {
  const void* fn = nullptr;    // the entry point (cast back by the family's caller)
  std::shared_ptr<void> keep;  // the module fn lives in (null for code linked into kiln)
  std::string origin;          // where it came from: "built in (file)", "jit cpu <digest>", ...
};

class KernelRegistry {
 public:
  static KernelRegistry& global();

  // Adds an entry. The same key again with the same pointer is ignored; another pointer is an
  // error naming the key (two bodies for one kernel).
  void add(const KernelKey& key, KernelEntry entry);
  // The entry for `key`: exact, else one registered for any dtype ("*") and / or any head dim (0).
  std::optional<KernelEntry> find(const KernelKey& key) const;
  // find(key), else make() (once: concurrent callers for the same key wait for the first and
  // share its result or its error; an error is not remembered, so a later call tries again).
  KernelEntry get_or_make(const KernelKey& key, const std::function<KernelEntry()>& make);
  // The keys of one family, sorted (for messages and `kiln precompile`).
  std::vector<KernelKey> keys(const std::string& family) const;
  // Removes the entries whose origin starts with `prefix` (tests: drop JIT entries).
  void remove_if_origin(const std::string& prefix);

 private:
  struct Hash {
    size_t operator()(const KernelKey& k) const;
  };
  mutable std::mutex mu_;
  std::unordered_map<KernelKey, KernelEntry, Hash> entries_;
  struct Pending;
  std::unordered_map<KernelKey, std::shared_ptr<Pending>, Hash> pending_;
};

// A static object that registers one build-time kernel: `static const KernelRegistrar r{key, fn, "file"};`.
struct KernelRegistrar {
  KernelRegistrar(KernelKey key, const void* fn, const char* origin);
};

}  // namespace kiln
