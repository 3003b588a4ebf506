// The training loop (see trainer.h).
#include "kiln/train/trainer.h"

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <new>
#include <optional>
#include <sstream>

#include "kiln/autograd/grad_mode.h"
#include "kiln/core/allocator.h"
#include "kiln/core/profile.h"
#include "kiln/data/dataset.h"
#include "kiln/data/default_corpus.h"
#include "kiln/data/token_file.h"
#include "kiln/io/safetensors.h"
#include "kiln/nn/generate.h"
#include "kiln/ops/ops.h"
#include "kiln/optim/adamw.h"
#include "kiln/optim/clip.h"
#include "kiln/optim/schedule.h"
#include "kiln/telemetry/telemetry.h"
#include "kiln/train/memory_estimate.h"
#include "kiln/train/report.h"
#include "kiln/train/run_folder.h"

namespace kiln::train {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

// Forward in bf16 copies of the f32 master weights: for the scope of the guard each module
// parameter is replaced by a (recorded) cast, so gradients flow back to the f32 masters.
class Bf16Params {
 public:
  Bf16Params(nn::Module& m, bool on) {
    if (!on) return;
    for (auto& [n, p] : m.named_parameters()) {
      saved_.emplace_back(p, *p);
      *p = p->to(DType::bf16);
    }
  }
  ~Bf16Params() {
    for (auto& [p, master] : saved_) *p = master;
  }

 private:
  std::vector<std::pair<Tensor*, Tensor>> saved_;
};

// -1 when `stop` was set between two batches (a signal is not held up by a long evaluation).
double evaluate(const nn::LlamaForCausalLM& model, data::Sampler& val, int64_t batches, Device dev, bool bf16,
                bool doc_mask, const std::atomic<bool>* stop) {
  NoGradGuard ng;
  val.set_position(0);  // the same held-out batches every time
  double sum = 0;
  int64_t count = 0;
  Bf16Params cast(const_cast<nn::LlamaForCausalLM&>(model), bf16);
  for (int64_t i = 0; i < batches; ++i) {
    if (stop && stop->load()) return -1;
    data::Batch b = val.next(dev);
    sum += model.loss_sum(b.input, b.target, doc_mask ? b.doc_ids : Tensor()).item();
    count += b.num_targets;
  }
  return count ? sum / static_cast<double>(count) : 0.0;
}

}  // namespace

