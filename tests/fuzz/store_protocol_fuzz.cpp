// libFuzzer target over the store server's message handling: the input is a byte stream as a
// client would send it after authenticating, fed to the server's FrameParser in chunks (sizes
// drawn from the input's first bytes, so frames split at every boundary), each frame decoded by
// parse_request and applied to a StoreState exactly as StoreServer does. Anything but replies
// and kiln::Errors is a bug (crash, hang, unbounded allocation, sanitizer report).
// Built and run by scripts/fuzz on tests/fuzz/store_corpus/.
#include <cstddef>
#include <cstdint>
#include <string>

#include "kiln/core/error.h"
#include "kiln/dist/store.h"
#include "kiln/dist/store_protocol.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kiln::dist;
  if (size < 2) return 0;
  const size_t chunk = 1 + (data[0] % 64);
  data += 1;
  size -= 1;
  proto::FrameParser parser;
  StoreState state;
  try {
    for (size_t pos = 0; pos < size; pos += chunk) {
      const size_t n = std::min(chunk, size - pos);
      parser.feed(reinterpret_cast<const char*>(data + pos), n);
      while (auto f = parser.next()) {
        const proto::Request r = proto::parse_request(f->op, f->payload);
        if (r.op == proto::Op::auth) continue;
        auto rep = state.apply(r);
        if (rep && rep->payload.size() > proto::kMaxValueBytes + 16) __builtin_trap();
      }
      if (parser.buffered() > proto::kHeaderBytes + proto::kMaxPayloadBytes + chunk) __builtin_trap();
    }
  } catch (const kiln::Error&) {
  }
  return 0;
}
