// The store (store.h): PrefixStore, StoreState, the poll()-driven StoreServer and the TcpStore
// client. The server refuses a connection that does not authenticate (auth.h) within
// auth_timeout, answers a malformed frame with an error frame and closes only that
// connection, and parks a wait until its keys are set or its deadline passes.
#include "kiln/dist/store.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <thread>

#include "kiln/dist/auth.h"

namespace kiln::dist {

using Clock = std::chrono::steady_clock;
using proto::Op;
using proto::Request;

// ---------------------------------------------------------------- PrefixStore

PrefixStore::PrefixStore(std::string prefix, std::shared_ptr<Store> base)
    : prefix_(std::move(prefix)), base_(std::move(base)) {
  KILN_CHECK(base_ != nullptr, "PrefixStore: base store is null");
  timeout_ = base_->timeout();
}
void PrefixStore::set(const std::string& key, const std::string& value) { base_->set(k(key), value); }
std::string PrefixStore::get(const std::string& key) {
  base_->wait({k(key)}, timeout_);
  return base_->get(k(key));
}
std::optional<std::string> PrefixStore::try_get(const std::string& key) { return base_->try_get(k(key)); }
int64_t PrefixStore::add(const std::string& key, int64_t delta) { return base_->add(k(key), delta); }
std::string PrefixStore::compare_set(const std::string& key, const std::string& expected, const std::string& desired) {
  return base_->compare_set(k(key), expected, desired);
}
void PrefixStore::wait(const std::vector<std::string>& keys, Millis timeout) {
  std::vector<std::string> full;
  for (const auto& key : keys) full.push_back(k(key));
  base_->wait(full, timeout);
}
bool PrefixStore::check(const std::vector<std::string>& keys) {
  std::vector<std::string> full;
  for (const auto& key : keys) full.push_back(k(key));
  return base_->check(full);
}
bool PrefixStore::delete_key(const std::string& key) { return base_->delete_key(k(key)); }
int64_t PrefixStore::num_keys() { return base_->num_keys(); }

// ---------------------------------------------------------------- StoreState

bool StoreState::has_all(const std::vector<std::string>& keys) const {
  return std::all_of(keys.begin(), keys.end(), [&](const std::string& key) { return kv_.count(key) > 0; });
}

std::optional<StoreState::Reply> StoreState::apply(const Request& r) {
  Reply out;
  switch (r.op) {
    case Op::set: kv_[r.key] = r.value; break;
    case Op::get: {
      auto it = kv_.find(r.key);
      if (it == kv_.end()) out.op = Op::not_found;
      else out.payload = it->second;
      break;
    }
    case Op::add: {
      int64_t v = 0;
      auto it = kv_.find(r.key);
      if (it != kv_.end()) {
        const std::string& s = it->second;
        auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
        if (ec != std::errc() || p != s.data() + s.size()) {
          out.op = Op::error;
          out.payload = "add: key '" + r.key + "' holds a value that is not an integer";
          return out;
        }
      }
      if ((r.number > 0 && v > INT64_MAX - r.number) || (r.number < 0 && v < INT64_MIN - r.number)) {
        out.op = Op::error;
        out.payload = "add: key '" + r.key + "' would overflow a 64-bit integer";
        return out;
      }
      v += r.number;
      kv_[r.key] = std::to_string(v);
      proto::put_i64(out.payload, v);
      break;
    }
    case Op::compare_set: {
      auto it = kv_.find(r.key);
      if (it == kv_.end()) {
        if (r.value.empty()) {
          kv_[r.key] = r.desired;
          out.payload = r.desired;
        } else {
          out.payload = r.value;
        }
      } else if (it->second == r.value) {
        it->second = r.desired;
        out.payload = r.desired;
      } else {
        out.payload = it->second;
      }
      break;
    }
    case Op::wait:
      if (!has_all(r.keys)) return std::nullopt;
      break;
    case Op::check: out.payload = has_all(r.keys) ? "\1" : std::string(1, '\0'); break;
    case Op::delete_key: out.payload = kv_.erase(r.key) ? "\1" : std::string(1, '\0'); break;
    case Op::num_keys: proto::put_i64(out.payload, static_cast<int64_t>(kv_.size())); break;
    case Op::ping: break;
    default: out.op = Op::error; out.payload = std::string("unexpected request ") + proto::op_name(r.op);
  }
  return out;
}

// ---------------------------------------------------------------- StoreServer

namespace {

std::string peer_name(const sockaddr_storage& a) {
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (a.ss_family == AF_INET) {
    const auto* s = reinterpret_cast<const sockaddr_in*>(&a);
    inet_ntop(AF_INET, &s->sin_addr, host, sizeof host);
    port = ntohs(s->sin_port);
  } else if (a.ss_family == AF_INET6) {
    const auto* s = reinterpret_cast<const sockaddr_in6*>(&a);
    inet_ntop(AF_INET6, &s->sin6_addr, host, sizeof host);
    port = ntohs(s->sin6_port);
  }
  return std::string(host) + ":" + std::to_string(port);
}

void set_nonblocking(int fd) { fcntl(fd, F_SETFL, fcntl(fd, F_GETFL, 0) | O_NONBLOCK); }

// Resolves host:port (numeric or a name) to the first IPv4/IPv6 address.
sockaddr_storage resolve(const std::string& host, int port, socklen_t* len, const char* what) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const std::string service = std::to_string(port);
  const int rc = getaddrinfo(host.c_str(), service.c_str(), &hints, &res);
  KILN_CHECK(rc == 0 && res != nullptr, what, ": cannot resolve host '", host, "': ", gai_strerror(rc));
  sockaddr_storage out{};
  std::memcpy(&out, res->ai_addr, res->ai_addrlen);
  *len = res->ai_addrlen;
  freeaddrinfo(res);
  return out;
}

}  // namespace

