// Authentication of store connections: random tokens and nonces (OpenSSL's RAND_bytes) and
// the proof a client sends, HMAC-SHA256(token, "kiln-store-v1" || server nonce), compared in
// constant time. The token never crosses the wire. Also a plain SHA-256 digest (split's store paths).
#pragma once
#include <string>
#include <string_view>

namespace kiln::dist {

// n bytes from the system's cryptographic generator; throws if it fails.
std::string random_bytes(size_t n);
// A fresh token: 32 random bytes as 64 lowercase hex digits (for KILN_STORE_TOKEN).
std::string random_token();
std::string hmac_sha256(std::string_view key, std::string_view message);
// SHA-256 of data as 64 lowercase hex digits.
std::string sha256_hex(std::string_view data);
// What a client proves it holds the token with, for one server nonce.
std::string auth_proof(std::string_view token, std::string_view nonce);
bool constant_time_equal(std::string_view a, std::string_view b);

}  // namespace kiln::dist
