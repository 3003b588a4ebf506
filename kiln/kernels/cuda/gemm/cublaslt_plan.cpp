// Bodies of the cuBLASLt planner (kernels/cuda/cublaslt.h): the dtype map, layouts, the plan
// cache (one per process, keyed by device and PlanKey) and runs. NOTE [cuBLASLt determinism
// rule] in the header says which split-K reduction schemes a plan allows.
#include <functional>
#include <string>
#include <unordered_map>
#include <utility>

#include "kiln/core/switches.h"
#include "kiln/kernels/cuda/context.h"
#include "kiln/kernels/cuda/cublaslt.h"

namespace kiln::kernels::cuda::lt {

cudaDataType_t cuda_type(DType t, const char* op) {
  switch (t) {
    case DType::f64: return CUDA_R_64F;
    case DType::f32: return CUDA_R_32F;
    case DType::f16: return CUDA_R_16F;
    case DType::bf16: return CUDA_R_16BF;
    default: fail(op, ": dtype ", dtype_name(t), " is not supported by cuBLASLt here (expected f64, f32, f16 or bf16)");
  }
}

ComputeTypes compute_types(DType t) {
  if (t == DType::f64) return {CUBLAS_COMPUTE_64F, CUDA_R_64F};
  return {CUBLAS_COMPUTE_32F, CUDA_R_32F};
}

Layout make_layout(const char* op, cudaDataType_t type, int64_t rows, int64_t cols, int64_t ld, int64_t batch,
                   int64_t stride) {
  cublasLtMatrixLayout_t l = nullptr;
  check(cublasLtMatrixLayoutCreate(&l, type, static_cast<uint64_t>(rows), static_cast<uint64_t>(cols), ld), op,
        "cublasLtMatrixLayoutCreate");
  Layout out(l);
  if (batch > 1) {
    const int32_t count = static_cast<int32_t>(batch);
    check(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)), op,
          "batch count");
    check(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride)),
          op, "batch stride");
  }
  return out;
}

namespace {

struct KeyHash {
  size_t operator()(const std::pair<int, PlanKey>& dk) const {
    const PlanKey& k = dk.second;
    size_t h = std::hash<int>()(dk.first);
    auto mix = [&](uint64_t v) { h ^= std::hash<uint64_t>()(v) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2); };
    mix(k.ta | (k.tb << 1) | (k.no_workspace << 2) | (k.deterministic << 3));
    for (int64_t v : {k.m, k.n, k.k, k.lda, k.ldb, k.ldc, k.batch, k.stride_a, k.stride_b, k.stride_c})
      mix(static_cast<uint64_t>(v));
    for (int v : {static_cast<int>(k.at), static_cast<int>(k.bt), static_cast<int>(k.ct), static_cast<int>(k.compute),
                  static_cast<int>(k.scale), static_cast<int>(k.epilogue), static_cast<int>(k.sm_target)})
      mix(static_cast<uint64_t>(v));
    mix((uint64_t{k.align_a} << 32) ^ (uint64_t{k.align_b} << 16) ^ k.align_c);
    return h;
  }
};

// The process's plans. A cache, not state: a plan is a pure function of its key (and the
// cuBLASLt version), so who made it first does not matter.
struct PlanCache {
  std::mutex mu;
  std::unordered_map<std::pair<int, PlanKey>, std::unique_ptr<Plan>, KeyHash> plans;
};
PlanCache& plan_cache() {
  static PlanCache* c = new PlanCache;  // never destroyed: plans may be used during static destruction
  return *c;
}

std::unique_ptr<Plan> make_plan(DeviceContext& ctx, const PlanKey& s, const char* op_name) {
  auto g = std::make_unique<Plan>();
  g->key = s;
  cublasLtMatmulDesc_t op = nullptr;
  check(cublasLtMatmulDescCreate(&op, s.compute, s.scale), op_name, "cublasLtMatmulDescCreate");
  g->op.reset(op);
  const cublasOperation_t opa = s.ta ? CUBLAS_OP_T : CUBLAS_OP_N, opb = s.tb ? CUBLAS_OP_T : CUBLAS_OP_N;
  check(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof(opa)), op_name, "transa");
  check(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof(opb)), op_name, "transb");
  if (s.sm_target > 0)
    check(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, &s.sm_target, sizeof(s.sm_target)),
          op_name, "sm count target");
  if (s.epilogue != CUBLASLT_EPILOGUE_DEFAULT) {
    check(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE, &s.epilogue, sizeof(s.epilogue)), op_name,
          "epilogue");
    check(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &s.ct, sizeof(s.ct)), op_name,
          "bias data type");
  }
  g->a = make_layout(op_name, s.at, s.ta ? s.k : s.m, s.ta ? s.m : s.k, s.lda, s.batch, s.stride_a);
  g->b = make_layout(op_name, s.bt, s.tb ? s.n : s.k, s.tb ? s.k : s.n, s.ldb, s.batch, s.stride_b);
  g->c = make_layout(op_name, s.ct, s.m, s.n, s.ldc, s.batch, s.stride_c);
  cublasLtMatmulPreference_t pr = nullptr;
  check(cublasLtMatmulPreferenceCreate(&pr), op_name, "cublasLtMatmulPreferenceCreate");
  Preference pref(pr);
  const uint64_t ws = s.no_workspace ? 0 : ctx.workspace_bytes;
  check(cublasLtMatmulPreferenceSetAttribute(pr, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)), op_name,
        "workspace preference");
  const std::pair<cublasLtMatmulPreferenceAttributes_t, const uint32_t*> alignments[] = {
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &s.align_a},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &s.align_b},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &s.align_c},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &s.align_c}};
  for (const auto& [attr, value] : alignments)
    check(cublasLtMatmulPreferenceSetAttribute(pr, attr, value, sizeof(*value)), op_name, "alignment preference");
  // NOTE [cuBLASLt determinism rule] (cublaslt.h).
  uint32_t mask = CUBLASLT_REDUCTION_SCHEME_MASK;
  if (s.deterministic) mask = CUBLASLT_REDUCTION_SCHEME_NONE;
  else if (s.ct != CUDA_R_32F && s.ct != CUDA_R_64F) mask &= ~static_cast<uint32_t>(CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE);
  check(cublasLtMatmulPreferenceSetAttribute(pr, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &mask, sizeof(mask)),
        op_name, "reduction scheme mask");
  int found = 0;
  check(cublasLtMatmulAlgoGetHeuristic(ctx.cublaslt, op, g->a.get(), g->b.get(), g->c.get(), g->c.get(), pr, 1,
                                       &g->heur, &found),
        op_name, "cublasLtMatmulAlgoGetHeuristic");
  KILN_CHECK(found > 0, op_name, ": cuBLASLt found no algorithm for a ", s.m, "x", s.n, "x", s.k, " product (batch ",
             s.batch, ", column-major, transa ", s.ta, ", transb ", s.tb, ")");
  return g;
}

}  // namespace

