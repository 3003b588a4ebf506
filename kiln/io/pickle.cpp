// The restricted unpickler (see pickle.h): a stack machine over the opcodes torch.save uses.
#include "kiln/io/pickle.h"

#include <algorithm>
#include <cstring>
#include <unordered_map>

#include "kiln/core/error.h"
#include "kiln/io/json.h"

namespace kiln::io::pickle {

const char* Object::kind_name() const {
  switch (kind) {
    case Kind::none: return "None";
    case Kind::boolean: return "bool";
    case Kind::integer: return "int";
    case Kind::floating: return "float";
    case Kind::string: return "str";
    case Kind::bytes: return "bytes";
    case Kind::tuple: return "tuple";
    case Kind::list: return "list";
    case Kind::dict: return "dict";
    case Kind::global: return "global";
    case Kind::opaque: return "object";
    case Kind::tensor: return "tensor";
  }
  return "?";
}

// Frees the subtree with a work list: a chain of 200,000 nested lists freed by recursion
// overflowed the stack. A child still referenced elsewhere (the memo, another parent) keeps
// its own children.
Object::~Object() {
  std::vector<Ref> work;
  auto take = [&work](Object& o) {
    for (auto& r : o.items) work.push_back(std::move(r));
    for (auto& [k, v] : o.entries) {
      work.push_back(std::move(k));
      work.push_back(std::move(v));
    }
    o.items.clear();
    o.entries.clear();
  };
  take(*this);
  while (!work.empty()) {
    Ref r = std::move(work.back());
    work.pop_back();
    if (r && r.use_count() == 1) take(*r);
  }
}

namespace {

class Machine {
 public:
  Machine(std::string_view d, const Hooks& h, std::string_view what) : d_(d), h_(h), what_(what) {}

