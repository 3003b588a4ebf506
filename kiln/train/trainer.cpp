// The Trainer's step, eval and checkpoint phases and the run that drives them (trainer.h); the
// setup phase is trainer_setup.cpp.
#include "kiln/train/trainer.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <new>
#include <optional>
#include <sstream>

#include "kiln/autograd/grad_mode.h"
#include "kiln/core/allocator.h"
#include "kiln/core/profile.h"
#include "kiln/nn/generate.h"
#include "kiln/ops/ops.h"
#include "kiln/parallel/dcp.h"
#include "kiln/telemetry/telemetry.h"
#include "kiln/train/trainer_state.h"

namespace kiln::train {

namespace fs = std::filesystem;

Trainer::Trainer(const TrainConfig& cfg, const TrainHooks& hooks) : s_(std::make_unique<State>()) {
  s_->hooks = hooks;
  s_->setup(cfg);
}

Trainer::~Trainer() = default;

const TrainConfig& Trainer::config() const { return s_->cfg; }
nn::LlamaForCausalLM& Trainer::model() { return *s_->model; }
int64_t Trainer::current_step() const { return s_->step; }
bool Trainer::already_done() const { return s_->already_done; }

StepResult Trainer::step() {
  State& s = *s_;
  const TrainConfig& cfg = s.cfg;
  const auto t_step = std::chrono::steady_clock::now();
  StepResult r;
  r.lr = s.sched.lr_at(s.step);
  s.opt->set_lr(r.lr);
  std::vector<data::Batch> micro;
  int64_t targets = 0;
  try {
    StepProfile::Wall data_time(s.step_profile, &PhaseTimes::data_ms);
    profile::Label label("data:", "batch");
    // This rank's micro-batches of the global batch; the others' are skipped (trainer_state.h).
    for (int64_t i = 0; i < s.micro_total; ++i) {
      if (i < s.micro_first || i >= s.micro_first + s.accum_local) {
        s.train_sampler->set_position(s.train_sampler->position() + static_cast<uint64_t>(cfg.batch));
        continue;
      }
      micro.push_back(s.train_sampler->next(s.dev));
      targets += micro.back().num_targets;
    }
  } catch (const std::bad_alloc&) {
    fail("train: a step's batch=", cfg.batch, " x seq=", cfg.seq, " x accum=", s.accum_local,
         " tokens cannot be allocated (out of host memory); use a smaller --batch, --seq or --accum");
  }
  // Sharded: the loss divides by the targets of every rank (so the summed gradient is the global
  // mean's), each rank runs every micro-batch (its backward's collectives are the others' too),
  // and the gradients are reduced once, at the last micro-batch (parallel/fsdp.h).
  const double divide_by = s.world ? parallel::global_count(*s.world, targets, s.dev) : static_cast<double>(targets);
  const double comm_before = s.fsdp ? s.fsdp->stats().all_gather_wait_s + s.fsdp->stats().reduce_scatter_wait_s : 0;
  // The loss stays on the device until the gradient norm has synchronised the host anyway
  // (reading it before the backward would stall the GPU while the backward is enqueued).
  Tensor loss_dev;
  if (s.in_backward) s.in_backward->begin_step();
  for (size_t a = 0; a < micro.size(); ++a) {
    const data::Batch& b = micro[a];
    if (b.num_targets == 0 && !s.fsdp) continue;
    if (s.fsdp) s.fsdp->set_requires_gradient_sync(a + 1 == micro.size());
    auto forward_backward = [&](const data::Batch& mb) {
      // This micro-batch's own bf16 parameters (precision.h), kept through its backward: an
      // activation checkpoint's recomputation reads them there.
      ParamCast::Forward cast(*s.cast);
      Tensor ls;
      {
        profile::Label label("forward:", "loss");  // the backward's kernels the engine labels "backward:"
        // this micro-batch's share of the mean over the whole accumulated (global) batch
        ls = s.model->loss_sum(mb.input, mb.target, cfg.document_mask() ? mb.doc_ids : Tensor(),
                               std::max(divide_by, 1.0));
      }
      ls.backward();
      return ls.detach();
    };
    // --cuda-graphs: captured once, then replayed (step_graph.h)
    const Tensor ls = s.graph ? s.graph->run(b, divide_by, forward_backward) : forward_backward(b);
    loss_dev = loss_dev.defined() ? add(loss_dev, ls) : ls;
  }
  {
    profile::Label label("optimizer:", "step");
    if (s.in_backward) {
      // Every parameter was updated in the backward (optim/in_backward.h): count the step, read
      // its norm. Nothing can be skipped any more.
      r.grad_norm = s.in_backward->end_step();
    } else if (s.fsdp) {
      // The norm over every rank's shards (one all-reduce, parallel/fsdp.h), its clip folded into
      // the multi-tensor update as below; a non-finite norm skips the step.
      r.grad_norm = s.fsdp->grad_norm();
      r.skipped = !s.opt->step_with_norm(r.grad_norm, cfg.clip > 0 ? cfg.clip : INFINITY);
    } else {
      // The multi-tensor update with the clip folded in (docs/optim.md): the norm from one
      // reduction, the clip's scale applied inside the update, no step when the norm is not
      // finite; --clip 0 measures the norm only (max_norm inf).
      r.grad_norm = s.opt->clip_and_step(cfg.clip > 0 ? cfg.clip : INFINITY);
      r.skipped = !std::isfinite(r.grad_norm);
    }
    s.opt->zero_grad();
  }
  if (s.fsdp) {
    const parallel::FsdpStats st = s.fsdp->stats();
    s.step_profile.add_comm(1e3 * (st.all_gather_wait_s + st.reduce_scatter_wait_s - comm_before));
    if (!loss_dev.defined()) loss_dev = zeros({}, DType::f32, s.dev);
    loss_dev = loss_dev.to(DType::f32).contiguous();
    s.world->all_reduce(loss_dev, dist::ReduceOp::sum)->wait();  // the global batch's mean loss
  }
  r.loss = loss_dev.defined() ? loss_dev.item() : 0.0;
  r.step = ++s.step;
  r.tokens = cfg.batch * cfg.seq * s.micro_total;  // every rank's
  s.tokens_seen += r.tokens;
  s.sum.losses.push_back(r.loss);
  if (s.sum.losses.size() == 1) s.sum.first_loss = r.loss;
  s.sum.final_loss = r.loss;
  s.step_profile.add_step(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t_step).count());
  return r;
}

