// BlockMask: the block-sparse schedule of a FlexAttention call (PyTorch's layout).
//
// The L x S score matrix is cut into Q_BLOCK x KV_BLOCK tiles. Each tile is empty (skipped),
// partial (the mask_mod is evaluated per element) or full (the mask is skipped). Per query
// block the partial tiles are listed in kv_num_blocks / kv_indices and the full ones in
// full_kv_num_blocks / full_kv_indices, in increasing kv order; the transposed lists
// (q_num_blocks / q_indices and full_q_*) drive the dK/dV pass. All are i32 tensors:
//   kv_num_blocks [Bm, Hm, nQ], kv_indices [Bm, Hm, nQ, nKV], q_num_blocks [Bm, Hm, nKV],
//   q_indices [Bm, Hm, nKV, nQ]   (Bm in {1, B}, Hm in {1, Hq}: 1 broadcasts)
// Memory is O(number of blocks); the L x S mask is never materialised. The builder classifies
// each tile by evaluating the mask on its elements (exact for any mask_mod), on CPU here or on
// the GPU (block_mask_cuda.cu). BlockMask<M> carries the mask_mod, which the kernels call on
// partial tiles.
#pragma once
#include <cstdint>
#include <vector>

#include "kiln/attention/mods.h"
#include "kiln/core/tensor.h"
#include "kiln/kernels/flex_tiles.h"
#include "kiln/kernels/cpu/loops.h"

namespace kiln::attention {

inline constexpr int64_t kDefaultBlockSize = 128;

struct BlockLayout {
  int64_t batch = 1, heads = 1;          // Bm, Hm (1: the mask does not depend on b / h)
  int64_t q_len = 0, kv_len = 0;         // L, S
  int64_t q_block = kDefaultBlockSize, kv_block = kDefaultBlockSize;
  int64_t num_q_blocks = 0, num_kv_blocks = 0;
  Tensor kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices;
  Tensor q_num_blocks, q_indices, full_q_num_blocks, full_q_indices;
  // A table the mask_mod points into (the run-time document mask's ids), held here so that a
  // backward recorded with this layout keeps it alive; the kernels never read it.
  Tensor mask_table;

  Device device() const { return kv_num_blocks.device(); }
  // Fraction of tiles that are skipped (empty), over all (b, h) of the layout.
  double sparsity() const;
  // The tile classes [Bm, Hm, nQ, nKV] (i32: 0 empty, 1 partial, 2 full), for debugging.
  Tensor to_dense() const;
  // Bytes held by the index tensors.
  int64_t nbytes() const;
  // The same layout on another device.
  BlockLayout to(Device device) const;
};

// Block sizes a layout may have: [1, 2^31) (the kernels' tile indices are 32-bit); an error
// names `what` and the sizes. Every builder checks them before dividing by them.
void check_block_sizes(int64_t q_block, int64_t kv_block, const char* what);
// Builds the layout from tile classes [Bm * Hm * nQ * nKV] (row-major), on CPU.
BlockLayout layout_from_classes(const std::vector<uint8_t>& classes, int64_t batch, int64_t heads, int64_t q_len,
                                int64_t kv_len, int64_t q_block, int64_t kv_block);
// Same, from classes held in a (CPU or CUDA) u8 tensor [Bm, Hm, nQ, nKV]; result on that device.
BlockLayout layout_from_class_tensor(const Tensor& classes, int64_t q_len, int64_t kv_len, int64_t q_block,
                                     int64_t kv_block);

template <MaskMod M>
struct BlockMask {
  M mask_mod{};
  BlockLayout layout;
  double sparsity() const { return layout.sparsity(); }
  Tensor to_dense() const { return layout.to_dense(); }
  // The element mask [Bm, Hm, L, S] (bool, CPU), evaluated from the mask_mod: O(L*S), debugging
  // and tests only (host-callable mask_mods with host pointers).
  Tensor materialize() const;
};

namespace detail {
// The library's mask mods that point to tables: a null pointer fails here, naming the mod,
// instead of crashing in a kernel (the tables' lengths cannot be checked: raw pointers).
template <class M> void check_mask_mod(const M&) {}
template <class A, class B> void check_mask_mod(const AndMask<A, B>& m);
template <class A, class B> void check_mask_mod(const OrMask<A, B>& m);
inline void check_mask_mod(const Document& m) {
  KILN_CHECK(m.q_doc != nullptr && m.kv_doc != nullptr,
             "Document mask: q_doc and kv_doc must point to the per-token document ids, got a null pointer");
}
template <class A, class B> void check_mask_mod(const AndMask<A, B>& m) { check_mask_mod(m.a), check_mask_mod(m.b); }
template <class A, class B> void check_mask_mod(const OrMask<A, B>& m) { check_mask_mod(m.a), check_mask_mod(m.b); }
}  // namespace detail

// Builds a BlockMask on the CPU (host pointers in the mask_mod). batch / heads: 1 when the
// mask does not depend on b / h (broadcast), else B / Hq.
template <MaskMod M>
BlockMask<M> create_block_mask(M mask_mod, int64_t batch, int64_t heads, int64_t q_len, int64_t kv_len,
                               int64_t q_block = kDefaultBlockSize, int64_t kv_block = kDefaultBlockSize) {
  KILN_CHECK(batch >= 1 && heads >= 1 && q_len >= 0 && kv_len >= 0, "create_block_mask: bad sizes batch=", batch,
             " heads=", heads, " q_len=", q_len, " kv_len=", kv_len);
  check_block_sizes(q_block, kv_block, "create_block_mask");
  KILN_CHECK(q_len < (int64_t{1} << 31) && kv_len < (int64_t{1} << 31), "create_block_mask: lengths must fit int32");
  detail::check_mask_mod(mask_mod);
  const int64_t nq = (q_len + q_block - 1) / q_block, nk = (kv_len + kv_block - 1) / kv_block;
  shape_numel({batch, heads, nq, nk});  // an error naming the shape where the product overflows (it was UB here)
  std::vector<uint8_t> cls(static_cast<size_t>(batch * heads * nq * nk));
  kernels::cpu::parallel_for(batch * heads * nq, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t qb = r % nq, h = (r / nq) % heads, b = r / (nq * heads);
      const int64_t q0 = qb * q_block, q1 = std::min(q_len, q0 + q_block);
      for (int64_t kb = 0; kb < nk; ++kb) {
        const int64_t k0 = kb * kv_block, k1 = std::min(kv_len, k0 + kv_block);
        cls[static_cast<size_t>(r * nk + kb)] =
            static_cast<uint8_t>(classify_tile(mask_mod, static_cast<int>(b), static_cast<int>(h), q0, q1, k0, k1));
      }
    }
  });
  return BlockMask<M>{mask_mod, layout_from_classes(cls, batch, heads, q_len, kv_len, q_block, kv_block)};
}

template <MaskMod M>
Tensor BlockMask<M>::materialize() const {
  const BlockLayout& l = layout;
  Tensor out = Tensor::empty({l.batch, l.heads, l.q_len, l.kv_len}, DType::boolean);
  bool* p = out.data<bool>();
  for (int64_t b = 0; b < l.batch; ++b)
    for (int64_t h = 0; h < l.heads; ++h)
      for (int64_t q = 0; q < l.q_len; ++q)
        for (int64_t k = 0; k < l.kv_len; ++k)
          *p++ = mask_mod(static_cast<int>(b), static_cast<int>(h), static_cast<int>(q), static_cast<int>(k));
  return out;
}

}  // namespace kiln::attention
