// FSDP (kiln/parallel): world size 1 in this process against the unsharded reference (bitwise);
// world sizes 2 and 3 as real processes through kiln launch (the ranks are FsdpWorker.Run of
// this program, fsdp_worker.cpp) against the reference in float64-checked tolerances, with
// accumulation (sync off), parameters kept gathered, uneven and empty shards; per-rank memory;
// sharded checkpoints saved at 2 and loaded at 1 and 3, from and to kiln train's single-process
// layout; damaged checkpoints; consolidation to the Hugging Face layout (kiln convert --hf).
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include <gtest/gtest.h>

#include "kiln/autograd/grad_mode.h"
#include "kiln/core/allocator.h"
#include "kiln/dist/store.h"
#include "kiln/io/file.h"
#include "kiln/io/json.h"
#include "kiln/io/safetensors.h"
#include "kiln/ops/backward.h"
#include "kiln/parallel/dcp.h"
#include "kiln/parallel/fsdp_group.h"
#include "kiln/train/hf_export.h"
#include "tests/dist/dist_test_util.h"
#include "tests/dist/fsdp_harness.h"
#include "tests/expect.h"

using namespace kiln;
using namespace kiln::parallel;
using namespace kiln::parallel::test;
using namespace kiln::test;
using kiln::dist::test::contains;
using kiln::dist::test::fresh_test_dir;
using kiln::dist::test::run_command;
namespace fs = std::filesystem;

namespace {

// A one-rank Gloo world in this process.
struct LocalWorld {
  dist::test::LocalStore local{"fsdp-test"};
  std::shared_ptr<dist::Communicator> comm = dist::new_gloo_communicator(local.store, 0, 1, "local");
};

// Runs FsdpWorker.Run as n ranks with `env` (KILN_FSDP_* variables).
dist::test::RunResult run_fsdp(int n, const std::string& env, int deadline_s = 120) {
  return run_command("env " + env + " " + dist::test::kiln_cli() + " launch --nproc-per-node " + std::to_string(n) +
                         " --master-port 0 --term-grace 1 -- " + dist::test::self_exe() +
                         " --gtest_filter=FsdpWorker.Run --gtest_brief=1",
                     deadline_s);
}

io::TensorMap read(const std::string& path, io::Metadata* meta = nullptr) {
  io::TensorMap m = io::load_safetensors(path, meta);
  io::materialize(m);
  return m;
}

Tensor find(const io::TensorMap& m, const std::string& name) {
  for (const auto& [n, t] : m)
    if (n == name) return t;
  ADD_FAILURE() << "no tensor " << name;
  return Tensor();
}

std::vector<double> as_f64(const Tensor& t) { return t.to(DType::f64).to_vector<double>(); }

// Every tensor of `want` but the losses against got's of the same name: within 1e-5.
void expect_tensors_close(const io::TensorMap& got, const io::TensorMap& want, const std::string& what) {
  for (const auto& [n, t] : want)
    if (n != "losses") {
      EXPECT_TRUE(all_close(find(got, n), t, {1e-5, 0}, what + " " + n));
    }
}

// The losses of a result file: within 1e-5 of the reference's, relative.
constexpr Tol kLossTol = finite_only({0, 1e-5});

}  // namespace

// ---- world size 1, in this process: the same code as N ranks, the bits of the plain run ----

TEST(Fsdp, WorldSizeOneIsBitwiseTheUnshardedRun) {
  KILN_SKIP_WITHOUT_GLOO();
  for (int accum : {1, 2}) {
    const RunResult ref = train_plain(3, accum);
    LocalWorld w;
    ShardedRun run = make_sharded(w.comm);
    const std::vector<double> losses = train_sharded(run, 0, 3, accum);
    ASSERT_EQ(losses.size(), ref.losses.size());
    for (size_t i = 0; i < losses.size(); ++i) EXPECT_EQ(losses[i], ref.losses[i]) << "accum " << accum << " step " << i;
    for (const auto& [n, t] : ref.params)
      EXPECT_TRUE(same_bits(run.fsdp->full_tensor(n), t, n + " accum " + std::to_string(accum)));
  }
}

TEST(Fsdp, ActivationCheckpointingRecomputesWithTheGatheredParametersBitwise) {
  KILN_SKIP_WITHOUT_GLOO();
  // The recomputation runs the block's forward (and its hooks) inside the backward.
  for (const char* mode : {"block", "mlp"}) {
    nn::LlamaConfig c = tiny_config();
    c.checkpoint_activations = mode;
    const RunResult ref = train_plain(2, 1, c);
    LocalWorld w;
    ShardedRun run = make_sharded(w.comm, {}, c);
    const std::vector<double> losses = train_sharded(run, 0, 2, 1);
    for (size_t i = 0; i < losses.size(); ++i) EXPECT_EQ(losses[i], ref.losses[i]) << mode << " step " << i;
    for (const auto& [n, t] : ref.params) EXPECT_TRUE(same_bits(run.fsdp->full_tensor(n), t, n + " " + mode));
    EXPECT_EQ(run.fsdp->stats().gathered_bytes, 0) << mode;
  }
}

