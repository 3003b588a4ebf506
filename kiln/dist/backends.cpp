// The environment of a rank (kiln launch, torchrun, SLURM), its store and world communicator.
#include "kiln/dist/backends.h"

#include <cstdlib>

#include "kiln/core/env.h"

namespace kiln::dist {
namespace {

// A rank, a count of ranks or a port.
int env_int(const char* name, int fallback, int64_t hi = int64_t{1} << 24) {
  return static_cast<int>(env_integer(name, 0, hi, fallback));
}
std::string env_str(const char* name, const std::string& fallback) { return env_string(name).value_or(fallback); }

// A client store that also owns the server it connects to (rank 0 under torchrun or SLURM).
struct ServerHolder {
  std::unique_ptr<StoreServer> server;
};
class HostedStore : private ServerHolder, public TcpStore {
 public:
  HostedStore(std::unique_ptr<StoreServer> s, const std::string& token)
      : ServerHolder{std::move(s)}, TcpStore("127.0.0.1", server->port(), token) {}
};

}  // namespace

DistEnv DistEnv::from_env() {
  DistEnv e;
  e.rank = env_int("RANK", env_int("SLURM_PROCID", 0));
  e.world_size = env_int("WORLD_SIZE", env_int("SLURM_NTASKS", 1));
  e.local_rank = env_int("LOCAL_RANK", env_int("SLURM_LOCALID", 0));
  e.local_world_size = env_int("LOCAL_WORLD_SIZE", 1);
  KILN_CHECK(e.world_size >= 1 && e.rank < e.world_size, "RANK=", e.rank, " out of range [0, WORLD_SIZE=",
             e.world_size, ")");
  e.launched_by_kiln = std::getenv("KILN_STORE_PORT") != nullptr && std::getenv("KILN_STORE_ADDR") != nullptr;
  e.store_addr = env_str("KILN_STORE_ADDR", env_str("MASTER_ADDR", "127.0.0.1"));
  e.store_port = env_int("KILN_STORE_PORT", env_int("MASTER_PORT", 29500, 65534) + 1, 65535);
  e.token = env_str("KILN_STORE_TOKEN", "");
  return e;
}

std::shared_ptr<Store> connect_store(const DistEnv& env) {
  KILN_CHECK(!env.token.empty(), "KILN_STORE_TOKEN is not set: kiln launch sets it; under torchrun or SLURM "
             "export the same secret to every rank (e.g. KILN_STORE_TOKEN=$(openssl rand -hex 32))");
  if (!env.launched_by_kiln && env.rank == 0) {
    StoreServerOptions o;
    o.token = env.token;
    o.port = env.store_port;
    const bool loopback = env.store_addr == "127.0.0.1" || env.store_addr == "localhost";
    o.host = loopback ? "127.0.0.1" : env_str("KILN_STORE_BIND", "0.0.0.0");
    return std::make_shared<HostedStore>(std::make_unique<StoreServer>(o), env.token);
  }
  return std::make_shared<TcpStore>(env.store_addr, env.store_port, env.token);
}

std::shared_ptr<Communicator> init_world(const std::string& backend, const std::string& name, CommOptions options) {
  const DistEnv env = DistEnv::from_env();
  auto store = connect_store(env);
  if (backend == "gloo") return new_gloo_communicator(store, env.rank, env.world_size, name, options);
  if (backend == "nccl") return new_nccl_world(store, env, name, options);
  fail("init_world: backend '", backend, "' (expected gloo or nccl)");
}

}  // namespace kiln::dist
