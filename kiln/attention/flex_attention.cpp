// flex_attention front end: argument checks, kernel parameters, the run-time mask selection
// (MaskSpec / AnyBlockMask) and the explicit instantiations for the library's masks.
#include "kiln/attention/flex_attention.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <limits>

#include "kiln/kernels/flex_files.h"

namespace kiln::attention {
namespace detail {

namespace {
// The q tables (per kv block: the backward's dK/dV walk) must list exactly the tiles of the kv
// tables (the forward's and dQ's), each as the same class: an edited q side gave dK off by 64 %
// with a correct output. (Called once both sides are valid and free of repeats: then the q
// side's tiles matching and adding up to the kv side's count makes the two sets equal.)
void check_transposed_tables(const BlockLayout& l) {
  const int64_t nq = l.num_q_blocks, nk = l.num_kv_blocks, wk = l.kv_indices.size(3), wq = l.q_indices.size(3);
  const int32_t *kn = l.kv_num_blocks.data<int32_t>(), *kfn = l.full_kv_num_blocks.data<int32_t>();
  const int32_t *ki = l.kv_indices.data<int32_t>(), *kfi = l.full_kv_indices.data<int32_t>();
  const int32_t *qn = l.q_num_blocks.data<int32_t>(), *qfn = l.full_q_num_blocks.data<int32_t>();
  const int32_t *qi = l.q_indices.data<int32_t>(), *qfi = l.full_q_indices.data<int32_t>();
  std::vector<uint8_t> cls(static_cast<size_t>(nq * nk));  // one (b, h) group's tiles: 0 empty, 1 partial, 2 full
  static constexpr const char* kClass[] = {"empty", "partial", "full"};
  for (int64_t g = 0; g < l.batch * l.heads; ++g) {
    std::fill(cls.begin(), cls.end(), uint8_t{0});
    int64_t kv_tiles = 0, q_tiles = 0;
    for (int64_t a = 0; a < nq; ++a) {
      const int64_t r = g * nq + a;
      for (int32_t c = 0; c < kn[r]; ++c) cls[static_cast<size_t>(a * nk + ki[r * wk + c])] = 1;
      for (int32_t c = 0; c < kfn[r]; ++c) cls[static_cast<size_t>(a * nk + kfi[r * wk + c])] = 2;
      kv_tiles += kn[r] + kfn[r];
    }
    for (int64_t c = 0; c < nk; ++c) {
      const int64_t r = g * nk + c;
      for (int32_t x = 0; x < qn[r] + qfn[r]; ++x) {
        const bool full = x >= qn[r];
        const int64_t a = full ? qfi[r * wq + (x - qn[r])] : qi[r * wq + x];
        const uint8_t want = full ? 2 : 1, have = cls[static_cast<size_t>(a * nk + c)];
        KILN_CHECK(have == want, "flex_attention: block mask's q tables list tile (q block ", a, ", kv block ", c,
                   ") of group ", g, " as ", kClass[want], ", its kv tables as ", kClass[have]);
      }
      q_tiles += qn[r] + qfn[r];
    }
    KILN_CHECK(q_tiles == kv_tiles, "flex_attention: block mask's q tables list ", q_tiles, " tiles of group ", g,
               ", its kv tables ", kv_tiles);
  }
}

// The layout's block tables as the kernels read them (raw pointers, no bounds checks there): i32,
// contiguous, shaped [Bm, Hm, n] (counts) and [Bm, Hm, n, ≥ 1] (indices) on the layout's device;
// on the CPU also their values (counts within the row, partial + full at most the other side's
// blocks, indices in range, no block twice within a row, the q tables matching the kv tables:
// O(tiles)). A hand-edited layout segfaulted the kernels or gave silent zeros or wrong
// gradients. (A GPU layout's values would need a copy back; they come from the builders.)
void check_block_tables(const BlockLayout& l) {
  struct Side {
    const char* name;
    const Tensor &num, &idx, &full_num, &full_idx;
    int64_t rows, other;
  };
  for (const Side& sd : {Side{"kv", l.kv_num_blocks, l.kv_indices, l.full_kv_num_blocks, l.full_kv_indices,
                              l.num_q_blocks, l.num_kv_blocks},
                         Side{"q", l.q_num_blocks, l.q_indices, l.full_q_num_blocks, l.full_q_indices,
                              l.num_kv_blocks, l.num_q_blocks}}) {
    for (const Tensor* t : {&sd.num, &sd.idx, &sd.full_num, &sd.full_idx}) {
      KILN_CHECK(t->defined() && t->dtype() == DType::i32 && t->is_contiguous() && t->device() == l.device(),
                 "flex_attention: block mask's ", sd.name, " tables must be contiguous i32 tensors on ",
                 l.device().str());
    }
    const Shape counts{l.batch, l.heads, sd.rows};
    KILN_CHECK(sd.num.shape() == counts && sd.full_num.shape() == counts, "flex_attention: block mask's ", sd.name,
               " counts are ", shape_str(sd.num.shape()), " and ", shape_str(sd.full_num.shape()), ", expected ",
               shape_str(counts));
    const int64_t width = sd.idx.dim() == 4 ? sd.idx.size(3) : 0;
    const Shape idx{l.batch, l.heads, sd.rows, width};
    KILN_CHECK(width >= std::max<int64_t>(sd.other, 1) && sd.idx.shape() == idx && sd.full_idx.shape() == idx,
               "flex_attention: block mask's ", sd.name, " indices are ", shape_str(sd.idx.shape()), " and ",
               shape_str(sd.full_idx.shape()), ", expected [", l.batch, ", ", l.heads, ", ", sd.rows, ", >= ",
               std::max<int64_t>(sd.other, 1), "]");
    if (!l.device().is_cpu()) continue;
    const int32_t *n = sd.num.data<int32_t>(), *fn = sd.full_num.data<int32_t>();
    const int32_t *ix = sd.idx.data<int32_t>(), *fix = sd.full_idx.data<int32_t>();
    std::vector<int64_t> listed_by(static_cast<size_t>(sd.other), -1);  // the last row that listed a block
    for (int64_t r = 0; r < l.batch * l.heads * sd.rows; ++r) {
      KILN_CHECK(n[r] >= 0 && fn[r] >= 0 && n[r] + int64_t{fn[r]} <= sd.other, "flex_attention: block mask's ",
                 sd.name, " row ", r, " counts ", n[r], " partial + ", fn[r], " full blocks of ", sd.other);
      for (int32_t c = 0; c < n[r] + fn[r]; ++c) {
        const int32_t j = c < n[r] ? ix[r * width + c] : fix[r * width + (c - n[r])];
        KILN_CHECK(j >= 0 && j < sd.other, "flex_attention: block mask's ", sd.name, " row ", r, " lists block ", j,
                   ", outside [0, ", sd.other, ")");
        KILN_CHECK(listed_by[static_cast<size_t>(j)] != r, "flex_attention: block mask's ", sd.name, " row ", r,
                   " lists block ", j, " twice");  // its tile was counted twice
        listed_by[static_cast<size_t>(j)] = r;
      }
    }
  }
  if (l.device().is_cpu()) check_transposed_tables(l);
}
}  // namespace

void check_flex_inputs(const Tensor& q, const Tensor& k, const Tensor& v, const BlockLayout& layout) {
  KILN_CHECK(q.defined() && k.defined() && v.defined(), "flex_attention: q, k and v must be defined");
  KILN_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "flex_attention: q, k, v must be 4-D [B, H, L, E], got ",
             shape_str(q.shape()), ", ", shape_str(k.shape()), ", ", shape_str(v.shape()));
  KILN_CHECK(q.dtype() == k.dtype() && q.dtype() == v.dtype(), "flex_attention: q, k, v dtypes differ: ",
             dtype_name(q.dtype()), ", ", dtype_name(k.dtype()), ", ", dtype_name(v.dtype()));
  KILN_CHECK(q.dtype() == DType::f32 || q.dtype() == DType::bf16 || q.dtype() == DType::f16,
             "flex_attention: dtype ", dtype_name(q.dtype()), " is not supported (expected f32, bf16 or f16)");
  KILN_CHECK(q.device() == k.device() && q.device() == v.device(), "flex_attention: q, k, v on different devices");
  KILN_CHECK(layout.kv_num_blocks.defined(), "flex_attention: the block mask is empty (not built)");
  KILN_CHECK(layout.device() == q.device(), "flex_attention: block mask on ", layout.device().str(),
             " but q on ", q.device().str());
  const int64_t B = q.size(0), Hq = q.size(1), L = q.size(2), E = q.size(3);
  const int64_t Hkv = k.size(1), S = k.size(2);
  KILN_CHECK(k.size(0) == B && v.size(0) == B, "flex_attention: batch sizes differ: q ", B, ", k ", k.size(0), ", v ",
             v.size(0));
  KILN_CHECK(v.size(1) == Hkv && v.size(2) == S, "flex_attention: k ", shape_str(k.shape()), " and v ",
             shape_str(v.shape()), " disagree on heads or length");
  KILN_CHECK(k.size(3) == E, "flex_attention: q head dim ", E, " != k head dim ", k.size(3));
  // (E = 0 had no default scale, 1/sqrt(0); Ev = 0 no lse; and the CPU kernels index empty tile rows.)
  KILN_CHECK(E >= 1 && v.size(3) >= 1, "flex_attention: head dims must be >= 1, got E=", E, " (q, k) and Ev=",
             v.size(3), " (v)");
  KILN_CHECK(Hkv >= 1, "flex_attention: k and v need at least one head, got k ", shape_str(k.shape()));
  KILN_CHECK(Hq % Hkv == 0, "flex_attention: query heads ", Hq, " must be a multiple of kv heads ", Hkv);
  KILN_CHECK(layout.q_len == L && layout.kv_len == S, "flex_attention: block mask built for L=", layout.q_len,
             ", S=", layout.kv_len, " but q has L=", L, ", k has S=", S);
  // The kernels walk num_q_blocks x num_kv_blocks tiles of q_block x kv_block: a hand-made or
  // edited layout whose counts disagree with its block sizes would leave rows unwritten.
  check_block_sizes(layout.q_block, layout.kv_block, "flex_attention: block mask");
  KILN_CHECK(layout.num_q_blocks == L / layout.q_block + (L % layout.q_block != 0) &&
                 layout.num_kv_blocks == S / layout.kv_block + (S % layout.kv_block != 0),
             "flex_attention: block mask has ", layout.num_q_blocks, " x ", layout.num_kv_blocks, " blocks of ",
             layout.q_block, " x ", layout.kv_block, ", which do not tile L=", L, ", S=", S);
  KILN_CHECK(layout.batch == 1 || layout.batch == B, "flex_attention: block mask batch ", layout.batch,
             " must be 1 or q's batch ", B);
  KILN_CHECK(layout.heads == 1 || layout.heads == Hq, "flex_attention: block mask heads ", layout.heads,
             " must be 1 or q's heads ", Hq);
  KILN_CHECK(L < (int64_t{1} << 31) && S < (int64_t{1} << 31), "flex_attention: lengths must fit int32");
  check_block_tables(layout);
}

double resolve_scale(const std::optional<double>& scale, int64_t E) {
  if (!scale) return 1.0 / std::sqrt(static_cast<double>(E));
  KILN_CHECK(std::isfinite(*scale) && std::abs(*scale) <= std::numeric_limits<float>::max(),
             "flex_attention: options.scale must be finite (in f32), got ", *scale);
  return *scale;
}

Tensor last_dim_contiguous(const Tensor& t) {
  return (t.size(3) <= 1 || t.stride(3) == 1) ? t : t.contiguous();
}

kernels::FlexParams make_params(const Tensor& q, const Tensor& k, const Tensor& v, const BlockLayout& l,
                                double scale, kernels::FlexBackend backend) {
  kernels::FlexParams p;
  p.backend = backend;
  p.B = q.size(0);
  p.Hq = q.size(1);
  p.L = q.size(2);
  p.E = q.size(3);
  p.Hkv = k.size(1);
  p.S = k.size(2);
  p.Ev = v.size(3);
  p.scale = static_cast<float>(scale);
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  for (int d = 0; d < 3; ++d) {
    p.q_st[d] = q.stride(d);
    p.k_st[d] = k.stride(d);
    p.v_st[d] = v.stride(d);
  }
  p.kv_num = l.kv_num_blocks.data<int32_t>();
  p.kv_idx = l.kv_indices.data<int32_t>();
  p.fkv_num = l.full_kv_num_blocks.data<int32_t>();
  p.fkv_idx = l.full_kv_indices.data<int32_t>();
  p.q_num = l.q_num_blocks.data<int32_t>();
  p.q_idx = l.q_indices.data<int32_t>();
  p.fq_num = l.full_q_num_blocks.data<int32_t>();
  p.fq_idx = l.full_q_indices.data<int32_t>();
  p.Bm = l.batch;
  p.Hm = l.heads;
  p.nQ = l.num_q_blocks;
  p.nKV = l.num_kv_blocks;
  p.QB = l.q_block;
  p.KB = l.kv_block;
  p.nk1 = l.kv_indices.size(3);
  p.nq1 = l.q_indices.size(3);
  return p;
}

kernels::FlexBackend resolve_backend(kernels::FlexBackend requested, Device device) {
  if (device.is_cpu()) {
    KILN_CHECK(requested == kernels::FlexBackend::automatic, "flex_attention: backend ", flex_backend_name(requested),
               " is a CUDA kernel family, but q is on the CPU (use auto)");
    return requested;
  }
  if (requested != kernels::FlexBackend::automatic) return requested;
  const char* env = std::getenv("KILN_FLEX_KERNEL");
  return env != nullptr && *env != '\0' ? parse_flex_backend(env, "KILN_FLEX_KERNEL") : requested;
}

Tensor tile_counters(kernels::FlexParams& p, int64_t n, Device device) {
  if (!device.is_cuda()) return Tensor();
  Tensor counters = Tensor::empty({n}, DType::i32, device);
  p.tile_counters = counters.data<int32_t>();
  return counters;
}

std::vector<SavedTensor> save_block_tables(const BlockLayout& l) {
  std::vector<SavedTensor> saved;
  for (const Tensor* t : {&l.kv_num_blocks, &l.kv_indices, &l.full_kv_num_blocks, &l.full_kv_indices,
                          &l.q_num_blocks, &l.q_indices, &l.full_q_num_blocks, &l.full_q_indices})
    saved.emplace_back(*t);
  return saved;
}

void check_saved_block_tables(const std::vector<SavedTensor>& saved, const BlockLayout& layout) {
  for (const SavedTensor& t : saved) t.get("flex_attention's block mask");
  check_block_tables(layout);
}

BackwardBuffers backward_buffers(kernels::FlexParams& bp, const Tensor& q, const Tensor& out, const Tensor& lse,
                                 const std::vector<Tensor>& grads, bool want_lse) {
  BackwardBuffers b;
  b.dout = grads[0].to(q.dtype()).contiguous();
  if (want_lse) b.dlse = grads[1].to(DType::f32).contiguous();
  b.delta = Tensor::empty({bp.B, bp.Hq, bp.L}, DType::f32, q.device());
  b.dq = Tensor::empty({bp.B, bp.Hq, bp.L, bp.E}, q.dtype(), q.device());
  b.dk = Tensor::empty({bp.B, bp.Hkv, bp.S, bp.E}, q.dtype(), q.device());
  b.dv = Tensor::empty({bp.B, bp.Hkv, bp.S, bp.Ev}, q.dtype(), q.device());
  bp.out = out.data_ptr();
  bp.lse = lse.data<float>();
  bp.dout = b.dout.data_ptr();
  bp.dlse = want_lse ? b.dlse.data<float>() : nullptr;
  bp.delta = b.delta.data<float>();
  bp.dq = b.dq.data_ptr();
  bp.dk = b.dk.data_ptr();
  bp.dv = b.dv.data_ptr();
  return b;
}

kernels::FlexEntry cuda_flex_entry(const KernelKey& key) {
  if (auto e = KernelRegistry::global().find(key)) return reinterpret_cast<kernels::FlexEntry>(e->fn);
  std::string have;
  for (const KernelKey& k : KernelRegistry::global().keys(key.family))
    if (k.device == key.device) have += (have.empty() ? "" : "; ") + k.mods;
  fail("flex_attention: no CUDA body for the score_mod|mask_mod pair ", key.mods, " (registered: ",
       have.empty() ? "none, this build has no CUDA kernels" : have,
       "); instantiate it with KILN_FLEX_CUDA_INSTANTIATE (docs/attention.md) or use RuntimeScoreMod / "
       "RuntimeMaskMod (docs/jit.md)");
}

}  // namespace detail