struct StoreServer::Impl {
  struct Conn {
    int fd = -1;
    std::string peer;
    bool authed = false;
    std::string nonce;
    proto::FrameParser parser;
    std::string out;
    size_t out_pos = 0;
    bool closing = false;  // close once `out` is flushed
    bool dead = false;
    std::optional<Request> parked;
    Clock::time_point deadline;  // of the parked wait, or of authentication
  };

  StoreServerOptions opt;
  int listen_fd = -1;
  int wake[2] = {-1, -1};
  int port = 0;
  std::thread thread;
  std::atomic<bool> stopping{false};
  std::mutex mu;  // guards state against clear() from another thread
  StoreState state;
  std::vector<std::unique_ptr<Conn>> conns;
  std::atomic<int64_t> refused{0}, errors{0};

  void log(const std::string& msg) {
    if (!opt.quiet) std::fprintf(stderr, "kiln store: %s\n", msg.c_str());
  }

  void reply(Conn& c, Op op, std::string_view payload) { proto::append_frame(c.out, op, payload); }

  void refuse(Conn& c, const std::string& why) {
    ++refused;
    log("refused the connection from " + c.peer + ": " + why);
    reply(c, Op::error, "authentication failed: " + why);
    c.closing = true;
  }

  void handle_frame(Conn& c, proto::FrameParser::Frame& f) {
    if (!c.authed) {
      if (f.op != Op::auth) return refuse(c, std::string("sent '") + proto::op_name(f.op) + "' before authenticating");
      const Request r = proto::parse_request(Op::auth, f.payload);
      if (!constant_time_equal(r.mac, auth_proof(opt.token, c.nonce)))
        return refuse(c, "wrong token (KILN_STORE_TOKEN differs from the launcher's)");
      c.authed = true;
      reply(c, Op::ok, {});
      return;
    }
    Request r = proto::parse_request(f.op, f.payload);
    KILN_CHECK(r.op != Op::auth, "store protocol: authenticated twice");
    std::lock_guard<std::mutex> lock(mu);
    auto rep = state.apply(r);
    if (rep) {
      reply(c, rep->op, rep->payload);
    } else {
      c.deadline = Clock::now() + Millis(std::min<int64_t>(r.number, int64_t{1} << 40));
      c.parked = std::move(r);
    }
  }

