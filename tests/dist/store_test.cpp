// The store: every client operation, concurrent clients, a dying client, waits with deadlines,
// authentication (wrong or missing token refused and logged), and every kind of malformed,
// oversized or truncated frame refused with an error while the server keeps serving; and the
// store paths split communicators meet under.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include "kiln/dist/auth.h"
#include "kiln/dist/communicator.h"
#include "kiln/dist/store.h"

using namespace kiln::dist;
using namespace std::chrono_literals;

namespace {

StoreServerOptions quiet_server(const std::string& token) {
  StoreServerOptions o;
  o.token = token;
  o.quiet = true;
  return o;
}

int raw_connect(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  return fd;
}

// Reads one frame (header + payload) with a deadline; returns op or -1 on close / timeout.
int read_frame(int fd, std::string* payload, int timeout_ms = 3000) {
  std::string buf;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (true) {
    if (buf.size() >= proto::kHeaderBytes) {
      const auto h = proto::parse_header(reinterpret_cast<const uint8_t*>(buf.data()));
      if (buf.size() >= proto::kHeaderBytes + h.length) {
        if (payload) *payload = buf.substr(proto::kHeaderBytes, h.length);
        return static_cast<int>(h.op);
      }
    }
    pollfd p{fd, POLLIN, 0};
    if (std::chrono::steady_clock::now() > deadline || poll(&p, 1, 100) < 0) return -1;
    if (!(p.revents & (POLLIN | POLLHUP))) continue;
    char tmp[4096];
    const ssize_t n = recv(fd, tmp, sizeof tmp, 0);
    if (n <= 0) return -1;
    buf.append(tmp, static_cast<size_t>(n));
  }
}

// A raw connection that has authenticated.
int authed_raw(int port, const std::string& token) {
  const int fd = raw_connect(port);
  std::string nonce;
  EXPECT_EQ(read_frame(fd, &nonce), static_cast<int>(proto::Op::nonce));
  proto::Request auth;
  auth.op = proto::Op::auth;
  auth.mac = auth_proof(token, nonce);
  const std::string bytes = proto::encode_request(auth);
  EXPECT_EQ(send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL), static_cast<ssize_t>(bytes.size()));
  EXPECT_EQ(read_frame(fd, nullptr), static_cast<int>(proto::Op::ok));
  return fd;
}

}  // namespace

TEST(Store, EveryOperation) {
  StoreServer server(quiet_server("secret"));
  TcpStore s("127.0.0.1", server.port(), "secret", 5s);
  s.set("a", std::string("x\0y", 3));
  EXPECT_EQ(s.get("a"), std::string("x\0y", 3));
  EXPECT_EQ(s.try_get("missing"), std::nullopt);
  EXPECT_EQ(s.add("n", 5), 5);
  EXPECT_EQ(s.add("n", -7), -2);
  EXPECT_THROW(s.add("a", 1), kiln::Error);  // not an integer
  TcpStore s2("127.0.0.1", server.port(), "secret", 5s);  // the failed call closed s's connection
  EXPECT_EQ(s2.compare_set("c", "", "first"), "first");
  EXPECT_EQ(s2.compare_set("c", "wrong", "second"), "first");
  EXPECT_EQ(s2.compare_set("c", "first", "second"), "second");
  EXPECT_EQ(s2.compare_set("unset", "expected", "d"), "expected");
  EXPECT_FALSE(s2.check({"unset"}));
  EXPECT_TRUE(s2.check({"a", "c", "n"}));
  EXPECT_EQ(s2.num_keys(), 3);
  EXPECT_TRUE(s2.delete_key("a"));
  EXPECT_FALSE(s2.delete_key("a"));
  EXPECT_EQ(s2.num_keys(), 2);
  s2.ping();
  PrefixStore p("job/1", std::make_shared<TcpStore>("127.0.0.1", server.port(), "secret", 5s));
  p.set("k", "v");
  EXPECT_EQ(s2.get("job/1/k"), "v");
  EXPECT_EQ(p.get("k"), "v");
  EXPECT_EQ(p.add("cnt", 2), 2);
  EXPECT_TRUE(p.check({"k", "cnt"}));
}