TEST(Fsdp, ABackwardThatFailsLeavesNothingBehind) {
  KILN_SKIP_WITHOUT_GLOO();
  LocalWorld w;
  ShardedRun run = make_sharded(w.comm);
  // A node after block 0 whose backward throws: the backward ends after block 1's gradients
  // were gathered and reduced, before block 0's.
  auto& layer = *run.model->model->layers[0];
  const int id = layer.register_forward_hook([](const nn::Module&, const Tensor& out) {
    Tensor y = out.detach();
    record("throws", {out}, y, [](const std::vector<Tensor>&) -> std::vector<Tensor> { fail("injected failure"); });
    return y;
  });
  const Batch b = batch_rows(0, 0, kGlobalBatch, run.model->config.vocab_size);
  Tensor l = run.model->loss_sum(b.input, b.target, Tensor(), static_cast<double>(count_targets(b.target)));
  EXPECT_THROW(l.backward(), Error);
  layer.remove_hook(id);
  run.opt->zero_grad();
  // The next step is the plain run's first.
  const RunResult ref = train_plain(1, 1);
  const std::vector<double> losses = train_sharded(run, 0, 1, 1);
  EXPECT_EQ(losses[0], ref.losses[0]);
  for (const auto& [n, t] : ref.params)
    EXPECT_TRUE(same_bits(run.fsdp->full_tensor(n), t, n + " after a failed backward"));
  const FsdpStats st = run.fsdp->stats();
  EXPECT_EQ(st.gathered_bytes, 0);
  EXPECT_EQ(st.all_gather_buffers, 0);
  EXPECT_EQ(st.reduce_scatter_buffers, 0);
}

TEST(Fsdp, ShardsAreTheRowsOfEachParameterAndTheModuleHoldsNoMemoryBetweenSteps) {
  KILN_SKIP_WITHOUT_GLOO();
  LocalWorld w;
  nn::LlamaForCausalLM ref(tiny_config(), kSeed);
  ShardedRun run = make_sharded(w.comm);
  const auto infos = run.fsdp->shard_infos();
  ASSERT_EQ(infos.size(), ref.named_parameters().size());
  for (const auto& [n, t] : ref.named_parameters()) {
    bool found = false;
    for (const auto& s : infos)
      if (s.name == n) {
        found = true;
        EXPECT_TRUE(same_bits(s.shard, *t, n));
        EXPECT_EQ(s.global_shape, t->shape());
      }
    EXPECT_TRUE(found) << n;
  }
  // The module's parameters keep their shapes, with empty storage.
  for (const auto& [n, t] : run.model->named_parameters()) {
    EXPECT_EQ(t->storage()->nbytes(), 0u) << n;
    EXPECT_GT(t->numel(), 0) << n;
  }
  train_sharded(run, 0, 1, 1);
  for (const auto& [n, t] : run.model->named_parameters()) EXPECT_EQ(t->storage()->nbytes(), 0u) << n << " after a step";
  EXPECT_EQ(run.fsdp->stats().gathered_bytes, 0);
  // Three groups (2 blocks, the root) gathered twice each per step (forward and backward) but
  // the root once; one reduce-scatter each.
  EXPECT_EQ(run.fsdp->stats().all_gathers, 5);
  EXPECT_EQ(run.fsdp->stats().reduce_scatters, 3);
  // Sharding twice is refused.
  EXPECT_THROW(fully_shard(*run.model, w.comm), Error);
}

// At one rank the gathered parameters are the all-gather buffer itself (no copy-out): each
// borrows its bytes, 16-byte aligned, one group's in order in one block, holding the shard's
// values (bf16 gathers too); resharding frees them. The bitwise runs above check the training.
TEST(Fsdp, OneRankGathersIntoTheBufferItselfAligned) {
  KILN_SKIP_WITHOUT_GLOO();
  LocalWorld w;
  for (DType param_dtype : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(param_dtype));
    FsdpOptions o;
    o.mixed_precision.param_dtype = param_dtype;
    ShardedRun run = make_sharded(w.comm, o);
    run.fsdp->unshard();
    for (FsdpGroup* g : run.fsdp->group().all_groups()) {
      const uint8_t* end = nullptr;
      ASSERT_FALSE(g->params.empty());
      for (const FsdpParam& p : g->params) {
        SCOPED_TRACE(p.name);
        const auto* begin = static_cast<const uint8_t*>(p.full.data_ptr());
        EXPECT_TRUE(p.full.storage()->borrowed());
        EXPECT_EQ(reinterpret_cast<uintptr_t>(begin) % 16, 0u);
        if (end) {
          EXPECT_GE(begin, end);
          EXPECT_LT(begin, end + 16);  // the next place in the same buffer
        }
        end = begin + p.full.nbytes();
        EXPECT_TRUE(same_bits(p.full, p.shard.to(param_dtype), p.name));
      }
    }
    run.fsdp->reshard();
    for (const auto& [n, t] : run.model->named_parameters()) EXPECT_EQ(t->storage()->nbytes(), 0u) << n;
  }
}

TEST(Fsdp, EvaluationWithoutGradientsFreesEveryGroupAndMatchesThePlainModel) {
  KILN_SKIP_WITHOUT_GLOO();
  LocalWorld w;
  nn::LlamaForCausalLM ref(tiny_config(), kSeed);
  ShardedRun run = make_sharded(w.comm);
  const Batch b = batch_rows(0, 0, 2, ref.config.vocab_size);
  NoGradGuard ng;
  EXPECT_TRUE(same_bits(run.model->logits(b.input), ref.logits(b.input), "logits"));
  EXPECT_EQ(run.fsdp->stats().gathered_bytes, 0);
}