double Trainer::eval() {
  State& s = *s_;
  if (!s.val_sampler) return -1;
  const std::atomic<bool>* stop = s.hooks.stop;
  s.model->eval();
  NoGradGuard ng;
  s.val_sampler->set_position(0);  // the same held-out batches every time
  double sum = 0;
  int64_t count = 0;
  bool stopped = false;
  for (int64_t i = 0; i < s.eval_batches; ++i) {
    if (stop && stop->load()) {  // a signal is not held up by a long evaluation
      stopped = true;
      break;
    }
    profile::Label label("eval:", "loss");  // not a step's phase (step_profile.h)
    data::Batch b = s.val_sampler->next(s.dev);
    ParamCast::Forward cast(*s.cast);
    sum += s.model->loss_sum(b.input, b.target, s.cfg.document_mask() ? b.doc_ids : Tensor()).item();
    count += b.num_targets;
  }
  s.model->train();
  if (stopped) return -1;
  return count ? sum / static_cast<double>(count) : 0.0;
}

void Trainer::checkpoint(const std::string& why) {
  State& s = *s_;
  json::Value st = json::Value::object();
  optim::OptimizerState os = s.opt->state_dict();
  st["step"] = s.step;
  st["sampler_position"] = static_cast<int64_t>(s.train_sampler->position());
  st["tokens_seen"] = s.tokens_seen;
  st["elapsed_s"] = s.elapsed_before + s.seconds();
  st["reason"] = why;
  st["data_checksum"] = s.data_checksum;
  st["config"] = s.cfg.to_json();
  st["optimizer"] = os.scalars;
  std::string name = "step-" + std::to_string(s.step);
  std::string dir = (fs::path(s.cfg.out) / name).string();
  if (s.fsdp) {
    // Sharded (parallel/dcp.h): every rank writes its shards and their optimizer state, rank 0
    // the index, config.json and trainer_state.json; loads at any world size (load_checkpoint).
    nn::LlamaConfig mc = s.model->config;
    parallel::save_checkpoint(dir, *s.fsdp, *s.opt, [&](const std::string& tmp) {
      json::Value cj = mc.to_json();
      cj[kTrainedSeqKey] = s.cfg.seq;
      std::ofstream(fs::path(tmp) / "config.json") << cj.dump(2) << "\n";
      std::ofstream(fs::path(tmp) / "trainer_state.json") << st.dump(1) << "\n";
    });
  } else {
    CheckpointData d;
    d.model = s.model.get();
    d.tokenizer = s.tok.get();
    d.optimizer_tensors = os.tensors;
    d.trainer_state = std::move(st);
    save_checkpoint(dir, d, s.hooks.checkpoint_hook);
  }
  if (s.is_rank0()) mark_latest(s.cfg.out, name, s.cfg.keep_ckpts);
  s.sum.checkpoint = dir;
  s.last_ckpt_dir = dir;
  s.last_ckpt_step = s.step;
}