kernels::FlexBackend parse_flex_backend(const std::string& text, const std::string& what) {
  using kernels::FlexBackend;
  if (text == "auto") return FlexBackend::automatic;
  if (text == "hopper" || text == "sm90") return FlexBackend::hopper;
  if (text == "sm80") return FlexBackend::sm80;
  if (text == "simt") return FlexBackend::simt;
  fail(what, ": '", text, "' is not a FlexAttention backend (expected auto, hopper, sm80 or simt)");
}

const char* flex_backend_name(kernels::FlexBackend b) {
  switch (b) {
    case kernels::FlexBackend::automatic: return "auto";
    case kernels::FlexBackend::hopper: return "hopper";
    case kernels::FlexBackend::sm80: return "sm80";
    case kernels::FlexBackend::simt: return "simt";
  }
  return "?";
}

MaskSpec parse_mask_spec(const std::string& text, int64_t seq_len, Device device) {
  MaskSpec s;
  auto number = [&](const std::string& tail) {
    char* end = nullptr;
    errno = 0;
    long long n = std::strtoll(tail.c_str(), &end, 10);
    KILN_CHECK(!tail.empty() && end && *end == '\0' && n >= 1 && errno != ERANGE, "mask '", text,
               "': expected a positive integer after ':', got '", tail, "'", errno == ERANGE ? " (out of range)" : "");
    return static_cast<int64_t>(n);
  };
  if (text == "none") {
    s.kind = MaskSpec::Kind::none;
  } else if (text == "causal") {
    s.kind = MaskSpec::Kind::causal;
  } else if (text.rfind("window:", 0) == 0) {
    s.kind = MaskSpec::Kind::sliding_window;
    s.window = number(text.substr(7));
  } else if (text.rfind("document:", 0) == 0) {
    s.kind = MaskSpec::Kind::document;
    const int64_t n = number(text.substr(9));
    KILN_CHECK(seq_len >= 0 && seq_len < (int64_t{1} << 31), "mask '", text, "': seq_len must be in [0, 2^31), got ",
               seq_len);
    std::vector<int32_t> ids(static_cast<size_t>(seq_len));
    for (int64_t i = 0; i < seq_len; ++i) ids[static_cast<size_t>(i)] = static_cast<int32_t>(i / n);
    s.document_ids = from_vector(ids, {seq_len}, device);
  } else {
    fail("mask '", text, "' is not one of none, causal, window:W, document:N");
  }
  return s;
}