// ---- real processes ----

class FsdpWorld : public ::testing::TestWithParam<int> {};

// `steps` steps at world size n with the KILN_FSDP_* settings `env`: losses and final parameters
// against the unsharded run on the same global batch; rank 0's counters.
static io::Metadata train_and_compare(int n, const std::string& name, int steps, const std::string& env) {
  const std::string what = name + ", world " + std::to_string(n);
  const std::string out = fresh_test_dir(name + std::to_string(n));
  const auto r = run_fsdp(n, "KILN_FSDP_CASE=train KILN_FSDP_STEPS=" + std::to_string(steps) + " " + env +
                                 " KILN_FSDP_OUT=" + out);
  EXPECT_EQ(r.status, 0) << r.output;
  io::Metadata meta;
  if (r.status != 0) return meta;
  const RunResult ref = train_plain(steps, 1);  // accumulation too equals the one large batch
  const io::TensorMap got = read(out + "/train.safetensors", &meta);
  EXPECT_TRUE(all_close(find(got, "losses"), ref.losses, kLossTol, what + " losses"));
  expect_tensors_close(got, ref.params, what);
  EXPECT_EQ(meta["gathered_bytes"], "0") << what;  // nothing is left gathered between steps
  return meta;
}

TEST_P(FsdpWorld, MatchesTheUnshardedRunWithUnevenShards) {
  KILN_SKIP_WITHOUT_GLOO();
  io::Metadata meta = train_and_compare(GetParam(), "world", 5, "");
  // Forward prefetch: at most two blocks gathered at once (the prefetched one counts once copied
  // out); one flat all-gather buffer at a time (a group's is freed at its copy-out, before the
  // next group's gather is started), one reduce-scatter input.
  EXPECT_LE(std::stoll(meta["peak_gathered_groups"]), 2);
  EXPECT_GE(std::stoll(meta["peak_gathered_groups"]), 1);
  EXPECT_EQ(meta["peak_all_gather_buffers"], "1");
  EXPECT_EQ(meta["peak_reduce_scatter_buffers"], "1");
  EXPECT_EQ(meta["reduce_scatter_comm"], "world.fsdp_reduce_scatter");  // on by default when N > 1
  // Per step: the root once, each block for its forward and again for its backward.
  EXPECT_EQ(meta["all_gathers"], "25");
}

TEST_P(FsdpWorld, AccumulationWithSyncOffMatchesOneBatch) {
  KILN_SKIP_WITHOUT_GLOO();
  io::Metadata meta = train_and_compare(GetParam(), "accum", 3, "KILN_FSDP_ACCUM=2");
  // 3 steps x 3 groups: one reduce-scatter per group per step, none for the sync-off micro-batch.
  EXPECT_EQ(meta["reduce_scatters"], "9");
}

TEST_P(FsdpWorld, ParametersKeptGatheredFromForwardToBackward) {
  KILN_SKIP_WITHOUT_GLOO();
  io::Metadata meta = train_and_compare(GetParam(), "keep", 3, "KILN_FSDP_RESHARD=0");
  // No second gather in the backward: each block once per step, the root once.
  EXPECT_EQ(meta["all_gathers"], "9");
  EXPECT_EQ(meta["peak_gathered_groups"], "2");  // both blocks, from the forward to the backward
}

TEST_P(FsdpWorld, ReduceScattersOnTheWorldCommunicatorToo) {
  KILN_SKIP_WITHOUT_GLOO();
  // separate_reduce_scatter_group is on by default when N > 1 (the other cases); off, the same run.
  io::Metadata meta = train_and_compare(GetParam(), "onecomm", 2, "KILN_FSDP_SEPARATE_RS=0");
  EXPECT_EQ(meta["reduce_scatter_comm"], "world");
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, FsdpWorld, ::testing::Values(2, 3, 4));

TEST(FsdpDeterminism, TwoRunsAtOneWorldSizeAreBitwiseIdentical) {
  KILN_SKIP_WITHOUT_GLOO();
  io::TensorMap runs[2];
  for (int i = 0; i < 2; ++i) {
    const std::string out = fresh_test_dir("det" + std::to_string(i));
    const auto r = run_fsdp(3, "KILN_FSDP_CASE=train KILN_FSDP_STEPS=3 KILN_FSDP_OUT=" + out);
    ASSERT_EQ(r.status, 0) << r.output;
    runs[i] = read(out + "/train.safetensors");
  }
  ASSERT_EQ(runs[0].size(), runs[1].size());
  for (size_t i = 0; i < runs[0].size(); ++i)
    EXPECT_TRUE(same_bits(runs[0][i].second, runs[1][i].second, runs[0][i].first));
}

namespace {
std::vector<int64_t> numbers(const std::string& csv) {
  std::vector<int64_t> v;
  std::stringstream ss(csv);
  for (std::string x; std::getline(ss, x, ',');) v.push_back(std::stoll(x));
  return v;
}
}  // namespace

