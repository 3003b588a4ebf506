// BlockLayout: the block-size check, index lists from tile classes (CPU), transposition for the
// dK/dV pass, sparsity, to_dense, device moves.
#include "kiln/attention/block_mask.h"

#include "kiln/ops/ops.h"

namespace kiln::attention {

void check_block_sizes(int64_t q_block, int64_t kv_block, const char* what) {
  KILN_CHECK(q_block >= 1 && kv_block >= 1 && q_block < (int64_t{1} << 31) && kv_block < (int64_t{1} << 31), what,
             ": block sizes must be in [1, 2^31), got ", q_block, ", ", kv_block);
}

BlockLayout layout_from_classes(const std::vector<uint8_t>& cls, int64_t batch, int64_t heads, int64_t q_len,
                                int64_t kv_len, int64_t q_block, int64_t kv_block) {
  check_block_sizes(q_block, kv_block, "layout_from_classes");
  KILN_CHECK(q_len >= 0 && kv_len >= 0, "layout_from_classes: lengths must be >= 0, got q_len=", q_len,
             " kv_len=", kv_len);
  BlockLayout l;
  l.batch = batch;
  l.heads = heads;
  l.q_len = q_len;
  l.kv_len = kv_len;
  l.q_block = q_block;
  l.kv_block = kv_block;
  const int64_t nq = (q_len + q_block - 1) / q_block, nk = (kv_len + kv_block - 1) / kv_block;
  l.num_q_blocks = nq;
  l.num_kv_blocks = nk;
  KILN_CHECK(static_cast<int64_t>(cls.size()) == batch * heads * nq * nk, "layout_from_classes: expected ",
             batch * heads * nq * nk, " classes, got ", cls.size());
  const int64_t bh = batch * heads;
  // At least one column so that index tensors are never zero-sized in the inner dim.
  const int64_t nk1 = std::max<int64_t>(nk, 1), nq1 = std::max<int64_t>(nq, 1);
  l.kv_num_blocks = zeros({batch, heads, nq}, DType::i32);
  l.full_kv_num_blocks = zeros({batch, heads, nq}, DType::i32);
  l.kv_indices = zeros({batch, heads, nq, nk1}, DType::i32);
  l.full_kv_indices = zeros({batch, heads, nq, nk1}, DType::i32);
  l.q_num_blocks = zeros({batch, heads, nk}, DType::i32);
  l.full_q_num_blocks = zeros({batch, heads, nk}, DType::i32);
  l.q_indices = zeros({batch, heads, nk, nq1}, DType::i32);
  l.full_q_indices = zeros({batch, heads, nk, nq1}, DType::i32);
  int32_t *kvn = l.kv_num_blocks.data<int32_t>(), *kvi = l.kv_indices.data<int32_t>();
  int32_t *fkvn = l.full_kv_num_blocks.data<int32_t>(), *fkvi = l.full_kv_indices.data<int32_t>();
  int32_t *qn = l.q_num_blocks.data<int32_t>(), *qi = l.q_indices.data<int32_t>();
  int32_t *fqn = l.full_q_num_blocks.data<int32_t>(), *fqi = l.full_q_indices.data<int32_t>();
  for (int64_t g = 0; g < bh; ++g) {
    for (int64_t qb = 0; qb < nq; ++qb) {
      for (int64_t kb = 0; kb < nk; ++kb) {
        const uint8_t c = cls[static_cast<size_t>((g * nq + qb) * nk + kb)];
        KILN_CHECK(c <= 2, "layout_from_classes: bad tile class ", int(c));
        if (c == static_cast<uint8_t>(BlockKind::partial)) {
          kvi[(g * nq + qb) * nk1 + kvn[g * nq + qb]++] = static_cast<int32_t>(kb);
          qi[(g * nk + kb) * nq1 + qn[g * nk + kb]++] = static_cast<int32_t>(qb);
        } else if (c == static_cast<uint8_t>(BlockKind::full)) {
          fkvi[(g * nq + qb) * nk1 + fkvn[g * nq + qb]++] = static_cast<int32_t>(kb);
          fqi[(g * nk + kb) * nq1 + fqn[g * nk + kb]++] = static_cast<int32_t>(qb);
        }
      }
    }
  }
  return l;
}

BlockLayout layout_from_class_tensor(const Tensor& classes, int64_t q_len, int64_t kv_len, int64_t q_block,
                                     int64_t kv_block) {
  KILN_CHECK(classes.dim() == 4 && classes.dtype() == DType::u8, "layout_from_class_tensor: expected u8 [Bm, Hm, nQ, nKV], got ",
             shape_str(classes.shape()));
  std::vector<uint8_t> cls = classes.to_vector<uint8_t>();
  BlockLayout l = layout_from_classes(cls, classes.size(0), classes.size(1), q_len, kv_len, q_block, kv_block);
  return classes.device().is_cpu() ? l : l.to(classes.device());
}

double BlockLayout::sparsity() const {
  const int64_t total = batch * heads * num_q_blocks * num_kv_blocks;
  if (total == 0) return 0.0;
  Tensor a = kv_num_blocks.to(kCPU), f = full_kv_num_blocks.to(kCPU);
  int64_t used = 0;
  for (int32_t v : a.to_vector<int32_t>()) used += v;
  for (int32_t v : f.to_vector<int32_t>()) used += v;
  return 1.0 - static_cast<double>(used) / static_cast<double>(total);
}

Tensor BlockLayout::to_dense() const {
  Tensor out = zeros({batch, heads, num_q_blocks, num_kv_blocks}, DType::i32);
  int32_t* o = out.data<int32_t>();
  auto kvn = kv_num_blocks.to_vector<int32_t>(), kvi = kv_indices.to_vector<int32_t>();
  auto fkvn = full_kv_num_blocks.to_vector<int32_t>(), fkvi = full_kv_indices.to_vector<int32_t>();
  const int64_t nk1 = kv_indices.size(3);
  for (int64_t r = 0; r < batch * heads * num_q_blocks; ++r) {
    for (int32_t j = 0; j < kvn[static_cast<size_t>(r)]; ++j)
      o[r * num_kv_blocks + kvi[static_cast<size_t>(r * nk1 + j)]] = 1;
    for (int32_t j = 0; j < fkvn[static_cast<size_t>(r)]; ++j)
      o[r * num_kv_blocks + fkvi[static_cast<size_t>(r * nk1 + j)]] = 2;
  }
  return out;
}

int64_t BlockLayout::nbytes() const {
  int64_t n = 0;
  for (const Tensor* t : {&kv_num_blocks, &kv_indices, &full_kv_num_blocks, &full_kv_indices, &q_num_blocks,
                          &q_indices, &full_q_num_blocks, &full_q_indices})
    n += static_cast<int64_t>(t->nbytes());
  return n;
}

BlockLayout BlockLayout::to(Device d) const {
  BlockLayout l = *this;
  for (Tensor* t : {&l.kv_num_blocks, &l.kv_indices, &l.full_kv_num_blocks, &l.full_kv_indices, &l.q_num_blocks,
                    &l.q_indices, &l.full_q_num_blocks, &l.full_q_indices})
    *t = t->to(d);
  return l;
}

}  // namespace kiln::attention