namespace {
// The CUDA instantiation files register their bodies when the program starts and nothing else
// names them: this reference keeps them in a static link (kernels/flex_files.h).
[[gnu::used]] int (*const kFlexCudaFiles)() = kernels::cuda::flex_builtin_files;
// The GPU builder: tile classes computed on the device by the registered classifier of MM,
// index lists derived from them.
template <class MM>
BlockLayout build_on_gpu(const MM& mm, int64_t L, int64_t S, int64_t bs, Device device) {
  const KernelKey key = kernels::flex_key<NoScoreMod, MM>(kernels::kFlexClassifyFamily, "cuda");
  const auto e = KernelRegistry::global().find(key);
  KILN_CHECK(e.has_value(), "create_block_mask: no GPU BlockMask builder for ", key.mods, " on ", device.str(),
             " (", kernels::cuda::flex_builtin_files() == 0 ? "kiln was built without CUDA" : "not instantiated",
             ")");
  const int64_t nq = (L + bs - 1) / bs, nk = (S + bs - 1) / bs;
  Tensor cls = Tensor::empty({1, 1, nq, nk}, DType::u8, device);
  reinterpret_cast<kernels::FlexClassifyEntry>(e->fn)(&mm, 1, 1, L, S, bs, bs, static_cast<uint8_t*>(cls.data_ptr()));
  return layout_from_class_tensor(cls, L, S, bs, bs);
}
}  // namespace

