// The Trainer's setup phase (trainer.h): the resumed run's configuration, the run folder's
// rules, the data, the model and optimizer, a resume's state, and the run's opening notes.
// Everything that can refuse bad input runs before the run folder is created. Also the setup
// again after a lost rank (recover, --on-failure shrink).
#include <signal.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <sstream>
#include <thread>

#include "kiln/attention/runtime_mods_setup.h"
#include "kiln/autograd/grad_mode.h"
#include "kiln/core/allocator.h"
#include "kiln/data/default_corpus.h"
#include "kiln/dist/backends.h"
#include "kiln/data/token_file.h"
#include "kiln/io/safetensors.h"
#include "kiln/kernels/cuda/gemm/options.h"
#include "kiln/parallel/dcp.h"
#include "kiln/train/memory_estimate.h"
#include "kiln/train/trainer_state.h"

namespace kiln::train {

namespace fs = std::filesystem;

// A resumed run: the saved configuration wins, except for what is not the run's own.
void Trainer::State::resolve_config(const TrainConfig& cfg_in) {
  TrainConfig in = cfg_in;
  // A restarted rank (kiln launch, torchrun) of a job that has written into this run folder
  // continues from the folder's latest checkpoint; before the job's first checkpoint it starts
  // again as the first attempt did, over the job's own files.
  if (hooks.restart_count > 0 && !hooks.job_id.empty() && run_folder_job(in.out) == hooks.job_id) {
    own_folder = true;
    if (!find_checkpoint(in.out, &restart_note).empty()) in.resume = in.out;
  }
  cfg = in;
  if (in.resume.empty()) return;
  resume_dir = find_checkpoint(in.resume);
  KILN_CHECK(!resume_dir.empty(), "resume: no checkpoint in '", in.resume, "'", why_no_checkpoint(in.resume));
  resume_state = read_trainer_state(resume_dir);
  cfg = TrainConfig{};
  apply_config_json(cfg, *resume_state.find("config"));
  saved_steps = cfg.steps;
  for (const ConfigField& f : config_fields())  // the settings that are not the run's own
    if (f.on_resume != OnResume::kept) f.copy(cfg, in);
}

void Trainer::State::prepare_run_folder() {
  lock = std::make_unique<RunLock>(cfg.out);  // one writer per run folder, then what a killed one left
  std::error_code ec;
  const bool resumed_here = !resume_dir.empty() && fs::equivalent(fs::path(resume_dir).parent_path(), cfg.out, ec);
  // A restart of this job that resumes from elsewhere again: the folder holds only what the
  // earlier attempt wrote before its first checkpoint.
  if (own_folder && !resume_dir.empty() && !resumed_here) remove_earlier_run(cfg.out);
  if (!resume_dir.empty()) check_resume_out(resume_dir, cfg.out);
  stale_note = remove_stale_temporaries(cfg.out);
  // The default warmup (5 % of the steps) is fixed when a run starts and saved with it: a resume
  // with another --steps recomputed it (100000 steps resumed with --steps 130: the lr jumped 7x).
  if (resume_dir.empty() && cfg.warmup < 0) cfg.warmup = std::max<int64_t>(1, cfg.steps / 20);
  if (resume_dir.empty()) {  // a fresh run: an earlier one in `out` would be mixed into it
    const EarlierRun earlier = earlier_run(cfg.out);
    // Without a checkpoint (a run stopped before its first save) there is nothing to resume.
    KILN_CHECK(!earlier.exists() || cfg.overwrite || own_folder, "train: --out ", cfg.out, " holds an earlier run (",
               earlier.what,
               earlier.has_checkpoint ? "); continue it with --resume " + cfg.out + ", choose another --out, or pass "
                                        "--overwrite to replace it"
                                      : " and no checkpoint, so it cannot be resumed); choose another --out, or pass "
                                        "--overwrite to replace it");
    if (earlier.exists()) remove_earlier_run(cfg.out);
  }
  if (!hooks.job_id.empty()) mark_run_folder_job(cfg.out, hooks.job_id);  // the folder is this job's now
}

void Trainer::State::load_data() {
  const std::string tok_spec = !resume_dir.empty() && cfg.tokenizer != "byte" ? resume_dir : cfg.tokenizer;
  if (data::is_token_data(cfg.data)) {  // token ids (FILE.bin, random:V): data/token_file.h
    stream.source = data::open_token_data(cfg.data, cfg.vocab, cfg.seed);
    stream.source_hash = stream.source->checksum();
    tok = data::token_data_tokenizer(*stream.source, tok_spec);
  } else {
    tok = data::load_tokenizer(tok_spec);
    stream = cfg.data.empty() ? data::tokenize_documents({data::default_corpus()}, *tok)
                              : data::load_corpus(cfg.data, *tok, cfg.out);
  }
  vocab = data::model_vocabulary(stream.source.get(), tok.get(), cfg.vocab);
  split = data::split_stream(stream, cfg.val_fraction, cfg.seq);
  const data::SampleMode mode = data::parse_sample_mode(cfg.sample);
  train_sampler = std::make_unique<data::Sampler>(stream, 0, split.train_end, cfg.batch, cfg.seq, cfg.seed, mode);
  if (split.train_end < stream.size())
    val_sampler = std::make_unique<data::Sampler>(stream, split.train_end, stream.size(), cfg.batch, cfg.seq,
                                                  cfg.seed + 1, mode);
  eval_batches = cfg.eval_batches;  // at most what the validation split holds (dataset.h)
  if (val_sampler && cfg.eval_every > 0)
    eval_note = data::clamp_batches(stream.size() - split.train_end, cfg.batch, cfg.seq, "--eval-batches", eval_batches);
  // The run's data: a resume on other data continues at the sampler's position in it (the docs'
  // bitwise resume no longer holds), which open_run says.
  const uint64_t h = cfg.data.empty() ? data::fnv1a(data::default_corpus(), data::fnv1a(tok->fingerprint()))
                                      : stream.source_hash;  // load_corpus hashed the texts already
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(h));
  data_checksum = hex;
}