namespace {

// "MFU against 989.4 TFLOP/s (NVIDIA H200 (bf16 dense, data sheet)), 9.84 GFLOP per token".
std::string mfu_basis(const Trainer::State& s) {
  char buf[320];
  const std::string ranks = s.world_size > 1 ? std::to_string(s.world_size) + " ranks x " : "";
  std::snprintf(buf, sizeof buf, "MFU against %s%.4g TFLOP/s (%s)%s, %.4g GFLOP per token (6 x parameters + 12 x "
                "layers x hidden x seq)", ranks.c_str(), s.peak.tflops, s.peak.source.c_str(),
                s.peak.estimate ? ", an estimate" : "", s.flops_per_token / 1e9);
  return buf;
}

json::Value mfu_json(const Trainer::State& s, double tokens_per_s) {
  json::Value v = json::Value::object();
  v["flops_per_token"] = s.flops_per_token;
  v["tokens_per_s"] = tokens_per_s;
  v["peak_tflops"] = s.peak.tflops;
  v["peak_source"] = s.peak.source;
  v["estimate"] = s.peak.estimate;
  if (s.peak.tflops > 0) v["mfu"] = mfu(s.flops_per_token, tokens_per_s, s.peak.tflops * s.world_size);
  return v;
}

// The phases of the profiled steps, ms per step and share, then the MFU of their tokens/s.
std::string phase_table(const PhaseTimes& p, const Trainer::State& s, double tokens_per_s) {
  std::ostringstream o;
  const double n = p.steps > 0 ? static_cast<double>(p.steps) : 1.0, total = std::max(p.step_ms, 1e-9);
  o << "step phases (" << p.steps << " steps, " << p.step_ms / n << " ms per step):\n";
  const std::pair<const char*, double> rows[] = {{"forward", p.forward_ms},     {"backward", p.backward_ms},
                                                 {"optimizer", p.optimizer_ms}, {"data", p.data_ms},
                                                 {"comm", p.comm_ms},           {"other", p.other_ms()}};
  char line[128];
  for (const auto& [name, ms] : rows) {
    std::snprintf(line, sizeof line, "  %-10s %10.3f ms %6.1f%%\n", name, ms / n, 100.0 * ms / total);
    o << line;
  }
  if (s.peak.tflops > 0) {
    std::snprintf(line, sizeof line, "MFU %.2f%% at %.0f tokens/s of these steps; ", 100.0 * mfu(s.flops_per_token,
                  tokens_per_s, s.peak.tflops * s.world_size), tokens_per_s);
    o << line << mfu_basis(s);
  } else {
    o << "MFU: no peak known for " << s.dev.str() << " (pass --peak-tflops T)";
  }
  return o.str();
}

// Tokens per second over windows of at least half a second (and at the last step).
class Throughput {
 public:
  explicit Throughput(std::chrono::steady_clock::time_point t0) : window_t_(t0) {}
  double add(int64_t tokens, bool last) {
    window_tokens_ += tokens;
    const auto now = std::chrono::steady_clock::now();
    const double wdt = std::chrono::duration<double>(now - window_t_).count();
    if (wdt > 0.5 || last) {
      tps_ = window_tokens_ / std::max(wdt, 1e-9);
      window_t_ = now;
      window_tokens_ = 0;
    } else if (tps_ == 0) {
      tps_ = window_tokens_ / std::max(wdt, 1e-9);
    }
    return tps_;
  }

