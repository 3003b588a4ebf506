// Counter-based random numbers (Philox-4x32-10): element i of a draw depends only on the seed,
// the generator's offset and i, so CPU and CUDA produce the same numbers for the same state,
// whatever the thread partition.
#pragma once
#include <cstdint>

#include "kiln/core/macros.h"

namespace kiln {

struct Philox4 {
  uint32_t v[4];
};

KILN_HD Philox4 philox4x32_10(uint64_t key, uint64_t counter_lo, uint64_t counter_hi) {
  uint32_t k0 = static_cast<uint32_t>(key), k1 = static_cast<uint32_t>(key >> 32);
  uint32_t c0 = static_cast<uint32_t>(counter_lo), c1 = static_cast<uint32_t>(counter_lo >> 32);
  uint32_t c2 = static_cast<uint32_t>(counter_hi), c3 = static_cast<uint32_t>(counter_hi >> 32);
  for (int r = 0; r < 10; ++r) {
    uint64_t p0 = static_cast<uint64_t>(0xD2511F53u) * c0;
    uint64_t p1 = static_cast<uint64_t>(0xCD9E8D57u) * c2;
    uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c1 ^ k0;
    uint32_t n1 = static_cast<uint32_t>(p1);
    uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c3 ^ k1;
    uint32_t n3 = static_cast<uint32_t>(p0);
    c0 = n0; c1 = n1; c2 = n2; c3 = n3;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return {{c0, c1, c2, c3}};
}

// Uniform float in [0, 1) from 24 random bits (exact in float).
KILN_HD float uniform_from_bits(uint32_t x) { return static_cast<float>(x >> 8) * (1.0f / 16777216.0f); }
// Uniform double in [0, 1) from 53 bits.
KILN_HD double uniform53(uint32_t hi, uint32_t lo) {
  return static_cast<double>((static_cast<uint64_t>(hi) << 21) ^ (lo >> 11)) * (1.0 / 9007199254740992.0);
}

// Element `i` of a draw at `offset` with seed `seed`.
KILN_HD Philox4 philox_element(uint64_t seed, uint64_t offset, uint64_t i) { return philox4x32_10(seed, i, offset); }

// Generator: a seed and an offset (how many draws were made). Copyable state, so saving and
// restoring it (checkpoints) replays the same numbers.
struct Generator {
  uint64_t seed = 0;
  uint64_t offset = 0;
  explicit Generator(uint64_t s = 0) : seed(s) {}
  // Reserves one draw and returns its offset.
  uint64_t next_offset() { return offset++; }
};

}  // namespace kiln
