// Source generation for run-time FlexAttention mods: the expression check, the functors, the CPU
// translation units with their entry points.
#include "kiln/jit/flex_source.h"

#include <cctype>
#include <set>
#include <sstream>

#include "kiln/core/error.h"

namespace kiln::jit {

namespace {
const std::set<std::string>& functions() {
  static const std::set<std::string> f{"exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid", "abs",
                                       "sin", "cos", "pow", "min", "max", "where"};
  return f;
}

std::string capture_type(const CaptureSig& c) {
  return std::string("Capture<") + (c.is_int ? "int32_t" : "float") + ", " + std::to_string(c.rank) + ">";
}

void check_text(const ModSpec& m, const std::string& text, bool has_score) {
  std::set<std::string> known{"b",   "h",     "q_idx", "kv_idx", "q_len", "kv_len", "inf",
                              "true", "false", "float", "double", "int", "int64_t", "bool"};
  if (has_score) known.insert("score");
  for (const auto& c : m.captures) known.insert(c.name);
  KILN_CHECK(!text.empty(), m.kind, ": the expression is empty");
  std::string open;  // brackets must balance inside the expression (else the compiler's message would point past it)
  for (size_t i = 0; i < text.size(); ++i) {
    const char ch = text[i];
    if (ch == '(' || ch == '[') open += ch;
    if (ch == ')' || ch == ']') {
      KILN_CHECK(!open.empty() && open.back() == (ch == ')' ? '(' : '['), m.kind, " '", text, "': unmatched '",
                 std::string(1, ch), "' at column ", i + 1);
      open.pop_back();
    }
  }
  KILN_CHECK(open.empty(), m.kind, " '", text, "': '", open.substr(open.size() - 1), "' not closed");
  for (size_t i = 0; i < text.size();) {
    const char ch = text[i];
    KILN_CHECK(std::string(";{}#\"'\\`").find(ch) == std::string::npos && (ch >= 32 || ch == '\t'), m.kind, " '",
               text, "': character '", std::string(1, ch), "' at column ", i + 1,
               " cannot appear in an expression (one C++ expression, no statements)");
    if (std::isdigit(static_cast<unsigned char>(ch)) || (ch == '.' && i + 1 < text.size() && std::isdigit(text[i + 1]))) {
      while (i < text.size() && (std::isalnum(static_cast<unsigned char>(text[i])) || text[i] == '.' ||
                                 ((text[i] == '+' || text[i] == '-') && (text[i - 1] == 'e' || text[i - 1] == 'E'))))
        ++i;
      continue;
    }
    if (std::isalpha(static_cast<unsigned char>(ch)) || ch == '_') {
      const size_t b = i;
      while (i < text.size() && (std::isalnum(static_cast<unsigned char>(text[i])) || text[i] == '_')) ++i;
      const std::string id = text.substr(b, i - b);
      if (known.count(id) || functions().count(id)) continue;
      std::string caps;
      for (const auto& c : m.captures) caps += (caps.empty() ? "" : ", ") + c.name;
      fail(m.kind, " '", text, "': unknown name '", id, "' at column ", b + 1, " (a ", m.kind,
           " sees ", has_score ? "score, " : "", "b, h, q_idx, kv_idx, q_len, kv_len, its captures (",
           caps.empty() ? "none given" : caps, ") and the functions of docs/jit.md)");
    }
    ++i;
  }
}

// The body of one functor's eval: views of its captures, then the expression under #line.
std::string bind_views(const ModSpec& m, const char* value_type, bool probe) {
  std::string s;
  for (const auto& c : m.captures)
    s += "    const auto " + c.name + " = this->" + c.name + ".template view<" + value_type + ">(" +
         (probe && c.learnable ? "probe_" : "nullptr") + ");\n    (void)" + c.name + ";\n";
  s += "    const int64_t q_len = this->q_len, kv_len = this->kv_len;\n    (void)q_len, (void)kv_len;\n";
  return s;
}

std::string line_block(const std::string& file, const std::string& text) {
  return "\n#line 1 \"" + file + "\"\n" + text + "\n#line 1 \"kiln-generated\"\n";
}

std::string members(const ModSpec& m) {
  std::string s = "  int64_t q_len = 0, kv_len = 0;\n";
  for (const auto& c : m.captures) s += "  " + capture_type(c) + " " + c.name + ";\n";
  return s;
}
}  // namespace

void check_mod(const ModSpec& m) {
  KILN_CHECK(m.kind == "score_mod" || m.kind == "mask_mod", "jit: unknown mod kind ", m.kind);
  std::set<std::string> names;
  int learnable = 0;
  for (const auto& c : m.captures) {
    bool ident = !c.name.empty() && (std::isalpha(static_cast<unsigned char>(c.name[0])) || c.name[0] == '_');
    for (char ch : c.name) ident = ident && (std::isalnum(static_cast<unsigned char>(ch)) || ch == '_');
    KILN_CHECK(ident, m.kind, ": capture name '", c.name, "' is not an identifier");
    static const std::set<std::string> taken{"score", "b", "h", "q_idx", "kv_idx", "q_len", "kv_len", "inf", "true", "false"};
    KILN_CHECK(!functions().count(c.name) && !taken.count(c.name), m.kind, ": capture name '", c.name,
               "' is taken by a variable or function of the expression language");
    KILN_CHECK(names.insert(c.name).second, m.kind, ": capture '", c.name, "' given twice");
    KILN_CHECK(c.rank >= 1 && c.rank <= 4, m.kind, ": capture '", c.name, "' must have 1 to 4 dims, got ", c.rank);
    learnable += c.learnable;
    KILN_CHECK(!c.learnable || (m.kind == "score_mod" && !c.is_int), m.kind, ": capture '", c.name,
               "' requires grad, which only an f32 capture of a score_mod may");
  }
  KILN_CHECK(learnable <= 1, m.kind, ": at most one captured tensor may require grad, got ", learnable);
  check_text(m, m.expr, m.kind == "score_mod");
  if (!m.dscore.empty()) check_text(m, m.dscore, true);
  for (const auto& c : m.captures) {
    if (!c.learnable) continue;
    // Its gradient is probed through one read per evaluation.
    size_t n = 0;
    for (size_t at = m.expr.find(c.name); at != std::string::npos; at = m.expr.find(c.name, at + 1)) {
      const bool start = at == 0 || !(std::isalnum(static_cast<unsigned char>(m.expr[at - 1])) || m.expr[at - 1] == '_');
      const size_t e = at + c.name.size();
      const bool end = e >= m.expr.size() || !(std::isalnum(static_cast<unsigned char>(m.expr[e])) || m.expr[e] == '_');
      n += start && end;
    }
    KILN_CHECK(n == 1, m.kind, " '", m.expr, "': the capture '", c.name,
               "' requires grad, so the expression must read it exactly once, got ", n);
  }
}

std::string mod_functors(const ModSpec& score, const ModSpec& mask) {
  check_mod(score);
  check_mod(mask);
  bool learn = false;
  for (const auto& c : score.captures) learn = learn || c.learnable;
  // The identity score_mod is the library's NoScoreMod: the kernels' fast path (the scale folded
  // into one pass, no raw scores kept) is chosen by its type.
  const bool identity = is_identity(score);
  std::ostringstream s;
  s << "namespace kiln::jit::expr::gen {\n";
  if (identity) {
    s << "using ScoreMod = ::kiln::attention::NoScoreMod;\n";
  } else {
    s << "struct ScoreMod {\n" << members(score)
      << "  static constexpr bool kCaptureGrad = " << (learn ? "true" : "false") << ";\n"
      << "  template <class T>\n  KILN_HD T eval(T score, int b, int h, int q_idx, int kv_idx, Probe* probe_) const {\n"
      << bind_views(score, "T", true) << "    (void)probe_, (void)score, (void)b, (void)h, (void)q_idx, (void)kv_idx;\n"
      << "    const auto kiln_result_ = (" << line_block("score_mod", score.expr) << ");\n    return T(kiln_result_);\n  }\n"
      << "  template <class T> KILN_HD T operator()(T score, int b, int h, int q_idx, int kv_idx) const {\n"
      << "    return eval<T>(score, b, h, q_idx, kv_idx, nullptr);\n  }\n"
      << "  template <class T> KILN_HD T dscore(T score, int b, int h, int q_idx, int kv_idx) const {\n";
    if (score.dscore.empty()) {
      s << "    return eval<Dual<T>>(Dual<T>(score, T(1)), b, h, q_idx, kv_idx, nullptr).d;\n  }\n";
    } else {
      s << bind_views(score, "T", false) << "    (void)score, (void)b, (void)h, (void)q_idx, (void)kv_idx;\n"
        << "    const auto kiln_result_ = (" << line_block("score_mod_derivative", score.dscore)
        << ");\n    return T(kiln_result_);\n  }\n";
    }
    s << "  KILN_HD float capture_grad(float score, int b, int h, int q_idx, int kv_idx, int64_t* offset) const {\n"
      << "    Probe probe_;\n"
      << "    const float d = eval<Dual<float>>(Dual<float>(score, 0.0f), b, h, q_idx, kv_idx, &probe_).d;\n"
      << "    *offset = probe_.offset;\n    return d;\n  }\n};\n";
  }
  s << "struct MaskMod {\n" << members(mask)
    << "  KILN_HD bool operator()(int b, int h, int q_idx, int kv_idx) const {\n"
    << bind_views(mask, "float", false) << "    (void)b, (void)h, (void)q_idx, (void)kv_idx;\n"
    << "    const bool kiln_result_ = (" << line_block("mask_mod", mask.expr) << ");\n    return kiln_result_;\n  }\n};\n";
  // The captures arrive in one array: the score_mod's, then the mask_mod's.
  s << "KILN_HD void bind(ScoreMod& sm, MaskMod& mm, const CaptureArg* caps, int64_t L, int64_t S) {\n"
    << (identity ? "  (void)sm;\n  mm.q_len = L;\n  mm.kv_len = S;\n" : "  sm.q_len = mm.q_len = L;\n  sm.kv_len = mm.kv_len = S;\n");
  size_t i = 0;
  for (const auto& c : score.captures) s << "  sm." << c.name << ".bind(caps[" << i++ << "]);\n";
  for (const auto& c : mask.captures) s << "  mm." << c.name << ".bind(caps[" << i++ << "]);\n";
  s << "  (void)caps;\n}\n}  // namespace kiln::jit::expr::gen\n";
  return s.str();
}

namespace {
// The kernels' head: kiln's CPU kernel templates. Their tile products and row loops
// (kernels/cpu/attention.cpp, compiled once per target ISA and picked at load time) are kiln's
// own: the entry kiln_flex_link receives their addresses, so a run-time mod's kernel computes
// with the very code of the built-in kernels (and compiles without them).
const char* kCpuHead =
    "// Generated by kiln/jit/flex_source.cpp.\n"
    "#include <cstdio>\n#include <exception>\n"
    "#include \"kiln/jit/expr_prelude.h\"\n"
    "#include \"kiln/kernels/cpu/attention_impl.h\"\n"
    "#define KILN_JIT_EXPORT extern \"C\" __attribute__((visibility(\"default\")))\n"
    "using kiln::jit::expr::CaptureArg;\n"
    "namespace kiln::kernels::cpu::flex_detail {\n"
    "#define KILN_JIT_FORWARD(ret, name, params, args) \\\n"
    "  static decltype(&name) name##_impl = nullptr; \\\n"
    "  ret name params { return name##_impl args; }\n"
    "KILN_JIT_FORWARD(void, tile_abt, (float* s, int64_t ld, const float* a, int64_t m, int64_t n, const float* bt, int64_t nk), (s, ld, a, m, n, bt, nk))\n"
    "KILN_JIT_FORWARD(void, tile_ax, (float* acc, int64_t n, const float* w, int64_t ld, int64_t rows, const float* x, int64_t cols), (acc, n, w, ld, rows, x, cols))\n"
    "KILN_JIT_FORWARD(void, tile_atx, (float* acc, int64_t n, const float* w, int64_t ld, int64_t rows, const float* x, int64_t cols), (acc, n, w, ld, rows, x, cols))\n"
    "KILN_JIT_FORWARD(float, row_dot, (const float* a, const float* b, int64_t n), (a, b, n))\n"
    "KILN_JIT_FORWARD(float, row_max, (const float* s, int64_t n), (s, n))\n"
    "KILN_JIT_FORWARD(float, row_exp_sum, (float* s, int64_t n, float m), (s, n, m))\n"
    "KILN_JIT_FORWARD(void, row_softmax_grad, (float* s, float* d, int64_t n, float lse, float delta), (s, d, n, lse, delta))\n"
    "}  // namespace kiln::kernels::cpu::flex_detail\n"
    "KILN_JIT_EXPORT void kiln_flex_link(void* const* fns) {\n"
    "  using namespace kiln::kernels::cpu::flex_detail;\n"
    "  tile_abt_impl = reinterpret_cast<decltype(tile_abt_impl)>(fns[0]);\n"
    "  tile_ax_impl = reinterpret_cast<decltype(tile_ax_impl)>(fns[1]);\n"
    "  tile_atx_impl = reinterpret_cast<decltype(tile_atx_impl)>(fns[2]);\n"
    "  row_dot_impl = reinterpret_cast<decltype(row_dot_impl)>(fns[3]);\n"
    "  row_max_impl = reinterpret_cast<decltype(row_max_impl)>(fns[4]);\n"
    "  row_exp_sum_impl = reinterpret_cast<decltype(row_exp_sum_impl)>(fns[5]);\n"
    "  row_softmax_grad_impl = reinterpret_cast<decltype(row_softmax_grad_impl)>(fns[6]);\n"
    "}\n";
// The tile classifier's head: the mask alone.
const char* kClassifyHead =
    "// Generated by kiln/jit/flex_source.cpp.\n"
    "#include <algorithm>\n#include <cstdio>\n#include <exception>\n"
    "#include \"kiln/jit/expr_prelude.h\"\n"
    "#include \"kiln/kernels/flex_tiles.h\"\n"
    "#define KILN_JIT_EXPORT extern \"C\" __attribute__((visibility(\"default\")))\n"
    "using kiln::jit::expr::CaptureArg;\n";

std::string cpp_storage(const std::string& storage) {
  if (storage == "f32") return "float";
  if (storage == "bf16") return "kiln::BFloat16";
  if (storage == "f16") return "kiln::Half";
  fail("jit: flex_attention storage '", storage, "' is not f32, bf16 or f16");
}
}  // namespace

std::string flex_cpu_source(const ModSpec& score, const ModSpec& mask, const std::string& storage, bool backward) {
  const std::string fn = backward ? "flex_backward" : "flex_forward";
  std::ostringstream s;
  s << kCpuHead << mod_functors(score, mask)
    << "KILN_JIT_EXPORT int kiln_" << fn
    << "(const kiln::kernels::FlexParams* p, const CaptureArg* caps, char* err, int errlen) {\n"
    << "  try {\n    kiln::jit::expr::gen::ScoreMod sm;\n    kiln::jit::expr::gen::MaskMod mm;\n"
    << "    kiln::jit::expr::gen::bind(sm, mm, caps, p->L, p->S);\n"
    << "    kiln::kernels::cpu::" << fn << "<" << cpp_storage(storage) << ">(*p, sm, mm);\n    return 0;\n"
    << "  } catch (const std::exception& e) {\n    std::snprintf(err, errlen, \"%s\", e.what());\n    return 1;\n  }\n}\n";
  return s.str();
}

std::string classify_cpu_source(const ModSpec& mask) {
  ModSpec none{"score_mod", "score", "", {}};
  std::ostringstream s;
  s << kClassifyHead << mod_functors(none, mask)
    << "KILN_JIT_EXPORT int kiln_flex_classify(const CaptureArg* caps, int64_t Bm, int64_t Hm, int64_t L, int64_t S,\n"
    << "                                       int64_t qb, int64_t kb, uint8_t* out, char* err, int errlen) {\n"
    << "  try {\n    kiln::jit::expr::gen::ScoreMod sm;\n    kiln::jit::expr::gen::MaskMod mm;\n"
    << "    kiln::jit::expr::gen::bind(sm, mm, caps, L, S);\n"
    << "    const int64_t nq = (L + qb - 1) / qb, nk = (S + kb - 1) / kb;\n"
    << "#pragma omp parallel for schedule(dynamic, 1)\n"
    << "    for (int64_t r = 0; r < Bm * Hm * nq; ++r) {\n"
    << "      const int64_t a = r % nq, h = (r / nq) % Hm, b = r / (nq * Hm);\n"
    << "      for (int64_t c = 0; c < nk; ++c)\n"
    << "        out[r * nk + c] = static_cast<uint8_t>(kiln::attention::classify_tile(mm, int(b), int(h), a * qb,\n"
    << "            std::min(L, (a + 1) * qb), c * kb, std::min(S, (c + 1) * kb)));\n"
    << "    }\n    return 0;\n"
    << "  } catch (const std::exception& e) {\n    std::snprintf(err, errlen, \"%s\", e.what());\n    return 1;\n  }\n}\n";
  return s.str();
}

std::string classify_cuda_source(const ModSpec& mask) {
  KILN_CHECK(static_cast<int>(mask.captures.size()) <= kMaxCudaCaptures, "mask_mod: at most ", kMaxCudaCaptures,
             " captures on CUDA, got ", mask.captures.size());
  ModSpec none{"score_mod", "score", "", {}};
  std::ostringstream s;
  s << "// Generated by kiln/jit/flex_source.cpp (NVRTC).\n"
    << "#include \"kiln/jit/expr_prelude.h\"\n#include \"kiln/kernels/flex_tiles.h\"\n"
    << "using kiln::jit::expr::CaptureArg;\n"
    << mod_functors(none, mask)
    << "struct CaptureArgs {\n  CaptureArg a[" << kMaxCudaCaptures << "];\n};\n"
    << "extern \"C\" __global__ void kiln_flex_classify(CaptureArgs caps, int64_t Bm, int64_t Hm, int64_t L, int64_t S,\n"
    << "                                              int64_t qb, int64_t kb, uint8_t* out) {\n"
    << "  kiln::jit::expr::gen::ScoreMod sm;\n  kiln::jit::expr::gen::MaskMod mm;\n"
    << "  kiln::jit::expr::gen::bind(sm, mm, caps.a, L, S);\n"
    << "  const int64_t nq = (L + qb - 1) / qb, nk = (S + kb - 1) / kb;\n"
    << "  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;\n"
    << "  if (t >= Bm * Hm * nq * nk) return;\n"
    << "  const int64_t c = t % nk, a = (t / nk) % nq, h = (t / (nk * nq)) % Hm, b = t / (nk * nq * Hm);\n"
    << "  out[t] = static_cast<uint8_t>(kiln::attention::classify_tile(mm, int(b), int(h), a * qb,\n"
    << "      min(L, (a + 1) * qb), c * kb, min(S, (c + 1) * kb)));\n}\n";
  return s.str();
}

bool is_identity(const ModSpec& score) {
  return score.expr == "score" && score.dscore.empty() && score.captures.empty();
}

namespace {
// The host writes the functors' bytes (functor_bytes): a generated source checks their layout.
std::string layout_asserts(const ModSpec& score, const ModSpec& mask) {
  std::string s = "using SM = kiln::jit::expr::gen::ScoreMod;\nusing MM = kiln::jit::expr::gen::MaskMod;\n"
                  "static_assert(sizeof(MM) == " + std::to_string(16 + 80 * mask.captures.size()) +
                  ", \"MaskMod layout\");\n";
  if (!is_identity(score))
    s += "static_assert(sizeof(SM) == " + std::to_string(16 + 80 * score.captures.size()) + ", \"ScoreMod layout\");\n";
  return s;
}

const char* cuda_storage(const std::string& storage) {
  if (storage == "f32") return "float";
  if (storage == "bf16") return "__nv_bfloat16";
  if (storage == "f16") return "__half";
  fail("jit: CUDA flex storage must be f32, bf16 or f16, got '", storage, "'");
}
}  // namespace

std::string flex_cuda_source(const ModSpec& score, const ModSpec& mask, int maxd, bool backward,
                             const std::string& storage) {
  KILN_CHECK(maxd == 128 || maxd == 256, "jit: CUDA flex row size must be 128 or 256, got ", maxd);
  const std::string T = cuda_storage(storage);
  std::ostringstream s;
  s << "// Generated by kiln/jit/flex_source.cpp (NVRTC).\n";
  if (storage == "bf16") s << "#include <cuda_bf16.h>\n";
  if (storage == "f16") s << "#include <cuda_fp16.h>\n";
  s << "#include \"kiln/jit/expr_prelude.h\"\n#include \"kiln/kernels/cuda/attention_simt.cuh\"\n"
    << "using kiln::jit::expr::CaptureArg;\n"
    << mod_functors(score, mask)
    << "using kiln::kernels::FlexParams;\nnamespace simt = kiln::kernels::cuda::flex_simt;\n"
    << layout_asserts(score, mask);
  if (!backward) {
    s << "extern \"C\" __global__ void kiln_flex_fwd(FlexParams p, SM sm, MM mm) {\n"
      << "  simt::flex_fwd_body<" << maxd << ", " << T << ">(p, sm, mm);\n}\n";
  } else {
    s << "extern \"C\" __global__ void kiln_flex_delta(FlexParams p) { simt::flex_delta_body<" << T << ">(p); }\n"
      << "extern \"C\" __global__ void kiln_flex_dq(FlexParams p, SM sm, MM mm) {\n"
      << "  simt::flex_dq_body<" << maxd << ", " << T << ">(p, sm, mm);\n}\n"
      << "extern \"C\" __global__ void kiln_flex_dkdv(FlexParams p, SM sm, MM mm) {\n"
      << "  simt::flex_dkdv_body<" << maxd << ", " << T << ">(p, sm, mm);\n}\n";
    bool learn = false;
    for (const auto& c : score.captures) learn = learn || c.learnable;
    if (learn) {
      // The learnable capture's gradient, as the CPU kernel computes it (kernels/cpu/attention_impl.h):
      // the thread of task t = (b, h, q block) adds P (dP - delta) * d score' / d capture (the
      // generated ScoreMod's capture_grad) into its own partial row of bias_row floats at the
      // element the expression read; then one thread per element sums the rows over the tasks in
      // order (deterministic). The mask is evaluated directly, every key in order.
      s << "extern \"C\" __global__ void kiln_flex_dcap_partial(FlexParams p, SM sm, MM mm) {\n"
        << "  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;\n"
        << "  if (t >= p.B * p.Hq * p.nQ) return;\n"
        << "  const int64_t qb = t % p.nQ, h = (t / p.nQ) % p.Hq, b = t / (p.nQ * p.Hq), hk = h / (p.Hq / p.Hkv);\n"
        << "  float* part = p.dbias_partial + t * p.bias_row;\n"
        << "  for (int64_t r = 0; r < p.bias_row; ++r) part[r] = 0.0f;\n"
        << "  const " << T << "* k = static_cast<const " << T << "*>(p.k) + b * p.k_st[0] + hk * p.k_st[1];\n"
        << "  const " << T << "* v = static_cast<const " << T << "*>(p.v) + b * p.v_st[0] + hk * p.v_st[1];\n"
        << "  for (int64_t i = qb * p.QB; i < min((qb + 1) * p.QB, p.L); ++i) {\n"
        << "    const int64_t o = (b * p.Hq + h) * p.L + i;\n"
        << "    const float lse = p.lse[o], delta = p.delta[o];\n"
        << "    if (lse == -INFINITY) continue;\n"
        << "    const " << T << "* qi = static_cast<const " << T
        << "*>(p.q) + b * p.q_st[0] + h * p.q_st[1] + i * p.q_st[2];\n"
        << "    const " << T << "* gi = static_cast<const " << T << "*>(p.dout) + o * p.Ev;\n"
        << "    for (int64_t j = 0; j < p.S; ++j) {\n"
        << "      if (!mm(int(b), int(h), int(i), int(j))) continue;\n"
        << "      const " << T << "* kj = k + j * p.k_st[2];\n"
        << "      const " << T << "* vj = v + j * p.v_st[2];\n"
        << "      float s = 0.0f, dp = 0.0f;\n"
        << "      for (int e = 0; e < p.E; ++e) s += static_cast<float>(qi[e]) * static_cast<float>(kj[e]);\n"
        << "      for (int e = 0; e < p.Ev; ++e) dp += static_cast<float>(gi[e]) * static_cast<float>(vj[e]);\n"
        << "      const float raw = s * p.scale, x = sm(raw, int(b), int(h), int(i), int(j));\n"
        << "      if (x == -INFINITY) continue;\n"
        << "      const float pj = __expf(x - lse);\n"
        << "      if (pj == 0.0f) continue;\n"
        << "      int64_t at = -1;\n"
        << "      const float d = sm.capture_grad(raw, int(b), int(h), int(i), int(j), &at);\n"
        << "      if (at >= 0 && at < p.bias_row) part[at] += pj * (dp - delta) * d;\n"
        << "    }\n  }\n}\n"
        << "extern \"C\" __global__ void kiln_flex_dcap_reduce(FlexParams p) {\n"
        << "  const int64_t x = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;\n"
        << "  if (x >= p.bias_row) return;\n"
        << "  float sum = 0.0f;\n"
        << "  for (int64_t t = 0; t < p.B * p.Hq * p.nQ; ++t) sum += p.dbias_partial[t * p.bias_row + x];\n"
        << "  p.dbias[x] = sum;\n}\n";
    }
  }
  return s.str();
}

std::string flex_hopper_source(const ModSpec& score, const ModSpec& mask, const std::string& storage) {
  KILN_CHECK(storage == "bf16" || storage == "f16", "jit: the Hopper flex kernels take bf16 or f16, got '", storage,
             "'");
  std::ostringstream s;
  s << "// Generated by kiln/jit/flex_source.cpp (NVRTC): the Hopper kernels with run-time mods.\n"
    << (storage == "bf16" ? "#include <cuda_bf16.h>\n" : "#include <cuda_fp16.h>\n")
    << "#include \"kiln/jit/expr_prelude.h\"\n#include \"kiln/kernels/cuda/attention_bwd_wgmma.cuh\"\n"
    << "using kiln::jit::expr::CaptureArg;\n"
    << mod_functors(score, mask) << layout_asserts(score, mask);
  return s.str();
}

std::vector<std::string> flex_cuda_kernels(bool backward, bool learnable) {
  if (!backward) return {"kiln_flex_fwd"};
  if (learnable) return {"kiln_flex_delta", "kiln_flex_dq", "kiln_flex_dkdv", "kiln_flex_dcap_partial", "kiln_flex_dcap_reduce"};
  return {"kiln_flex_delta", "kiln_flex_dq", "kiln_flex_dkdv"};
}

std::vector<std::string> flex_hopper_kernels(int head_dim, bool backward, const std::string& storage) {
  KILN_CHECK(head_dim == 64 || head_dim == 128, "jit: the Hopper flex kernels take head dim 64 or 128, got ", head_dim);
  const std::string args = std::string(cuda_storage(storage)) + ", " + std::to_string(head_dim) + ", ";
  const std::string mods = "kiln::jit::expr::gen::ScoreMod, kiln::jit::expr::gen::MaskMod>";
  const std::string ns = "&kiln::kernels::cuda::flex_wgmma::";
  if (!backward) return {ns + "flex_fwd_wgmma_kernel<" + args + mods};
  return {ns + "flex_bwd_wgmma_kernel<" + args + "false, " + mods, ns + "flex_bwd_wgmma_kernel<" + args + "true, " + mods};
}

std::vector<unsigned char> functor_bytes(bool identity, int64_t q_len, int64_t kv_len, const void* const* data,
                                         const int64_t (*sizes)[4], const int64_t (*strides)[4],
                                         int32_t* const* flags, size_t n) {
  if (identity) return std::vector<unsigned char>(1, 0);
  std::vector<unsigned char> out;
  auto put = [&](const void* p, size_t bytes) {
    const auto* b = static_cast<const unsigned char*>(p);
    out.insert(out.end(), b, b + bytes);
  };
  put(&q_len, 8);
  put(&kv_len, 8);
  for (size_t i = 0; i < n; ++i) {
    put(&data[i], sizeof(void*));
    put(sizes[i], 32);
    put(strides[i], 32);
    put(&flags[i], sizeof(void*));
  }
  return out;
}

}  // namespace kiln::jit
