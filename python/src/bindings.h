// What the binding files share: PyTensor (the Python object kiln.Tensor: a kiln::Tensor and
// whether its memory may be written), and one bind_* function per layer bound (core.cpp,
// loss.cpp, attention.cpp, io.cpp, telemetry.cpp, train.cpp), called by module.cpp.
#pragma once
#include <nanobind/nanobind.h>

#include <optional>
#include <vector>

#include "kiln/core/tensor.h"

namespace kiln::python {

namespace nb = nanobind;

// kiln.Tensor. read_only: the memory came from a read-only DLPack producer (a non-writeable
// numpy array); it travels with the tensor when it is exported again.
struct PyTensor {
  Tensor t;
  bool read_only = false;
};

// A kiln autograd graph kept for a torch.autograd.Function's backward: the outputs (roots) and
// the inputs (leaves) that require grad. run(grads) back-propagates and gives each leaf's
// gradient (None where it got none); with retain the graph stays for another run (torch's
// retain_graph), else it is freed and a second run is an error.
struct Graph {
  std::vector<Tensor> roots;
  std::vector<Tensor> leaves;
  bool done = false;
  Tensor keep;  // memory the graph's nodes point into (a score_mod's table), kept until run
  std::vector<std::optional<PyTensor>> run(const std::vector<std::optional<PyTensor>>& grads, bool retain);
};

// A tensor argument that may be None.
inline Tensor opt_tensor(const std::optional<PyTensor>& t) { return t ? t->t : Tensor(); }
inline std::optional<PyTensor> wrap(const Tensor& t) {
  if (!t.defined()) return std::nullopt;
  return PyTensor{t, false};
}

void bind_core(nb::module_& m);
void bind_loss(nb::module_& m);
void bind_attention(nb::module_& m);
void bind_io(nb::module_& m);
void bind_telemetry(nb::module_& m);
void bind_train(nb::module_& m);

}  // namespace kiln::python