AnyBlockMask create_block_mask(const MaskSpec& spec, int64_t q_len, int64_t kv_len, Device device) {
  using K = MaskSpec::Kind;  // a kind out of range fell through every switch: an empty layout
  KILN_CHECK(spec.kind == K::none || spec.kind == K::causal || spec.kind == K::sliding_window ||
                 spec.kind == K::document,
             "create_block_mask: MaskSpec kind=", static_cast<int>(spec.kind),
             " is not one of: none, causal, sliding_window, document");
  // Before either builder divides by the block size or narrows the window to int.
  check_block_sizes(spec.block_size, spec.block_size, "create_block_mask");
  if (spec.kind == MaskSpec::Kind::sliding_window)
    KILN_CHECK(spec.window >= 1 && spec.window < (int64_t{1} << 31),
               "sliding window: window must be in [1, 2^31), got ", spec.window);
  AnyBlockMask m;
  if (device.is_cuda()) {
    m.spec = spec;
    const int64_t bs = spec.block_size;
    switch (spec.kind) {
      case MaskSpec::Kind::none: m.layout = build_on_gpu(NoMask{}, q_len, kv_len, bs, device); return m;
      case MaskSpec::Kind::causal: m.layout = build_on_gpu(Causal{}, q_len, kv_len, bs, device); return m;
      case MaskSpec::Kind::sliding_window:
        m.layout = build_on_gpu(SlidingWindow{static_cast<int>(spec.window)}, q_len, kv_len, bs, device);
        return m;
      case MaskSpec::Kind::document: break;  // below (needs the host ids as well)
    }
  }
  m.spec = spec;
  const int64_t bs = spec.block_size;
  switch (spec.kind) {
    case MaskSpec::Kind::none: m.layout = create_block_mask(NoMask{}, 1, 1, q_len, kv_len, bs, bs).layout; break;
    case MaskSpec::Kind::causal: m.layout = create_block_mask(Causal{}, 1, 1, q_len, kv_len, bs, bs).layout; break;
    case MaskSpec::Kind::sliding_window:
      m.layout = create_block_mask(SlidingWindow{static_cast<int>(spec.window)}, 1, 1, q_len, kv_len, bs, bs).layout;
      break;
    case MaskSpec::Kind::document: {
      const Tensor& ids_in = spec.document_ids;
      const int64_t need = std::max(q_len, kv_len);
      KILN_CHECK(ids_in.defined(), "document mask: document_ids is not set (expected i32 [>= ", need, "])");
      KILN_CHECK(ids_in.dim() == 1 && ids_in.size(0) >= need && is_integral(ids_in.dtype()),
                 "document mask: document_ids must be integer ids (i32) [>= ", need, "], got ",
                 dtype_name(ids_in.dtype()), " ", shape_str(ids_in.shape()));
      const Tensor host_ids = ids_in.to(kCPU);
      if (ids_in.dtype() == DType::i64) {  // narrowed to i32 below: ids past int32 would merge documents
        for (int64_t id : host_ids.to_vector<int64_t>())
          KILN_CHECK(id >= std::numeric_limits<int32_t>::min() && id <= std::numeric_limits<int32_t>::max(),
                     "document mask: document id ", id, " does not fit i32");
      }
      m.document_ids_cpu = host_ids.to(DType::i32).contiguous();
      m.spec.document_ids = ids_in.to(DType::i32).to(device).contiguous();
      const int32_t* ids = m.document_ids_cpu.data<int32_t>();
      if (device.is_cuda()) {
        const int32_t* dids = m.spec.document_ids.data<int32_t>();
        m.layout = build_on_gpu(DocumentCausal{Causal{}, Document{dids, dids}}, q_len, kv_len, bs, device);
        return m;
      }
      m.layout = create_block_mask(DocumentCausal{Causal{}, Document{ids, ids}}, 1, 1, q_len, kv_len, bs, bs).layout;
      break;
    }
  }
  if (!device.is_cpu()) m.layout = m.layout.to(device);
  return m;
}

