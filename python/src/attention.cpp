// Bindings of kiln/attention: block masks of the library's mask mods (none, causal,
// sliding_window, document, prefix_lm; built once per shape) and flex_attention with the
// library's score mods (none, alibi, softcap), returning out, lse and the autograd Graph that
// kiln.torch's backward runs; and run-time mods (kiln/attention/runtime_mods.h): expressions that
// kiln.torch traces from Python functions, with their captured tensors, compiled by the JIT. The
// GIL is released around the kernels and the compilations.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include "kiln/attention/flex_attention.h"
#include "kiln/attention/runtime_mods.h"
#include "python/src/bindings.h"

namespace kiln::python {
namespace {

using namespace kiln::attention;

// A built block mask and which library mask_mod it is.
struct PyBlockMask {
  std::string kind;  // none | causal | sliding_window | document | prefix_lm
  AnyBlockMask any;  // none, causal, sliding_window, document
  int64_t prefix = 0;
  BlockLayout prefix_layout;  // prefix_lm
  const BlockLayout& layout() const { return kind == "prefix_lm" ? prefix_layout : any.layout; }
};

std::unique_ptr<PyBlockMask> make_block_mask(const std::string& kind, int64_t q_len, int64_t kv_len, int64_t window,
                                             int64_t prefix, const std::optional<PyTensor>& document_ids,
                                             int64_t block_size, const std::string& device) {
  const Device dev = Device::parse(device);
  check_device_available(dev, "create_block_mask");
  auto m = std::make_unique<PyBlockMask>();
  m->kind = kind;
  nb::gil_scoped_release nogil;
  if (kind == "prefix_lm") {
    KILN_CHECK(prefix >= 0 && prefix < (int64_t{1} << 31), "create_block_mask: prefix_lm's prefix must be in [0, 2^31), got ",
               prefix);
    m->prefix = prefix;
    m->prefix_layout = create_block_mask(PrefixLM{static_cast<int>(prefix)}, 1, 1, q_len, kv_len, block_size,
                                         block_size).layout;
    if (!dev.is_cpu()) m->prefix_layout = m->prefix_layout.to(dev);
    return m;
  }
  MaskSpec spec;
  spec.block_size = block_size;
  if (kind == "none") spec.kind = MaskSpec::Kind::none;
  else if (kind == "causal") spec.kind = MaskSpec::Kind::causal;
  else if (kind == "sliding_window") spec.kind = MaskSpec::Kind::sliding_window, spec.window = window;
  else if (kind == "document") {
    spec.kind = MaskSpec::Kind::document;
    KILN_CHECK(document_ids.has_value(), "create_block_mask: the document mask needs document_ids (one id per position)");
    spec.document_ids = document_ids->t;
  } else {
    fail("create_block_mask: unknown mask '", kind, "' (expected none, causal, sliding_window, document or prefix_lm)");
  }
  m->any = create_block_mask(spec, q_len, kv_len, dev);
  return m;
}

template <class SM>
FlexResult run_mask(const Tensor& q, const Tensor& k, const Tensor& v, const SM& sm, const PyBlockMask& m,
                    const FlexOptions& o, const char* score_name) {
  if (m.kind == "none") return flex_attention(q, k, v, sm, BlockMask<NoMask>{{}, m.any.layout}, o);
  if (m.kind == "causal") return flex_attention(q, k, v, sm, BlockMask<Causal>{{}, m.any.layout}, o);
  if constexpr (std::is_same_v<SM, NoScoreMod>) {
    if (m.kind == "prefix_lm")
      return flex_attention(q, k, v, sm, BlockMask<PrefixLM>{PrefixLM{static_cast<int>(m.prefix)}, m.prefix_layout}, o);
    return flex_attention(q, k, v, m.any, o);  // sliding_window, document
  }
  fail("flex_attention: score_mod ", score_name, " runs with the none and causal masks only (kiln's kernels are "
       "instantiated for those); got mask ", m.kind);
}

using FlexOut = std::tuple<PyTensor, std::optional<PyTensor>, std::unique_ptr<Graph>>;

// The keep-all mask of a call given none.
AnyBlockMask no_mask(const PyTensor& q, const PyTensor& k) {
  MaskSpec spec;
  spec.kind = MaskSpec::Kind::none;
  return create_block_mask(spec, q.t.dim() == 4 ? q.t.size(2) : 0, k.t.dim() == 4 ? k.t.size(2) : 0, q.t.device());
}

// A detached copy of an input, a leaf that requires grad when its gradient is asked for.
Tensor leaf(const Tensor& t, bool g) {
  Tensor l = t.detach();
  if (g) l.requires_grad_(true);
  return l;
}

// What a flex call hands back: out, lse when asked, and the Graph over the leaves (q, k, v, then
// `extra`) when the output has history.
FlexOut flex_out(const FlexResult& r, bool return_lse, std::vector<Tensor> leaves) {
  std::unique_ptr<Graph> g;
  if (r.out.requires_grad()) {
    g = std::make_unique<Graph>();
    g->roots = {r.out, r.lse};
    g->leaves = std::move(leaves);
  }
  std::optional<PyTensor> lse;
  if (return_lse) lse = PyTensor{r.lse.detach(), false};
  return {PyTensor{r.out.detach(), false}, lse, std::move(g)};
}

FlexOut flex(const PyTensor& q, const PyTensor& k, const PyTensor& v, const PyBlockMask* mask,
             const std::string& score_mod, double softcap, const std::optional<PyTensor>& alibi_slopes,
             std::optional<double> scale, bool return_lse, bool q_grad, bool k_grad, bool v_grad) {
  nb::gil_scoped_release nogil;
  Tensor lq = leaf(q.t, q_grad), lk = leaf(k.t, k_grad), lv = leaf(v.t, v_grad);
  FlexOptions o;
  o.scale = scale;
  o.return_lse = true;  // kept for the caller's lse; returned only when asked
  PyBlockMask none;
  if (!mask) {
    none.kind = "none";
    none.any = no_mask(q, k);
    mask = &none;
  }
  FlexResult r;
  Tensor slopes;
  if (score_mod == "none") {
    r = run_mask(lq, lk, lv, NoScoreMod{}, *mask, o, "none");
  } else if (score_mod == "softcap") {
    r = run_mask(lq, lk, lv, Softcap{static_cast<float>(softcap)}, *mask, o, "softcap");
  } else if (score_mod == "alibi") {
    KILN_CHECK(alibi_slopes.has_value(), "flex_attention: the alibi score_mod needs its slopes");
    slopes = alibi_slopes->t.to(DType::f32).to(q.t.device()).contiguous();
    KILN_CHECK(q.t.dim() == 4 && slopes.dim() == 1 && slopes.size(0) == q.t.size(1),
               "flex_attention: alibi slopes must be [Hq=", q.t.dim() == 4 ? q.t.size(1) : -1, "], got ",
               shape_str(slopes.shape()));
    r = run_mask(lq, lk, lv, Alibi{slopes.data<float>()}, *mask, o, "alibi");
  } else {
    fail("flex_attention: unknown score_mod '", score_mod, "' (expected none, softcap or alibi)");
  }
  FlexOut out = flex_out(r, return_lse, {q_grad ? lq : Tensor(), k_grad ? lk : Tensor(), v_grad ? lv : Tensor()});
  // The backward reads the slopes through the functor's raw pointer: the Graph keeps them.
  if (auto& g = std::get<2>(out)) g->keep = slopes;
  return out;
}

// Captures from Python: names and tensors side by side (requires_grad set where asked).
Captures make_captures(const std::vector<std::string>& names, const std::vector<PyTensor>& tensors,
                       const std::vector<bool>& learn) {
  KILN_CHECK(names.size() == tensors.size(), "runtime mods: ", names.size(), " capture names for ", tensors.size(),
             " tensors");
  Captures c;
  for (size_t i = 0; i < names.size(); ++i) {
    Tensor t = tensors[i].t.detach();
    if (i < learn.size() && learn[i]) t.requires_grad_(true);
    c.emplace_back(names[i], t);
  }
  return c;
}

std::unique_ptr<RuntimeBlockMask> make_runtime_mask(const std::string& expr, const std::vector<std::string>& names,
                                                    const std::vector<PyTensor>& tensors, int64_t q_len,
                                                    int64_t kv_len, int64_t block_size, const std::string& device) {
  const Device dev = Device::parse(device);
  check_device_available(dev, "create_block_mask");
  RuntimeMaskMod mm(expr, make_captures(names, tensors, {}));
  nb::gil_scoped_release nogil;
  return std::make_unique<RuntimeBlockMask>(create_block_mask(mm, 1, 1, q_len, kv_len, block_size, block_size, dev));
}

// A library mask's tiles with its rule as an expression (the same pairs), for a call whose
// score_mod is a run-time one.
std::unique_ptr<RuntimeBlockMask> library_as_runtime(const PyBlockMask& m, const std::string& expr,
                                                     const std::vector<std::string>& names,
                                                     const std::vector<PyTensor>& tensors) {
  return std::make_unique<RuntimeBlockMask>(RuntimeBlockMask{RuntimeMaskMod(expr, make_captures(names, tensors, {})),
                                                             m.layout()});
}

FlexOut flex_runtime(const PyTensor& q, const PyTensor& k, const PyTensor& v, const RuntimeBlockMask* mask,
                     const std::string& score_expr, const std::string& score_dexpr,
                     const std::vector<std::string>& names, const std::vector<PyTensor>& tensors,
                     const std::vector<bool>& learn, std::optional<double> scale, bool return_lse, bool q_grad,
                     bool k_grad, bool v_grad) {
  RuntimeScoreMod sm(score_expr, make_captures(names, tensors, learn), score_dexpr);
  nb::gil_scoped_release nogil;
  Tensor lq = leaf(q.t, q_grad), lk = leaf(k.t, k_grad), lv = leaf(v.t, v_grad);
  FlexOptions o;
  o.scale = scale;
  o.return_lse = true;
  RuntimeBlockMask none;
  if (!mask) {
    none = RuntimeBlockMask{RuntimeMaskMod("true"), no_mask(q, k).layout};
    mask = &none;
  }
  FlexResult r = flex_attention(lq, lk, lv, sm, *mask, o);
  std::vector<Tensor> leaves{q_grad ? lq : Tensor(), k_grad ? lk : Tensor(), v_grad ? lv : Tensor()};
  for (size_t i = 0; i < sm.captures.size(); ++i)
    leaves.push_back(i < learn.size() && learn[i] ? sm.captures[i].second : Tensor());
  return flex_out(r, return_lse, std::move(leaves));
}

}  // namespace

void bind_attention(nb::module_& m) {
  nb::class_<RuntimeBlockMask>(m, "RuntimeBlockMask",
                               "The block-sparse schedule of a run-time mask_mod (an expression), built once per shape")
      .def_prop_ro("expr", [](const RuntimeBlockMask& b) { return b.mask_mod.expr; })
      .def_prop_ro("q_len", [](const RuntimeBlockMask& b) { return b.layout.q_len; })
      .def_prop_ro("kv_len", [](const RuntimeBlockMask& b) { return b.layout.kv_len; })
      .def_prop_ro("block_size", [](const RuntimeBlockMask& b) { return b.layout.q_block; })
      .def_prop_ro("device", [](const RuntimeBlockMask& b) { return b.layout.device().str(); })
      .def("sparsity", [](const RuntimeBlockMask& b) { return b.layout.sparsity(); })
      .def("to_dense", [](const RuntimeBlockMask& b) { return PyTensor{b.layout.to_dense(), false}; });
  m.def("create_runtime_block_mask", &make_runtime_mask, nb::arg("expr"), nb::arg("names"), nb::arg("tensors"),
        nb::arg("q_len"), nb::arg("kv_len"), nb::kw_only(), nb::arg("block_size") = kDefaultBlockSize,
        nb::arg("device") = "cpu", "create_block_mask of a run-time mask_mod (docs/jit.md's expression language)");
  m.def("library_mask_as_runtime", &library_as_runtime, nb::arg("mask"), nb::arg("expr"), nb::arg("names"),
        nb::arg("tensors"), "a library BlockMask's tiles with its rule written as an expression");
  m.def("flex_attention_runtime", &flex_runtime, nb::arg("q"), nb::arg("k"), nb::arg("v"),
        nb::arg("block_mask").none(), nb::kw_only(), nb::arg("score_mod") = "score",
        nb::arg("score_mod_derivative") = "", nb::arg("names") = std::vector<std::string>{},
        nb::arg("tensors") = std::vector<PyTensor>{}, nb::arg("learn") = std::vector<bool>{},
        nb::arg("scale") = nb::none(), nb::arg("return_lse") = false, nb::arg("q_grad") = false,
        nb::arg("k_grad") = false, nb::arg("v_grad") = false,
        "flex_attention with a run-time score_mod: (out, lse or None, Graph or None); the Graph's leaves are "
        "(q, k, v, then each capture, None where it learns nothing)");
  nb::class_<PyBlockMask>(m, "BlockMask", "The block-sparse schedule of a library mask, built once per shape")
      .def_prop_ro("kind", [](const PyBlockMask& b) { return b.kind; })
      .def_prop_ro("q_len", [](const PyBlockMask& b) { return b.layout().q_len; })
      .def_prop_ro("kv_len", [](const PyBlockMask& b) { return b.layout().kv_len; })
      .def_prop_ro("block_size", [](const PyBlockMask& b) { return b.layout().q_block; })
      .def_prop_ro("device", [](const PyBlockMask& b) { return b.layout().device().str(); })
      .def("sparsity", [](const PyBlockMask& b) { return b.layout().sparsity(); })
      .def("to_dense", [](const PyBlockMask& b) { return PyTensor{b.layout().to_dense(), false}; },
           "tile classes [1, 1, nQ, nKV] (i32: 0 empty, 1 partial, 2 full)");
  m.def("create_block_mask", &make_block_mask, nb::arg("kind"), nb::arg("q_len"), nb::arg("kv_len"), nb::kw_only(),
        nb::arg("window") = 0, nb::arg("prefix") = 0, nb::arg("document_ids") = nb::none(),
        nb::arg("block_size") = kDefaultBlockSize, nb::arg("device") = "cpu");
  m.def("flex_attention", &flex, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("block_mask").none(),
        nb::kw_only(), nb::arg("score_mod") = "none", nb::arg("softcap") = 0.0, nb::arg("alibi_slopes") = nb::none(),
        nb::arg("scale") = nb::none(), nb::arg("return_lse") = false, nb::arg("q_grad") = false,
        nb::arg("k_grad") = false, nb::arg("v_grad") = false,
        "kiln::attention::flex_attention: (out, lse or None, Graph or None); the Graph's leaves are (q, k, v)");
  m.def("alibi_slopes", [](int heads) {
    KILN_CHECK(heads >= 1, "alibi_slopes: heads must be >= 1, got ", heads);
    Tensor s = Tensor::empty({heads}, DType::f32);
    alibi_slopes(heads, s.data<float>());
    return PyTensor{s, false};
  }, nb::arg("heads"));
}

}  // namespace kiln::python