// --score-mod / --attention-mask EXPR: the run-time mods, every kernel of the run compiled now
// (all at once in the JIT's pool, with a line saying so), so an expression that does not compile
// stops the run before its first step and before the run folder is written.
std::shared_ptr<const attention::RuntimeMods> Trainer::State::compile_runtime_mods(const nn::LlamaConfig& mcfg) {
  const std::string what = (cfg.score_mod.empty() ? "" : "--score-mod '" + cfg.score_mod + "'") +
                           (cfg.score_mod.empty() || !cfg.mask_is_expression() ? "" : ", ") +
                           (cfg.mask_is_expression() ? "--attention-mask '" + cfg.attention_mask + "'" : "");
  auto mods = std::make_shared<attention::RuntimeMods>(attention::runtime_mods(
      cfg.score_mod, cfg.mask_expression(), cfg.captures, dev, cfg.score_mod_derivative, "train: " + what));
  progress->message("compiling the kernels of " + what + " (forward, backward, mask) before the first step...");
  attention::PrecompileReport r;
  try {
    r = attention::precompile_runtime_mods(*mods, {bf16 ? DType::bf16 : DType::f32}, dev, /*backward=*/true,
                                           mcfg.head_dim());
  } catch (const Error& e) {
    fail("train: ", what, " does not compile", cfg.mask_is_expression() && cfg.attention_mask.find_first_of("=<>&|!()")
         == std::string::npos ? " (an --attention-mask other than auto, causal, window:W or document is a mask_mod "
                                "expression)" : "", ": ", e.what());
  }
  char buf[96];
  std::snprintf(buf, sizeof buf, "%zu kernels ready in %.1f s", r.kernels, r.seconds);
  progress->message(buf);
  return mods;
}