TEST(Store, WaitBlocksUntilSetAndTimesOutNamingKeys) {
  StoreServer server(quiet_server("t"));
  TcpStore a("127.0.0.1", server.port(), "t", 5s), b("127.0.0.1", server.port(), "t", 5s);
  std::thread setter([&] {
    std::this_thread::sleep_for(100ms);
    b.set("late", "1");
  });
  const auto t0 = std::chrono::steady_clock::now();
  a.wait({"late"}, 5s);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 3s);
  setter.join();
  try {
    a.wait({"late", "never"}, 200ms);
    FAIL() << "wait did not time out";
  } catch (const StoreTimeout& e) {
    EXPECT_NE(std::string(e.what()).find("'never'"), std::string::npos) << e.what();
    EXPECT_EQ(std::string(e.what()).find("'late'"), std::string::npos) << e.what();
  }
  a.set_timeout(200ms);
  EXPECT_THROW(a.get("nope"), StoreTimeout);
}

TEST(Store, ConcurrentClientsAddExactly) {
  StoreServer server(quiet_server("t"));
  constexpr int kClients = 8, kAdds = 50;
  std::vector<std::thread> threads;
  for (int i = 0; i < kClients; ++i)
    threads.emplace_back([&, i] {
      TcpStore s("127.0.0.1", server.port(), "t", 5s);
      for (int j = 0; j < kAdds; ++j) s.add("counter", 1);
      s.set("done/" + std::to_string(i), "1");
    });
  for (auto& t : threads) t.join();
  TcpStore s("127.0.0.1", server.port(), "t", 5s);
  EXPECT_EQ(s.add("counter", 0), kClients * kAdds);
}

TEST(Store, WrongOrMissingTokenRefused) {
  StoreServer server(quiet_server("right"));
  try {
    TcpStore s("127.0.0.1", server.port(), "wrong", 2s);
    FAIL() << "a wrong token was accepted";
  } catch (const kiln::Error& e) {
    EXPECT_NE(std::string(e.what()).find("wrong token"), std::string::npos) << e.what();
  }
  EXPECT_THROW(TcpStore("127.0.0.1", server.port(), "", 2s), kiln::Error);
  // A raw client that skips authentication gets an error and a closed connection.
  const int fd = raw_connect(server.port());
  ASSERT_EQ(read_frame(fd, nullptr), static_cast<int>(proto::Op::nonce));
  proto::Request set;
  set.op = proto::Op::set;
  set.key = "k";
  set.value = "v";
  const auto bytes = proto::encode_request(set);
  send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
  std::string msg;
  EXPECT_EQ(read_frame(fd, &msg), static_cast<int>(proto::Op::error));
  EXPECT_NE(msg.find("before authenticating"), std::string::npos) << msg;
  EXPECT_EQ(read_frame(fd, nullptr), -1);  // closed
  close(fd);
  EXPECT_EQ(server.refused_connections(), 2);
  TcpStore ok("127.0.0.1", server.port(), "right", 2s);
  EXPECT_EQ(ok.try_get("k"), std::nullopt);  // the unauthenticated set did nothing
}

TEST(Store, SilentClientDroppedAfterAuthDeadline) {
  StoreServerOptions o = quiet_server("t");
  o.auth_timeout = 200ms;
  StoreServer server(o);
  const int fd = raw_connect(server.port());
  ASSERT_EQ(read_frame(fd, nullptr), static_cast<int>(proto::Op::nonce));
  std::string msg;
  EXPECT_EQ(read_frame(fd, &msg, 3000), static_cast<int>(proto::Op::error));
  EXPECT_NE(msg.find("deadline"), std::string::npos) << msg;
  close(fd);
}