  void on_readable(Conn& c) {
    char buf[65536];
    const ssize_t n = recv(c.fd, buf, sizeof buf, 0);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
      c.dead = true;  // the client went away (maybe mid-request): drop only it
      return;
    }
    if (n < 0) return;
    c.parser.feed(buf, static_cast<size_t>(n));
    process(c);
  }

  void process(Conn& c) {
    try {
      while (!c.closing && !c.parked) {
        auto f = c.parser.next();
        if (!f) break;
        handle_frame(c, *f);
      }
      KILN_CHECK(c.parser.buffered() <= proto::kHeaderBytes + proto::kMaxPayloadBytes + sizeof(char) * 65536,
                 "store protocol: client sent more than one frame while waiting");
    } catch (const Error& e) {
      ++errors;
      log("closed the connection from " + c.peer + ": " + e.what());
      reply(c, Op::error, e.what());
      c.closing = true;
    }
  }

  void on_writable(Conn& c) {
    while (c.out_pos < c.out.size()) {
      const ssize_t n = send(c.fd, c.out.data() + c.out_pos, c.out.size() - c.out_pos, MSG_NOSIGNAL);
      if (n < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return;
        c.dead = true;
        return;
      }
      c.out_pos += static_cast<size_t>(n);
    }
    c.out.clear();
    c.out_pos = 0;
    if (c.closing) c.dead = true;
  }

  void accept_one() {
    sockaddr_storage addr{};
    socklen_t len = sizeof addr;
    const int fd = accept(listen_fd, reinterpret_cast<sockaddr*>(&addr), &len);
    if (fd < 0) return;
    if (static_cast<int>(conns.size()) >= opt.max_connections) {
      ++refused;
      log("refused the connection from " + peer_name(addr) + ": too many connections");
      close(fd);
      return;
    }
    set_nonblocking(fd);
    const int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    auto c = std::make_unique<Conn>();
    c->fd = fd;
    c->peer = peer_name(addr);
    c->nonce = random_bytes(proto::kNonceBytes);
    c->deadline = Clock::now() + opt.auth_timeout;
    reply(*c, Op::nonce, c->nonce);
    conns.push_back(std::move(c));
  }

  void check_deadlines() {
    const auto now = Clock::now();
    std::lock_guard<std::mutex> lock(mu);
    for (auto& c : conns) {
      if (c->dead) continue;
      if (!c->authed && !c->closing && now >= c->deadline) {
        refuse(*c, "did not authenticate within the deadline");
        continue;
      }
      if (c->parked) {
        if (state.has_all(c->parked->keys)) {
          reply(*c, Op::ok, {});
          c->parked.reset();
        } else if (now >= c->deadline) {
          reply(*c, Op::timeout, {});
          c->parked.reset();
        }
      }
    }
  }

  void loop() {
    std::vector<pollfd> fds;
    while (!stopping) {
      fds.clear();
      fds.push_back({wake[0], POLLIN, 0});
      fds.push_back({listen_fd, POLLIN, 0});
      auto next = Clock::now() + Millis(100);
      for (auto& c : conns) {
        short ev = POLLIN;
        if (c->out_pos < c->out.size()) ev |= POLLOUT;
        fds.push_back({c->fd, ev, 0});
        if (c->parked || !c->authed) next = std::min(next, c->deadline);
      }
      const auto wait_ms = std::chrono::duration_cast<Millis>(next - Clock::now()).count();
      const int rc = poll(fds.data(), fds.size(), static_cast<int>(std::clamp<int64_t>(wait_ms, 0, 100)));
      if (rc < 0 && errno != EINTR) break;
      if (fds[0].revents & POLLIN) break;
      const size_t n_before = conns.size();
      for (size_t i = 0; i < n_before; ++i) {
        Conn& c = *conns[i];
        const short re = fds[i + 2].revents;
        if (re & (POLLIN | POLLHUP | POLLERR)) on_readable(c);
        if (!c.dead && (re & POLLOUT)) on_writable(c);
      }
      if (fds[1].revents & POLLIN) accept_one();
      check_deadlines();
      for (auto& c : conns)  // replies that became due (woken waits) go out now
        if (!c->dead && c->out_pos < c->out.size()) on_writable(*c);
      // Parked waits that finished may have pipelined frames behind them.
      for (auto& c : conns)
        if (!c->dead && !c->parked && c->parser.buffered() > 0) process(*c);
      conns.erase(std::remove_if(conns.begin(), conns.end(),
                                 [](const std::unique_ptr<Conn>& c) {
                                   if (c->dead) close(c->fd);
                                   return c->dead;
                                 }),
                  conns.end());
    }
    for (auto& c : conns) close(c->fd);
    conns.clear();
  }
};

