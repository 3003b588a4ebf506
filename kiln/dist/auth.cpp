// Store authentication (auth.h) over OpenSSL's libcrypto.
#include "kiln/dist/auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include "kiln/core/error.h"

namespace kiln::dist {

std::string random_bytes(size_t n) {
  std::string out(n, '\0');
  KILN_CHECK(RAND_bytes(reinterpret_cast<unsigned char*>(out.data()), static_cast<int>(n)) == 1,
             "random_bytes: OpenSSL's RAND_bytes failed");
  return out;
}

namespace {
std::string to_hex(std::string_view raw) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string hex;
  for (unsigned char c : raw) {
    hex.push_back(kHex[c >> 4]);
    hex.push_back(kHex[c & 15]);
  }
  return hex;
}
}  // namespace

std::string random_token() { return to_hex(random_bytes(32)); }

std::string sha256_hex(std::string_view data) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  KILN_CHECK(EVP_Digest(data.data(), data.size(), md, &len, EVP_sha256(), nullptr) == 1 && len == 32,
             "sha256_hex: OpenSSL's EVP_Digest failed");
  return to_hex(std::string_view(reinterpret_cast<const char*>(md), len));
}

std::string hmac_sha256(std::string_view key, std::string_view message) {
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  const unsigned char* r = HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
                                reinterpret_cast<const unsigned char*>(message.data()), message.size(), mac, &len);
  KILN_CHECK(r != nullptr && len == 32, "hmac_sha256: OpenSSL's HMAC failed");
  return std::string(reinterpret_cast<const char*>(mac), len);
}

std::string auth_proof(std::string_view token, std::string_view nonce) {
  std::string msg = "kiln-store-v1";
  msg.append(nonce);
  return hmac_sha256(token, msg);
}

bool constant_time_equal(std::string_view a, std::string_view b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

}  // namespace kiln::dist