TEST(Store, MalformedFramesRefusedServerKeepsServing) {
  StoreServer server(quiet_server("t"));
  TcpStore good("127.0.0.1", server.port(), "t", 5s);
  good.set("keep", "1");
  auto frame = [](uint32_t magic, uint8_t version, uint8_t op, uint16_t flags, const std::string& payload,
                  uint32_t len_override = UINT32_MAX) {
    std::string out;
    proto::put_u32(out, magic);
    out.push_back(static_cast<char>(version));
    out.push_back(static_cast<char>(op));
    out.push_back(static_cast<char>(flags & 0xff));
    out.push_back(static_cast<char>(flags >> 8));
    proto::put_u32(out, len_override == UINT32_MAX ? static_cast<uint32_t>(payload.size()) : len_override);
    out += payload;
    return out;
  };
  std::string key_only;
  proto::put_string(key_only, "k");
  std::string huge_key;
  proto::put_u32(huge_key, proto::kMaxKeyBytes + 1);
  std::string truncated_value;
  proto::put_string(truncated_value, "k");
  proto::put_u32(truncated_value, 100);
  truncated_value += "short";
  std::string zero_keys;
  proto::put_u32(zero_keys, 0);
  proto::put_i64(zero_keys, 10);
  std::string neg_wait;
  proto::put_u32(neg_wait, 1);
  proto::put_string(neg_wait, "k");
  proto::put_i64(neg_wait, -5);
  struct Case {
    const char* name;
    std::string bytes;
    const char* expect;
  };
  const Case cases[] = {
      {"bad magic", frame(0xdeadbeef, 1, 2, 0, key_only), "bad magic"},
      {"bad version", frame(proto::kMagic, 9, 2, 0, key_only), "version 9"},
      {"unknown op", frame(proto::kMagic, 1, 200, 0, key_only), "unknown op"},
      {"flags", frame(proto::kMagic, 1, 3, 1, key_only), "flags"},
      {"oversized", frame(proto::kMagic, 1, 2, 0, "", 0xfffffff0u), "exceeds the bound"},
      {"huge key", frame(proto::kMagic, 1, 3, 0, huge_key), "key of"},
      {"truncated value", frame(proto::kMagic, 1, 2, 0, truncated_value), "truncated value"},
      {"trailing bytes", frame(proto::kMagic, 1, 3, 0, key_only + "zz"), "trailing"},
      {"wait of 0 keys", frame(proto::kMagic, 1, 6, 0, zero_keys), "0 keys"},
      {"negative wait", frame(proto::kMagic, 1, 6, 0, neg_wait), "negative"},
      {"response op", frame(proto::kMagic, 1, 65, 0, ""), "not a request"},
      {"second auth", frame(proto::kMagic, 1, 1, 0, std::string(4, '\0')), "authenticated twice"},
  };
  for (const auto& c : cases) {
    const int fd = authed_raw(server.port(), "t");
    send(fd, c.bytes.data(), c.bytes.size(), MSG_NOSIGNAL);
    std::string msg;
    EXPECT_EQ(read_frame(fd, &msg), static_cast<int>(proto::Op::error)) << c.name;
    EXPECT_NE(msg.find(c.expect), std::string::npos) << c.name << ": " << msg;
    EXPECT_EQ(read_frame(fd, nullptr), -1) << c.name << ": connection left open";
    close(fd);
  }
  EXPECT_EQ(server.protocol_errors(), static_cast<int64_t>(std::size(cases)));
  EXPECT_EQ(good.get("keep"), "1");
}

TEST(Store, ClientDyingMidRequestLeavesServerServing) {
  // A child process authenticates, sends half a frame and a parked wait, then dies by SIGKILL.
  // It is forked before the server starts its thread (it learns the port through a pipe): a
  // child forked from a threaded process can inherit a lock that thread held (under ASan its
  // allocator's: the child hung in malloc) and must not allocate.
  int port_pipe[2];
  ASSERT_EQ(pipe(port_pipe), 0);
  const pid_t pid = fork();
  if (pid == 0) {
    close(port_pipe[1]);
    int port = 0;
    if (read(port_pipe[0], &port, sizeof port) != static_cast<ssize_t>(sizeof port)) _exit(3);
    TcpStore s("127.0.0.1", port, "t", 5s);
    std::thread([&] {
      try { s.wait({"never"}, 60s); } catch (...) {}
    }).detach();
    const int fd = authed_raw(port, "t");
    proto::Request set;
    set.op = proto::Op::set;
    set.key = "half";
    set.value = std::string(1000, 'x');
    const auto bytes = proto::encode_request(set);
    send(fd, bytes.data(), bytes.size() / 2, MSG_NOSIGNAL);
    std::this_thread::sleep_for(100ms);
    kill(getpid(), SIGKILL);
  }
  close(port_pipe[0]);
  StoreServer server(quiet_server("t"));
  const int port = server.port();
  EXPECT_EQ(write(port_pipe[1], &port, sizeof port), static_cast<ssize_t>(sizeof port));
  close(port_pipe[1]);
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFSIGNALED(status)) << "the child " << (WIFEXITED(status) ? "exited " + std::to_string(WEXITSTATUS(status)) : "");
  TcpStore s("127.0.0.1", server.port(), "t", 5s);
  s.set("after", "ok");
  EXPECT_EQ(s.get("after"), "ok");
  EXPECT_EQ(s.try_get("half"), std::nullopt);
}

