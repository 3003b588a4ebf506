// The rank side of the FSDP tests: FsdpWorker.Run does nothing in a plain test run; started by
// kiln launch with KILN_FSDP_CASE=<case> it runs that case as one rank of a Gloo world and
// rank 0 writes what the test compares (KILN_FSDP_OUT/<name>.safetensors: the loss of each
// step and the final whole parameters; optimizer state where the case has it).
//   train      KILN_FSDP_STEPS steps, KILN_FSDP_ACCUM micro-batches (sync on the last only),
//              KILN_FSDP_RESHARD=0 keeps parameters gathered from forward to backward,
//              KILN_FSDP_SEPARATE_RS=0 reduce-scatters on the world communicator;
//              KILN_FSDP_LAYERS blocks (2); also the per-rank memory (between steps, and
//              with gradients after one more backward) and the FSDP counters.
//   save       trains 2 steps, writes a sharded checkpoint to KILN_FSDP_CKPT, trains 2 more.
//   load       loads KILN_FSDP_CKPT (any world size), writes what it loaded, trains steps 2..4.
// KILN_FSDP_BACKEND=nccl runs on the GPU of LOCAL_RANK instead of the CPU.
#include <chrono>
#include <cstdlib>
#include <map>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include "kiln/core/allocator.h"
#include "kiln/io/safetensors.h"
#include "kiln/parallel/dcp.h"
#include "tests/dist/fsdp_harness.h"

using namespace kiln;
using namespace kiln::parallel;
using namespace kiln::parallel::test;

namespace {

std::string env_or(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v ? v : fallback;
}

// Whole optimizer buffers ("exp_avg.<param>"), gathered from every rank's shards.
void add_full_optimizer_state(ShardedRun& run, io::TensorMap& out) {
  optim::OptimizerState st = run.opt->state_dict();
  for (const auto& info : run.fsdp->shard_infos())
    for (const char* buf : {"exp_avg", "exp_avg_sq"}) {
      const std::string key = std::string(buf) + "." + info.name;
      for (const auto& [n, t] : st.tensors)
        if (n == key) out.emplace_back(key, gather_rows(*run.fsdp->communicator(), info.global_shape, t).to(kCPU));
    }
}

void write_result(ShardedRun& run, const std::vector<double>& losses, const std::string& name, bool with_opt,
                  io::Metadata meta = {}) {
  io::TensorMap out;
  out.emplace_back("losses", from_vector<double>(losses, {static_cast<int64_t>(losses.size())}));
  for (auto& p : full_params(run)) out.push_back(p);
  if (with_opt) add_full_optimizer_state(run, out);
  if (run.fsdp->communicator()->rank() == 0)
    io::save_safetensors(env_or("KILN_FSDP_OUT", ".") + "/" + name + ".safetensors", out, meta);
}

}  // namespace

