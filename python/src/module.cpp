// The extension module kiln._C: kiln::Error becomes a Python exception (kiln.KilnError, a
// RuntimeError carrying kiln's message), then each layer's bindings are added.
#include "python/src/bindings.h"

#include "kiln/core/error.h"

NB_MODULE(_C, m) {
  using namespace kiln::python;
  m.doc() = "kiln's C++ engine (bindings; use the package kiln)";
  nb::exception<kiln::Error>(m, "KilnError", PyExc_RuntimeError);
  bind_core(m);
  bind_loss(m);
  bind_attention(m);
  bind_io(m);
  bind_telemetry(m);
  bind_train(m);
}
