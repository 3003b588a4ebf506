// Constructors of the backends' communicators, and of the world communicator of a process
// started by kiln launch, torchrun or SLURM (the variables they set).
#pragma once
#include <memory>
#include <string>

#include "kiln/dist/communicator.h"
#include "kiln/dist/store.h"

namespace kiln::dist {

// A Gloo communicator of `size` ranks meeting under `name` in `store`. Blocks until every rank
// has connected (within options.timeout). Built without Gloo: an Error saying so.
std::shared_ptr<Communicator> new_gloo_communicator(std::shared_ptr<Store> store, int rank, int size,
                                                    const std::string& name, CommOptions options = {});

// What a rank learns from its environment.
struct DistEnv {
  int rank = 0, world_size = 1, local_rank = 0, local_world_size = 1;
  std::string store_addr = "127.0.0.1";
  int store_port = 0;
  bool launched_by_kiln = false;  // KILN_STORE_PORT set: the launcher serves the store
  std::string token;
  static DistEnv from_env();
};

// The NCCL communicator of the world (every rank, the GPU of LOCAL_RANK). Built without CUDA:
// an Error saying so.
std::shared_ptr<Communicator> new_nccl_world(std::shared_ptr<Store> store, const DistEnv& env,
                                             const std::string& name, CommOptions options);

// The store of this job: the launcher's (KILN_STORE_ADDR / KILN_STORE_PORT), or, under torchrun
// or SLURM, one rank 0 serves at MASTER_ADDR:MASTER_PORT+1 (KILN_STORE_PORT overrides). Every
// rank needs KILN_STORE_TOKEN.
std::shared_ptr<Store> connect_store(const DistEnv& env);
// The world communicator: backend "gloo" (or "nccl" in a CUDA build), every rank of the job.
std::shared_ptr<Communicator> init_world(const std::string& backend = "gloo", const std::string& name = "world",
                                         CommOptions options = {});

}  // namespace kiln::dist
