// The Trainer of `kiln train`, in phases: setup (resume, data, model, optimizer, run folder),
// step (the micro-batches' forward and backward, clipping, the optimizer), eval (the held-out
// loss), checkpoint, and run() which drives them with the metrics log, the progress line,
// divergence checks, interval checkpoints, the profile and the final sample.
//
// What a step computes: AdamW with warmup + cosine, clipping, gradient accumulation (the loss
// of each micro-batch is a sum divided by the count of non-ignored targets over the whole
// accumulated batch, so accumulation equals one big batch), and bf16 mixed precision with f32
// master weights (the bf16 parameters are materialised per forward: trainer_precision.h).
// A checkpoint is written every N steps, at the end, and when `stop` is set (e.g. by Ctrl-C).
#pragma once
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kiln/dist/communicator.h"
#include "kiln/train/checkpoint.h"
#include "kiln/train/config.h"

namespace kiln::train {

struct TrainHooks {
  const std::atomic<bool>* stop = nullptr;  // checked after every step
  FILE* progress = stderr;                   // null: silent
  WriteHook checkpoint_hook;                 // tests inject checkpoint failures
  std::function<void(int64_t step)> on_step;  // after each step (before the stop check)
  std::function<void(const json::Value& record)> on_log;  // each metrics.jsonl record, once written
  // The job's world (kiln launch, torchrun: dist::init_world): the model is FSDP-sharded over it
  // (parallel/fsdp.h), rank r takes its slice of each global batch, rank 0 alone writes the
  // metrics, the loss curve and the run folder's files. Null: one process, unsharded.
  std::shared_ptr<dist::Communicator> world;
  // A job of several ranks (kiln launch, torchrun): which attempt this process is
  // (TORCHELASTIC_RESTART_COUNT) and the job's id, the same on every rank and every attempt. A
  // restarted rank (restart_count > 0) continues from the run folder's latest checkpoint when
  // this job wrote there (run_folder.h: the folder's job marker), without cfg.resume.
  int restart_count = 0;
  std::string job_id;
};

struct TrainSummary {
  int64_t start_step = 0, steps_done = 0;  // steps_done: the step count at the end
  double first_loss = 0, final_loss = 0, final_eval_loss = -1;
  double tokens_per_s = 0, seconds = 0;
  int64_t num_parameters = 0, tokens_seen = 0, peak_memory_bytes = 0;
  bool interrupted = false;
  bool out_of_time = false;   // stopped by --max-time before --steps
  bool already_done = false;  // resumed at its last step: nothing trained, saved or sampled
  std::string checkpoint;  // the last one written
  std::string sample;      // generated text (when sample_tokens > 0)
  std::vector<double> losses;  // per step of this run (after a shrink: of the steps kept)
  int rank = 0;                // this process's rank at the end (after a shrink, maybe another)
  int world_size = 1;          // the ranks at the end (fewer after a shrink)
  int shrinks = 0;             // ranks lost and survived (--on-failure shrink)
  int64_t graph_replays = 0;   // micro-batches run as replays of the captured CUDA graphs (--cuda-graphs)
};

// What one optimizer step did.
struct StepResult {
  int64_t step = 0;  // the step count after it
  double loss = 0;   // the accumulated batch's mean loss
  double lr = 0;
  double grad_norm = 0;
  bool skipped = false;  // a non-finite gradient norm: no update
  int64_t tokens = 0;    // batch x seq x accum
};

class Trainer {
 public:
  // Setup: with cfg.resume set, the run continues from that checkpoint (a run directory's
  // latest, or a checkpoint directory) with the configuration saved there; only the settings a
  // resumed run may change (changeable_on_resume, and out) come from `cfg`. Refuses bad input
  // before it writes anything (no run folder is left behind).
  explicit Trainer(const TrainConfig& cfg, const TrainHooks& hooks = {});
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // The whole run: steps until --steps, a stop, --max-time or a failed metrics log; then the
  // last checkpoint, the loss curve and the sample. Call it once.
  TrainSummary run();

  // The phases run() is made of (each usable alone, e.g. by tests).
  StepResult step();
  // The mean held-out loss; -1 when `stop` was set between two batches, or there is no
  // validation split.
  double eval();
  // Writes DIR/step-N (N: the current step), marks it latest, keeps --keep-ckpts of them.
  void checkpoint(const std::string& why);

  const TrainConfig& config() const;
  nn::LlamaForCausalLM& model();
  int64_t current_step() const;
  // Resumed at its last step: run() trains, saves and samples nothing.
  bool already_done() const;

  struct State;

 private:
  std::unique_ptr<State> s_;
};

// Trainer(cfg, hooks).run().
TrainSummary run_training(const TrainConfig& cfg, const TrainHooks& hooks = {});

}  // namespace kiln::train
