// The key-value store ranks meet through: the abstract Store (set, get, add, compare_set,
// wait, check, delete_key, num_keys), a PrefixStore that namespaces keys, the in-memory
// StoreState that both the server and the fuzz target drive, the TCP StoreServer (one
// poll() thread, authenticated connections, 127.0.0.1 unless asked otherwise) and its
// client TcpStore. Every blocking call has a deadline.
#pragma once
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "kiln/core/error.h"
#include "kiln/dist/store_protocol.h"

namespace kiln::dist {

using Millis = std::chrono::milliseconds;

// A wait() or get() that ran out of time; the message names the keys still missing.
class StoreTimeout : public Error {
 public:
  using Error::Error;
};

class Store {
 public:
  virtual ~Store() = default;
  virtual void set(const std::string& key, const std::string& value) = 0;
  // The value of key, waiting up to timeout() for it to be set.
  virtual std::string get(const std::string& key) = 0;
  // The value if the key is set now, without waiting.
  virtual std::optional<std::string> try_get(const std::string& key) = 0;
  // Adds delta to the integer at key (0 when unset) and returns the new value.
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  // Sets key to desired if its value is expected (or it is unset and expected is empty);
  // returns the value stored afterwards (desired when it was set).
  virtual std::string compare_set(const std::string& key, const std::string& expected,
                                  const std::string& desired) = 0;
  // Waits until every key is set; throws StoreTimeout naming the missing ones.
  virtual void wait(const std::vector<std::string>& keys, Millis timeout) = 0;
  void wait(const std::vector<std::string>& keys) { wait(keys, timeout()); }
  virtual bool check(const std::vector<std::string>& keys) = 0;
  virtual bool delete_key(const std::string& key) = 0;
  virtual int64_t num_keys() = 0;
  Millis timeout() const { return timeout_; }
  void set_timeout(Millis t) { timeout_ = t; }

 protected:
  Millis timeout_{std::chrono::seconds(300)};
};

// Keys of `base` under "<prefix>/".
class PrefixStore : public Store {
 public:
  PrefixStore(std::string prefix, std::shared_ptr<Store> base);
  void set(const std::string& key, const std::string& value) override;
  std::string get(const std::string& key) override;
  std::optional<std::string> try_get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t delta) override;
  std::string compare_set(const std::string& key, const std::string& expected, const std::string& desired) override;
  void wait(const std::vector<std::string>& keys, Millis timeout) override;
  using Store::wait;
  bool check(const std::vector<std::string>& keys) override;
  bool delete_key(const std::string& key) override;
  int64_t num_keys() override;  // of the whole base store
  const std::shared_ptr<Store>& base() const { return base_; }

 private:
  std::string k(const std::string& key) const { return prefix_ + "/" + key; }
  std::string prefix_;
  std::shared_ptr<Store> base_;
};

// The server's data and the meaning of each request, without sockets.
class StoreState {
 public:
  struct Reply {
    proto::Op op = proto::Op::ok;
    std::string payload;
  };
  // The reply to a request, or nullopt for a wait whose keys are not all set yet.
  std::optional<Reply> apply(const proto::Request& r);
  bool has_all(const std::vector<std::string>& keys) const;
  void clear() { kv_.clear(); }
  size_t size() const { return kv_.size(); }

 private:
  std::map<std::string, std::string, std::less<>> kv_;
};

struct StoreServerOptions {
  std::string host = "127.0.0.1";  // the interface to bind; "0.0.0.0" for all
  int port = 0;                    // 0: a free port, read back with port()
  std::string token;               // what clients must prove; must not be empty
  int max_connections = 1024;
  Millis auth_timeout{std::chrono::seconds(10)};
  bool quiet = false;              // no log lines on stderr for refused connections
};

class StoreServer {
 public:
  explicit StoreServer(StoreServerOptions options);  // binds, listens and starts serving
  ~StoreServer();
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;
  int port() const;
  void stop();
  void clear();  // drops every key (between restarts of a job)
  int64_t refused_connections() const;
  int64_t protocol_errors() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// A client connection to a StoreServer. Thread-safe (one request at a time).
class TcpStore : public Store {
 public:
  // Connects (retrying until connect_timeout: the server may start after this rank) and
  // authenticates with token. Throws with the address and the reason on failure.
  TcpStore(const std::string& host, int port, const std::string& token,
           Millis connect_timeout = std::chrono::seconds(60));
  ~TcpStore() override;
  void set(const std::string& key, const std::string& value) override;
  std::string get(const std::string& key) override;
  std::optional<std::string> try_get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t delta) override;
  std::string compare_set(const std::string& key, const std::string& expected, const std::string& desired) override;
  void wait(const std::vector<std::string>& keys, Millis timeout) override;
  using Store::wait;
  bool check(const std::vector<std::string>& keys) override;
  bool delete_key(const std::string& key) override;
  int64_t num_keys() override;
  void ping();

 private:
  StoreState::Reply call(const proto::Request& r, Millis deadline_after);
  void send_all(const std::string& bytes, Millis timeout);
  StoreState::Reply read_frame(Millis timeout);
  std::mutex mu_;
  int fd_ = -1;
  std::string where_;
};

}  // namespace kiln::dist