StoreServer::StoreServer(StoreServerOptions options) : impl_(std::make_unique<Impl>()) {
  KILN_CHECK(!options.token.empty(), "StoreServer: the token is empty (every store needs one)");
  KILN_CHECK(options.port >= 0 && options.port <= 65535, "StoreServer: port ", options.port,
             " out of range [0, 65535]");
  impl_->opt = std::move(options);
  socklen_t len = 0;
  sockaddr_storage addr = resolve(impl_->opt.host, impl_->opt.port, &len, "StoreServer");
  const int fd = socket(addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  KILN_CHECK(fd >= 0, "StoreServer: socket: ", std::strerror(errno));
  const int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), len) != 0 || listen(fd, 1024) != 0) {
    const int e = errno;
    close(fd);
    fail("StoreServer: cannot listen on ", impl_->opt.host, ":", impl_->opt.port, ": ", std::strerror(e),
         e == EADDRINUSE ? " (pick another --master-port, or 0 for a free one)" : "");
  }
  sockaddr_storage bound{};
  socklen_t blen = sizeof bound;
  getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &blen);
  impl_->port = ntohs(bound.ss_family == AF_INET ? reinterpret_cast<sockaddr_in*>(&bound)->sin_port
                                                 : reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port);
  set_nonblocking(fd);
  impl_->listen_fd = fd;
  KILN_CHECK(pipe2(impl_->wake, O_CLOEXEC | O_NONBLOCK) == 0, "StoreServer: pipe: ", std::strerror(errno));
  impl_->thread = std::thread([this] { impl_->loop(); });
}

StoreServer::~StoreServer() { stop(); }

void StoreServer::stop() {
  if (!impl_ || impl_->listen_fd < 0) return;
  impl_->stopping = true;
  const char b = 1;
  [[maybe_unused]] ssize_t w = write(impl_->wake[1], &b, 1);
  if (impl_->thread.joinable()) impl_->thread.join();
  close(impl_->listen_fd);
  close(impl_->wake[0]);
  close(impl_->wake[1]);
  impl_->listen_fd = -1;
}

int StoreServer::port() const { return impl_->port; }
void StoreServer::clear() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->state.clear();
}
int64_t StoreServer::refused_connections() const { return impl_->refused; }
int64_t StoreServer::protocol_errors() const { return impl_->errors; }

// ---------------------------------------------------------------- TcpStore

namespace {
int64_t ms_left(Clock::time_point deadline) {
  return std::max<int64_t>(0, std::chrono::duration_cast<Millis>(deadline - Clock::now()).count());
}
}  // namespace