// The split of a step's global batch over the ranks and their micro-batches (trainer_state.h).
// keep_global > 0 (a shrink): that global batch, the run's so far, over the ranks there are now.
void Trainer::State::plan_ranks(int64_t keep_global) {
  if (world) {
    rank = world->rank();
    world_size = world->size();
  }
  const int64_t n = world_size;
  const int64_t global = keep_global > 0         ? keep_global
                         : cfg.global_batch > 0 ? cfg.global_batch
                                                : cfg.batch * cfg.accum * n;
  KILN_CHECK(global % (cfg.batch * n) == 0, "train: ", keep_global > 0 ? "the global batch " : "--global-batch ", global,
             " is not a multiple of --batch ", cfg.batch, " x ", n, " rank(s) = ", cfg.batch * n,
             ": every rank takes the same number of micro-batches of --batch sequences");
  micro_total = global / cfg.batch;
  accum_local = micro_total / n;
  micro_first = rank * accum_local;
  KILN_CHECK(keep_global > 0 || cfg.global_batch == 0 || cfg.accum == 1 || cfg.accum == accum_local, "train: --accum ", cfg.accum,
             " disagrees with --global-batch ", cfg.global_batch, " / (--batch ", cfg.batch, " x ", n,
             " rank(s)) = ", accum_local, " micro-batches per rank; give one of them");
}

void Trainer::State::build_model() {
  nn::LlamaConfig mcfg = cfg.model_config(vocab);
  check_memory_fits(cfg, mcfg, bf16, dev, available_memory(dev));  // refused, not OOM-killed
  if (cfg.runtime_mods()) mcfg.runtime_mods = compile_runtime_mods(mcfg);
  model = std::make_unique<nn::LlamaForCausalLM>(mcfg, cfg.seed, dev);  // the same on every rank (seed)
  optim::NamedTensors named;
  if (world) {  // FSDP: each decoder block a group, then the root; the optimizer steps on the shards
    parallel::FsdpOptions fo;
    if (bf16) fo.mixed_precision = parallel::MixedPrecision{DType::bf16, DType::f32};  // FSDP casts, not ParamCast
    // Under shrink every collective runs on the world, so that a lost rank is one failure the
    // survivors agree on once (a second communicator would shrink on its own, at its own time).
    if (shrinks()) fo.separate_reduce_scatter_group = false;
    for (auto& layer : model->model->layers) parallel::fully_shard(*layer, world, fo);
    fsdp = parallel::fully_shard(*model, world, fo);
    named = fsdp->named_shards();
    cast = std::make_unique<ParamCast>(*model, DType::f32);
  } else {
    cast = std::make_unique<ParamCast>(*model, bf16 ? DType::bf16 : DType::f32);
    for (auto& [n, p] : model->named_parameters()) named.emplace_back(n, *p);
  }
  optim::AdamWOptions ao;
  ao.lr = cfg.lr;
  ao.beta1 = cfg.beta1;
  ao.beta2 = cfg.beta2;
  ao.eps = cfg.eps;
  ao.weight_decay = cfg.weight_decay;
  ao.decay = optim::decay_matrices_only;
  in_backward.reset();  // its hooks are on the parameters of the model this replaces
  opt = std::make_unique<optim::AdamW>(named, ao);
  if (cfg.optimizer_in_backward) in_backward = std::make_unique<optim::OptimizerInBackward>(*opt);
  sched.kind = optim::ScheduleKind::cosine;
  sched.max_lr = cfg.lr;
  sched.min_lr = cfg.lr * cfg.min_lr_ratio;
  sched.warmup_steps = cfg.warmup >= 0 ? cfg.warmup : std::max<int64_t>(1, cfg.steps / 20);
  sched.total_steps = std::max(cfg.steps, sched.warmup_steps + 1);
  sum.num_parameters = model->num_parameters();
  flops_per_token = train::flops_per_token(mcfg, sum.num_parameters, cfg.seq);
  peak = peak_flops(dev, bf16 ? DType::bf16 : DType::f32, cfg.peak_tflops);
}