// memory_stats (the CPU allocator's live bytes) of every rank at world sizes 1, 2 and 4, with 4
// blocks: parameters + optimizer state (between steps) and parameters + gradients + optimizer
// state (after a backward) are the bytes of the rank's shards (3 f32 copies, 4 with gradients)
// and about 1/N of world size 1's; every rank's together are world size 1's (no padding is
// stored); the gathered parameters never exceed the root and two blocks (FsdpStats).
TEST(FsdpMemory, PerRankStateIsAboutOneNthAndGatheredParametersTwoGroups) {
  KILN_SKIP_WITHOUT_GLOO();
  std::map<int, io::Metadata> metas;
  for (int n : {1, 2, 4}) {
    const std::string out = fresh_test_dir("mem" + std::to_string(n));
    const auto r = run_fsdp(n, "KILN_FSDP_CASE=train KILN_FSDP_STEPS=2 KILN_FSDP_LAYERS=4 KILN_FSDP_OUT=" + out);
    ASSERT_EQ(r.status, 0) << r.output;
    read(out + "/train.safetensors", &metas[n]);
  }
  const std::vector<int64_t> one = numbers(metas[1]["live_grad_bytes_per_rank"]),
                             one_live = numbers(metas[1]["live_bytes_per_rank"]);
  ASSERT_EQ(one.size(), 1u);
  for (int n : {1, 2, 4}) {
    io::Metadata& m = metas[n];
    const auto grads = numbers(m["live_grad_bytes_per_rank"]), live = numbers(m["live_bytes_per_rank"]),
               shard = numbers(m["shard_bytes_per_rank"]);
    ASSERT_EQ(grads.size(), static_cast<size_t>(n));
    int64_t sum = 0, sum_live = 0;
    for (int r = 0; r < n; ++r) {
      const std::string what = "world " + std::to_string(n) + " rank " + std::to_string(r);
      std::printf("%s: shards %lld B, live %lld B, with gradients %lld B\n", what.c_str(),
                  static_cast<long long>(shard[r]), static_cast<long long>(live[r]), static_cast<long long>(grads[r]));
      // The shards, their gradients and AdamW's two moments, and nothing else of size (under 1 KiB:
      // scalars).
      EXPECT_GE(grads[r], 4 * shard[r]) << what;
      EXPECT_LE(grads[r], 4 * shard[r] + 1024) << what;
      EXPECT_GE(live[r], 3 * shard[r]) << what;
      EXPECT_LE(live[r], 3 * shard[r] + 1024) << what;
      // About 1/N: the vocabulary's 37 rows split 19/18 and 10/10/10/7, so a rank holds a little over 1/N.
      const double frac = static_cast<double>(grads[r]) / static_cast<double>(one[0]);
      EXPECT_GT(frac, 0.85 / n) << what;
      EXPECT_LT(frac, 1.12 / n) << what;
      sum += grads[r];
      sum_live += live[r];
    }
    EXPECT_LE(std::abs(static_cast<double>(sum - one[0])), 0.02 * static_cast<double>(one[0])) << "world " << n;
    EXPECT_LE(std::abs(static_cast<double>(sum_live - one_live[0])), 0.02 * static_cast<double>(one_live[0]))
        << "world " << n;
    // Gathered: the root (kept from its forward to the end of the backward) and the block that
    // computes; the next block's all-gather in flight meanwhile is one flat buffer (at most one
    // at a time) of at most a block: the root and two blocks at most.
    const int64_t peak = std::stoll(m["peak_gathered_bytes"]), root = std::stoll(m["root_bytes"]),
                  block = std::stoll(m["block_bytes"]);
    std::printf("world %d: peak gathered %lld B (root %lld B, a block %lld B)\n", n, static_cast<long long>(peak),
                static_cast<long long>(root), static_cast<long long>(block));
    EXPECT_LE(peak, root + 2 * block) << "world " << n;
    EXPECT_GE(peak, root + block) << "world " << n;
    EXPECT_LE(std::stoll(m["peak_gathered_groups"]), 2) << "world " << n;
    EXPECT_EQ(m["peak_all_gather_buffers"], "1") << "world " << n;
    EXPECT_EQ(m["peak_reduce_scatter_buffers"], "1") << "world " << n;
    EXPECT_EQ(m["gathered_bytes"], "0") << "world " << n;
  }
}

// ---- sharded checkpoints ----

class FsdpCheckpoint : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!dist::test::have_gloo()) return;
    dir_ = fresh_test_dir("ckpt");
    const auto r = run_fsdp(2, "KILN_FSDP_CASE=save KILN_FSDP_TAG=w2 KILN_FSDP_OUT=" + dir_ + " KILN_FSDP_CKPT=" +
                                   dir_ + "/step-2");
    saved_ok_ = r.status == 0;
    if (!saved_ok_) std::fprintf(stderr, "%s\n", r.output.c_str());
  }
  static std::string dir_;
  static bool saved_ok_;
};
std::string FsdpCheckpoint::dir_;
bool FsdpCheckpoint::saved_ok_ = false;

