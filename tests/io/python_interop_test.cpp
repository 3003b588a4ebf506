// Interop with the reference implementation (pip's safetensors + numpy), run through python3:
// files Python writes are read by kiln bit-exactly, and files kiln writes are read by Python.
// Skips with a message when python3, numpy or safetensors is missing.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <random>

#include "kiln/io/json.h"
#include "kiln/io/safetensors.h"
#include "tests/io/io_test_util.h"

namespace kiln::io {
namespace {

bool have_python_safetensors() {
  return std::system("python3 -c 'import numpy, safetensors' > /dev/null 2>&1") == 0;
}

// Writes py.safetensors (every numpy dtype the format has, random values, metadata), its raw
// bytes per tensor in py.<name>.bin, and f32only.safetensors; then, when kiln.safetensors
// exists, re-saves it through Python as back.safetensors.
constexpr const char* kScript = R"PY(
import json, sys, os
import numpy as np
from safetensors.numpy import save_file, load_file
d = sys.argv[1]
rng = np.random.default_rng(int(sys.argv[2]))
arrs = {}
for name, dt in [("bool", np.bool_), ("u8", np.uint8), ("i8", np.int8), ("i16", np.int16), ("u16", np.uint16),
                 ("i32", np.int32), ("u32", np.uint32), ("i64", np.int64), ("u64", np.uint64),
                 ("f16", np.float16), ("f32", np.float32), ("f64", np.float64), ("c64", np.complex64)]:
    shape = (3, 7) if name != "f32" else (129,)
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * np.dtype(dt).itemsize, dtype=np.uint8)
    a = raw.view(dt).reshape(shape) if dt != np.bool_ else (raw % 2).astype(np.bool_).reshape(shape)
    arrs[name] = a
arrs["scalar"] = np.array(3.25, dtype=np.float32)
arrs["empty"] = np.zeros((0, 4), dtype=np.float16)
save_file(arrs, os.path.join(d, "py.safetensors"), metadata={"source": "python", "k": "v"})
for k, a in arrs.items():
    open(os.path.join(d, "py.%s.bin" % k), "wb").write(a.tobytes())
save_file({"b": rng.standard_normal((5, 3)).astype(np.float32), "a": rng.standard_normal(7).astype(np.float32),
           "c": np.zeros((0,), np.float32)}, os.path.join(d, "f32only.safetensors"))
k = os.path.join(d, "kiln.safetensors")
if os.path.exists(k):
    t = load_file(k)
    save_file(t, os.path.join(d, "back.safetensors"))
    json.dump({n: [str(a.dtype), list(a.shape)] for n, a in t.items()}, open(os.path.join(d, "seen.json"), "w"))
)PY";

int run_script(const TempDir& dir, int seed) {
  std::ofstream(dir.file("interop.py")) << kScript;
  const std::string cmd = "python3 " + dir.file("interop.py") + " " + dir.path() + " " + std::to_string(seed);
  return std::system(cmd.c_str());
}

TEST(PythonInterop, KilnReadsPythonFilesBitExactly) {
  if (!have_python_safetensors()) GTEST_SKIP() << "python3 with numpy and safetensors not found (scripts/setup installs them)";
  TempDir dir;
  ASSERT_EQ(run_script(dir, static_cast<int>(std::random_device{}() % 100000)), 0);
  Metadata md;
  SafetensorsFile f = SafetensorsFile::open(dir.file("py.safetensors"));
  EXPECT_EQ(f.metadata(), (Metadata{{"source", "python"}, {"k", "v"}}));
  StoredTensors all = f.tensors();
  EXPECT_EQ(all.size(), 15u);
  for (const auto& s : all) {
    const std::string expect = read_bytes(dir.file("py." + s.name + ".bin"));
    const std::vector<uint8_t> got = tensor_bytes(s.data);
    EXPECT_EQ(std::string(got.begin(), got.end()), expect) << s.name;
  }
  // Same bytes in, same bytes out: kiln's writer reproduces Python's file exactly.
  TensorMap t = load_safetensors(dir.file("f32only.safetensors"));
  save_safetensors(dir.file("f32again.safetensors"), t);
  EXPECT_EQ(read_bytes(dir.file("f32again.safetensors")), read_bytes(dir.file("f32only.safetensors")));
}

TEST(PythonInterop, PythonReadsKilnFiles) {
  if (!have_python_safetensors()) GTEST_SKIP() << "python3 with numpy and safetensors not found (scripts/setup installs them)";
  TempDir dir;
  Generator gen(static_cast<uint64_t>(std::random_device{}()));
  StoredTensors out;
  for (DType dt : {DType::f64, DType::f32, DType::f16, DType::i64, DType::i32, DType::i16, DType::i8, DType::u8,
                   DType::boolean})
    out.push_back(StoredTensor::from_tensor(std::string("t_") + dtype_name(dt), random_bytes_tensor({7, 3}, dt, gen)));
  out.push_back(StoredTensor::from_tensor("scalar", scalar_tensor(-1.0, DType::f64)));
  out.push_back(StoredTensor::from_raw("raw_u32", "U32", {5}, random_bytes_tensor({20}, DType::u8, gen)));
  save_safetensors(dir.file("kiln.safetensors"), out, {{"writer", "kiln"}});
  ASSERT_EQ(run_script(dir, 1), 0);
  json::Value seen = json::parse(read_bytes(dir.file("seen.json")));
  EXPECT_EQ(seen.size(), out.size());
  EXPECT_EQ((*seen.find("raw_u32")).as_array()[0].as_string(), "uint32");
  StoredTensors back = SafetensorsFile::open(dir.file("back.safetensors")).tensors();
  ASSERT_EQ(back.size(), out.size());
  for (const auto& b : back) {
    auto it = std::find_if(out.begin(), out.end(), [&](const StoredTensor& o) { return o.name == b.name; });
    ASSERT_NE(it, out.end()) << b.name;
    EXPECT_EQ(b.dtype, it->dtype) << b.name;
    EXPECT_EQ(b.shape, it->shape) << b.name;
    EXPECT_EQ(tensor_bytes(b.data), tensor_bytes(it->data)) << b.name;
  }
}

}  // namespace
}  // namespace kiln::io