void Trainer::State::load_resume_state() {
  if (resume_dir.empty()) return;
  const fs::path index = fs::path(resume_dir) / parallel::kShardedIndexFile;
  if (fsdp) {  // this rank's rows of every tensor, from a sharded checkpoint of any world size or a whole one
    parallel::load_checkpoint(resume_dir, *fsdp, *opt);
  } else if (fs::exists(index)) {  // a sharded checkpoint, consolidated into one process
    std::vector<std::pair<std::string, Tensor>> weights, buffers;
    const auto params = model->named_parameters();
    for (auto& [name, t] : parallel::load_full(resume_dir)) {
      bool is_param = false;
      for (const auto& [pn, p] : params) is_param = is_param || pn == name;
      (is_param ? weights : buffers).emplace_back(name, t);
    }
    load_model_state(*model, weights);
    optim::OptimizerState st;
    st.tensors = buffers;
    const json::Value idx = read_json_file(index.string());
    const json::Value* meta = idx.find("metadata");
    KILN_CHECK(meta && meta->find("optimizer"), "resume: ", index.string(), " has no optimizer state in its metadata");
    st.scalars = *meta->find("optimizer");
    opt->load_state_dict(st);
  } else {
    load_model_state(*model, load_weights(resume_dir));
    optim::OptimizerState st;
    fs::path of = fs::path(resume_dir) / "optimizer.safetensors";
    if (fs::exists(of)) st.tensors = io::load_safetensors(of.string());
    st.scalars = *resume_state.find("optimizer");
    opt->load_state_dict(st);
  }
  elapsed_before = restore_position(resume_state);
  KILN_CHECK(step <= cfg.steps, "resume: the checkpoint is at step ", step, ", beyond --steps ", cfg.steps);
  last_ckpt_dir = resume_dir;
  last_ckpt_step = step;
}

double Trainer::State::restore_position(const json::Value& st) {
  step = st.find("step")->as_int("step");
  train_sampler->set_position(static_cast<uint64_t>(st.find("sampler_position")->as_int()));
  tokens_seen = st.find("tokens_seen")->as_int();
  return st.find("elapsed_s")->as_double();
}

