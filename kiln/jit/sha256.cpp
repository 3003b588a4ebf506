// SHA-256 through OpenSSL's EVP interface.
#include "kiln/jit/sha256.h"

#include <openssl/evp.h>

#include "kiln/core/error.h"

namespace kiln::jit {
namespace {
std::string to_hex(const unsigned char* d, unsigned n) {
  static const char* digits = "0123456789abcdef";
  std::string out(2 * n, '0');
  for (unsigned i = 0; i < n; ++i) out[2 * i] = digits[d[i] >> 4], out[2 * i + 1] = digits[d[i] & 15];
  return out;
}
}  // namespace

std::string sha256_hex(std::string_view data) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned n = 0;
  KILN_CHECK(EVP_Digest(data.data(), data.size(), md, &n, EVP_sha256(), nullptr) == 1, "sha256: EVP_Digest failed");
  return to_hex(md, n);
}

Sha256::Sha256() : ctx_(EVP_MD_CTX_new()) {
  KILN_CHECK(ctx_ != nullptr && EVP_DigestInit_ex(static_cast<EVP_MD_CTX*>(ctx_), EVP_sha256(), nullptr) == 1,
             "sha256: EVP_DigestInit_ex failed");
}
Sha256::~Sha256() { EVP_MD_CTX_free(static_cast<EVP_MD_CTX*>(ctx_)); }

Sha256& Sha256::field(std::string_view name, std::string_view value) {
  const std::string head = std::string(name) + ":" + std::to_string(value.size()) + ":";
  auto* c = static_cast<EVP_MD_CTX*>(ctx_);
  KILN_CHECK(EVP_DigestUpdate(c, head.data(), head.size()) == 1 && EVP_DigestUpdate(c, value.data(), value.size()) == 1,
             "sha256: EVP_DigestUpdate failed");
  return *this;
}

std::string Sha256::hex() {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned n = 0;
  KILN_CHECK(EVP_DigestFinal_ex(static_cast<EVP_MD_CTX*>(ctx_), md, &n) == 1, "sha256: EVP_DigestFinal_ex failed");
  return to_hex(md, n);
}

}  // namespace kiln::jit
