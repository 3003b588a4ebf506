// The CUDA backend: NVRTC and the driver opened with dlopen, cubins compiled and cached.
#include "kiln/jit/cuda_backend.h"

#include <dlfcn.h>

#include <cstdlib>
#include <filesystem>
#include <mutex>

#include "kiln/core/error.h"
#include "kiln/jit/cache.h"
#include "kiln/jit/sha256.h"

namespace kiln::jit {
namespace fs = std::filesystem;

namespace {
void* open_first(const std::vector<std::string>& names, std::string* tried) {
  for (const auto& n : names) {
    if (n.empty()) continue;
    if (void* h = ::dlopen(n.c_str(), RTLD_NOW | RTLD_LOCAL)) return h;
    *tried += (tried->empty() ? "" : ", ") + n;
  }
  return nullptr;
}
std::string cuda_home() {
  const char* h = std::getenv("CUDA_HOME");
  return h && *h ? h : "/usr/local/cuda";
}
template <class F> void bind(void* h, const char* name, F& out, std::string& missing) {
  out = reinterpret_cast<F>(::dlsym(h, name));
  if (!out) missing += std::string(missing.empty() ? "" : ", ") + name;
}
}  // namespace

const NvrtcApi* nvrtc(std::string* why) {
  static std::once_flag once;
  static NvrtcApi api;
  static const NvrtcApi* ready = nullptr;
  static std::string reason;
  std::call_once(once, [] {
    std::string tried;
    const char* env = std::getenv("KILN_NVRTC");
    void* h = open_first({env ? env : "", "libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12",
                          cuda_home() + "/lib64/libnvrtc.so"},
                         &tried);
    if (!h) {
      reason = "libnvrtc not found (tried " + tried + "; set KILN_NVRTC to its path)";
      return;
    }
    std::string missing;
    bind(h, "nvrtcVersion", api.version, missing);
    bind(h, "nvrtcCreateProgram", api.create, missing);
    bind(h, "nvrtcCompileProgram", api.compile, missing);
    bind(h, "nvrtcGetProgramLogSize", api.log_size, missing);
    bind(h, "nvrtcGetProgramLog", api.log, missing);
    bind(h, "nvrtcGetCUBINSize", api.cubin_size, missing);
    bind(h, "nvrtcGetCUBIN", api.cubin, missing);
    bind(h, "nvrtcDestroyProgram", api.destroy, missing);
    bind(h, "nvrtcAddNameExpression", api.add_name_expression, missing);
    bind(h, "nvrtcGetLoweredName", api.lowered_name, missing);
    if (!missing.empty()) {
      reason = "libnvrtc lacks " + missing;
      return;
    }
    int major = 0, minor = 0;
    api.version(&major, &minor);
    api.version_string = std::to_string(major) + "." + std::to_string(minor);
    ready = &api;
  });
  if (!ready && why) *why = reason;
  return ready;
}

const DriverApi* driver(std::string* why) {
  static std::once_flag once;
  static DriverApi api;
  static const DriverApi* ready = nullptr;
  static std::string reason;
  std::call_once(once, [] {
    std::string tried;
    void* h = open_first({"libcuda.so.1", "libcuda.so"}, &tried);
    if (!h) {
      reason = "no CUDA driver (libcuda.so.1 not found)";
      return;
    }
    std::string missing;
    bind(h, "cuInit", api.init, missing);
    bind(h, "cuLibraryLoadData", api.library_load_data, missing);
    bind(h, "cuLibraryGetKernel", api.library_get_kernel, missing);
    bind(h, "cuKernelGetFunction", api.kernel_get_function, missing);
    bind(h, "cuLibraryUnload", api.library_unload, missing);
    bind(h, "cuLaunchKernel", api.launch, missing);
    bind(h, "cuGetErrorString", api.get_error_string, missing);
    bind(h, "cuFuncSetAttribute", api.func_set_attribute, missing);
    bind(h, "cuCtxGetCurrent", api.ctx_get_current, missing);
    bind(h, "cuDevicePrimaryCtxRetain", api.primary_ctx_retain, missing);
    bind(h, "cuCtxSetCurrent", api.ctx_set_current, missing);
    if (!missing.empty()) {
      reason = "the CUDA driver lacks " + missing + " (CUDA 12 or newer is needed)";
      return;
    }
    if (const int rc = api.init(0); rc != 0) {
      reason = "cuInit failed with error " + std::to_string(rc) + " (no GPU?)";
      return;
    }
    ready = &api;
  });
  if (!ready && why) *why = reason;
  return ready;
}

std::string cuda_include_dir() {
  std::error_code ec;
  for (std::string d : {std::string(std::getenv("KILN_CUDA_INCLUDE") ? std::getenv("KILN_CUDA_INCLUDE") : ""),
                        cuda_home() + "/include", std::string("/usr/local/cuda/include")})
    if (!d.empty() && fs::exists(d + "/cuda_fp16.h", ec)) return d;
  return "";
}

std::vector<std::string> nvrtc_flags(const std::string& arch) {
  std::vector<std::string> f{"-arch=" + arch, "-std=c++20", "-default-device",
                             "-I" + include_root()};
  if (const std::string inc = cuda_include_dir(); !inc.empty()) f.push_back("-I" + inc);
  return f;
}

Cubin compile_cuda(const CompileRequest& r, const std::string& arch, const CancelToken* token) {
  std::string why;
  const NvrtcApi* api = nvrtc(&why);
  KILN_CHECK(api != nullptr, "jit: ", r.name, " needs NVRTC for CUDA: ", why);
  const std::vector<std::string> flags = nvrtc_flags(arch);
  std::string opts;
  for (const auto& f : flags) opts += f + " ";
  std::string names;  // the name expressions, one a line
  for (const auto& e : r.name_expressions) names += e + "\n";
  Sha256 h;
  h.field("backend", "nvrtc")
      .field("source", r.source)
      .field("names", names)
      .field("headers", kiln_headers_of(r.source, include_root()))
      .field("options", opts)
      .field("target", arch)
      .field("compiler", api->version_string)
      .field("kiln", KILN_VERSION);
  const std::string key = h.hex();
  DiskCache cache(cache_dir());
  auto split_lines = [](const std::string& text) {
    std::vector<std::string> out;
    for (size_t at = 0, nl; (nl = text.find('\n', at)) != std::string::npos; at = nl + 1)
      out.push_back(text.substr(at, nl - at));
    return out;
  };
  if (auto hit = cache.lookup(key, "cubin")) {
    if (r.name_expressions.empty()) return Cubin{read_file(*hit), key, true, {}};
    // The lowered names are an entry of their own (key + "-names"), stored before the cubin.
    if (auto lowered = cache.lookup(key + "-names", "txt")) {
      std::vector<std::string> l = split_lines(read_file(*lowered));
      if (l.size() == r.name_expressions.size()) return Cubin{read_file(*hit), key, true, l};
    }
  }
  KILN_CHECK(!token || !token->cancelled, "jit: ", r.name, " cancelled");
  void* prog = nullptr;
  KILN_CHECK(api->create(&prog, r.source.c_str(), "kiln-generated.cu", 0, nullptr, nullptr) == 0,
             "jit: nvrtcCreateProgram failed for ", r.name);
  for (const auto& e : r.name_expressions)
    KILN_CHECK(api->add_name_expression(prog, e.c_str()) == 0, "jit: nvrtcAddNameExpression failed for ", e);
  std::vector<const char*> argv;
  for (const auto& f : flags) argv.push_back(f.c_str());
  const int rc = api->compile(prog, static_cast<int>(argv.size()), argv.data());
  size_t n = 0;
  api->log_size(prog, &n);
  std::string log(n, '\0');
  if (n) api->log(prog, log.data());
  std::string image, lowered_lines;
  std::vector<std::string> lowered;
  if (rc == 0) {
    size_t size = 0;
    api->cubin_size(prog, &size);
    image.resize(size);
    api->cubin(prog, image.data());
    for (const auto& e : r.name_expressions) {
      const char* l = nullptr;
      if (api->lowered_name(prog, e.c_str(), &l) != 0 || l == nullptr) {
        api->destroy(&prog);
        fail("jit: ", r.name, ": NVRTC gives no symbol for ", e);
      }
      lowered.emplace_back(l);
      lowered_lines += lowered.back() + "\n";
    }
  }
  api->destroy(&prog);
  KILN_CHECK(rc == 0, "jit: ", r.name, " does not compile (NVRTC ", api->version_string, "):\n", log);
  KILN_CHECK(!token || !token->cancelled, "jit: ", r.name, " cancelled");
  if (!lowered.empty()) cache.store(key + "-names", "txt", lowered_lines);
  cache.store(key, "cubin", image);
  return Cubin{image, key, false, lowered};
}

namespace {
std::string driver_error(const DriverApi* d, int rc) {
  const char* s = nullptr;
  d->get_error_string(rc, &s);
  return std::string(s ? s : "unknown error") + " (" + std::to_string(rc) + ")";
}

// cuKernelGetFunction needs a current context: a thread that has not touched the GPU yet (a
// kernel compiled and loaded before any tensor went to the device, as `kiln bench jit` does) gets
// device 0's primary context, the one the CUDA runtime would make current there (retained for
// the process, as the runtime keeps it).
void make_context_current(const DriverApi* d) {
  void* ctx = nullptr;
  int rc = d->ctx_get_current(&ctx);
  KILN_CHECK(rc == 0, "jit: cuCtxGetCurrent failed: ", driver_error(d, rc));
  if (ctx) return;
  rc = d->primary_ctx_retain(&ctx, 0);
  KILN_CHECK(rc == 0, "jit: no current CUDA context, and device 0's primary one cannot be retained: ",
             driver_error(d, rc));
  rc = d->ctx_set_current(ctx);
  KILN_CHECK(rc == 0, "jit: cuCtxSetCurrent failed: ", driver_error(d, rc));
}
}  // namespace

CudaFunctions load_cuda_functions(const Cubin& cubin, const std::vector<std::string>& names) {
  std::string why;
  const DriverApi* d = driver(&why);
  KILN_CHECK(d != nullptr, "jit: cannot load a CUDA kernel: ", why);
  make_context_current(d);
  void* lib = nullptr;
  int rc = d->library_load_data(&lib, cubin.image.data(), nullptr, nullptr, 0, nullptr, nullptr, 0);
  KILN_CHECK(rc == 0, "jit: cuLibraryLoadData failed: ", driver_error(d, rc));
  CudaFunctions out{std::shared_ptr<void>(lib, [d](void* l) { d->library_unload(l); }), {}};
  for (const auto& name : names) {
    void* kernel = nullptr;
    rc = d->library_get_kernel(&kernel, lib, name.c_str());
    KILN_CHECK(rc == 0, "jit: the cubin has no kernel ", name, ": ", driver_error(d, rc));
    void* fn = nullptr;
    rc = d->kernel_get_function(&fn, kernel);
    KILN_CHECK(rc == 0, "jit: cuKernelGetFunction(", name, ") failed: ", driver_error(d, rc));
    out.functions.push_back(fn);
  }
  return out;
}

CudaFunction load_cuda_function(const Cubin& cubin, const char* name) {
  CudaFunctions f = load_cuda_functions(cubin, {name});
  return CudaFunction{f.library, f.functions[0]};
}

void allow_dynamic_smem(void* fn, int bytes, const char* what) {
  std::string why;
  const DriverApi* d = driver(&why);
  KILN_CHECK(d != nullptr, what, ": no CUDA driver: ", why);
  constexpr int kMaxDynamicSharedSizeBytes = 8;  // CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
  const int rc = d->func_set_attribute(fn, kMaxDynamicSharedSizeBytes, bytes);
  KILN_CHECK(rc == 0, what, ": cannot give the kernel ", bytes, " bytes of shared memory: ", driver_error(d, rc));
}

void launch_cuda(void* fn, unsigned gx, unsigned gy, unsigned gz, unsigned block, void** args, const Stream& stream,
                 const char* what, unsigned smem) {
  std::string why;
  const DriverApi* d = driver(&why);
  KILN_CHECK(d != nullptr, what, ": no CUDA driver: ", why);
  KILN_CHECK(stream.device().is_cuda(), what, ": launched on a stream of ", stream.device().str(),
             ", expected a CUDA stream");
  // A cudaStream_t is a CUstream: the runtime's streams live in the device's primary context,
  // which the driver's loaded libraries use too.
  const int rc = d->launch(fn, gx, gy, gz, block, 1, 1, smem, stream.native(), args, nullptr);
  KILN_CHECK(rc == 0, what, ": the launch failed: ", driver_error(d, rc));
}

}  // namespace kiln::jit
