// The training loop of `kiln train`: data, model, AdamW with warmup + cosine, clipping,
// gradient accumulation (the loss of each micro-batch is a sum divided by the count of
// non-ignored targets over the whole accumulated batch, so accumulation equals one big
// batch), bf16 mixed precision with f32 master weights on CUDA, evaluation, checkpoints
// (every N steps, at the end, and when `stop` is set, e.g. by Ctrl-C), resume, metrics log,
// progress, loss-curve SVG, and a generated sample at the end.
#pragma once
#include <cstdint>
#include <atomic>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "kiln/train/checkpoint.h"
#include "kiln/train/config.h"

namespace kiln::train {

struct TrainHooks {
  const std::atomic<bool>* stop = nullptr;  // checked after every step
  FILE* progress = stderr;                   // null: silent
  WriteHook checkpoint_hook;                 // tests inject checkpoint failures
  std::function<void(int64_t step)> on_step;  // after each step (before the stop check)
  std::function<void(const json::Value& record)> on_log;  // each metrics.jsonl record, once written
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
  std::vector<double> losses;  // per step of this run
};

// Runs training. With cfg.resume set, the run continues from that checkpoint (a run
// directory's latest, or a checkpoint directory) with the configuration saved there; only
// steps, out, max_time, the eval/ckpt/log intervals and the final sample come from `cfg`.
TrainSummary run_training(const TrainConfig& cfg, const TrainHooks& hooks = {});

}  // namespace kiln::train