TEST(Store, ServerBindsLoopbackByDefaultAndReportsPortInUse) {
  StoreServer a(quiet_server("t"));
  StoreServerOptions o = quiet_server("t");
  o.port = a.port();
  try {
    StoreServer b(o);
    FAIL() << "two servers on one port";
  } catch (const kiln::Error& e) {
    EXPECT_NE(std::string(e.what()).find("127.0.0.1:" + std::to_string(a.port())), std::string::npos) << e.what();
  }
  EXPECT_THROW(StoreServer(quiet_server("")), kiln::Error);
}

TEST(Store, ConnectTimesOutWithAMessage) {
  int port = 0;
  {
    StoreServer s(quiet_server("t"));
    port = s.port();
  }
  try {
    TcpStore s("127.0.0.1", port, "t", 300ms);
    FAIL();
  } catch (const kiln::Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot connect"), std::string::npos) << e.what();
  }
}

TEST(Store, HmacMatchesRfc4231) {
  // RFC 4231 test case 2.
  const std::string mac = hmac_sha256("Jefe", "what do ya want for nothing?");
  static const unsigned char want[] = {0x5b, 0xdc, 0xc1, 0x46, 0xbf, 0x60, 0x75, 0x4e, 0x6a, 0x04, 0x24,
                                       0x26, 0x08, 0x95, 0x75, 0xc7, 0x5a, 0x00, 0x3f, 0x08, 0x9d, 0x27,
                                       0x39, 0x83, 0x9d, 0xec, 0x58, 0xb9, 0x64, 0xec, 0x38, 0x43};
  EXPECT_EQ(mac, std::string(reinterpret_cast<const char*>(want), 32));
  EXPECT_EQ(random_token().size(), 64u);
  EXPECT_NE(random_token(), random_token());
}

// A split's store path: one per name and rank list (disjoint groups under one name apart), and a
// count of the communicator's earlier splits of that group (the same group split twice apart).
TEST(Store, SplitPathsKeepGroupsAndRepeatedSplitsApart) {
  std::map<std::string, int> counts;
  const std::string evens = next_split_store_path(counts, "dp", {0, 2});
  const std::string odds = next_split_store_path(counts, "dp", {1, 3});
  const std::string evens_again = next_split_store_path(counts, "dp", {0, 2});
  const std::string reordered = next_split_store_path(counts, "dp", {2, 0});
  const std::string other_name = next_split_store_path(counts, "tp", {0, 2});
  EXPECT_EQ(evens.rfind("split/dp/", 0), 0u) << evens;
  EXPECT_EQ(evens.substr(evens.size() - 2), "/0") << evens;
  EXPECT_EQ(evens_again, evens.substr(0, evens.size() - 1) + "1");
  for (const std::string& p : {odds, reordered, other_name}) {
    EXPECT_NE(p.substr(0, p.size() - 2), evens.substr(0, evens.size() - 2)) << p;
    EXPECT_EQ(p.substr(p.size() - 2), "/0") << p;
  }
  // Every rank computes the same path for the same call.
  std::map<std::string, int> elsewhere;
  EXPECT_EQ(next_split_store_path(elsewhere, "dp", {1, 3}), odds);
}