FlexResult flex_attention(const Tensor& q, const Tensor& k, const Tensor& v, const AnyBlockMask& mask,
                          const FlexOptions& options) {
  switch (mask.spec.kind) {
    case MaskSpec::Kind::none: return flex_attention(q, k, v, NoScoreMod{}, BlockMask<NoMask>{{}, mask.layout}, options);
    case MaskSpec::Kind::causal:
      return flex_attention(q, k, v, NoScoreMod{}, BlockMask<Causal>{{}, mask.layout}, options);
    case MaskSpec::Kind::sliding_window:
      return flex_attention(q, k, v, NoScoreMod{},
                            BlockMask<SlidingWindow>{SlidingWindow{static_cast<int>(mask.spec.window)}, mask.layout},
                            options);
    case MaskSpec::Kind::document: {
      const Tensor& ids = q.device().is_cpu() ? mask.document_ids_cpu : mask.spec.document_ids;
      KILN_CHECK(ids.defined(), "flex_attention: the document mask has no ids on ", q.device().str());
      const int32_t* p = ids.data<int32_t>();
      // The backward keeps the layout; with the ids in it, a temporary mask outlives the call.
      BlockLayout layout = mask.layout;
      layout.mask_table = ids;
      return flex_attention(q, k, v, NoScoreMod{},
                            BlockMask<DocumentCausal>{DocumentCausal{Causal{}, Document{p, p}}, layout}, options);
    }
  }
  fail("flex_attention: unknown mask kind");
}

#define KILN_FLEX_INSTANTIATE(SM, MM)                                                         \
  template FlexResult flex_attention<SM, MM>(const Tensor&, const Tensor&, const Tensor&, SM, \
                                             const BlockMask<MM>&, const FlexOptions&);
KILN_FLEX_INSTANTIATE(NoScoreMod, NoMask)
KILN_FLEX_INSTANTIATE(NoScoreMod, Causal)
KILN_FLEX_INSTANTIATE(NoScoreMod, SlidingWindow)
KILN_FLEX_INSTANTIATE(NoScoreMod, DocumentCausal)
KILN_FLEX_INSTANTIATE(NoScoreMod, PrefixLM)

}  // namespace kiln::attention