TcpStore::TcpStore(const std::string& host, int port, const std::string& token, Millis connect_timeout) {
  where_ = host + ":" + std::to_string(port);
  KILN_CHECK(!token.empty(), "TcpStore: empty token for the store at ", where_,
             " (set KILN_STORE_TOKEN to the launcher's token)");
  socklen_t len = 0;
  const sockaddr_storage addr = resolve(host, port, &len, "TcpStore");
  const auto deadline = Clock::now() + connect_timeout;
  std::string last_error;
  for (int attempt = 0;; ++attempt) {
    fd_ = socket(addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    KILN_CHECK(fd_ >= 0, "TcpStore: socket: ", std::strerror(errno));
    if (connect(fd_, reinterpret_cast<const sockaddr*>(&addr), len) == 0) break;
    last_error = std::strerror(errno);
    close(fd_);
    fd_ = -1;
    if (Clock::now() >= deadline)
      fail("TcpStore: cannot connect to the store at ", where_, " within ", connect_timeout.count(), " ms: ",
           last_error, " (is the launcher or rank 0 running, and MASTER_ADDR / MASTER_PORT right?)");
    std::this_thread::sleep_for(Millis(std::min(50 * (attempt + 1), 500)));
  }
  const int one = 1;
  setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  try {
    const auto nonce = read_frame(connect_timeout);
    KILN_CHECK(nonce.op == Op::nonce && nonce.payload.size() == proto::kNonceBytes, "TcpStore: the peer at ",
               where_, " did not greet as a kiln store");
    Request auth;
    auth.op = Op::auth;
    auth.mac = auth_proof(token, nonce.payload);
    send_all(proto::encode_request(auth), connect_timeout);
    const auto ok = read_frame(connect_timeout);
    KILN_CHECK(ok.op == Op::ok, "TcpStore: the store at ", where_, " refused this rank: ", ok.payload);
  } catch (...) {
    close(fd_);
    fd_ = -1;
    throw;
  }
}

TcpStore::~TcpStore() {
  if (fd_ >= 0) close(fd_);
}

void TcpStore::send_all(const std::string& bytes, Millis timeout) {
  const auto deadline = Clock::now() + timeout;
  size_t pos = 0;
  while (pos < bytes.size()) {
    pollfd p{fd_, POLLOUT, 0};
    const int rc = poll(&p, 1, static_cast<int>(std::min<int64_t>(ms_left(deadline), 1000)));
    if (rc < 0 && errno == EINTR) continue;
    KILN_CHECK(Clock::now() < deadline || rc > 0, "TcpStore: sending to the store at ", where_, " timed out");
    if (rc == 0) continue;
    const ssize_t n = send(fd_, bytes.data() + pos, bytes.size() - pos, MSG_NOSIGNAL);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
    KILN_CHECK(n > 0, "TcpStore: the connection to the store at ", where_, " broke: ", std::strerror(errno));
    pos += static_cast<size_t>(n);
  }
}

StoreState::Reply TcpStore::read_frame(Millis timeout) {
  const auto deadline = Clock::now() + timeout;
  auto read_exact = [&](char* dst, size_t n) {
    size_t got = 0;
    while (got < n) {
      pollfd p{fd_, POLLIN, 0};
      const int rc = poll(&p, 1, static_cast<int>(std::min<int64_t>(ms_left(deadline), 1000)));
      if (rc < 0 && errno == EINTR) continue;
      if (rc == 0) {
        KILN_CHECK(Clock::now() < deadline, "TcpStore: no reply from the store at ", where_, " within ",
                   timeout.count(), " ms");
        continue;
      }
      const ssize_t r = recv(fd_, dst + got, n - got, 0);
      if (r < 0 && (errno == EAGAIN || errno == EINTR)) continue;
      KILN_CHECK(r > 0, "TcpStore: the store at ", where_, " closed the connection",
                 r < 0 ? std::string(": ") + std::strerror(errno) : std::string(" (did the launcher exit?)"));
      got += static_cast<size_t>(r);
    }
  };
  uint8_t h[proto::kHeaderBytes];
  read_exact(reinterpret_cast<char*>(h), sizeof h);
  const proto::Header hdr = proto::parse_header(h);
  StoreState::Reply rep;
  rep.op = hdr.op;
  rep.payload.resize(hdr.length);
  read_exact(rep.payload.data(), hdr.length);
  return rep;
}

StoreState::Reply TcpStore::call(const Request& r, Millis deadline_after) {
  std::lock_guard<std::mutex> lock(mu_);
  KILN_CHECK(fd_ >= 0, "TcpStore: the connection to ", where_, " is closed");
  try {
    send_all(proto::encode_request(r), deadline_after);
    auto rep = read_frame(deadline_after);
    KILN_CHECK(rep.op != Op::error, "TcpStore: the store at ", where_, " refused ", proto::op_name(r.op), ": ",
               rep.payload);
    return rep;
  } catch (...) {
    // A broken or desynchronised connection is not reused.
    close(fd_);
    fd_ = -1;
    throw;
  }
}

namespace {
constexpr Millis kCallSlack{std::chrono::seconds(30)};
Request make(Op op, std::string key = {}) {
  Request r;
  r.op = op;
  r.key = std::move(key);
  return r;
}
void check_key(const std::string& key) {
  KILN_CHECK(key.size() <= proto::kMaxKeyBytes, "store: key of ", key.size(), " bytes exceeds the bound ",
             proto::kMaxKeyBytes);
}
void check_value(const std::string& v, const char* what) {
  KILN_CHECK(v.size() <= proto::kMaxValueBytes, "store: ", what, " of ", v.size(), " bytes exceeds the bound ",
             proto::kMaxValueBytes);
}
}  // namespace

void TcpStore::set(const std::string& key, const std::string& value) {
  check_key(key);
  check_value(value, "value");
  Request r = make(Op::set, key);
  r.value = value;
  call(r, kCallSlack);
}

std::optional<std::string> TcpStore::try_get(const std::string& key) {
  check_key(key);
  auto rep = call(make(Op::get, key), kCallSlack);
  if (rep.op == Op::not_found) return std::nullopt;
  return std::move(rep.payload);
}

std::string TcpStore::get(const std::string& key) {
  wait({key}, timeout_);
  auto v = try_get(key);
  KILN_CHECK(v.has_value(), "TcpStore: key '", key, "' was deleted while being read");
  return *v;
}

int64_t TcpStore::add(const std::string& key, int64_t delta) {
  check_key(key);
  Request r = make(Op::add, key);
  r.number = delta;
  auto rep = call(r, kCallSlack);
  proto::Reader in(rep.payload);
  return in.i64();
}

std::string TcpStore::compare_set(const std::string& key, const std::string& expected, const std::string& desired) {
  check_key(key);
  check_value(expected, "expected value");
  check_value(desired, "desired value");
  Request r = make(Op::compare_set, key);
  r.value = expected;
  r.desired = desired;
  return call(r, kCallSlack).payload;
}

void TcpStore::wait(const std::vector<std::string>& keys, Millis timeout) {
  KILN_CHECK(!keys.empty() && keys.size() <= proto::kMaxKeys, "store: wait on ", keys.size(),
             " keys (expected 1 to ", proto::kMaxKeys, ")");
  for (const auto& k : keys) check_key(k);
  Request r = make(Op::wait);
  r.keys = keys;
  r.number = std::max<int64_t>(0, timeout.count());
  auto rep = call(r, timeout + kCallSlack);
  if (rep.op == Op::timeout) {
    std::string missing;
    int shown = 0;
    for (const auto& k : keys) {
      if (check({k})) continue;
      if (shown++ < 8) missing += (missing.empty() ? "'" : ", '") + k + "'";
    }
    throw StoreTimeout(detail::str_cat("store: wait timed out after ", timeout.count(), " ms; keys not set: ",
                                       missing.empty() ? std::string("(set just now)") : missing));
  }
}

bool TcpStore::check(const std::vector<std::string>& keys) {
  KILN_CHECK(!keys.empty() && keys.size() <= proto::kMaxKeys, "store: check on ", keys.size(),
             " keys (expected 1 to ", proto::kMaxKeys, ")");
  Request r = make(Op::check);
  r.keys = keys;
  return call(r, kCallSlack).payload == "\1";
}

bool TcpStore::delete_key(const std::string& key) {
  check_key(key);
  return call(make(Op::delete_key, key), kCallSlack).payload == "\1";
}

int64_t TcpStore::num_keys() {
  auto rep = call(make(Op::num_keys), kCallSlack);
  proto::Reader in(rep.payload);
  return in.i64();
}

void TcpStore::ping() { call(make(Op::ping), kCallSlack); }

}  // namespace kiln::dist