// Only once the data, model and resume state are in place: a run refused for bad input leaves
// no run directory behind (the token cache creates it for itself when it writes).
void Trainer::State::open_run() {
  {
    std::error_code ec;
    KILN_CHECK(!fs::exists(cfg.out, ec) || fs::is_directory(cfg.out, ec), "out '", cfg.out,
               "' exists and is not a folder (the run folder)");
    fs::create_directories(cfg.out, ec);
    KILN_CHECK(!ec, "out '", cfg.out, "': cannot create the run folder: ", ec.message());
  }
  metrics = std::make_unique<MetricsLog>((fs::path(cfg.out) / "metrics.jsonl").string(), resume_dir.empty() ? -1 : step);
  if (hooks.restart_count > 0) {  // kiln launch restarted the job: the event, then the steps again
    json::Value ev = json::Value::object();
    ev["event"] = "restart";
    ev["step"] = step;
    ev["restart_count"] = hooks.restart_count;
    ev["world_size"] = world_size;
    ev["checkpoint"] = resume_dir;
    metrics->write(ev);
    if (hooks.on_log) hooks.on_log(ev);
    if (!restart_note.empty()) progress->message(restart_note);
    progress->message("restart " + std::to_string(hooks.restart_count) + " of the job: " +
                      (resume_dir.empty() ? std::string("no checkpoint of this job yet, training again from step 0")
                                          : "continuing from " + resume_dir + " at step " + std::to_string(step)));
  }
  {
    char buf[256];
    std::snprintf(buf, sizeof buf, "kiln train: %s model, %.2fM parameters, %zu tokens (%s), batch %lld x %lld x %lld, "
                  "%s%s, %s", cfg.preset.c_str(), static_cast<double>(sum.num_parameters) / 1e6, stream.size(),
                  cfg.data.empty() ? "default corpus" : cfg.data.c_str(), (long long)cfg.batch, (long long)cfg.seq,
                  (long long)accum_local, dev.str().c_str(), bf16 ? " bf16" : "", resume_dir.empty() ? "from scratch"
                  : ("resumed at step " + std::to_string(step)).c_str());
    progress->message(buf);
    if (world)
      progress->message(std::to_string(world_size) + (world_size == 1 ? " rank (" : " ranks (") + world->backend() + ", FSDP-sharded): a global batch of " +
                        std::to_string(micro_total * cfg.batch) + " sequences per step, " + std::to_string(accum_local) +
                        " micro-batch(es) of " + std::to_string(cfg.batch) + " per rank");
  }
  if (const json::Value* saved = resume_dir.empty() ? nullptr : resume_state.find("data_checksum");
      saved && saved->is_string() && saved->as_string() != data_checksum)
    progress->message("note: the training data differs from the run's (its texts' checksum changed): resuming at the "
                      "sampler's position in this data, so the run will not match an uninterrupted one");
  if (saved_steps >= 0 && saved_steps != cfg.steps)
    progress->message("note: --steps " + std::to_string(cfg.steps) + " (the run had " + std::to_string(saved_steps) +
                      "): the learning rate now decays to step " + std::to_string(cfg.steps) + " from here");
  if (cfg.runtime_mods() && tok && cfg.sample_tokens > 0)
    progress->message("note: the sample at the end is generated with causal attention (KV-cache decoding does not "
                      "apply run-time mods)");
  if (!tok && cfg.sample_tokens > 0)
    progress->message("note: no tokenizer for these token ids (no sidecar names one; pass --tokenizer): no sample at "
                      "the end, none saved with the checkpoint");
  if (!stale_note.empty()) progress->message(stale_note);
  for (const std::string& note : stream.notes) progress->message(note);
  if (!eval_note.empty()) progress->message(eval_note);
  if (!val_sampler && cfg.eval_every > 0) {  // --eval-every asked for evals that cannot run
    std::ostringstream m;
    m << "note: no validation text (--val-fraction " << cfg.val_fraction << " of this text), so no eval runs: "
      << "--eval-every " << cfg.eval_every << " is ignored";
    progress->message(m.str());
  }
}

void Trainer::State::setup(const TrainConfig& cfg_in) {
  world = hooks.world;
  resolve_config(cfg_in);
  cfg.validate();
  plan_ranks();
  KILN_CHECK(!cfg.optimizer_in_backward || !world,
             "train: --optimizer-in-backward runs in one process, unsharded; this is a job of ", world_size,
             " rank(s) (kiln launch or torchrun), which trains FSDP-sharded and reduces the gradients after the "
             "backward");
  KILN_CHECK(!cfg.optimizer_in_backward || micro_total == 1,
             "train: --optimizer-in-backward needs one micro-batch a step (it uses up each gradient in the backward); "
             "this run has ", micro_total, " micro-batches a step", cfg.global_batch > 0 ? " (--global-batch)" : "");
  refuse_cuda_graphs_on();
  for (int r = 0; r < world_size; ++r) members.push_back(r);
  // KILN_TEST_KILL_AT=RANK:STEP[,RANK:STEP...] (tests): on the job's first attempt the rank the
  // launcher numbered RANK kills itself with SIGKILL after STEP (maybe_kill_self).
  if (const char* k = std::getenv("KILN_TEST_KILL_AT"); k && *k && world) {
    std::stringstream list(k);
    for (std::string item; std::getline(list, item, ',');) {
      int r = -1;
      long long at = 0;
      char extra = 0;
      KILN_CHECK(std::sscanf(item.c_str(), "%d:%lld%c", &r, &at, &extra) == 2 && r >= 0 && at > 0,
                 "KILN_TEST_KILL_AT='", k, "': expected RANK:STEP[,RANK:STEP...] (tests: that rank kills itself "
                 "with SIGKILL after that step)");
      if (r == rank && hooks.restart_count == 0) kill_at_step = at;
    }
  }
  if (is_rank0()) prepare_run_folder();  // the run folder is rank 0's (the others write shards into it)
  else if (resume_dir.empty() && cfg.warmup < 0) cfg.warmup = std::max<int64_t>(1, cfg.steps / 20);
  set_deterministic(cfg.deterministic);
  if (!cfg.gemm_backend.empty())  // the process's GEMM backend (the linears, the fused loss)
    kernels::gemm::set_default_backend(kernels::gemm::parse_backend(cfg.gemm_backend, "train: --gemm-backend"));
  dev = Device::parse(cfg.device);
  if (dev.is_cuda() && world) dev = cuda(dist::DistEnv::from_env().local_rank);  // one GPU per rank
  check_device_available(dev, "train");
  reset_peak_memory_stats(dev);  // the run's peak (metrics.jsonl), not an earlier run's in this process
  bf16 = cfg.dtype == "bf16" || (cfg.dtype == "auto" && dev.is_cuda());
  progress = std::make_unique<Progress>(is_rank0() ? hooks.progress : nullptr, cfg.steps, cfg.log_every);  // rank 0's
  load_data();
  build_model();
  load_resume_state();
  sum.start_step = step;
  if (!resume_dir.empty() && step == cfg.steps) {  // nothing to train: no save, no sample (they repeated)
    already_done = true;
    sum.already_done = true;
    sum.steps_done = step;
    return;
  }
  if (is_rank0()) open_run();
  plan_cuda_graphs();
  if (world) world->barrier()->wait();  // rank 0's run folder is in place
  t0 = Clock::now();
}