TEST(FsdpWorker, Run) {
  const char* which = std::getenv("KILN_FSDP_CASE");
  if (!which) GTEST_SKIP() << "runs only as a rank of a multi-process FSDP test";
  const std::string mode = which;
  dist::CommOptions co;
  co.timeout = dist::Millis(30000);
  const std::string backend = env_or("KILN_FSDP_BACKEND", "gloo");  // nccl: one GPU per rank
  auto world = dist::init_world(backend, "world", co);
  const int N = world->size();
  const Device device = backend == "nccl" ? cuda(dist::DistEnv::from_env().local_rank) : kCPU;
  FsdpOptions o;
  o.reshard_after_forward = env_or("KILN_FSDP_RESHARD", "1") == "1";
  if (std::getenv("KILN_FSDP_SEPARATE_RS")) o.separate_reduce_scatter_group = env_or("KILN_FSDP_SEPARATE_RS", "1") == "1";
  const int accum = std::atoi(env_or("KILN_FSDP_ACCUM", "1").c_str());
  const std::string tag = env_or("KILN_FSDP_TAG", mode.c_str());
  nn::LlamaConfig config = tiny_config();
  config.num_hidden_layers = std::atoi(env_or("KILN_FSDP_LAYERS", "2").c_str());
  ShardedRun run = make_sharded(world, o, config, device);
  if (mode == "train") {
    const int steps = std::atoi(env_or("KILN_FSDP_STEPS", "4").c_str());
    run.fsdp->reset_peak_stats();
    std::vector<double> losses = train_sharded(run, 0, steps, accum);
    const FsdpStats st = run.fsdp->stats();
    // Between steps: the shards, their optimizer state and nothing gathered. A Gloo worker
    // thread lets go of a finished operation's tensors just after its Work completes, so the
    // figure is the lowest seen over half a second.
    auto settled_bytes = [&] {
      int64_t v = memory_stats(device).current_bytes;
      for (int i = 0; i < 50; ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        v = std::min(v, memory_stats(device).current_bytes);
      }
      return v;
    };
    const int64_t live = settled_bytes();
    // With gradients: one more backward (no step), its gradients reduce-scattered onto the shards.
    int64_t live_grads = 0;
    {
      const int64_t mine = kGlobalBatch / N;
      Batch b = batch_rows(steps, world->rank() * mine, mine, config.vocab_size, device);
      const double global = global_count(*world, count_targets(b.target), device);
      run.model->loss_sum(b.input, b.target, Tensor(), global).backward();
      b = Batch{};  // the batch's ids are no state
      live_grads = settled_bytes();
      run.opt->zero_grad();
    }
    // The bytes of this rank's shards, and of each group's whole parameters (what it gathers).
    int64_t shard_bytes = 0, root_bytes = 0, block_bytes = 0;
    std::map<std::string, int64_t> per_block;
    for (const auto& s : run.fsdp->shard_infos()) {
      shard_bytes += static_cast<int64_t>(s.shard.nbytes());
      int64_t whole = 4;
      for (int64_t d : s.global_shape) whole *= d;
      if (s.name.rfind("model.layers.", 0) == 0) per_block[s.name.substr(0, s.name.find('.', 13))] += whole;
      else root_bytes += whole;
    }
    for (const auto& [n, b] : per_block) block_bytes = std::max(block_bytes, b);
    io::Metadata meta{{"live_bytes", std::to_string(live)},
                      {"peak_gathered_groups", std::to_string(st.peak_gathered_groups)},
                      {"gathered_bytes", std::to_string(st.gathered_bytes)},
                      {"all_gathers", std::to_string(st.all_gathers)},
                      {"reduce_scatters", std::to_string(st.reduce_scatters)},
                      {"peak_all_gather_buffers", std::to_string(st.peak_all_gather_buffers)},
                      {"reduce_scatter_comm", run.fsdp->reduce_scatter_communicator()->name()},
                      {"peak_reduce_scatter_buffers", std::to_string(st.peak_reduce_scatter_buffers)},
                      {"peak_gathered_bytes", std::to_string(st.peak_gathered_bytes)},
                      {"root_bytes", std::to_string(root_bytes)},
                      {"block_bytes", std::to_string(block_bytes)}};
    // Every rank's figures (rank 0 writes them all).
    auto per_rank = [&](int64_t mine) {
      Tensor lb = zeros({N}, DType::i64, device);
      lb.narrow(0, world->rank(), 1).fill_(static_cast<double>(mine));
      world->all_reduce(lb, dist::ReduceOp::sum)->wait();
      std::string all;
      for (int64_t v : lb.to(kCPU).to_vector<int64_t>()) all += (all.empty() ? "" : ",") + std::to_string(v);
      return all;
    };
    meta["live_bytes_per_rank"] = per_rank(live);
    meta["live_grad_bytes_per_rank"] = per_rank(live_grads);
    meta["shard_bytes_per_rank"] = per_rank(shard_bytes);
    write_result(run, losses, tag, false, meta);
  } else if (mode == "save") {
    std::vector<double> losses = train_sharded(run, 0, 2, 1);
    save_checkpoint(env_or("KILN_FSDP_CKPT", "ckpt"), *run.fsdp, *run.opt);
    write_result(run, losses, tag + "-at2", true);
    std::vector<double> more = train_sharded(run, 2, 4, 1);
    write_result(run, more, tag + "-at4", true);
  } else if (mode == "load") {
    load_checkpoint(env_or("KILN_FSDP_CKPT", "ckpt"), *run.fsdp, *run.opt);
    write_result(run, {}, tag + "-loaded", true);
    std::vector<double> more = train_sharded(run, 2, 4, 1);
    write_result(run, more, tag + "-at4", true);
  } else {
    FAIL() << "unknown KILN_FSDP_CASE " << mode;
  }
}