  Ref run() {
    while (true) {
      const size_t op_at = i_;
      const uint8_t op = u8();
      switch (op) {
        case 0x80: u8(); break;                          // PROTO
        case 0x95: n(8); break;                          // FRAME (length ignored: we read linearly)
        case '.':                                        // STOP
          KILN_CHECK(stack_.size() == 1 && marks_.empty(), what_, ": pickle ends with ", stack_.size(),
                     " values on its stack (malformed pickle)");
          return stack_.back();
        case '(': marks_.push_back(stack_.size()); break;
        case '0': pop(); break;
        case '1': pop_mark(); break;
        case '2': push(top()); break;
        case 'N': push(Object::make(Object::Kind::none)); break;
        case 0x88: case 0x89: {
          auto r = Object::make(Object::Kind::boolean);
          r->b = op == 0x88;
          push(r);
          break;
        }
        case 'J': push_int(static_cast<int32_t>(n(4))); break;
        case 'K': push_int(static_cast<int64_t>(n(1))); break;
        case 'M': push_int(static_cast<int64_t>(n(2))); break;
        case 0x8a: case 0x8b: {                          // LONG1, LONG4
          const uint64_t len = n(op == 0x8a ? 1 : 4);
          std::string_view b = bytes(len);
          if (len > 8) {
            auto r = Object::make(Object::Kind::opaque);
            r->s = "big int";
            push(r);
            break;
          }
          uint64_t v = 0;
          for (size_t k = len; k-- > 0;) v = (v << 8) | static_cast<uint8_t>(b[k]);
          if (len > 0 && len < 8 && (static_cast<uint8_t>(b[len - 1]) & 0x80)) v |= ~uint64_t{0} << (8 * len);
          push_int(static_cast<int64_t>(v));
          break;
        }
        case 'G': {                                      // BINFLOAT, big-endian
          std::string_view b = bytes(8);
          uint64_t v = 0;
          for (char c : b) v = (v << 8) | static_cast<uint8_t>(c);
          auto r = Object::make(Object::Kind::floating);
          std::memcpy(&r->f, &v, 8);
          push(r);
          break;
        }
        case 'X': push_str(Object::Kind::string, n(4)); break;
        case 0x8c: push_str(Object::Kind::string, n(1)); break;
        case 0x8d: push_str(Object::Kind::string, n(8)); break;
        case 'T': push_str(Object::Kind::bytes, n(4)); break;
        case 'U': push_str(Object::Kind::bytes, n(1)); break;
        case 'B': push_str(Object::Kind::bytes, n(4)); break;
        case 'C': push_str(Object::Kind::bytes, n(1)); break;
        case 0x8e: push_str(Object::Kind::bytes, n(8)); break;
        case ')': push(settled(Object::make(Object::Kind::tuple), "EMPTY_TUPLE")); break;
        case ']': push(settled(Object::make(Object::Kind::list), "EMPTY_LIST")); break;
        case '}': push(settled(Object::make(Object::Kind::dict), "EMPTY_DICT")); break;
        case 't': {
          auto r = Object::make(Object::Kind::tuple);
          r->items = pop_mark();
          push(settled(r, "TUPLE"));
          break;
        }
        case 0x85: case 0x86: case 0x87: {
          const size_t k = op - 0x84u;
          need(k, "TUPLE1/2/3");
          auto r = Object::make(Object::Kind::tuple);
          r->items.assign(stack_.end() - static_cast<ptrdiff_t>(k), stack_.end());
          stack_.resize(stack_.size() - k);
          push(settled(r, "TUPLE1/2/3"));
          break;
        }
        case 'l': {
          auto r = Object::make(Object::Kind::list);
          r->items = pop_mark();
          push(settled(r, "LIST"));
          break;
        }
        case 'd': {
          auto items = pop_mark();
          KILN_CHECK(items.size() % 2 == 0, what_, ": pickle DICT with an odd number of items");
          auto r = Object::make(Object::Kind::dict);
          for (size_t k = 0; k < items.size(); k += 2) r->entries.emplace_back(items[k], items[k + 1]);
          push(settled(r, "DICT"));
          break;
        }
        case 'a': {
          Ref v = pop();
          Object* l = growing(list_of(top(), "APPEND"), "APPEND");
          adopt(l, v, "APPEND");  // before the insertion: a refused self-reference must not become a cycle
          l->items.push_back(v);
          break;
        }
        case 'e': {
          auto items = pop_mark();
          Object* l = growing(list_of(top(), "APPENDS"), "APPENDS");
          for (const Ref& v : items) adopt(l, v, "APPENDS");
          l->items.insert(l->items.end(), items.begin(), items.end());
          break;
        }
        case 's': {
          Ref v = pop(), k = pop();
          Object* d = growing(dict_of(top(), "SETITEM"), "SETITEM");
          adopt(d, k, "SETITEM");
          adopt(d, v, "SETITEM");
          d->entries.emplace_back(k, v);
          break;
        }
        case 'u': {
          auto items = pop_mark();
          KILN_CHECK(items.size() % 2 == 0, what_, ": pickle SETITEMS with an odd number of items");
          Object* d = growing(dict_of(top(), "SETITEMS"), "SETITEMS");
          for (const Ref& v : items) adopt(d, v, "SETITEMS");
          for (size_t k = 0; k < items.size(); k += 2) d->entries.emplace_back(items[k], items[k + 1]);
          break;
        }
        case 'q': memo_[n(1)] = top(); break;
        case 'r': memo_[n(4)] = top(); break;
        case 0x94: memo_[memo_.size()] = top(); break;
        case 'h': push(get(n(1))); break;
        case 'j': push(get(n(4))); break;
        case 'c': {
          std::string module = line(), name = line();
          push(h_.global(module, name));
          break;
        }
        case 0x93: {
          Ref name = pop(), module = pop();
          KILN_CHECK(module->kind == Object::Kind::string && name->kind == Object::Kind::string, what_,
                     ": pickle STACK_GLOBAL needs two strings");
          push(h_.global(module->s, name->s));
          break;
        }
        case 'R': case 0x81: {                           // REDUCE, NEWOBJ
          Ref args = pop(), callable = pop();
          KILN_CHECK(args->kind == Object::Kind::tuple, what_, ": pickle ", op == 'R' ? "REDUCE" : "NEWOBJ",
                     " arguments are a ", args->kind_name(), ", not a tuple");
          push(settled(h_.call(callable, args), op == 'R' ? "REDUCE" : "NEWOBJ"));
          break;
        }
        case 'b': {                                      // BUILD: object state is ignored for containers/tensors
          Ref state = pop();
          const Ref& obj = top();
          KILN_CHECK(obj->kind == Object::Kind::dict || obj->kind == Object::Kind::tensor ||
                         obj->kind == Object::Kind::list,
                     what_, ": pickle BUILD on a ", obj->kind_name(), " is not supported");
          break;
        }
        case 'Q': push(h_.persistent_load(pop())); break;
        default:
          fail(what_, ": pickle opcode 0x", hex(op), " at byte ", op_at,
               " is not supported by kiln's restricted unpickler");
      }
    }
  }