void Trainer::State::refuse_cuda_graphs_on() const {
  if (cfg.cuda_graphs != "on") return;
  const std::string why = cuda_graphs_unavailable(cfg, world != nullptr || cfg.fsdp);
  KILN_CHECK(why.empty(), "train: --cuda-graphs on: ", why, " (--cuda-graphs auto uses them where a run allows it)");
}

void Trainer::State::plan_cuda_graphs() {
  if (cfg.cuda_graphs == "off") return;
  const std::string why = cuda_graphs_unavailable(cfg, world != nullptr || cfg.fsdp);
  if (!why.empty()) {
    if (dev.is_cuda()) progress->message("note: --cuda-graphs: not used: " + why);
    return;
  }
  std::vector<Tensor> params;
  for (const auto& [name, p] : opt->params()) params.push_back(p);
  graph = std::make_unique<StepGraph>(dev, std::move(params), [this](const std::string& m) { progress->message(m); });
}

// Rank 0's files of the run folder (its lock, metrics.jsonl from `keep_until_step` on) and the
// progress line: after a shrink the new rank 0 may be another process than the lost one.
void Trainer::State::open_rank0_files(int64_t keep_until_step) {
  // The lost rank 0's lock goes with its process (flock), a moment after it died.
  for (int attempt = 0; !lock; ++attempt) {
    try {
      lock = std::make_unique<RunLock>(cfg.out);
    } catch (const Error&) {
      if (attempt >= 50) throw;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }
  metrics.reset();  // closed before it is rewritten up to the checkpoint
  metrics = std::make_unique<MetricsLog>((fs::path(cfg.out) / "metrics.jsonl").string(), keep_until_step);
  progress = std::make_unique<Progress>(hooks.progress, cfg.steps, cfg.log_every);
}

// NOTE [shrink]: a PeerLost carries the world's successor (the survivors, renumbered in order).
// The model, its FSDP groups and the optimizer are built again over it (every survivor has the
// same seed and reaches this point in the same state of the job), the last checkpoint is loaded
// resharded to the new world size (parallel::load_checkpoint intersects the saved rows with the
// new shards), and the run goes on from its step with the global batch it had: the same
// sequences per step, so the loss curve is the uninterrupted one up to rounding.
json::Value Trainer::State::recover(const dist::PeerLost& lost, Clock::time_point failed_at) {
  const int64_t failed_step = step;
  std::shared_ptr<dist::Communicator> next = lost.communicator();
  std::vector<int> gone = lost.lost_ranks();
  if (next && next->name() != world->name()) {
    // Another communicator's successor: the world's own failure comes at its next operation.
    try {
      world->barrier()->wait();
    } catch (const dist::PeerLost& w) {
      next = w.communicator();
      gone = w.lost_ranks();
    }
  }
  KILN_CHECK(next && next->name() == world->name(), "train: --on-failure shrink: ", lost.what(),
             "; the world communicator '", world->name(), "' did not shrink with it");
  std::vector<int> kept;
  std::string lost_names;
  json::Value lost_json = json::Value::array();
  for (int r = 0; r < world_size; ++r) {
    if (std::find(gone.begin(), gone.end(), r) == gone.end()) {
      kept.push_back(members[static_cast<size_t>(r)]);
    } else {
      lost_names += (lost_names.empty() ? "" : ", ") + std::to_string(members[static_cast<size_t>(r)]);
      lost_json.push_back(members[static_cast<size_t>(r)]);
    }
  }
  members = kept;
  world = next;
  const int64_t global = micro_total * cfg.batch;
  opt.reset();
  cast.reset();
  fsdp.reset();
  model.reset();
  try {
    plan_ranks(global);
  } catch (const Error& e) {
    fail("train: --on-failure shrink: rank(s) ", lost_names, " lost at step ", failed_step, ", and the ", world->size(),
         " survivors cannot keep the run's global batch of ", global, " sequences: ", e.what());
  }
  build_model();
  model->train();
  // Every survivor goes back to the same checkpoint (one all-reduce of its step, max and -min).
  Tensor at = from_vector<int64_t>({last_ckpt_step, -last_ckpt_step}, {2}, dev);
  world->all_reduce(at, dist::ReduceOp::max)->wait();
  const std::vector<int64_t> agreed = at.to_vector<int64_t>();
  KILN_CHECK(agreed[0] == -agreed[1], "train: --on-failure shrink: the survivors' last checkpoints differ (steps ",
             -agreed[1], " and ", agreed[0], ")");
  double ckpt_elapsed = 0;
  if (!last_ckpt_dir.empty()) {
    parallel::load_checkpoint(last_ckpt_dir, *fsdp, *opt);
    ckpt_elapsed = restore_position(read_trainer_state(last_ckpt_dir));
  } else {  // lost before the run's first checkpoint: from the start (the model is the seed's again)
    step = 0;
    train_sampler->set_position(0);
    tokens_seen = 0;
  }
  sum.losses.resize(static_cast<size_t>(std::max<int64_t>(0, step - sum.start_step)));
  if (!sum.losses.empty()) sum.final_loss = sum.losses.back();
  ++sum.shrinks;
  if (is_rank0()) open_rank0_files(step);
  else progress = std::make_unique<Progress>(nullptr, cfg.steps, cfg.log_every);
  const double now = elapsed_before + seconds();
  json::Value ev = json::Value::object();
  ev["event"] = "shrink";
  ev["step"] = step;
  ev["failed_at_step"] = failed_step;
  ev["lost_ranks"] = lost_json;
  ev["world_size"] = world_size;
  ev["seconds_lost"] = now - ckpt_elapsed;
  // after the survivors' communicator had shrunk (its agreement waits up to CommOptions::shrink_window)
  ev["rebuild_s"] = std::chrono::duration<double>(Clock::now() - failed_at).count();
  ev["checkpoint"] = last_ckpt_dir;
  char buf[160];
  std::snprintf(buf, sizeof buf, "; %.1f s lost (%.2f s to rebuild)", now - ckpt_elapsed,
                ev.find("rebuild_s")->as_double());
  progress->message("rank(s) " + lost_names + " lost at step " + std::to_string(failed_step) + ": going on with " +
                    std::to_string(world_size) + " ranks from " + (last_ckpt_dir.empty() ? std::string("step 0")
                    : last_ckpt_dir + " (step " + std::to_string(step) + ")") + buf);
  return ev;
}

void Trainer::State::maybe_kill_self(int64_t step_done) const {
  if (kill_at_step != step_done) return;
  std::fflush(nullptr);
  ::raise(SIGKILL);
}

}  // namespace kiln::train