 private:
  std::chrono::steady_clock::time_point window_t_;
  int64_t window_tokens_ = 0;
  double tps_ = 0;
};

// The sample at the end of a run: the prompt (--prompt, else "kiln ") and --sample-tokens more.
std::string sample_text(nn::LlamaForCausalLM& model, const data::Tokenizer& tok, const TrainConfig& cfg) {
  model.eval();
  std::string prompt = cfg.prompt.empty() ? "kiln " : cfg.prompt;
  std::vector<int32_t> ids;
  if (tok.bos_id() >= 0) ids.push_back(tok.bos_id());
  for (int32_t t : tok.encode(prompt)) ids.push_back(t);
  nn::GenerateOptions go;
  go.max_new_tokens = cfg.sample_tokens;
  go.temperature = 0.8;
  go.top_k = 40;
  go.seed = cfg.seed;
  go.eos_id = tok.eos_id();
  return prompt + tok.decode_continuation(ids, nn::generate(model, ids, go));
}

// One metrics.jsonl record of a step. `logged`: the profile's phase totals at the last record.
json::Value step_record(Trainer::State& s, const StepResult& r, double tps, double run_s, double eval_loss,
                        const MemoryStats& mem, PhaseTimes& logged) {
  const TrainConfig& cfg = s.cfg;
  json::Value m = json::Value::object();
  m["step"] = r.step;
  m["loss"] = r.loss;
  m["lr"] = r.lr;
  m["grad_norm"] = r.grad_norm;
  m["tokens_per_s"] = tps;
  m["tokens"] = s.tokens_seen;
  m["elapsed_s"] = s.elapsed_before + run_s;
  m["memory_bytes"] = mem.current_bytes;
  m["peak_memory_bytes"] = mem.peak_bytes;  // since the run began (reset at its setup)
  if (eval_loss >= 0) m["eval_loss"] = eval_loss;
  if (r.skipped) m["skipped"] = true;
  if (s.peak.tflops > 0) m["mfu"] = mfu(s.flops_per_token, tps, s.peak.tflops * s.world_size);
  if (s.step_profile.on()) {  // the steps since the last record, by phase (step_profile.h)
    const PhaseTimes now = s.step_profile.totals(), d = now.minus(logged);
    logged = now;
    m["profile"] = d.to_json();
  }
  if (cfg.telemetry_every > 0 && (r.step % cfg.telemetry_every == 0 || r.step == 1)) {
    try {
      m["telemetry"] = telemetry::to_json(telemetry::sample(s.dev));
    } catch (const Error&) {
      // telemetry is informative only: a platform that cannot say is not a training error
    }
  }
  return m;
}

// Why the loop stops early: a signal (hooks.stop), --max-time, or metrics that can no longer be
// written. The ranks agree (one rank's signal, clock or disk stops all): one all-reduce.
struct StopReasons {
  bool signal = false, out_of_time = false, log_failed = false;
  bool any() const { return signal || out_of_time || log_failed; }
};
StopReasons agree_to_stop(Trainer::State& s, StopReasons mine) {
  if (!s.world) return mine;
  Tensor flags = from_vector<int32_t>({mine.signal, mine.out_of_time, mine.log_failed}, {3}, s.dev);
  s.world->all_reduce(flags, dist::ReduceOp::max)->wait();
  const std::vector<int32_t> f = flags.to_vector<int32_t>();
  return {f[0] != 0, f[1] != 0, f[2] != 0};
}

// Rank 0 writes profile.json and prints the kernel and phase tables of the profiled steps.
void report_profile(Trainer::State& s, Progress& progress, profile::Profiler& prof, int64_t prof_from,
                    const PhaseTimes& phases) {
  const TrainConfig& cfg = s.cfg;
  json::Value pj = profile_to_json(prof);
  pj["steps"] = s.step - prof_from;
  pj["device"] = s.dev.str();
  pj["phases"] = phases.to_json();
  const double step_tps =
      phases.step_ms > 0 ? phases.steps * cfg.batch * cfg.seq * s.micro_total / (phases.step_ms / 1e3) : 0.0;
  pj["mfu"] = mfu_json(s, step_tps);
  std::ofstream(fs::path(cfg.out) / "profile.json") << pj.dump(1) << "\n";
  progress.message("profile of steps " + std::to_string(prof_from + 1) + ".." + std::to_string(s.step) + " (" +
                   (fs::path(cfg.out) / "profile.json").string() + "):\n" + prof.table() + "\n" +
                   phase_table(phases, s, step_tps));
}

// The sample of a sharded run: every rank gathers each parameter (one all-gather each), rank 0
// builds the whole model and generates; "" elsewhere, or when a rank is lost meanwhile.
std::string sharded_sample(Trainer::State& s, Progress& progress) {
  std::unique_ptr<nn::LlamaForCausalLM> whole;
  try {
    std::vector<std::pair<std::string, Tensor>> full;
    for (const auto& [name, shard] : s.fsdp->named_shards()) {
      Tensor t = s.fsdp->full_tensor(name);
      if (s.is_rank0()) full.emplace_back(name, t);
    }
    if (s.is_rank0()) {
      whole = std::make_unique<nn::LlamaForCausalLM>(s.model->config, s.cfg.seed, s.dev);
      load_model_state(*whole, full);
    }
  } catch (const dist::PeerLost& e) {
    progress.message(std::string("note: no sample: a rank was lost while the parameters were gathered (") + e.what() +
                     ")");
  }
  return whole ? sample_text(*whole, *s.tok, s.cfg) : "";
}

}  // namespace