TEST_F(FsdpCheckpoint, SavedAtTwoLoadsAtOneAndThreeBitExactAndTrainingContinues) {
  KILN_SKIP_WITHOUT_GLOO();
  ASSERT_TRUE(saved_ok_);
  EXPECT_TRUE(fs::exists(dir_ + "/step-2/" + kShardedIndexFile));
  EXPECT_FALSE(fs::exists(dir_ + "/step-2.tmp-sharded"));
  const io::TensorMap saved = read(dir_ + "/w2-at2.safetensors");
  const io::TensorMap at4 = read(dir_ + "/w2-at4.safetensors");
  for (int n : {1, 3}) {
    const std::string tag = "w" + std::to_string(n);
    const auto r = run_fsdp(n, "KILN_FSDP_CASE=load KILN_FSDP_TAG=" + tag + " KILN_FSDP_OUT=" + dir_ +
                                   " KILN_FSDP_CKPT=" + dir_ + "/step-2");
    ASSERT_EQ(r.status, 0) << r.output;
    const io::TensorMap loaded = read(dir_ + "/" + tag + "-loaded.safetensors");
    size_t compared = 0;
    for (const auto& [name, t] : saved) {
      if (name == "losses") continue;
      EXPECT_TRUE(same_bits(find(loaded, name), t, name + " loaded at world size " + std::to_string(n)));
      ++compared;
    }
    EXPECT_GT(compared, 3 * tiny_config().num_hidden_layers * 9u);  // parameters and both Adam moments
    // Steps 2 and 3 from the checkpoint follow the run that saved it.
    const io::TensorMap cont = read(dir_ + "/" + tag + "-at4.safetensors");
    const std::string what = "continued at world size " + std::to_string(n);
    EXPECT_TRUE(all_close(find(cont, "losses"), as_f64(find(at4, "losses")), kLossTol, what + " losses"));
    expect_tensors_close(cont, at4, what);
  }
}

TEST_F(FsdpCheckpoint, ConsolidatesToASingleProcessCheckpointThatLoadsIntoTwoRanks) {
  KILN_SKIP_WITHOUT_GLOO();
  ASSERT_TRUE(saved_ok_);
  // Sharded -> whole (what kiln train's single-process checkpoint holds), in kiln train's layout.
  const auto whole = load_full(dir_ + "/step-2");
  const io::TensorMap saved = read(dir_ + "/w2-at2.safetensors");
  io::TensorMap model, opt;
  for (const auto& [n, t] : whole) {
    EXPECT_TRUE(same_bits(t, find(saved, n), n + " consolidated"));
    (n.rfind("exp_avg", 0) == 0 ? opt : model).emplace_back(n, t);
  }
  const std::string single = fresh_test_dir("single");
  io::save_safetensors(single + "/model.safetensors", model);
  io::save_safetensors(single + "/optimizer.safetensors", opt);
  const auto idx = json::parse(io::read_file_prefix(dir_ + "/step-2/" + kShardedIndexFile, 1 << 24));
  json::Value st = json::Value::object();
  st["optimizer"] = *idx.find("metadata")->find("optimizer");
  std::ofstream(single + "/trainer_state.json") << st.dump(1);
  // ... which loads into 2 ranks with the same bits.
  const auto r = run_fsdp(2, "KILN_FSDP_CASE=load KILN_FSDP_TAG=single KILN_FSDP_OUT=" + dir_ + " KILN_FSDP_CKPT=" +
                                 single);
  ASSERT_EQ(r.status, 0) << r.output;
  const io::TensorMap loaded = read(dir_ + "/single-loaded.safetensors");
  for (const auto& [n, t] : whole)
    EXPECT_TRUE(same_bits(find(loaded, n), t, n + " from the single-process checkpoint"));
}

namespace {
// A copy of the saved checkpoint whose index or files `damage` changes.
std::string damaged_copy(const std::string& from, const std::string& name,
                         const std::function<void(const std::string& dir, json::Value& index)>& damage) {
  const std::string d = fresh_test_dir(name);
  fs::remove_all(d);
  fs::copy(from, d, fs::copy_options::recursive);
  json::Value idx = json::parse(io::read_file_prefix(d + "/" + kShardedIndexFile, 1 << 24));
  damage(d, idx);
  std::ofstream(d + "/" + kShardedIndexFile, std::ios::trunc) << idx.dump(1);
  return d;
}

// Loads `dir` into a one-rank model + optimizer; expects a kiln::Error containing every part of
// `want`, and that the shards and optimizer state did not change.
void expect_load_error(const std::string& dir, const std::vector<std::string>& want) {
  LocalWorld w;
  ShardedRun run = make_sharded(w.comm);
  train_sharded(run, 0, 1, 1);  // some optimizer state to keep
  std::vector<Tensor> before;
  for (auto& [n, t] : run.fsdp->named_shards()) before.push_back(t.clone());
  const auto opt_before = run.opt->state_dict();
  std::vector<Tensor> opt_copy;
  for (auto& [n, t] : opt_before.tensors) opt_copy.push_back(t.clone());
  try {
    load_checkpoint(dir, *run.fsdp, *run.opt);
    ADD_FAILURE() << "loaded " << dir;
  } catch (const Error& e) {
    for (const auto& s : want) EXPECT_TRUE(contains(e.what(), s)) << e.what() << "\nmissing: " << s;
  }
  size_t i = 0;
  for (auto& [n, t] : run.fsdp->named_shards()) EXPECT_TRUE(same_bits(t, before[i++], n + " after a failed load"));
  i = 0;
  for (auto& [n, t] : run.opt->state_dict().tensors)
    EXPECT_TRUE(same_bits(t, opt_copy[i++], n + " after a failed load"));
}
}  // namespace

