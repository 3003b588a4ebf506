// SHA-256 digests for the JIT cache's keys and entry checks (OpenSSL's libcrypto, which kiln
// links for the store's HMAC as well).
#pragma once
#include <string>
#include <string_view>

namespace kiln::jit {

// The digest of `data` as 64 lowercase hex digits.
std::string sha256_hex(std::string_view data);

// Feeds fields one by one; each is length-prefixed, so ("ab", "c") and ("a", "bc") differ.
class Sha256 {
 public:
  Sha256();
  ~Sha256();
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;
  Sha256& field(std::string_view name, std::string_view value);
  std::string hex();  // once

 private:
  void* ctx_;
};

}  // namespace kiln::jit
