// A restricted unpickler: it builds plain values (None, bools, ints, floats, strings, bytes,
// tuples, lists, dicts) and leaves every "global" and "call" to hooks supplied by the caller,
// which decide what they mean (kiln/io/torch_pt.cpp allows only what rebuilds tensors and
// containers). Nothing from the file is ever executed; memory is bounded by the input's size
// and nesting by kMaxDepth, checked as each container is filled (every kind: tuple, list, dict,
// and what the hooks return), so no reader of the tree recurses deeper than that; an Object's
// destructor frees its subtree with a work list, not by recursion. Opcodes: those of protocols 0-2 that torch.save emits, plus FRAME, MEMOIZE,
// STACK_GLOBAL, SHORT_BINUNICODE and BINUNICODE8 of protocol 4.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kiln/core/tensor.h"

namespace kiln::io::pickle {

struct Object;
using Ref = std::shared_ptr<Object>;

// The deepest nesting of containers a pickle may build (torch.save's state dicts nest a few
// levels; Python's own recursion limit is 1000).
constexpr int kMaxDepth = 1000;

struct Object {
  enum class Kind { none, boolean, integer, floating, string, bytes, tuple, list, dict, global, opaque, tensor };
  Kind kind = Kind::none;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;                                // string, bytes, global ("module.name"), opaque tag
  std::vector<Ref> items;                       // tuple, list
  std::vector<std::pair<Ref, Ref>> entries;     // dict (in insertion order)
  Tensor tensor;                                // tensor
  std::shared_ptr<Storage> storage;             // opaque storage handle (torch)
  DType dtype = DType::u8;                      // with `storage`
  // Containers nested in this one, itself included (0: a scalar or an empty container's
  // contents); `nested` once it is an item of another container (it may then no longer grow:
  // its parents' depths were computed from it).
  int depth = 0;
  bool nested = false;

  Object() = default;
  Object(const Object&) = delete;
  Object& operator=(const Object&) = delete;
  ~Object();
  static Ref make(Kind k) { auto r = std::make_shared<Object>(); r->kind = k; return r; }
  const char* kind_name() const;
};

struct Hooks {
  // Called for GLOBAL / STACK_GLOBAL: return the object standing for it, or throw.
  std::function<Ref(const std::string& module, const std::string& name)> global;
  // Called for REDUCE and NEWOBJ: `callable` is what `global` returned; `args` a tuple.
  std::function<Ref(const Ref& callable, const Ref& args)> call;
  // Called for BINPERSID / PERSID.
  std::function<Ref(const Ref& pid)> persistent_load;
};

// Runs the pickle in `data` to its STOP and returns the result; `what` names the file in errors.
Ref unpickle(std::string_view data, const Hooks& hooks, std::string_view what);

}  // namespace kiln::io::pickle