TEST(FsdpSave, ReplacesAWholeCheckpointOnlyOnceTheNewOneIsComplete) {
  KILN_SKIP_WITHOUT_GLOO();
  LocalWorld w;
  ShardedRun run = make_sharded(w.comm);
  const std::string dir = fresh_test_dir("replace") + "/step-1";
  train_sharded(run, 0, 1, 1);
  save_checkpoint(dir, *run.fsdp, *run.opt);
  const auto first = load_full(dir);
  train_sharded(run, 1, 2, 1);
  // A save that fails (here: rank 0's extra files) leaves the previous checkpoint, and no temporary.
  EXPECT_THROW(save_checkpoint(dir, *run.fsdp, *run.opt, [](const std::string&) { fail("disk full"); }), Error);
  EXPECT_FALSE(fs::exists(dir + ".tmp-sharded"));
  const auto kept = load_full(dir);
  ASSERT_EQ(kept.size(), first.size());
  for (size_t i = 0; i < kept.size(); ++i) EXPECT_TRUE(same_bits(kept[i].second, first[i].second, kept[i].first));
  // A save that succeeds replaces it whole, with the extra files.
  save_checkpoint(dir, *run.fsdp, *run.opt, [](const std::string& tmp) { std::ofstream(tmp + "/config.json") << "{}"; });
  EXPECT_TRUE(fs::exists(dir + "/config.json"));
  EXPECT_FALSE(fs::exists(dir + ".old-sharded"));
  for (const auto& [n, t] : load_full(dir))
    if (n.find('.') != std::string::npos && n.rfind("exp_avg", 0) != 0) {
      EXPECT_TRUE(same_bits(t, run.fsdp->full_tensor(n), n + " after the second save"));
    }
}

TEST_F(FsdpCheckpoint, DamagedCheckpointsNameTheFileAndTensorAndChangeNothing) {
  KILN_SKIP_WITHOUT_GLOO();
  ASSERT_TRUE(saved_ok_);
  const std::string src = dir_ + "/step-2";
  const std::string victim = "model.layers.1.mlp.up_proj.weight";
  // An index missing a chunk.
  std::string d = damaged_copy(src, "missing", [&](const std::string&, json::Value& idx) {
    auto& chunks = idx["tensors"][victim]["chunks"].as_array();
    chunks.erase(chunks.begin() + 1);
  });
  expect_load_error(d, {victim, "rows [15, 30)", "in no chunk", kShardedIndexFile});
  // Overlapping chunks.
  d = damaged_copy(src, "overlap", [&](const std::string&, json::Value& idx) {
    auto& c = idx["tensors"][victim]["chunks"].as_array()[1];
    c["offset"].as_array()[0] = 10;
    c["shape"].as_array()[0] = 20;
  });
  expect_load_error(d, {victim, "overlap", "shard-00000-of-00002.safetensors", "shard-00001-of-00002.safetensors"});
  // A shard file cut short.
  d = damaged_copy(src, "truncated", [&](const std::string& dir, json::Value&) {
    const std::string f = dir + "/shard-00001-of-00002.safetensors";
    fs::resize_file(f, fs::file_size(f) - 100);
  });
  expect_load_error(d, {"shard-00001-of-00002.safetensors", "holding tensor '", "unreadable"});
  // A shard file missing.
  d = damaged_copy(src, "nofile", [&](const std::string& dir, json::Value&) {
    fs::remove(dir + "/shard-00000-of-00002.safetensors");
  });
  expect_load_error(d, {"shard-00000-of-00002.safetensors", "which does not exist", "has a chunk in"});
  // A missing index and model: named.
  const std::string empty = fresh_test_dir("empty");
  expect_load_error(empty, {empty, kShardedIndexFile});
}

// ---- consolidation to the Hugging Face layout (kiln convert --hf, train/hf_export.h) ----

namespace {

// The unsharded model with the whole parameters of a result file.
std::unique_ptr<nn::LlamaForCausalLM> plain_with(const io::TensorMap& params) {
  auto m = std::make_unique<nn::LlamaForCausalLM>(tiny_config(), kSeed + 1);  // other initial weights
  NoGradGuard ng;
  for (auto& [n, t] : m->named_parameters()) t->copy_(find(params, n));
  return m;
}

// A run folder as kiln train --nproc 2 leaves it: step-2 (the fixture's sharded checkpoint, with
// config.json) and `latest`.
std::string sharded_run(const std::string& ckpt, const std::string& name) {
  const std::string run = fresh_test_dir(name);
  fs::copy(ckpt, run + "/step-2", fs::copy_options::recursive);
  json::Value cj = tiny_config().to_json();
  cj[train::kTrainedSeqKey] = kSeq;
  std::ofstream(run + "/step-2/config.json") << cj.dump(2);
  std::ofstream(run + "/latest") << "step-2\n";
  return run;
}

std::vector<std::string> names_in(const std::string& dir) {
  std::vector<std::string> v;
  for (const auto& e : fs::directory_iterator(dir)) v.push_back(e.path().filename().string());
  std::sort(v.begin(), v.end());
  return v;
}

}  // namespace