 private:
  static std::string hex(uint8_t v) {
    const char* d = "0123456789abcdef";
    return {d[v >> 4], d[v & 15]};
  }
  uint8_t u8() {
    KILN_CHECK(i_ < d_.size(), what_, ": pickle ends without STOP (truncated file?)");
    return static_cast<uint8_t>(d_[i_++]);
  }
  uint64_t n(int k) {
    std::string_view b = bytes(static_cast<uint64_t>(k));
    uint64_t v = 0;
    for (int j = k - 1; j >= 0; --j) v = (v << 8) | static_cast<uint8_t>(b[static_cast<size_t>(j)]);
    return v;
  }
  std::string_view bytes(uint64_t len) {
    KILN_CHECK(len <= d_.size() - i_, what_, ": pickle item of ", len, " bytes runs past the end of data.pkl");
    std::string_view b = d_.substr(i_, len);
    i_ += len;
    return b;
  }
  std::string line() {
    size_t e = d_.find('\n', i_);
    KILN_CHECK(e != std::string_view::npos && e - i_ < 256, what_, ": pickle GLOBAL name is malformed");
    std::string s(d_.substr(i_, e - i_));
    i_ = e + 1;
    return s;
  }
  void push(Ref r) { stack_.push_back(std::move(r)); }
  void push_int(int64_t v) {
    auto r = Object::make(Object::Kind::integer);
    r->i = v;
    push(r);
  }
  void push_str(Object::Kind k, uint64_t len) {
    auto r = Object::make(k);
    r->s = std::string(bytes(len));
    // A str is UTF-8 in a pickle: Python's unpickler refuses other bytes, and a name kept with
    // them made safetensors that no reader took (convert wrote one).
    if (k == Object::Kind::string)
      json::check_utf8(r->s, std::string(what_) + ": pickle string of " + std::to_string(len) + " bytes",
                       "malformed pickle");
    push(r);
  }
  // Depth bookkeeping (see Object::depth). A container takes items only while it is in no other
  // container, and never itself: so no cycle can form and each depth, computed from the items
  // as they arrive, is exact (a list grown after its parent was built would have been deeper
  // than its parent's depth said).
  void adopt(Object* parent, const Ref& child, const char* op) {
    KILN_CHECK(child.get() != parent, what_, ": pickle ", op, " puts a ", parent->kind_name(),
               " inside itself (kiln's unpickler takes no recursive containers)");
    child->nested = true;
    if (child->depth + 1 > parent->depth) {
      KILN_CHECK(child->depth + 1 <= kMaxDepth, what_, ": pickle nests containers deeper than ", kMaxDepth,
                 " levels (at ", op, ", byte ", i_, "): not a checkpoint kiln reads");
      parent->depth = child->depth + 1;
    }
  }
  Object* growing(Object* c, const char* op) {
    KILN_CHECK(!c->nested, what_, ": pickle ", op, " adds to a ", c->kind_name(),
               " that is already inside another container (kiln's unpickler does not take that)");
    return c;
  }
  // A container made from items (or returned by a hook): its depth from its direct items.
  Ref settled(Ref r, const char* op) {
    if (r->kind == Object::Kind::tuple || r->kind == Object::Kind::list || r->kind == Object::Kind::dict)
      r->depth = std::max(r->depth, 1);
    for (const Ref& x : r->items) adopt(r.get(), x, op);
    for (const auto& [k, v] : r->entries) {
      adopt(r.get(), k, op);
      adopt(r.get(), v, op);
    }
    return r;
  }
  void need(size_t k, const char* op) {
    const size_t floor = marks_.empty() ? 0 : marks_.back();
    KILN_CHECK(stack_.size() >= floor + k, what_, ": pickle ", op, " on a stack that is too short (malformed pickle)");
  }
  Ref pop() {
    need(1, "pop");
    Ref r = std::move(stack_.back());
    stack_.pop_back();
    return r;
  }
  const Ref& top() {
    need(1, "top");
    return stack_.back();
  }
  std::vector<Ref> pop_mark() {
    KILN_CHECK(!marks_.empty(), what_, ": pickle uses a MARK that was never set (malformed pickle)");
    const size_t m = marks_.back();
    marks_.pop_back();
    std::vector<Ref> out(stack_.begin() + static_cast<ptrdiff_t>(m), stack_.end());
    stack_.resize(m);
    return out;
  }
  Ref get(uint64_t k) {
    auto it = memo_.find(k);
    KILN_CHECK(it != memo_.end(), what_, ": pickle memo key ", k, " was never stored (malformed pickle)");
    return it->second;
  }
  Object* list_of(const Ref& r, const char* op) {
    KILN_CHECK(r->kind == Object::Kind::list, what_, ": pickle ", op, " on a ", r->kind_name(), ", not a list");
    return r.get();
  }
  Object* dict_of(const Ref& r, const char* op) {
    KILN_CHECK(r->kind == Object::Kind::dict, what_, ": pickle ", op, " on a ", r->kind_name(), ", not a dict");
    return r.get();
  }

  std::string_view d_;
  const Hooks& h_;
  std::string_view what_;
  size_t i_ = 0;
  std::vector<Ref> stack_;
  std::vector<size_t> marks_;
  std::unordered_map<uint64_t, Ref> memo_;
};

}  // namespace

Ref unpickle(std::string_view data, const Hooks& hooks, std::string_view what) {
  return Machine(data, hooks, what).run();
}

}  // namespace kiln::io::pickle
