// The JIT's machinery (kiln/jit/, core/kernel_registry.h): the KernelRegistry (wildcards, two
// bodies for one key, single-flight get_or_make), SHA-256 against known vectors, the compile
// pool (futures, cancellation, errors), the disk cache (every key field changes the key, a
// truncated or foreign entry is rebuilt, two processes compiling one kernel at once, folders of
// another user or writable by others refused), no C++ compiler (a clear error, built-in mods
// still work), and the NVRTC compile of the device-only kernel headers where libnvrtc is found.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

#include "kiln/attention/flex_attention.h"
#include "kiln/core/error.h"
#include "kiln/core/kernel_registry.h"
#include "kiln/jit/cache.h"
#include "kiln/jit/compile_service.h"
#include "kiln/jit/cpu_backend.h"
#include "kiln/jit/sha256.h"
#include "tests/jit/jit_test_util.h"
#include "tests/ops/harness.h"

using namespace kiln;

namespace {

int f1() { return 1; }
int f2() { return 2; }

TEST(KernelRegistry, WildcardsDuplicatesAndSingleFlight) {
  KernelRegistry r;
  const KernelKey any{"fam", "cpu", "*", 0, "m", ""};
  r.add(any, KernelEntry{reinterpret_cast<const void*>(&f1), nullptr, "test"});
  r.add(any, KernelEntry{reinterpret_cast<const void*>(&f1), nullptr, "test again"});  // the same body: ignored
  EXPECT_THROW(r.add(any, KernelEntry{reinterpret_cast<const void*>(&f2), nullptr, "other"}), Error);
  auto hit = r.find(KernelKey{"fam", "cpu", "bf16", 128, "m", ""});
  ASSERT_TRUE(hit.has_value());
  EXPECT_EQ(hit->fn, reinterpret_cast<const void*>(&f1));
  EXPECT_FALSE(r.find(KernelKey{"fam", "cpu", "bf16", 128, "other", ""}).has_value());
  EXPECT_FALSE(r.find(KernelKey{"fam", "cuda", "*", 0, "m", ""}).has_value());
  // Eight threads ask for one missing key: one make() runs, all get its entry.
  std::atomic<int> made{0};
  const KernelKey k{"fam", "cpu", "f32", 64, "jit", ""};
  std::vector<std::thread> ts;
  std::vector<const void*> got(8);
  for (int i = 0; i < 8; ++i)
    ts.emplace_back([&, i] {
      got[static_cast<size_t>(i)] = r.get_or_make(k, [&] {
        ++made;
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        return KernelEntry{reinterpret_cast<const void*>(&f2), nullptr, "made"};
      }).fn;
    });
  for (auto& t : ts) t.join();
  EXPECT_EQ(made.load(), 1);
  for (const void* g : got) EXPECT_EQ(g, reinterpret_cast<const void*>(&f2));
  // A failed make is not remembered.
  const KernelKey bad{"fam", "cpu", "f32", 64, "bad", ""};
  EXPECT_THROW(r.get_or_make(bad, []() -> KernelEntry { fail("no"); }), Error);
  EXPECT_EQ(r.get_or_make(bad, [] { return KernelEntry{reinterpret_cast<const void*>(&f1), nullptr, "ok"}; }).fn,
            reinterpret_cast<const void*>(&f1));
  EXPECT_EQ(r.keys("fam").size(), 3u);
}

TEST(JitSha256, KnownVectors) {
  EXPECT_EQ(jit::sha256_hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(jit::sha256_hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(jit::sha256_hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  jit::Sha256 a, b;
  EXPECT_NE(a.field("x", "ab").field("y", "c").hex(), b.field("x", "a").field("y", "bc").hex());
}

TEST(JitCompileService, FuturesErrorsAndCancellation) {
  jit::CompileService pool(2);
  pool.set_quiet(true);
  std::atomic<int> ran{0};
  auto ok = pool.submit("ok", [&](const jit::CancelToken&) { ++ran; });
  auto bad = pool.submit("bad", [&](const jit::CancelToken&) { fail("compile failed here"); });
  ok.wait();
  EXPECT_EQ(ran.load(), 1);
  EXPECT_THROW(bad.wait(), Error);
  // A running job sees its token; a child process is killed.
  auto slow = pool.submit("sleep", [&](const jit::CancelToken& t) { jit::run_process({"/bin/sleep", "30"}, &t); });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const auto t0 = std::chrono::steady_clock::now();
  slow.cancel();
  EXPECT_THROW(slow.wait(), Error);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  EXPECT_GE(jit::compile_threads(), 1);
  {
    test::ScopedEnv env("KILN_COMPILE_THREADS", "zero");
    EXPECT_THROW(jit::compile_threads(), Error);
  }
  {
    test::ScopedEnv env("KILN_COMPILE_THREADS", "3");
    EXPECT_LE(jit::compile_threads(), 3);
  }
}

jit::CompileRequest tiny(const std::string& body = "return 41;") {
  return jit::CompileRequest{"test kernel", "extern \"C\" __attribute__((visibility(\"default\"))) int kiln_tiny() {\n"
                                            "#line 1 \"user\"\n" + body + "\n}\n", {"user"}};
}
int call_tiny(const jit::LoadedModule& m) { return reinterpret_cast<int (*)()>(jit::module_symbol(m, "kiln_tiny"))(); }

TEST(JitCache, KeyFieldsEachMatter) {
  const auto cxx = jit::find_cpu_compiler();
  if (!cxx) GTEST_SKIP() << "no C++ compiler on this machine";
  const jit::KeyFields base = jit::cpu_key_fields(tiny(), *cxx);
  std::vector<std::string> names;
  for (const auto& [k, v] : base.fields) names.push_back(k);
  EXPECT_EQ(names, (std::vector<std::string>{"backend", "source", "headers", "options", "target", "compiler", "kiln"}));
  for (size_t i = 0; i < base.fields.size(); ++i) {
    jit::KeyFields f = base;
    f.fields[i].second += "x";
    EXPECT_NE(f.digest(), base.digest()) << "field " << f.fields[i].first << " does not change the key";
  }
  // The headers field follows a source's kiln includes, and their own.
  const std::string h = jit::kiln_headers_of("#include \"kiln/kernels/flex_mods.h\"\n", jit::include_root());
  EXPECT_NE(h.find("kiln/kernels/flex_mods.h\n"), std::string::npos);
  EXPECT_NE(h.find("kiln/core/macros.h\n"), std::string::npos);
  EXPECT_NE(h.find("kiln/kernels/device_std.h\n"), std::string::npos);
}

TEST(JitCache, CompilesCachesAndRebuildsATruncatedEntry) {
  if (!jit::find_cpu_compiler()) GTEST_SKIP() << "no C++ compiler on this machine";
  test::TempDir dir;
  test::ScopedEnv env("KILN_CACHE_DIR", dir.path.c_str());
  const jit::LoadedModule a = jit::compile_cpu(tiny());
  EXPECT_FALSE(a.from_cache);
  EXPECT_EQ(call_tiny(a), 41);
  const jit::LoadedModule b = jit::compile_cpu(tiny());
  EXPECT_TRUE(b.from_cache);
  EXPECT_EQ(b.path, a.path);
  // Truncate the payload: ignored with a warning, rebuilt.
  // (A new file in its place: the loaded one stays mapped and must not change under it.)
  const std::string whole = jit::read_file(a.path);
  jit::write_file_atomic(a.path, whole.substr(0, whole.size() / 2));
  testing::internal::CaptureStderr();
  const jit::LoadedModule c = jit::compile_cpu(tiny());
  const std::string warn = testing::internal::GetCapturedStderr();
  EXPECT_FALSE(c.from_cache);
  EXPECT_NE(warn.find("ignoring the cached kernel"), std::string::npos) << warn;
  // A foreign record (another key's meta copied over): rebuilt too.
  jit::DiskCache cache(dir.path);
  const std::string meta = dir.path + "/jit/" + c.key + ".meta";
  std::ofstream(meta) << "kiln-jit-entry 1\nkey 0000\nsize 1\nsha256 00\n";
  testing::internal::CaptureStderr();
  EXPECT_FALSE(cache.lookup(c.key, "so").has_value());
  testing::internal::GetCapturedStderr();
  // A compile error carries the compiler's message about the user's lines, and caches nothing.
  try {
    jit::compile_cpu(tiny("return undefined_name;"));
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("user:1:"), std::string::npos) << e.what();
  }
  size_t so = 0;
  for (const auto& f : std::filesystem::directory_iterator(dir.path + "/jit")) so += f.path().extension() == ".so";
  EXPECT_EQ(so, 0u);  // the foreign entry went with its payload; the failed compile added none
}

TEST(JitCache, TwoProcessesCompileTheSameKernelAtOnce) {
  if (!jit::find_cpu_compiler()) GTEST_SKIP() << "no C++ compiler on this machine";
  test::TempDir dir;
  test::ScopedEnv env("KILN_CACHE_DIR", dir.path.c_str());
  std::vector<pid_t> kids;
  for (int i = 0; i < 2; ++i) {
    const pid_t pid = fork();
    if (pid == 0) {
      int rc = 1;
      try {
        rc = call_tiny(jit::compile_cpu(tiny("return 7;"))) == 7 ? 0 : 2;
      } catch (...) {
        rc = 3;
      }
      _exit(rc);
    }
    kids.push_back(pid);
  }
  for (pid_t k : kids) {
    int status = 0;
    ASSERT_EQ(waitpid(k, &status, 0), k);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status;
  }
  const jit::LoadedModule m = jit::compile_cpu(tiny("return 7;"));
  EXPECT_TRUE(m.from_cache);
  EXPECT_EQ(call_tiny(m), 7);
  for (const auto& f : std::filesystem::directory_iterator(dir.path + "/jit"))
    EXPECT_EQ(f.path().string().find(".tmp."), std::string::npos) << "left over: " << f.path();
}

TEST(JitCache, RefusesFoldersOthersCanWriteOrOwn) {
  test::TempDir dir;
  ::chmod(dir.path.c_str(), 0777);
  try {
    jit::check_cache_dir(dir.path);
    ADD_FAILURE() << "a world-writable folder was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("can be written by others"), std::string::npos) << e.what();
  }
  ::chmod(dir.path.c_str(), 0700);
  EXPECT_NO_THROW(jit::check_cache_dir(dir.path));
  {
    test::ScopedEnv env("KILN_CACHE_DIR", (dir.path + "/new/kiln").c_str());
    const std::string made = jit::cache_dir();
    struct stat st {};
    ASSERT_EQ(::stat(made.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0700u);
  }
  // A folder of another user: / is root's; as root, a folder given to nobody (65534).
  test::TempDir other;
  const std::string foreign = getuid() != 0 ? std::string("/") : other.path;
  if (getuid() == 0) ASSERT_EQ(::chown(other.path.c_str(), 65534, 65534), 0);
  {
    try {
      jit::check_cache_dir(foreign);
      ADD_FAILURE() << "root's folder was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("not to you"), std::string::npos) << e.what();
    }
  }
}

TEST(JitCache, NoCompilerIsAClearErrorAndBuiltinModsStillWork) {
  test::TempDir dir;
  test::ScopedEnv cache("KILN_CACHE_DIR", dir.path.c_str());
  test::ScopedEnv path("PATH", "/nonexistent");
  test::ScopedEnv cxx("KILN_CXX", "/nonexistent/g++");
  test::ScopedEnv cxx2("CXX", nullptr);
  EXPECT_FALSE(jit::find_cpu_compiler().has_value());
  try {
    jit::compile_cpu(tiny());
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("none was found"), std::string::npos) << e.what();
  }
  KILN_TEST_GENERATOR(gen);
  Tensor q = randn({1, 1, 8, 4}, gen);
  auto mask = attention::create_block_mask(attention::Causal{}, 1, 1, 8, 8);
  EXPECT_EQ(attention::flex_attention(q, q, q, attention::NoScoreMod{}, mask).out.size(2), 8);
}

}  // namespace