TEST_F(FsdpCheckpoint, ConvertsToTheHuggingFaceLayoutWithTheLogitsOfTheUnshardedModel) {
  KILN_SKIP_WITHOUT_GLOO();
  ASSERT_TRUE(saved_ok_);
  const std::string run = sharded_run(dir_ + "/step-2", "hfrun");
  const std::string out = fresh_test_dir("hfout") + "/hf";
  const auto r = run_command(dist::test::kiln_cli() + " convert " + run + " " + out + " --hf", 60);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "sharded over 2 rank(s)")) << r.output;
  // config.json + model.safetensors, no optimizer state, no shards.
  EXPECT_EQ(names_in(out), (std::vector<std::string>{"config.json", "model.safetensors"}));
  const json::Value cj = json::parse(io::read_file_prefix(out + "/config.json", 1 << 20));
  EXPECT_EQ(cj.find("architectures")->as_array()[0].as_string(), "LlamaForCausalLM");
  EXPECT_EQ(cj.find("model_type")->as_string(), "llama");
  EXPECT_EQ(cj.find("vocab_size")->as_int(), 37);
  EXPECT_EQ(cj.find(train::kTrainedSeqKey)->as_int(), kSeq);
  // The Hugging Face names: the model's parameters, each whole.
  const io::TensorMap saved = read(dir_ + "/w2-at2.safetensors");
  const auto ref = plain_with(saved);
  const io::TensorMap written = read(out + "/model.safetensors");
  ASSERT_EQ(written.size(), ref->named_parameters().size());
  for (const auto& [n, t] : ref->named_parameters())
    EXPECT_TRUE(same_bits(find(written, n), *t, n + " in model.safetensors"));
  // The logits of the unsharded model with the same weights, on a batch.
  const auto hf = train::load_model(out);
  const Batch b = batch_rows(7, 0, 4, tiny_config().vocab_size);
  NoGradGuard ng;
  const Tensor want = ref->logits(b.input);
  EXPECT_TRUE(same_bits(hf->logits(b.input), want, "logits of the consolidated model"));
  // The same from the checkpoint folder itself, and with --step.
  for (const std::string& args : {run + "/step-2 " + out + "2", run + " " + out + "3 --step 2"}) {
    const auto r2 = run_command(dist::test::kiln_cli() + " convert " + args + " --hf", 60);
    ASSERT_EQ(r2.status, 0) << r2.output;
  }
  EXPECT_TRUE(same_bits(train::load_model(out + "2")->logits(b.input), want, "converted from step-2"));
  EXPECT_TRUE(same_bits(train::load_model(out + "3")->logits(b.input), want, "converted with --step 2"));
  // No step-9; --force without --hf.
  auto bad = run_command(dist::test::kiln_cli() + " convert " + run + " " + out + "4 --hf --step 9", 60);
  EXPECT_EQ(bad.status, 1);
  EXPECT_TRUE(contains(bad.output, "step-9 does not exist")) << bad.output;
  bad = run_command(dist::test::kiln_cli() + " convert " + run + " " + out + "4 --force", 60);
  EXPECT_EQ(bad.status, 1);
  EXPECT_TRUE(contains(bad.output, "--step and --force go with --hf")) << bad.output;
  EXPECT_FALSE(fs::exists(out + "4"));
}

TEST(FsdpConvert, AOneProcessCheckpointConvertsWithoutItsOptimizerState) {
  // kiln train's one-process checkpoint (save_checkpoint with the optimizer and trainer state).
  nn::LlamaForCausalLM model(tiny_config(), kSeed);
  std::vector<std::pair<std::string, Tensor>> named;
  for (auto& [n, t] : model.named_parameters()) named.emplace_back(n, *t);
  optim::AdamW opt(named, adam_options());
  const Batch b = batch_rows(0, 0, 4, tiny_config().vocab_size);
  model.loss_sum(b.input, b.target, Tensor(), static_cast<double>(count_targets(b.target))).backward();
  opt.step();
  const std::string dir = fresh_test_dir("single1p") + "/step-1";
  train::CheckpointData d;
  d.model = &model;
  d.optimizer_tensors = opt.state_dict().tensors;
  d.trainer_state = json::Value::object();
  d.trainer_state["config"] = json::Value::object();
  d.trainer_state["config"]["seq"] = kSeq;
  train::save_checkpoint(dir, d);
  ASSERT_TRUE(fs::exists(dir + "/optimizer.safetensors"));
  const std::string out = fresh_test_dir("single1p_out") + "/hf";
  const train::HfExportResult r = train::export_hf(dir, out);
  EXPECT_FALSE(r.sharded);
  EXPECT_EQ(r.checkpoint, dir);
  EXPECT_EQ(names_in(out), (std::vector<std::string>{"config.json", "model.safetensors"}));
  NoGradGuard ng;
  EXPECT_TRUE(same_bits(train::load_model(out)->logits(b.input), model.logits(b.input), "logits"));
  EXPECT_EQ(train::trained_seq_len(out), kSeq);
}