const Plan& plan(DeviceContext& ctx, PlanKey key, const char* op) {
  key.deterministic = deterministic();
  PlanCache& c = plan_cache();
  const std::pair<int, PlanKey> dk{ctx.device, key};
  std::lock_guard<std::mutex> lock(c.mu);
  auto it = c.plans.find(dk);
  if (it != c.plans.end()) return *it->second;
  auto p = make_plan(ctx, key, op);
  const Plan& ref = *p;
  c.plans.emplace(dk, std::move(p));
  return ref;
}

void run(DeviceContext& ctx, const Plan& p, const void* alpha, const void* A, const void* B, const void* beta, void* C,
         const char* op, cudaStream_t st, const void* bias) {
  const bool ws = !p.key.no_workspace;
  cudaStream_t s = st ? st : stream(ctx.device);
  auto call = [&] {
    check(cublasLtMatmul(ctx.cublaslt, p.op.get(), alpha, A, p.a.get(), B, p.b.get(), beta, C, p.c.get(), C, p.c.get(),
                         &p.heur.algo, ws ? ctx.workspace : nullptr, ws ? ctx.workspace_bytes : 0, s),
          op, "cublasLtMatmul");
  };
  if (p.key.epilogue == CUBLASLT_EPILOGUE_DEFAULT) return call();
  KILN_CHECK(bias != nullptr, op, ": a cuBLASLt plan with a bias epilogue was run without a bias");
  std::lock_guard<std::mutex> lock(p.bias_mu);
  check(cublasLtMatmulDescSetAttribute(p.op.get(), CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)), op,
        "bias pointer");
  call();
}

void run_f32(DeviceContext& ctx, const Plan& p, float alpha, const void* A, const void* B, float beta, void* C,
             const char* op, cudaStream_t stream, const void* bias) {
  KILN_CHECK(p.key.scale == CUDA_R_32F, op, ": an f32-scaled run of a plan whose scale type is not f32");
  run(ctx, p, &alpha, A, B, &beta, C, op, stream, bias);
}

std::string describe(const Plan& p) {
  const cublasLtMatmulHeuristicResult_t& h = p.heur;
  int32_t id = 0, splitk = 0;
  uint32_t tile = 0, red = 0, swz = 0, stages = 0;
  uint16_t cluster = 0;
  size_t w = 0;
  cublasLtMatmulAlgoConfigGetAttribute(&h.algo, CUBLASLT_ALGO_CONFIG_ID, &id, sizeof(id), &w);
  cublasLtMatmulAlgoConfigGetAttribute(&h.algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof(tile), &w);
  cublasLtMatmulAlgoConfigGetAttribute(&h.algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages, sizeof(stages), &w);
  cublasLtMatmulAlgoConfigGetAttribute(&h.algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk, sizeof(splitk), &w);
  cublasLtMatmulAlgoConfigGetAttribute(&h.algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &red, sizeof(red), &w);
  cublasLtMatmulAlgoConfigGetAttribute(&h.algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, &swz, sizeof(swz), &w);
  cublasLtMatmulAlgoConfigGetAttribute(&h.algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cluster, sizeof(cluster), &w);
  return "id=" + std::to_string(id) + " tile=" + std::to_string(tile) + " stages=" + std::to_string(stages) +
         " splitk=" + std::to_string(splitk) + " red=" + std::to_string(red) + " swizzle=" + std::to_string(swz) +
         " cluster=" + std::to_string(cluster) + " waves=" + std::to_string(h.wavesCount);
}

}  // namespace kiln::kernels::cuda::lt
