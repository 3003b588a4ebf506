// Trainer::State: what the phases of a run share (trainer.h), set up by trainer_setup.cpp and
// used by trainer.cpp. Internal to kiln/train.
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kiln/data/dataset.h"
#include "kiln/data/tokenizer.h"
#include "kiln/nn/llama.h"
#include "kiln/optim/adamw.h"
#include "kiln/optim/in_backward.h"
#include "kiln/optim/schedule.h"
#include "kiln/parallel/fsdp.h"
#include "kiln/train/mfu.h"
#include "kiln/train/precision.h"
#include "kiln/train/report.h"
#include "kiln/train/run_folder.h"
#include "kiln/train/step_graph.h"
#include "kiln/train/step_profile.h"
#include "kiln/train/trainer.h"

namespace kiln::train {

struct Trainer::State {
  using Clock = std::chrono::steady_clock;
  TrainConfig cfg;
  TrainHooks hooks;
  // resume
  std::string resume_dir;  // "" for a fresh run
  json::Value resume_state;
  int64_t saved_steps = -1;  // a resumed run's own --steps (another one stretches its decay)
  // the run folder
  std::unique_ptr<RunLock> lock;
  std::unique_ptr<MetricsLog> metrics;
  std::string stale_note;
  // device and precision
  Device dev;
  bool bf16 = false;
  std::unique_ptr<Progress> progress;
  // data
  data::TokenStream stream;
  std::unique_ptr<data::Tokenizer> tok;
  int64_t vocab = 0;
  data::Split split;
  std::unique_ptr<data::Sampler> train_sampler, val_sampler;
  int64_t eval_batches = 0;  // at most what the validation split holds
  std::string eval_note;     // said when it was clamped
  std::string data_checksum;
  // ranks: the world (null: one process), this rank, and the micro-batches of a step: a global
  // batch is `micro_total` micro-batches of cfg.batch sequences, rank r draws `accum_local` of
  // them from `micro_first` on and skips the others' (the data order does not depend on the ranks)
  std::shared_ptr<dist::Communicator> world;
  int rank = 0, world_size = 1;
  int64_t micro_total = 1, accum_local = 1, micro_first = 0;
  std::shared_ptr<parallel::FsdpModule> fsdp;  // the root's, when sharded
  // model and optimizer
  std::unique_ptr<nn::LlamaForCausalLM> model;
  std::unique_ptr<ParamCast> cast;
  std::unique_ptr<optim::AdamW> opt;
  std::unique_ptr<optim::OptimizerInBackward> in_backward;  // --optimizer-in-backward: opt's steps in the backward
  optim::LrSchedule sched;
  std::unique_ptr<StepGraph> graph;  // --cuda-graphs, where the run allows them (step_graph.h)
  // MFU (mfu.h) and, while run() profiles, the phase times of the steps (step_profile.h)
  double flops_per_token = 0;
  PeakFlops peak;
  StepProfile step_profile{nullptr};
  // progress of the run
  TrainSummary sum;
  int64_t step = 0, tokens_seen = 0;
  double elapsed_before = 0;  // seconds trained before a resume
  Clock::time_point t0;
  bool already_done = false;
  // failures of a job of several ranks (docs/training.md, "When a rank dies")
  bool own_folder = false;      // a restarted rank's run folder holds this job's files (its job marker)
  std::string restart_note;     // how the restart found its checkpoint (a damaged latest)
  std::string last_ckpt_dir;    // the checkpoint a shrink goes back to: the last written, or the resume's
  int64_t last_ckpt_step = 0;
  std::vector<int> members;     // the launcher's rank of each rank of the current world
  int64_t kill_at_step = -1;    // KILN_TEST_KILL_AT=RANK:STEP,... (tests): this process SIGKILLs itself then

  void setup(const TrainConfig& cfg_in);
  void resolve_config(const TrainConfig& cfg_in);
  void prepare_run_folder();
  void load_data();
  void plan_ranks(int64_t keep_global = 0);
  void build_model();
  // --cuda-graphs (step_graph.h): `on` refused, before the run folder exists, where the run cannot
  // use graphs; the StepGraph made where it can (else auto's note).
  void refuse_cuda_graphs_on() const;
  void plan_cuda_graphs();
  bool is_rank0() const { return rank == 0; }
  std::shared_ptr<const attention::RuntimeMods> compile_runtime_mods(const nn::LlamaConfig& mcfg);
  void load_resume_state();
  // The step, the sampler's position and the tokens seen of a checkpoint's trainer_state.json;
  // returns its elapsed_s.
  double restore_position(const json::Value& trainer_state);
  void open_run();
  void open_rank0_files(int64_t keep_until_step);
  bool shrinks() const { return world && cfg.on_failure == "shrink"; }
  // --on-failure shrink: the survivors of `lost` rebuild the model, the optimizer and FSDP on the
  // smaller world, reload the last checkpoint resharded and go on from its step; returns the
  // metrics record of the event.
  json::Value recover(const dist::PeerLost& lost, Clock::time_point failed_at);
  void maybe_kill_self(int64_t step_done) const;
  double seconds() const { return std::chrono::duration<double>(Clock::now() - t0).count(); }
};

}  // namespace kiln::train