TEST_F(FsdpCheckpoint, ConvertRefusesToOverwriteAndLeavesOutAsItWasOnAnyFailure) {
  KILN_SKIP_WITHOUT_GLOO();
  ASSERT_TRUE(saved_ok_);
  const std::string run = sharded_run(dir_ + "/step-2", "hfrefuse");
  const std::string parent = fresh_test_dir("hfrefuse_out"), out = parent + "/hf";
  fs::create_directories(out);
  std::ofstream(out + "/keep.txt") << "the user's";
  auto expect_error = [&](const std::function<void()>& fn, const std::vector<std::string>& want) {
    try {
      fn();
      ADD_FAILURE() << "no error; wanted " << want[0];
    } catch (const Error& e) {
      for (const auto& w : want) EXPECT_TRUE(contains(e.what(), w)) << e.what() << "\nmissing: " << w;
    }
    EXPECT_EQ(names_in(out), (std::vector<std::string>{"keep.txt"}));  // untouched
    EXPECT_EQ(names_in(parent), (std::vector<std::string>{"hf"}));     // no temporary left
  };
  // A non-empty OUT, without --force.
  expect_error([&] { train::export_hf(run, out); }, {out, "not empty", "--force"});
  train::HfExportOptions force;
  force.force = true;
  // A failure while writing (after model.safetensors is written).
  train::HfExportOptions failing = force;
  failing.hook = [](const std::string& file) {
    if (file == "model.safetensors") fail("injected: disk full after ", file);
  };
  expect_error([&] { train::export_hf(run, out, failing); }, {"injected: disk full"});
  // Damaged checkpoints: named, and OUT untouched.
  const std::string victim = "model.layers.0.self_attn.o_proj.weight";
  json::Value idx = json::parse(io::read_file_prefix(run + "/step-2/" + kShardedIndexFile, 1 << 24));
  const json::Value whole = idx;
  auto write_index = [&](const json::Value& v) {
    std::ofstream(run + "/step-2/" + kShardedIndexFile, std::ios::trunc) << v.dump(1);
  };
  idx["tensors"][victim]["chunks"].as_array().pop_back();  // a chunk missing
  write_index(idx);
  expect_error([&] { train::export_hf(run, out, force); }, {victim, "in no chunk", kShardedIndexFile});
  idx = whole;
  idx["tensors"][victim]["chunks"].as_array()[1]["offset"].as_array()[0] = 5;  // overlapping
  idx["tensors"][victim]["chunks"].as_array()[1]["shape"].as_array()[0] = 15;
  write_index(idx);
  expect_error([&] { train::export_hf(run, out, force); }, {victim, "overlap"});
  write_index(whole);
  const std::string shard = run + "/step-2/shard-00001-of-00002.safetensors";
  fs::copy_file(shard, shard + ".bak");
  fs::resize_file(shard, fs::file_size(shard) - 64);  // cut short
  expect_error([&] { train::export_hf(run, out, force); }, {"shard-00001-of-00002.safetensors", "holding tensor '"});
  fs::remove(shard);  // missing
  expect_error([&] { train::export_hf(run, out, force); }, {"shard-00001-of-00002.safetensors", "does not exist", "tensor '"});
  fs::rename(shard + ".bak", shard);
  // A tensor that is no parameter of config.json's model (tied embeddings, an lm_head stored).
  {
    json::Value cj = json::parse(io::read_file_prefix(run + "/step-2/config.json", 1 << 20));
    const json::Value keep = cj;
    cj["tie_word_embeddings"] = true;
    std::ofstream(run + "/step-2/config.json", std::ios::trunc) << cj.dump(2);
    expect_error([&] { train::export_hf(run, out, force); }, {"lm_head.weight", "neither a parameter"});
    std::ofstream(run + "/step-2/config.json", std::ios::trunc) << keep.dump(2);
  }
  // OUT is the checkpoint, or holds it: refused even with --force.
  try {
    train::export_hf(run, run, force);
    ADD_FAILURE() << "converted onto the run folder";
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "is or holds the checkpoint")) << e.what();
  }
  try {
    train::export_hf(run, run + "/step-2/hf", force);
    ADD_FAILURE() << "converted into the checkpoint";
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "inside the checkpoint")) << e.what();
  }
  EXPECT_TRUE(fs::exists(run + "/step-2/" + kShardedIndexFile));
  // A folder with no checkpoint.
  try {
    train::export_hf(parent + "/none", parent + "/x");
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "no checkpoint in")) << e.what();
  }
  // With --force, once whole: OUT replaced.
  train::export_hf(run, out, force);
  EXPECT_EQ(names_in(out), (std::vector<std::string>{"config.json", "model.safetensors"}));
  EXPECT_EQ(names_in(parent), (std::vector<std::string>{"hf"}));
}

// ---- mixed precision ----

TEST(Fsdp, MixedPrecisionGathersInBf16AndReducesOntoF32Shards) {
  KILN_SKIP_WITHOUT_GLOO();
  LocalWorld w;
  FsdpOptions o;
  o.mixed_precision.param_dtype = DType::bf16;
  o.mixed_precision.reduce_dtype = DType::f32;
  ShardedRun run = make_sharded(w.comm, o);
  DType seen = DType::f32;
  auto& layer = *run.model->model->layers[0];
  layer.register_forward_pre_hook([&](const nn::Module&) { seen = layer.mlp->up_proj->weight.dtype(); });
  const RunResult ref = train_plain(1, 1);
  const Batch b = batch_rows(0, 0, kGlobalBatch, run.model->config.vocab_size);
  Tensor l = run.model->loss_sum(b.input, b.target, Tensor(), static_cast<double>(count_targets(b.target)));
  l.backward();
  EXPECT_EQ(seen, DType::bf16);  // the gathered parameters, after FSDP's pre-forward hook
  EXPECT_NEAR(l.item(), ref.losses[0], 2e-2 * std::abs(ref.losses[0]));
  for (auto& [n, t] : run.fsdp->named_shards()) {
    EXPECT_EQ(t.dtype(), DType::f32) << n;
    ASSERT_TRUE(t.grad().defined()) << n;
    EXPECT_EQ(t.grad().dtype(), DType::f32) << n;
  }
}
