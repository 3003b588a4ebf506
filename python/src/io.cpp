// Bindings of kiln/io: kiln::io::load (safetensors, sharded Hugging Face checkpoints and
// folders, PyTorch .pt/.bin through the restricted unpickler; safetensors tensors are
// zero-copy views of the file's mapping) with the safetensors metadata, and save_safetensors.
#include <nanobind/stl/map.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "kiln/io/load.h"
#include "kiln/io/safetensors.h"
#include "python/src/bindings.h"

namespace kiln::python {
namespace {

using Named = std::vector<std::pair<std::string, PyTensor>>;

std::pair<Named, io::Metadata> load(const std::string& path) {
  nb::gil_scoped_release nogil;
  io::Metadata meta;
  io::TensorMap tensors;
  if (io::sniff_format(path) == io::FileFormat::safetensors) tensors = io::load_safetensors(path, &meta);
  else tensors = io::load(path);
  Named out;
  out.reserve(tensors.size());
  for (auto& [name, t] : tensors) out.emplace_back(name, PyTensor{t, false});
  return {std::move(out), std::move(meta)};
}

void save(const std::string& path, const Named& tensors, const io::Metadata& metadata) {
  io::TensorMap map;
  map.reserve(tensors.size());
  for (const auto& [name, t] : tensors) {
    KILN_CHECK(t.t.defined(), "kiln.save_safetensors: tensor '", name, "' is undefined");
    map.emplace_back(name, t.t.detach());
  }
  nb::gil_scoped_release nogil;
  io::save_safetensors(path, map, metadata);
}

}  // namespace

void bind_io(nb::module_& m) {
  m.def("load", &load, nb::arg("path"),
        "kiln::io::load: ([(name, Tensor)], metadata); the format is judged from the content");
  m.def("save_safetensors", &save, nb::arg("path"), nb::arg("tensors"), nb::arg("metadata"),
        "kiln::io::save_safetensors (atomic: a temporary file renamed into place)");
  m.def("sniff_format", [](const std::string& path) { return std::string(io::format_name(io::sniff_format(path))); },
        nb::arg("path"));
}

}  // namespace kiln::python