TrainSummary Trainer::run() {
  State& s = *s_;
  const TrainConfig& cfg = s.cfg;
  const TrainHooks& hooks = s.hooks;
  TrainSummary& sum = s.sum;
  if (s.already_done) return sum;
  // Rank 0's (silent elsewhere); after a shrink the new rank 0's.
  Progress* progress = s.progress.get();
  MetricsLog* metrics = s.metrics.get();

  // ---- the op-level profile (the first step, a warm-up, is excluded when there are more) ----
  std::unique_ptr<profile::Profiler> prof;
  std::optional<profile::Session> prof_on;
  int64_t prof_from = s.step;
  if (cfg.profile || profile::env_requested()) {
    prof = std::make_unique<profile::Profiler>();
    prof_on.emplace(*prof);
    s.step_profile = StepProfile(prof.get());
    progress->message(s.peak.tflops > 0 ? mfu_basis(s) : "note: no peak FLOP/s known for " + s.dev.str() +
                                                             ": pass --peak-tflops T for the MFU");
  }
  PhaseTimes logged;  // the phase totals at the last metrics record

  Throughput throughput(s.t0);
  s.model->train();
  // A run whose loss is no longer finite has diverged (--lr far too high, bad data): after
  // kMaxNonFiniteSteps skipped steps in a row it stops with an error, saving nothing more (the
  // parameters may no longer be finite; the last interval checkpoint stays), and a run whose
  // last step is not finite ends with an error after its checkpoint, instead of "done".
  constexpr int kMaxNonFiniteSteps = 10;
  int non_finite_steps = 0;
  DivergenceWatch growth;  // a finite loss grown by orders of magnitude (report.h)
  auto diverged = [&](const char* what, double loss) {
    std::ostringstream m;
    m << "train: " << what << " (loss " << loss << ", " << non_finite_steps
      << " non-finite step(s) in a row up to step " << s.step << "): training diverged; lower --lr (it is " << cfg.lr
      << ") or check the data";
    return m.str();
  };
  // --on-failure shrink: a lost rank surfaces as PeerLost from any collective of the loop or of
  // the last checkpoint; the survivors rebuild on the smaller world, go back to the last
  // checkpoint (recover, trainer_setup.cpp) and run the loop again from there.
  bool finished = false, profile_done = false;
  std::optional<dist::PeerLost> lost;
  while (!finished) {
    try {
      while (s.step < cfg.steps) {
        const StepResult r = step();
        s.maybe_kill_self(r.step);
        const double tps = throughput.add(r.tokens, r.step == cfg.steps);
        const double run_s = s.seconds();
        double eval_loss = -1;
        if (s.val_sampler && cfg.eval_every > 0 && (r.step % cfg.eval_every == 0 || r.step == cfg.steps)) {
          eval_loss = eval();
          sum.final_eval_loss = eval_loss;
        }
        const MemoryStats mem = memory_stats(s.dev);
        if (r.step % cfg.log_every == 0 || eval_loss >= 0 || r.step == cfg.steps) {
          const json::Value m = step_record(s, r, tps, run_s, eval_loss, mem, logged);
          if (metrics) {
            metrics->write(m);
            if (const std::string w = metrics->take_warning(); !w.empty()) progress->message(w);
            if (hooks.on_log) hooks.on_log(m);
          }
        }
        const double eta = (cfg.steps - r.step) * run_s / std::max<int64_t>(r.step - sum.start_step, 1);
        progress->update(r.step, r.loss, tps, eta, mem.current_bytes, eval_loss);
        if (r.skipped)
          progress->message("warning: non-finite gradient norm at step " + std::to_string(r.step) + ", step skipped");
        if (s.in_backward && !std::isfinite(r.grad_norm)) {
          // Already applied: the parameters are no longer finite. Stop before anything is saved.
          progress->finish();
          fail("train: non-finite gradient norm (", r.grad_norm, ") at step ", r.step, " with --optimizer-in-backward, "
               "which updated the parameters with it (no step can be skipped there); nothing of this step was saved, "
               "the last checkpoint is the latest: lower --lr (it is ", cfg.lr, "), check the data, or train without "
               "--optimizer-in-backward to skip such steps");
        }
        non_finite_steps = r.skipped || !std::isfinite(r.loss) ? non_finite_steps + 1 : 0;
        growth.observe(r.loss);
        if (growth.in_a_row_limit()) {
          progress->finish();
          fail(growth.message("stopped: the loss has grown by orders of magnitude", r.step, cfg.lr));
        }
        if (non_finite_steps >= kMaxNonFiniteSteps) {
          progress->finish();
          fail(diverged("stopped: no recent step had a finite gradient norm", r.loss));
        }
        if (prof && r.step == sum.start_step + 1 && cfg.steps > r.step) {
          prof->reset();
          s.step_profile.reset();
          logged = PhaseTimes{};
          prof_from = r.step;
        }
        if (hooks.on_step) hooks.on_step(r.step);
        const StopReasons why = agree_to_stop(
            s, {hooks.stop && hooks.stop->load(), cfg.max_time > 0 && run_s >= cfg.max_time,
                metrics && metrics->stop_at(r.step, cfg.ckpt_every)});  // a full disk: stop at a checkpoint
        if (why.any()) {
          sum.interrupted = why.signal;
          sum.out_of_time = !why.signal && why.out_of_time;
          progress->message(why.signal        ? "interrupted: saving a checkpoint"
                            : why.out_of_time ? "time limit reached: saving a checkpoint"
                                              : "metrics cannot be written: saving a checkpoint and stopping");
          break;
        }
        if (cfg.ckpt_every > 0 && r.step % cfg.ckpt_every == 0 && r.step < cfg.steps) checkpoint("interval");
      }
      progress->finish();
      if (prof && !profile_done && !s.is_rank0()) {
        s.step_profile = StepProfile(nullptr);
      } else if (prof && !profile_done) {
        const PhaseTimes phases = s.step_profile.totals();
        s.step_profile = StepProfile(nullptr);
        prof_on.reset();
        report_profile(s, *progress, *prof, prof_from, phases);
      }
      profile_done = true;
      sum.steps_done = s.step;
      sum.seconds = s.seconds();
      sum.tokens_seen = s.tokens_seen;
      sum.tokens_per_s =
          sum.seconds > 0 ? (s.step - sum.start_step) * cfg.batch * cfg.seq * s.micro_total / sum.seconds : 0;
      sum.peak_memory_bytes = memory_stats(s.dev).peak_bytes;
      sum.graph_replays = s.graph ? s.graph->replays() : 0;
      checkpoint(sum.interrupted ? "interrupted" : "end");
      finished = true;
    } catch (const dist::PeerLost& e) {
      if (!s.shrinks()) throw;
      lost.emplace(e);
    }
    while (lost) {  // a rank lost again while recovering: recover from that
      const dist::PeerLost now = *lost;
      lost.reset();
      try {
        const json::Value ev = s.recover(now, std::chrono::steady_clock::now());
        progress = s.progress.get();
        metrics = s.metrics.get();
        if (metrics) {
          metrics->write(ev);
          if (hooks.on_log) hooks.on_log(ev);
        }
        throughput = Throughput(std::chrono::steady_clock::now());
      } catch (const dist::PeerLost& again) {
        lost.emplace(again);
      }
    }
  }
  sum.rank = s.rank;
  sum.world_size = s.world_size;
  if (metrics) {
    std::ofstream svg(fs::path(cfg.out) / "loss.svg");
    svg << loss_curve_svg(curves_from_metrics(metrics->path()), "kiln train: " + cfg.preset + " preset");
  }
  KILN_CHECK(non_finite_steps == 0, diverged("the last step was not finite; its checkpoint was saved anyway",
                                             sum.final_loss));
  KILN_CHECK(!growth.last_diverged(), growth.message("the loss has grown by orders of magnitude; the last "
                                                     "checkpoint was saved anyway", s.step, cfg.lr));
  KILN_CHECK(!metrics || metrics->ok(), "train: ", metrics ? metrics->error() : "", "; the run stopped at step ", s.step,
             " with checkpoint ", sum.checkpoint, ": free space and continue it with --resume ", cfg.out);
  if (cfg.sample_tokens > 0 && !sum.interrupted && s.tok) {  // token data without a tokenizer: no sample
    sum.sample = s.fsdp ? sharded_sample(s, *progress) : sample_text(*s.model, *s.tok, cfg);
  }
  return sum;
}

TrainSummary run_training(const TrainConfig& cfg, const TrainHooks& hooks) { return Trainer(cfg, hooks).run(); }

}  // namespace kiln::train
