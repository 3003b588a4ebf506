// Bindings of kiln/core: kiln.Tensor (PyTensor) with the DLPack protocol both ways
// (__dlpack__ with versioned capsules, strides, copy, dl_device and the read-only flag;
// __dlpack_device__; from_capsule, which takes what a producer's __dlpack__ returned, zero
// copy), the autograd Graph of kiln.torch, the caller's-stream scope (StreamScope over
// kiln/core/stream.h), memory statistics and build facts.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <memory>

#include "kiln/core/allocator.h"
#include "kiln/core/error.h"
#include "kiln/ops/backward.h"
#include "kiln/ops/ops.h"
#include "python/src/bindings.h"
#include "python/src/dlpack.h"

#if __has_include("kiln/core/stream.h")
#include "kiln/core/stream.h"
#define KILN_PY_STREAMS 1
#else
#define KILN_PY_STREAMS 0
#endif

namespace kiln::python {
namespace {

namespace dl = dlpack;

// ---- dtypes ----
bool to_dl_dtype(DType t, dl::DataType* out) {
  auto set = [&](uint8_t code) { *out = dl::DataType{code, static_cast<uint8_t>(itemsize(t) * 8), 1}; };
  switch (t) {
    case DType::f64: case DType::f32: case DType::f16: set(dl::kFloat); return true;
    case DType::bf16: set(dl::kBfloat); return true;
    case DType::i64: case DType::i32: case DType::i16: case DType::i8: set(dl::kInt); return true;
    case DType::u8: set(dl::kUInt); return true;
    case DType::boolean: set(dl::kBool); return true;
    case DType::f8_e4m3: set(dl::kFloat8_e4m3fn); return true;
    case DType::f8_e5m2: set(dl::kFloat8_e5m2); return true;
  }
  return false;
}

DType from_dl_dtype(const dl::DataType& d) {
  KILN_CHECK(d.lanes == 1, "kiln.from_dlpack: vector dtypes (lanes=", d.lanes, ") are not supported");
  switch (d.code) {
    case dl::kFloat:
      if (d.bits == 64) return DType::f64;
      if (d.bits == 32) return DType::f32;
      if (d.bits == 16) return DType::f16;
      break;
    case dl::kBfloat:
      if (d.bits == 16) return DType::bf16;
      break;
    case dl::kInt:
      if (d.bits == 64) return DType::i64;
      if (d.bits == 32) return DType::i32;
      if (d.bits == 16) return DType::i16;
      if (d.bits == 8) return DType::i8;
      break;
    case dl::kUInt:
      if (d.bits == 8) return DType::u8;
      break;
    case dl::kBool:
      if (d.bits == 8) return DType::boolean;
      break;
    case dl::kFloat8_e4m3fn:
      if (d.bits == 8) return DType::f8_e4m3;
      break;
    case dl::kFloat8_e5m2:
      if (d.bits == 8) return DType::f8_e5m2;
      break;
  }
  fail("kiln.from_dlpack: DLPack dtype (code ", int(d.code), ", bits ", int(d.bits),
       ") has no kiln dtype (kiln has f64, f32, f16, bf16, i64, i32, i16, i8, u8, bool, "
       "float8_e4m3fn, float8_e5m2)");
}

std::pair<int, int> dl_device_of(const Device& d) {
  return d.is_cuda() ? std::pair{int(dl::kCUDA), d.index} : std::pair{int(dl::kCPU), 0};
}

Device device_from_dl(int type, int id, const char* what) {
  if (type == dl::kCPU || type == dl::kCUDAHost) return kCPU;  // pinned host memory is host memory
  if (type == dl::kCUDA) {
    Device d = cuda(id);
    check_device_available(d, what);
    return d;
  }
  fail(what, ": DLPack device type ", type, " is not supported (kiln takes CPU (1), CUDA (2) and CUDA host (3) memory)");
}

#if KILN_PY_STREAMS
// A DLPack stream integer as a native handle: None is the legacy default stream (as DLPack says
// for CUDA), 1 the legacy default and 2 the per-thread default (cudaStreamLegacy/PerThread).
void* native_stream(std::optional<int64_t> s) {
  return s ? reinterpret_cast<void*>(static_cast<intptr_t>(*s)) : nullptr;
}
#endif

// ---- export: kiln::Tensor -> capsule ----
struct ExportCtx {
  Tensor t;  // keeps the storage alive
  std::vector<int64_t> shape, strides;
  dl::ManagedTensorVersioned versioned{};
  dl::ManagedTensor legacy{};
};

void fill_dltensor(ExportCtx* c, dl::DLTensor* d) {
  const Tensor& t = c->t;
  c->shape = t.shape();
  c->strides = t.strides();
  d->data = t.numel() == 0 ? nullptr : t.data_ptr();
  auto [type, id] = dl_device_of(t.device());
  d->device = dl::Device{type, id};
  d->ndim = static_cast<int32_t>(t.dim());
  KILN_CHECK(to_dl_dtype(t.dtype(), &d->dtype), "Tensor.__dlpack__: dtype ", dtype_name(t.dtype()),
             " has no DLPack type");
  d->shape = c->shape.data();
  d->strides = c->strides.data();
  d->byte_offset = 0;
}

void delete_versioned(dl::ManagedTensorVersioned* m) { delete static_cast<ExportCtx*>(m->manager_ctx); }
void delete_legacy(dl::ManagedTensor* m) { delete static_cast<ExportCtx*>(m->manager_ctx); }

// A capsule nobody consumed frees its tensor (the DLPack rule: only the unused name owns it).
void capsule_destructor_versioned(PyObject* cap) {
  if (PyCapsule_IsValid(cap, dl::kCapsuleVersioned)) {
    auto* m = static_cast<dl::ManagedTensorVersioned*>(PyCapsule_GetPointer(cap, dl::kCapsuleVersioned));
    if (m && m->deleter) m->deleter(m);
  }
}
void capsule_destructor_legacy(PyObject* cap) {
  if (PyCapsule_IsValid(cap, dl::kCapsule)) {
    auto* m = static_cast<dl::ManagedTensor*>(PyCapsule_GetPointer(cap, dl::kCapsule));
    if (m && m->deleter) m->deleter(m);
  }
}

nb::object dlpack_export(const PyTensor& self, std::optional<int64_t> stream,
                         std::optional<std::pair<int, int>> max_version,
                         std::optional<std::pair<int, int>> dl_device, std::optional<bool> copy) {
  Tensor t = self.t;
  KILN_CHECK(t.defined(), "Tensor.__dlpack__: the tensor is undefined");
  bool copied = false;
  Device target = t.device();
  if (dl_device) target = device_from_dl(dl_device->first, dl_device->second, "Tensor.__dlpack__(dl_device)");
  if (!(target == t.device())) {
    if (copy && !*copy)
      throw nb::buffer_error(("Tensor.__dlpack__: dl_device asks for " + target.str() + " but the tensor is on " +
                              t.device().str() + " and copy=False")
                                 .c_str());
    nb::gil_scoped_release nogil;
    t = t.detach().to(target);
    copied = true;
  } else if (copy && *copy) {
    nb::gil_scoped_release nogil;
    t = t.detach().clone();
    copied = true;
  }
  if (t.requires_grad()) t = t.detach();
#if KILN_PY_STREAMS
  // The consumer reads on `stream`: make it wait for kiln's work on the tensor so far (-1: the
  // consumer asks for no synchronisation).
  if (t.is_cuda() && (!stream || *stream != -1)) {
    KILN_CHECK(!stream || *stream != 0, "Tensor.__dlpack__: stream=0 is ambiguous for CUDA (DLPack): pass 1 for the "
                                        "legacy default stream, 2 for the per-thread one, or the stream's handle");
    const Stream consumer = external_stream(t.device(), native_stream(stream));
    const Stream producer = current_stream(t.device());
    if (!(consumer == producer)) wait_stream(consumer, producer);
  }
#else
  (void)stream;
#endif
  auto ctx = std::make_unique<ExportCtx>();
  ctx->t = t;
  const bool versioned = max_version && max_version->first >= 1;
  PyObject* cap = nullptr;
  if (versioned) {
    dl::ManagedTensorVersioned* m = &ctx->versioned;
    m->version = dl::Version{dl::kMajor, dl::kMinor};
    m->manager_ctx = ctx.get();
    m->deleter = delete_versioned;
    m->flags = (self.read_only && !copied ? dl::kFlagReadOnly : 0) | (copied ? dl::kFlagIsCopied : 0);
    fill_dltensor(ctx.get(), &m->dl_tensor);
    cap = PyCapsule_New(m, dl::kCapsuleVersioned, capsule_destructor_versioned);
  } else {
    // A pre-1.0 consumer has no read-only flag: it would be free to write memory that is not
    // writable, so refuse unless a copy is allowed.
    if (self.read_only && !copied) {
      if (copy && !*copy)
        throw nb::buffer_error("Tensor.__dlpack__: the tensor is read-only and the consumer asked for a pre-1.0 "
                               "capsule (no read-only flag) with copy=False");
      nb::gil_scoped_release nogil;
      ctx->t = t.clone();
    }
    dl::ManagedTensor* m = &ctx->legacy;
    m->manager_ctx = ctx.get();
    m->deleter = delete_legacy;
    fill_dltensor(ctx.get(), &m->dl_tensor);
    cap = PyCapsule_New(m, dl::kCapsule, capsule_destructor_legacy);
  }
  if (!cap) throw nb::python_error();
  ctx.release();  // the capsule (then its consumer) owns it
  return nb::steal(cap);
}

// ---- import: capsule -> kiln::Tensor ----
// Owns a consumed managed tensor: calls its producer's deleter when the last kiln view is gone.
struct ImportOwner {
  dl::ManagedTensorVersioned* versioned = nullptr;
  dl::ManagedTensor* legacy = nullptr;
  ~ImportOwner() {
    if (versioned && versioned->deleter) versioned->deleter(versioned);
    if (legacy && legacy->deleter) legacy->deleter(legacy);
  }
};

PyTensor tensor_from_dl(const dl::DLTensor& d, bool read_only, std::shared_ptr<ImportOwner> owner) {
  const DType dtype = from_dl_dtype(d.dtype);
  const Device device = device_from_dl(d.device.device_type, d.device.device_id, "kiln.from_dlpack");
  KILN_CHECK(d.ndim >= 0 && d.ndim <= 64, "kiln.from_dlpack: ndim=", d.ndim, " out of range [0, 64]");
  Shape shape(d.shape, d.shape + d.ndim);
  for (int i = 0; i < d.ndim; ++i)
    KILN_CHECK(shape[i] >= 0, "kiln.from_dlpack: shape[", i, "]=", shape[i], " is negative");
  Strides strides = d.strides ? Strides(d.strides, d.strides + d.ndim) : contiguous_strides(shape);
  const int64_t numel = shape_numel(shape);
  int64_t span = numel == 0 ? 0 : 1;  // elements from the first to one past the last
  for (int i = 0; i < d.ndim && numel > 0; ++i) {
    KILN_CHECK(strides[i] >= 0 || shape[i] == 1, "kiln.from_dlpack: negative strides are not supported (stride[", i,
               "]=", strides[i], "); pass a copy, e.g. numpy.ascontiguousarray(x) or x.contiguous()");
    if (shape[i] == 1) strides[i] = std::max<int64_t>(strides[i], 0);
    span += (shape[i] - 1) * strides[i];
  }
  char* base = static_cast<char*>(d.data) + d.byte_offset;
  if (numel == 0) base = nullptr;
  auto storage = std::make_shared<Storage>(base, static_cast<size_t>(span) * itemsize(dtype), device,
                                           std::shared_ptr<void>(owner, owner.get()));
  return PyTensor{Tensor::from_storage(storage, shape, strides, 0, dtype), read_only};
}

PyTensor dlpack_import(nb::handle capsule) {
  PyObject* cap = capsule.ptr();
  if (PyCapsule_IsValid(cap, dl::kCapsuleVersioned)) {
    auto* m = static_cast<dl::ManagedTensorVersioned*>(PyCapsule_GetPointer(cap, dl::kCapsuleVersioned));
    KILN_CHECK(m->version.major == 1, "kiln.from_dlpack: DLPack version ", m->version.major, ".", m->version.minor,
               " is not supported (kiln reads 1.x)");
    auto owner = std::make_shared<ImportOwner>();
    // The tensor is checked before it is taken over: on error the capsule still owns it.
    dl::ManagedTensorVersioned probe = *m;
    probe.deleter = nullptr;
    (void)tensor_from_dl(probe.dl_tensor, false, std::make_shared<ImportOwner>());
    owner->versioned = m;
    if (PyCapsule_SetName(cap, dl::kUsedCapsuleVersioned) != 0) throw nb::python_error();
    return tensor_from_dl(m->dl_tensor, (m->flags & dl::kFlagReadOnly) != 0, owner);
  }
  if (PyCapsule_IsValid(cap, dl::kCapsule)) {
    auto* m = static_cast<dl::ManagedTensor*>(PyCapsule_GetPointer(cap, dl::kCapsule));
    (void)tensor_from_dl(m->dl_tensor, false, std::make_shared<ImportOwner>());
    auto owner = std::make_shared<ImportOwner>();
    owner->legacy = m;
    if (PyCapsule_SetName(cap, dl::kUsedCapsule) != 0) throw nb::python_error();
    return tensor_from_dl(m->dl_tensor, false, owner);
  }
  if (PyCapsule_CheckExact(cap)) {
    const char* name = PyCapsule_GetName(cap);
    throw nb::value_error((std::string("kiln.from_dlpack: the capsule is named '") + (name ? name : "") +
                           "'; a DLPack capsule that was not consumed yet is named 'dltensor' or "
                           "'dltensor_versioned' (a capsule can be consumed once)")
                              .c_str());
  }
  throw nb::type_error("kiln.from_dlpack: expected a DLPack capsule");
}

std::string tensor_repr(const PyTensor& p) {
  if (!p.t.defined()) return "kiln.Tensor(undefined)";
  return "kiln." + p.t.str();
}

}  // namespace

std::vector<std::optional<PyTensor>> Graph::run(const std::vector<std::optional<PyTensor>>& grads, bool retain) {
  KILN_CHECK(!done, "kiln backward: the graph was already run (a second backward through it needs "
                   "retain_graph, which kiln.torch does not keep)");
  KILN_CHECK(grads.size() == roots.size(), "kiln backward: ", grads.size(), " gradients for ", roots.size(),
             " outputs");
  done = !retain;
  for (Tensor& l : leaves)
    if (l.defined()) l.set_grad(Tensor());  // each run gives its own gradients (retained runs too)
  std::vector<Tensor> r, g;
  for (size_t i = 0; i < roots.size(); ++i)
    if (grads[i] && roots[i].requires_grad()) {
      r.push_back(roots[i]);
      Tensor gi = grads[i]->t;
      if (gi.dtype() != roots[i].dtype()) gi = gi.to(roots[i].dtype());
      g.push_back(gi);
    }
  if (!r.empty()) run_backward(r, g, retain);
  std::vector<std::optional<PyTensor>> out;
  for (const Tensor& l : leaves) out.push_back(l.defined() ? wrap(l.grad()) : std::nullopt);
  if (!retain) roots.clear(), leaves.clear(), keep = Tensor();
  return out;
}

#if KILN_PY_STREAMS
// `with kiln._C.StreamScope("cuda:0", handle):` kiln's kernels on that device launch on the
// caller's stream (a StreamGuard for the scope, on this thread).
struct StreamScope {
  Device device;
  void* native;
  std::unique_ptr<StreamGuard> guard;
};
#endif

void bind_core(nb::module_& m) {
  nb::class_<PyTensor>(m, "Tensor", "A kiln tensor: a view (shape, strides, dtype, device) of shared memory")
      .def_prop_ro("shape", [](const PyTensor& p) { return p.t.shape(); })
      .def_prop_ro("strides", [](const PyTensor& p) { return p.t.strides(); }, "strides in elements")
      .def_prop_ro("dtype", [](const PyTensor& p) { return std::string(dtype_name(p.t.dtype())); })
      .def_prop_ro("device", [](const PyTensor& p) { return p.t.device().str(); })
      .def_prop_ro("ndim", [](const PyTensor& p) { return p.t.dim(); })
      .def_prop_ro("numel", [](const PyTensor& p) { return p.t.numel(); })
      .def_prop_ro("nbytes", [](const PyTensor& p) { return p.t.nbytes(); })
      .def_prop_ro("itemsize", [](const PyTensor& p) { return itemsize(p.t.dtype()); })
      .def_prop_ro("data_ptr", [](const PyTensor& p) {
        return p.t.numel() == 0 ? uintptr_t{0} : reinterpret_cast<uintptr_t>(p.t.data_ptr());
      }, "address of the first element")
      .def_prop_ro("read_only", [](const PyTensor& p) { return p.read_only; })
      .def_prop_ro("requires_grad", [](const PyTensor& p) { return p.t.requires_grad(); })
      .def("is_contiguous", [](const PyTensor& p) { return p.t.is_contiguous(); })
      .def("contiguous", [](const PyTensor& p) {
        nb::gil_scoped_release nogil;
        return PyTensor{p.t.detach().contiguous(), false};
      })
      .def("clone", [](const PyTensor& p) {
        nb::gil_scoped_release nogil;
        return PyTensor{p.t.detach().clone(), false};
      })
      .def("to", [](const PyTensor& p, const std::string& what) {
        // A dtype name ("bf16", "float32") or a device ("cpu", "cuda:0").
        const bool is_device = what.rfind("cpu", 0) == 0 || what.rfind("cuda", 0) == 0;
        nb::gil_scoped_release nogil;
        Tensor t = p.t.detach();
        return PyTensor{is_device ? t.to(Device::parse(what)) : t.to(parse_dtype(what)), false};
      }, nb::arg("dtype_or_device"))
      .def("view_as", [](const PyTensor& p, const std::string& dtype) {
        // The same bytes as another dtype of the same size (a bit cast, no copy).
        const DType d = parse_dtype(dtype);
        KILN_CHECK(itemsize(d) == itemsize(p.t.dtype()), "Tensor.view_as: ", dtype_name(p.t.dtype()), " (",
                   itemsize(p.t.dtype()), " bytes) cannot be viewed as ", dtype_name(d), " (", itemsize(d), " bytes)");
        return PyTensor{Tensor::from_storage(p.t.storage(), p.t.shape(), p.t.strides(), p.t.offset(), d), p.read_only};
      }, nb::arg("dtype"))
      .def("item", [](const PyTensor& p) { return p.t.item(); })
      .def("tolist_flat", [](const PyTensor& p) { return p.t.to(DType::f64).to_vector<double>(); },
           "the elements in row-major order, as floats")
      .def("__dlpack__", &dlpack_export, nb::kw_only(), nb::arg("stream") = nb::none(),
           nb::arg("max_version") = nb::none(), nb::arg("dl_device") = nb::none(), nb::arg("copy") = nb::none())
      .def("__dlpack_device__", [](const PyTensor& p) { return dl_device_of(p.t.device()); })
      .def("__repr__", &tensor_repr);

  m.def("from_capsule", &dlpack_import, nb::arg("capsule"),
        "A kiln.Tensor over the memory of a DLPack capsule (consumes it; zero copy)");
  m.def("_set_read_only", [](PyTensor& p, bool ro) { p.read_only = ro; });

  nb::class_<Graph>(m, "Graph", "A kiln autograd graph kept for one backward")
      .def("run", &Graph::run, nb::arg("grads"), nb::arg("retain") = false,
           nb::call_guard<nb::gil_scoped_release>(),
           "back-propagates `grads` (one per output, None for none); retain keeps the graph for another run")
      .def_prop_ro("num_leaves", [](const Graph& g) { return g.leaves.size(); });

  m.def("empty", [](const std::vector<int64_t>& shape, const std::string& dtype, const std::string& device) {
    const Device d = Device::parse(device);
    check_device_available(d, "kiln.empty");
    return PyTensor{Tensor::empty(shape, parse_dtype(dtype), d), false};
  }, nb::arg("shape"), nb::arg("dtype") = "f32", nb::arg("device") = "cpu");
  m.def("cuda_built", &cuda_built);
  m.def("cuda_device_count", &cuda_device_count);
  m.def("version", [] { return std::string(KILN_VERSION); });
  m.def("memory_stats", [](const std::string& device) {
    const MemoryStats s = memory_stats(Device::parse(device));
    nb::dict d;
    d["current_bytes"] = s.current_bytes;
    d["peak_bytes"] = s.peak_bytes;
    d["reserved_bytes"] = s.reserved_bytes;
    return d;
  }, nb::arg("device") = "cpu");
  m.def("synchronize", [](const std::string& device) {
    nb::gil_scoped_release nogil;
    synchronize(Device::parse(device));
  }, nb::arg("device") = "cpu",
        "waits for kiln's work on `device`'s current stream; raises a failed device-side range check (KilnError)");
  m.def("reset_peak_memory_stats", [](const std::string& device) { reset_peak_memory_stats(Device::parse(device)); },
        nb::arg("device") = "cpu");
  m.attr("has_streams") = bool(KILN_PY_STREAMS);
#if KILN_PY_STREAMS
  m.def("current_stream", [](const std::string& device) -> std::optional<uintptr_t> {
    const Device d = Device::parse(device);
    if (!d.is_cuda()) return std::nullopt;
    return reinterpret_cast<uintptr_t>(current_stream(d).native());
  }, nb::arg("device"), "the native handle kiln's kernels of `device` launch on from this thread (None on the CPU)");
  nb::class_<StreamScope>(m, "StreamScope")
      .def("__init__", [](StreamScope* s, const std::string& device, uintptr_t handle) {
        new (s) StreamScope{Device::parse(device), reinterpret_cast<void*>(handle), nullptr};
      }, nb::arg("device"), nb::arg("handle"))
      .def("__enter__", [](StreamScope& s) {
        KILN_CHECK(!s.guard, "StreamScope: already entered");
        if (s.device.is_cuda()) s.guard = std::make_unique<StreamGuard>(external_stream(s.device, s.native));
      })
      .def("__exit__", [](StreamScope& s, nb::args) { s.guard.reset(); });
#endif
}

}  // namespace kiln::python