TrainSummary run_training(const TrainConfig& cfg_in, const TrainHooks& hooks) {
  TrainConfig cfg = cfg_in;
  // ---- resume: the saved configuration wins, except for what may change between runs ----
  std::string resume_dir;
  json::Value resume_state;
  int64_t saved_steps = -1;  // a resumed run's own --steps (another one stretches its decay)
  if (!cfg_in.resume.empty()) {
    resume_dir = find_checkpoint(cfg_in.resume);
    KILN_CHECK(!resume_dir.empty(), "resume: no checkpoint in '", cfg_in.resume, "'", why_no_checkpoint(cfg_in.resume));
    resume_state = read_trainer_state(resume_dir);
    cfg = TrainConfig{};
    apply_config_json(cfg, *resume_state.find("config"));
    saved_steps = cfg.steps;
    for (const ConfigField& f : config_fields())  // the settings that are not the run's own
      if (f.on_resume != OnResume::kept) f.copy(cfg, cfg_in);
  }
  cfg.validate();
  RunLock lock(cfg.out);  // one writer per run folder, then what a killed one left (run_folder.h)
  if (!resume_dir.empty()) check_resume_out(resume_dir, cfg.out);
  const std::string stale_note = remove_stale_temporaries(cfg.out);
  // The default warmup (5 % of the steps) is fixed when a run starts and saved with it: a resume
  // with another --steps recomputed it (100000 steps resumed with --steps 130: the lr jumped 7x).
  if (resume_dir.empty() && cfg.warmup < 0) cfg.warmup = std::max<int64_t>(1, cfg.steps / 20);
  if (resume_dir.empty()) {  // a fresh run: an earlier one in `out` would be mixed into it
    const EarlierRun earlier = earlier_run(cfg.out);
    // Without a checkpoint (a run stopped before its first save) there is nothing to resume.
    KILN_CHECK(!earlier.exists() || cfg.overwrite, "train: --out ", cfg.out, " holds an earlier run (", earlier.what,
               earlier.has_checkpoint ? "); continue it with --resume " + cfg.out + ", choose another --out, or pass "
                                        "--overwrite to replace it"
                                      : " and no checkpoint, so it cannot be resumed); choose another --out, or pass "
                                        "--overwrite to replace it");
    if (earlier.exists()) remove_earlier_run(cfg.out);
  }
  set_deterministic(cfg.deterministic);
  const Device dev = Device::parse(cfg.device);
  check_device_available(dev, "train");
  const bool bf16 = cfg.dtype == "bf16" || (cfg.dtype == "auto" && dev.is_cuda());
  Progress progress(hooks.progress, cfg.steps, cfg.log_every);

  // ---- data ----
  const std::string tok_spec = !resume_dir.empty() && cfg.tokenizer != "byte" ? resume_dir : cfg.tokenizer;
  data::TokenStream stream;
  std::unique_ptr<data::Tokenizer> tok;
  if (data::is_token_data(cfg.data)) {  // token ids (FILE.bin, random:V): data/token_file.h
    stream.source = data::open_token_data(cfg.data, cfg.vocab, cfg.seed);
    stream.source_hash = stream.source->checksum();
    tok = data::token_data_tokenizer(*stream.source, tok_spec);
  } else {
    tok = data::load_tokenizer(tok_spec);
    stream = cfg.data.empty() ? data::tokenize_documents({data::default_corpus()}, *tok)
                              : data::load_corpus(cfg.data, *tok, cfg.out);
  }
  const int64_t vocab = data::model_vocabulary(stream.source.get(), tok.get(), cfg.vocab);
  data::Split split = data::split_stream(stream, cfg.val_fraction, cfg.seq);
  const data::SampleMode mode = data::parse_sample_mode(cfg.sample);
  data::Sampler train_sampler(stream, 0, split.train_end, cfg.batch, cfg.seq, cfg.seed, mode);
  std::unique_ptr<data::Sampler> val_sampler;
  if (split.train_end < stream.size())
    val_sampler = std::make_unique<data::Sampler>(stream, split.train_end, stream.size(), cfg.batch, cfg.seq,
                                                  cfg.seed + 1, mode);

  // ---- model and optimizer ----
  nn::LlamaConfig mcfg = cfg.model_config(vocab);
  check_memory_fits(cfg, mcfg, bf16, dev, available_memory(dev));  // refused, not OOM-killed
  nn::LlamaForCausalLM model(mcfg, cfg.seed, dev);
  optim::NamedTensors named;
  for (auto& [n, p] : model.named_parameters()) named.emplace_back(n, *p);
  optim::AdamWOptions ao;
  ao.lr = cfg.lr;
  ao.beta1 = cfg.beta1;
  ao.beta2 = cfg.beta2;
  ao.eps = cfg.eps;
  ao.weight_decay = cfg.weight_decay;
  ao.decay = optim::decay_matrices_only;
  optim::AdamW opt(named, ao);
  std::vector<Tensor> params;
  for (auto& [n, p] : named) params.push_back(p);
  optim::LrSchedule sched;
  sched.kind = optim::ScheduleKind::cosine;
  sched.max_lr = cfg.lr;
  sched.min_lr = cfg.lr * cfg.min_lr_ratio;
  sched.warmup_steps = cfg.warmup >= 0 ? cfg.warmup : std::max<int64_t>(1, cfg.steps / 20);
  sched.total_steps = std::max(cfg.steps, sched.warmup_steps + 1);

  TrainSummary sum;
  sum.num_parameters = model.num_parameters();
  int64_t step = 0, tokens_seen = 0;
  double elapsed_before = 0;
  if (!resume_dir.empty()) {
    load_model_state(model, load_weights(resume_dir));
    optim::OptimizerState st;
    fs::path of = fs::path(resume_dir) / "optimizer.safetensors";
    if (fs::exists(of)) st.tensors = io::load_safetensors(of.string());
    st.scalars = *resume_state.find("optimizer");
    opt.load_state_dict(st);
    step = resume_state.find("step")->as_int("step");
    train_sampler.set_position(static_cast<uint64_t>(resume_state.find("sampler_position")->as_int()));
    tokens_seen = resume_state.find("tokens_seen")->as_int();
    elapsed_before = resume_state.find("elapsed_s")->as_double();
    KILN_CHECK(step <= cfg.steps, "resume: the checkpoint is at step ", step, ", beyond --steps ", cfg.steps);
  }
  sum.start_step = step;
  if (!resume_dir.empty() && step == cfg.steps) {  // nothing to train: no save, no sample (they repeated)
    sum.already_done = true;
    sum.steps_done = step;
    return sum;
  }
  // only now that the data, model and resume state are in place: a run refused for bad input
  // leaves no run directory behind (the token cache creates it for itself when it writes)
  {
    std::error_code ec;
    KILN_CHECK(!fs::exists(cfg.out, ec) || fs::is_directory(cfg.out, ec), "out '", cfg.out,
               "' exists and is not a folder (the run folder)");
    fs::create_directories(cfg.out, ec);
    KILN_CHECK(!ec, "out '", cfg.out, "': cannot create the run folder: ", ec.message());
  }
  MetricsLog metrics((fs::path(cfg.out) / "metrics.jsonl").string(), resume_dir.empty() ? -1 : step);
  {
    char buf[256];
    std::snprintf(buf, sizeof buf, "kiln train: %s model, %.2fM parameters, %zu tokens (%s), batch %lld x %lld x %lld, "
                  "%s%s, %s", cfg.preset.c_str(), static_cast<double>(sum.num_parameters) / 1e6, stream.size(),
                  cfg.data.empty() ? "default corpus" : cfg.data.c_str(), (long long)cfg.batch, (long long)cfg.seq,
                  (long long)cfg.accum, dev.str().c_str(), bf16 ? " bf16" : "", resume_dir.empty() ? "from scratch"
                  : ("resumed at step " + std::to_string(step)).c_str());
    progress.message(buf);
  }
  // The run's data: a resume on other data continues at the sampler's position in it (the docs'
  // bitwise resume no longer holds), which is said, not silently done.
  const std::string data_checksum = [&] {  // of the tokenizer and the texts (load_corpus hashed them already)
    const uint64_t h = cfg.data.empty() ? data::fnv1a(data::default_corpus(), data::fnv1a(tok->fingerprint()))
                                        : stream.source_hash;
    char hex[17];
    std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(h));
    return std::string(hex);
  }();
  if (const json::Value* saved = resume_dir.empty() ? nullptr : resume_state.find("data_checksum");
      saved && saved->is_string() && saved->as_string() != data_checksum)
    progress.message("note: the training data differs from the run's (its texts' checksum changed): resuming at the "
                     "sampler's position in this data, so the run will not match an uninterrupted one");
  if (saved_steps >= 0 && saved_steps != cfg.steps)
    progress.message("note: --steps " + std::to_string(cfg.steps) + " (the run had " + std::to_string(saved_steps) +
                     "): the learning rate now decays to step " + std::to_string(cfg.steps) + " from here");
  if (!tok && cfg.sample_tokens > 0)
    progress.message("note: no tokenizer for these token ids (no sidecar names one; pass --tokenizer): no sample at "
                     "the end, none saved with the checkpoint");
  if (!stale_note.empty()) progress.message(stale_note);
  for (const std::string& note : stream.notes) progress.message(note);
  int64_t eval_batches = cfg.eval_batches;  // at most what the validation split holds (dataset.h)
  if (val_sampler && cfg.eval_every > 0)
    if (const std::string n = data::clamp_batches(stream.size() - split.train_end, cfg.batch, cfg.seq, "--eval-batches",
                                                  eval_batches); !n.empty())
      progress.message(n);
  if (!val_sampler && cfg.eval_every > 0) {  // --eval-every asked for evals that cannot run
    std::ostringstream m;
    m << "note: no validation text (--val-fraction " << cfg.val_fraction << " of this text), so no eval runs: "
      << "--eval-every " << cfg.eval_every << " is ignored";
    progress.message(m.str());
  }

  const auto t0 = Clock::now();
  auto save = [&](const std::string& why) {
    json::Value st = json::Value::object();
    optim::OptimizerState os = opt.state_dict();
    st["step"] = step;
    st["sampler_position"] = static_cast<int64_t>(train_sampler.position());
    st["tokens_seen"] = tokens_seen;
    st["elapsed_s"] = elapsed_before + std::chrono::duration<double>(Clock::now() - t0).count();
    st["reason"] = why;
    st["data_checksum"] = data_checksum;
    st["config"] = cfg.to_json();
    st["optimizer"] = os.scalars;
    CheckpointData d;
    d.model = &model;
    d.tokenizer = tok.get();
    d.optimizer_tensors = os.tensors;
    d.trainer_state = std::move(st);
    std::string name = "step-" + std::to_string(step);
    std::string dir = (fs::path(cfg.out) / name).string();
    save_checkpoint(dir, d, hooks.checkpoint_hook);
    mark_latest(cfg.out, name, cfg.keep_ckpts);
    sum.checkpoint = dir;
  };

  // ---- the op-level profile (the first step, a warm-up, is excluded when there are more) ----
  std::unique_ptr<profile::Profiler> prof;
  std::optional<profile::Session> prof_on;
  int64_t prof_from = step;
  if (cfg.profile || profile::env_requested()) {
    prof = std::make_unique<profile::Profiler>();
    prof_on.emplace(*prof);
  }

  auto window_t = t0;
  int64_t window_tokens = 0;
  double tps = 0;
  model.train();
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
      << " non-finite step(s) in a row up to step " << step << "): training diverged; lower --lr (it is " << cfg.lr
      << ") or check the data";
    return m.str();
  };
  while (step < cfg.steps) {
    const double lr = sched.lr_at(step);
    opt.set_lr(lr);
    std::vector<data::Batch> micro;
    int64_t targets = 0;
    try {
      for (int64_t a = 0; a < cfg.accum; ++a) {
        micro.push_back(train_sampler.next(dev));
        targets += micro.back().num_targets;
      }
    } catch (const std::bad_alloc&) {
      fail("train: a step's batch=", cfg.batch, " x seq=", cfg.seq, " x accum=", cfg.accum,
           " tokens cannot be allocated (out of host memory); use a smaller --batch, --seq or --accum");
    }
    // The loss stays on the device until the gradient norm has synchronised the host anyway
    // (reading it before the backward would stall the GPU while the backward is enqueued).
    Tensor loss_dev;
    for (auto& b : micro) {
      if (b.num_targets == 0) continue;
      {
        // The bf16 copies are made per forward: each micro-batch's graph holds its own casts,
        // so its backward never reaches a cast an earlier micro-batch's backward has freed.
        Bf16Params cast(model, bf16);
        // this micro-batch's share of the mean over the whole accumulated batch
        Tensor ls = model.loss_sum(b.input, b.target, cfg.document_mask() ? b.doc_ids : Tensor(),
                                   static_cast<double>(targets));
        ls.backward();
        loss_dev = loss_dev.defined() ? add(loss_dev, ls.detach()) : ls.detach();
      }
    }
    double gnorm = cfg.clip > 0 ? optim::clip_grad_norm_(params, cfg.clip) : optim::grad_norm(params);
    const double loss = loss_dev.defined() ? loss_dev.item() : 0.0;
    bool skipped = !std::isfinite(gnorm);
    if (!skipped) opt.step();
    opt.zero_grad();
    ++step;
    const int64_t step_tokens = cfg.batch * cfg.seq * cfg.accum;
    tokens_seen += step_tokens;
    window_tokens += step_tokens;
    sum.losses.push_back(loss);
    if (sum.losses.size() == 1) sum.first_loss = loss;
    sum.final_loss = loss;
    const auto now = Clock::now();
    const double wdt = std::chrono::duration<double>(now - window_t).count();
    if (wdt > 0.5 || step == cfg.steps) {
      tps = window_tokens / std::max(wdt, 1e-9);
      window_t = now;
      window_tokens = 0;
    } else if (tps == 0) {
      tps = window_tokens / std::max(wdt, 1e-9);
    }
    const double run_s = std::chrono::duration<double>(now - t0).count();
    double eval_loss = -1;
    if (val_sampler && cfg.eval_every > 0 && (step % cfg.eval_every == 0 || step == cfg.steps)) {
      model.eval();
      eval_loss = evaluate(model, *val_sampler, eval_batches, dev, bf16, cfg.document_mask(), hooks.stop);
      model.train();
      sum.final_eval_loss = eval_loss;
    }
    const int64_t mem = memory_stats(dev).current_bytes;
    if (step % cfg.log_every == 0 || eval_loss >= 0 || step == cfg.steps) {
      json::Value m = json::Value::object();
      m["step"] = step;
      m["loss"] = loss;
      m["lr"] = lr;
      m["grad_norm"] = gnorm;
      m["tokens_per_s"] = tps;
      m["tokens"] = tokens_seen;
      m["elapsed_s"] = elapsed_before + run_s;
      m["memory_bytes"] = mem;
      if (eval_loss >= 0) m["eval_loss"] = eval_loss;
      if (skipped) m["skipped"] = true;
      if (cfg.telemetry_every > 0 && (step % cfg.telemetry_every == 0 || step == 1)) {
        try {
          m["telemetry"] = telemetry::to_json(telemetry::sample(dev));
        } catch (const Error&) {
          // telemetry is informative only: a platform that cannot say is not a training error
        }
      }
      metrics.write(m);
      if (const std::string w = metrics.take_warning(); !w.empty()) progress.message(w);
      if (hooks.on_log) hooks.on_log(m);
    }
    const double eta = (cfg.steps - step) * run_s / std::max<int64_t>(step - sum.start_step, 1);
    progress.update(step, loss, tps, eta, mem, eval_loss);
    if (skipped) progress.message("warning: non-finite gradient norm at step " + std::to_string(step) + ", step skipped");
    non_finite_steps = skipped || !std::isfinite(loss) ? non_finite_steps + 1 : 0;
    growth.observe(loss);
    if (growth.in_a_row_limit()) {
      progress.finish();
      fail(growth.message("stopped: the loss has grown by orders of magnitude", step, cfg.lr));
    }
    if (non_finite_steps >= kMaxNonFiniteSteps) {
      progress.finish();
      fail(diverged("stopped: no recent step had a finite gradient norm", loss));
    }
    if (prof && step == sum.start_step + 1 && cfg.steps > step) {
      prof->reset();
      prof_from = step;
    }
    if (hooks.on_step) hooks.on_step(step);
    const bool stop = hooks.stop && hooks.stop->load();
    const bool out_of_time = cfg.max_time > 0 && run_s >= cfg.max_time;
    const bool log_failed = metrics.stop_at(step, cfg.ckpt_every);  // a full disk: stop at a checkpoint
    if (stop || out_of_time || log_failed) {
      sum.interrupted = stop;
      sum.out_of_time = !stop && out_of_time;
      progress.message(stop ? "interrupted: saving a checkpoint" : out_of_time ? "time limit reached: saving a checkpoint"
                       : "metrics cannot be written: saving a checkpoint and stopping");
      break;
    }
    if (cfg.ckpt_every > 0 && step % cfg.ckpt_every == 0 && step < cfg.steps) save("interval");
  }
  progress.finish();
  if (prof) {
    prof_on.reset();
    json::Value pj = profile_to_json(*prof);
    pj["steps"] = step - prof_from;
    pj["device"] = dev.str();
    std::ofstream(fs::path(cfg.out) / "profile.json") << pj.dump(1) << "\n";
    progress.message("profile of steps " + std::to_string(prof_from + 1) + ".." + std::to_string(step) + " (" +
                     (fs::path(cfg.out) / "profile.json").string() + "):\n" + prof->table());
  }
  sum.steps_done = step;
  sum.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  sum.tokens_seen = tokens_seen;
  sum.tokens_per_s = sum.seconds > 0 ? (step - sum.start_step) * cfg.batch * cfg.seq * cfg.accum / sum.seconds : 0;
  sum.peak_memory_bytes = memory_stats(dev).peak_bytes;
  save(sum.interrupted ? "interrupted" : "end");
  {
    std::ofstream svg(fs::path(cfg.out) / "loss.svg");
    svg << loss_curve_svg(curves_from_metrics(metrics.path()), "kiln train: " + cfg.preset + " preset");
  }
  KILN_CHECK(non_finite_steps == 0, diverged("the last step was not finite; its checkpoint was saved anyway",
                                             sum.final_loss));
  KILN_CHECK(!growth.last_diverged(), growth.message("the loss has grown by orders of magnitude; the last "
                                                     "checkpoint was saved anyway", step, cfg.lr));
  KILN_CHECK(metrics.ok(), "train: ", metrics.error(), "; the run stopped at step ", step, " with checkpoint ",
             sum.checkpoint, ": free space and continue it with --resume ", cfg.out);
  if (cfg.sample_tokens > 0 && !sum.interrupted && tok) {  // token data without a tokenizer: no sample
    model.eval();
    std::string prompt = cfg.prompt.empty() ? "kiln " : cfg.prompt;
    std::vector<int32_t> ids;
    if (tok->bos_id() >= 0) ids.push_back(tok->bos_id());
    for (int32_t t : tok->encode(prompt)) ids.push_back(t);
    nn::GenerateOptions go;
    go.max_new_tokens = cfg.sample_tokens;
    go.temperature = 0.8;
    go.top_k = 40;
    go.seed = cfg.seed;
    go.eos_id = tok->eos_id();
    sum.sample = prompt + tok->decode_continuation(ids, nn::generate(model, ids, go));
  }
  return sum;
}

}  // namespace kiln::train
