// Bindings of kiln/loss: the fused linear + cross-entropy (kiln::linear_cross_entropy) with its
// options, returning the loss, its z-loss part, the per-token lse when asked, and the autograd
// Graph that kiln.torch's backward runs (kiln computes the gradients in the forward for mean
// and sum, so that backward only scales them). The GIL is released around the kernels.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include "kiln/loss/linear_cross_entropy.h"
#include "python/src/bindings.h"

namespace kiln::python {
namespace {

// A leaf of the kiln graph: the caller's memory, requiring grad when the caller wants its gradient.
Tensor leaf(const Tensor& t, bool grad) {
  if (!t.defined()) return t;
  Tensor l = t.detach();
  if (grad) l.requires_grad_(true);
  return l;
}

using LceOut = std::tuple<PyTensor, PyTensor, std::optional<PyTensor>, std::unique_ptr<Graph>>;

LceOut lce(const PyTensor& hidden, const PyTensor& weight, const PyTensor& target,
           const std::optional<PyTensor>& bias, const std::optional<PyTensor>& class_weight, bool hidden_grad,
           bool weight_grad, bool bias_grad, int64_t ignore_index, const std::string& reduction,
           double label_smoothing, double z_loss, double softcap, double num_items, bool return_lse,
           double filter_eps, int64_t chunk_tokens) {
  nb::gil_scoped_release nogil;
  LinearCrossEntropyOptions o;
  o.ignore_index = ignore_index;
  o.reduction = parse_reduction(reduction);
  o.label_smoothing = label_smoothing;
  o.z_loss = z_loss;
  o.softcap = softcap;
  o.num_items = num_items;
  o.return_lse = return_lse;
  o.filter_eps = filter_eps;
  o.chunk_tokens = chunk_tokens;
  o.weight = opt_tensor(class_weight);
  Tensor h = leaf(hidden.t, hidden_grad), w = leaf(weight.t, weight_grad), b = leaf(opt_tensor(bias), bias_grad);
  o.bias = b;
  LinearCrossEntropyResult r = linear_cross_entropy(h, w, target.t, o);
  std::unique_ptr<Graph> g;
  if (r.loss.requires_grad()) {
    g = std::make_unique<Graph>();
    g->roots = {r.loss};
    g->leaves = {hidden_grad ? h : Tensor(), weight_grad ? w : Tensor(), bias_grad ? b : Tensor()};
  }
  return {PyTensor{r.loss.detach(), false}, PyTensor{r.z_loss, false}, wrap(r.lse), std::move(g)};
}

}  // namespace

void bind_loss(nb::module_& m) {
  m.def("linear_cross_entropy", &lce, nb::arg("hidden"), nb::arg("weight"), nb::arg("target"), nb::kw_only(),
        nb::arg("bias") = nb::none(), nb::arg("class_weight") = nb::none(), nb::arg("hidden_grad") = false,
        nb::arg("weight_grad") = false, nb::arg("bias_grad") = false, nb::arg("ignore_index") = -100,
        nb::arg("reduction") = "mean", nb::arg("label_smoothing") = 0.0, nb::arg("z_loss") = 0.0,
        nb::arg("softcap") = 0.0, nb::arg("num_items") = 0.0, nb::arg("return_lse") = false,
        nb::arg("filter_eps") = 0.0, nb::arg("chunk_tokens") = 0,
        "kiln::linear_cross_entropy: (loss, z_loss, lse or None, Graph or None); the Graph's leaves are "
        "(hidden, weight, bias)");
}

}  // namespace kiln::python
