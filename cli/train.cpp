// `kiln train`: builds a TrainConfig from a preset, an optional config file and flags, runs
// the training loop with a SIGINT / SIGTERM handler (the first asks the loop to checkpoint and
// stop; another a second later exits at once), and prints a summary and a generated sample.
#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <deque>
#include <filesystem>
#include <type_traits>
#include <variant>

#include <unistd.h>

#include "cli/args.h"
#include "cli/commands.h"
#include "kiln/data/dataset.h"
#include "kiln/data/tokenizer.h"
#include "kiln/dist/auth.h"
#include "kiln/dist/backends.h"
#include "kiln/dist/launcher.h"
#include "kiln/train/checkpoint.h"
#include "kiln/train/config.h"
#include "kiln/train/report.h"
#include "kiln/train/run_folder.h"
#include "kiln/train/trainer.h"

namespace kiln::cli {

namespace {

// NOTE: the process-wide state a signal handler may touch (async-signal-safe lock-free atomics).
std::atomic<bool> g_stop{false};
std::atomic<int> g_signal{0};             // the first SIGINT / SIGTERM
std::atomic<int64_t> g_signal_ns{0};      // when it came (CLOCK_MONOTONIC)

int64_t monotonic_ns() {  // clock_gettime is async-signal-safe
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

void say(const char* text) {  // write(2): async-signal-safe, unlike stdio
  ssize_t rc = ::write(STDERR_FILENO, text, std::strlen(text));
  (void)rc;
}

// The first SIGINT or SIGTERM (Slurm, docker stop, timeout) stops the run after its step, with
// a checkpoint; it says so at once (a slow step showed nothing for 48 s). Another within a
// second is the same request twice (timeout signals the child and then its process group: one
// such pair aborted the run without a checkpoint or a word); a later one aborts, saying so.
static_assert(std::atomic<bool>::is_always_lock_free && std::atomic<int>::is_always_lock_free &&
              std::atomic<int64_t>::is_always_lock_free);
std::atomic<bool> g_loop_done{false};     // the run has left its loop (summary, sample)

void on_stop_signal(int sig) {
  bool first = false;
  if (g_stop.compare_exchange_strong(first, true)) {  // one thread takes the first signal
    g_signal.store(sig);
    g_signal_ns.store(monotonic_ns());
    say(g_loop_done.load() ? "\nkiln train: stopping (the run has finished training)\n"
                           : "\nkiln train: stopping after this step and saving a checkpoint (interrupt again, a "
                             "second later, to abort without one)\n");
    return;
  }
  if (monotonic_ns() - g_signal_ns.load() < 1000000000) {
    say("kiln train: already stopping\n");
    return;
  }
  say("\nkiln train: aborted (steps since the last checkpoint are not saved)\n");
  std::_Exit(128 + sig);
}

// The value of `--name` (or --name=value) in args, if given; the last one when repeated, as
// the parser keeps it.
std::string prescan(const Args& args, const std::string& name) {
  std::string value;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == name && i + 1 < args.size()) value = args[++i];
    else if (args[i].rfind(name + "=", 0) == 0) value = args[i].substr(name.size() + 1);
  }
  return value;
}

// kiln train --nproc N: the same command as N ranks on this machine through kiln/dist's launcher
// (torchrun's variables, a store on a free port, '[rank N] ' prefixes, the first failure
// reported), with --nproc dropped and the run folder chosen here passed to every rank.
int launch_ranks(const Args& args, const train::TrainConfig& c) {
  dist::LaunchOptions o;
  o.nproc_per_node = static_cast<int>(c.nproc);
  o.master_port = 0;  // a free one
  // --on-failure: restart (the ranks' communicators abort, the launcher restarts every rank up to
  // --max-restarts times, each resuming from the run folder's latest) or shrink (the survivors'
  // communicators shrink and the launcher lets them finish; --max-restarts still restarts a job
  // whose survivors failed too).
  o.policy = c.on_failure == "shrink" ? "shrink" : "abort";
  o.max_restarts = static_cast<int>(c.max_restarts);
  // The job's id, the same for every rank and restart: a restarted rank knows the run folder's
  // files are its own job's (run_folder.h).
  ::setenv("KILN_TRAIN_JOB", dist::random_token().substr(0, 16).c_str(), 1);
  o.program.push_back(std::filesystem::read_symlink("/proc/self/exe").string());
  o.program.push_back("train");
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--nproc") {
      ++i;
      continue;
    }
    if (args[i].rfind("--nproc=", 0) == 0) continue;
    o.program.push_back(args[i]);
  }
  o.program.push_back("--out");  // the last --out wins: the folder resolved here (runs/kiln-N)
  o.program.push_back(c.out);
  std::fprintf(stderr, "kiln train: starting %lld rank%s (--on-failure %s, --max-restarts %lld)\n",
               static_cast<long long>(c.nproc), c.nproc == 1 ? "" : "s", c.on_failure.c_str(),
               static_cast<long long>(c.max_restarts));
  return dist::launch(o);
}

// The id of this rank's job: kiln train --nproc's, else one made of what the launcher (kiln
// launch, torchrun) gives every rank of one job and keeps across its restarts.
std::string job_identity() {
  if (const char* j = std::getenv("KILN_TRAIN_JOB"); j && *j) return j;
  std::string key;
  for (const char* v : {"KILN_STORE_TOKEN", "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT"}) {
    const char* x = std::getenv(v);
    key += std::string(x ? x : "") + "\n";
  }
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(data::fnv1a(key)));
  return hex;
}

int restart_count() {
  const char* r = std::getenv("TORCHELASTIC_RESTART_COUNT");
  if (!r || !*r) return 0;
  char* end = nullptr;
  const long n = std::strtol(r, &end, 10);
  KILN_CHECK(end && *end == 0 && n >= 0, "TORCHELASTIC_RESTART_COUNT='", r, "' is not a count");
  return static_cast<int>(n);
}

}  // namespace

int run_train(const Args& args) {
  // preset, then config file, then flags: the flags' defaults shown by --help are the preset's
  std::string preset_name = prescan(args, "--preset");
  std::string config_file = prescan(args, "--config");
  train::TrainConfig c = train::preset(preset_name.empty() ? "small" : preset_name);
  if (!config_file.empty()) {
    train::apply_config_file(c, config_file);
    if (preset_name.empty() && c.preset != "small") {  // the file chose a preset: rebuild on it
      train::TrainConfig p = train::preset(c.preset);
      train::apply_config_file(p, config_file);
      c = p;
    }
  }
  ArgParser p("train",
              "Train a Llama-style language model. With no arguments: the 'small' preset on the corpus built\n"
              "into kiln (its own docs and headers) for about a minute on 2 CPU cores, then a sample.\n"
              "Settings come from --preset, then --config FILE (TOML or JSON, keys = flag names), then flags.");
  // The flags are the config's field table (kiln/train/config.h), bound to `c`, so their defaults
  // in --help are the preset's (and the file's). Unsigned settings (the seed) parse as integers
  // and are checked after the parse.
  std::deque<std::pair<const train::ConfigField*, int64_t>> unsigned_values;
  for (const train::ConfigField& f : train::config_fields()) {
    std::visit(
        [&](auto m) {
          using T = std::remove_reference_t<decltype(c.*m)>;
          if constexpr (std::is_same_v<T, bool>) {
            p.flag(f.flag, &(c.*m), f.help);
          } else if constexpr (std::is_same_v<T, uint64_t>) {
            unsigned_values.emplace_back(&f, static_cast<int64_t>(c.*m));
            p.option(f.flag, &unsigned_values.back().second, f.metavar, f.help);
          } else {
            p.option(f.flag, &(c.*m), f.metavar, f.help);
          }
        },
        f.member);
    if (f.key == "preset")
      p.option("--config", &config_file, "FILE", "TOML or JSON file of settings (keys as the flags, e.g. lr = 1e-3)");
  }
  p.epilog("examples:\n  kiln train\n  kiln train --preset tiny --data input.txt --steps 500 --out runs/tiny\n"
           "  kiln train --resume runs/tiny --steps 1000\n");
  if (!p.parse(args)) return 0;
  for (const auto& [f, value] : unsigned_values) {
    KILN_CHECK(value >= 0, f->flag, ": must be >= 0, got ", value);
    f->set(c, json::Value(value));
  }
  // Checked before ranks are started: a bad value would fail on every rank (and be restarted).
  KILN_CHECK(c.nproc >= 1, "--nproc ", c.nproc, ": nproc=", c.nproc, " must be positive (the number of ranks)");
  KILN_CHECK(c.on_failure == "restart" || c.on_failure == "shrink", "--on-failure '", c.on_failure,
             "' is not one of: restart, shrink");
  KILN_CHECK(c.max_restarts >= 0, "--max-restarts ", c.max_restarts, " must be >= 0");
  // A rank of `kiln launch --policy shrink` (KILN_DIST_POLICY=shrink) shrinks unless told otherwise.
  if (const char* pol = std::getenv("KILN_DIST_POLICY"); !p.given("--on-failure") && pol && std::string(pol) == "shrink")
    c.on_failure = "shrink";
  // An empty --data (a shell variable that was not set) trained on the built-in corpus silently.
  KILN_CHECK(!p.given("--data") || !c.data.empty(), "--data: the path is empty (''); give a text file or folder, or "
             "leave --data out to train on the built-in corpus");
  if (c.resume.empty() && !p.given("--device") && c.device == train::preset(c.preset).device) {
    // A preset's device the user never named ("device cuda:0 requested but kiln was built
    // without CUDA" for --preset 125m on a CPU build): say where it comes from.
    try {
      check_device_available(Device::parse(c.device), "train");
    } catch (const Error& e) {
      fail("the '", c.preset, "' preset trains on ", c.device, " (", e.what(),
           "); pass --device cpu to train on the CPU");
    }
  }
  if (!c.resume.empty()) {
    // A resumed run keeps its saved settings; of those a run may change, the flags not given
    // come from the checkpoint too (and --out defaults to the run directory resumed from).
    std::string note;
    std::string ck = train::find_checkpoint(c.resume, &note);
    KILN_CHECK(!ck.empty(), "--resume: no checkpoint in '", c.resume, "'", train::why_no_checkpoint(c.resume));
    const char* rank_env = std::getenv("RANK");
    if (!note.empty() && (!rank_env || std::string(rank_env) == "0")) std::fprintf(stderr, "%s\n", note.c_str());
    const json::Value saved = *train::read_trainer_state(ck).find("config");
    using train::OnResume;
    std::string changeable;
    for (const train::ConfigField& f : train::config_fields()) {
      if (f.on_resume != OnResume::changeable) continue;
      if (!p.given(f.flag) && saved.find(f.key)) train::set_config_value(c, f.key, *saved.find(f.key));
      changeable += (changeable.empty() ? "" : ", ") + f.flag;
    }
    // The other settings are the run's: a flag that would change one was dropped without a word
    // (--lr 0.5 trained on at the saved lr). Flags that repeat the saved value are fine.
    KILN_CHECK(!p.given("--config"), "--resume continues a run with its saved settings, so --config does not apply; "
               "give the settings a resumed run may change as flags");
    std::string differ;
    for (const train::ConfigField& f : train::config_fields()) {
      if (f.on_resume != OnResume::kept || !f.saved || !p.given(f.flag)) continue;
      const json::Value value = f.get(c);
      const json::Value* was = saved.find(f.key);
      if (was && was->dump() == value.dump()) continue;
      differ += (differ.empty() ? "" : ", ") + f.flag + " " + value.dump() + " (the run has " +
                (was ? was->dump() : std::string("none")) + ")";
    }
    KILN_CHECK(differ.empty(), "--resume continues a run with its saved settings, which these flags would change: ",
               differ, ". Drop them, or start a new run with another --out; a resumed run may change ", changeable,
               " and --out");
    if (!p.given("--out"))
      c.out = ck == c.resume || ck == std::filesystem::path(c.resume).lexically_normal().string()
                  ? std::filesystem::path(ck).parent_path().string()
                  : c.resume;
  }

  // The default run directory never takes over an earlier run: the next free runs/kiln-N does.
  if (c.resume.empty() && !p.given("--out") && c.out == train::TrainConfig{}.out && !c.overwrite) {
    const std::string base = c.out;
    for (int n = 2; train::earlier_run(c.out).exists() || train::run_folder_holder(c.out) != 0; ++n)
      c.out = base + "-" + std::to_string(n);
    if (c.out != base)
      std::fprintf(stderr, "%s holds an earlier run: this one goes to %s\n", base.c_str(), c.out.c_str());
  }

  // --nproc N: this process launches N ranks of the same command (kiln/dist's launcher, as kiln
  // launch) and waits for them; a rank (WORLD_SIZE set by kiln launch, torchrun or SLURM) joins
  // the job's world instead.
  const bool in_job = std::getenv("WORLD_SIZE") != nullptr || std::getenv("SLURM_NTASKS") != nullptr;
  const dist::DistEnv env = dist::DistEnv::from_env();
  KILN_CHECK(!in_job || !p.given("--nproc") || c.nproc == env.world_size, "--nproc ", c.nproc, ": this process is ",
             "a rank of a job of ", env.world_size, " (WORLD_SIZE); leave --nproc out under kiln launch or torchrun");
  if ((c.nproc > 1 || c.fsdp) && !in_job) return launch_ranks(args, c);
  train::TrainHooks hooks;
  if (in_job) {
    hooks.restart_count = restart_count();
    hooks.job_id = job_identity();
  }
  if (in_job && (env.world_size > 1 || c.fsdp)) {  // --fsdp: a world of one too
    dist::CommOptions co;
    // shrink: a lost peer gives the survivors PeerLost with the smaller world (the trainer goes on)
    if (c.on_failure == "shrink") co.policy = dist::FailurePolicy::shrink;
    hooks.world = dist::init_world(Device::parse(c.device).is_cuda() ? "nccl" : "gloo", "world", co);
  }

  g_stop.store(false);
  g_signal.store(0);
  g_loop_done.store(false);
  std::signal(SIGINT, on_stop_signal);
  std::signal(SIGTERM, on_stop_signal);
  hooks.stop = &g_stop;
  // The handlers stay until exit: a repeated signal that comes after the loop (timeout's second
  // one, on a fast step) would otherwise kill the process as it prints its summary.
  train::TrainSummary s = train::run_training(c, hooks);
  g_loop_done.store(true);
  // rank 0 alone prints the summary and the sample (after a shrink: the new rank 0)
  const bool quiet_rank = hooks.world && s.rank != 0;
  if (quiet_rank) return s.interrupted ? 128 + (g_signal.load() ? g_signal.load() : SIGINT) : 0;
  if (s.already_done) {
    std::fprintf(stderr, "the run in %s is already at its last step, %lld: nothing to train (pass a larger --steps to "
                 "continue it)\n", c.out.c_str(), (long long)s.start_step);
    return 0;
  }

  std::fprintf(stderr, "\n%s after %lld steps (%s): loss %.4f -> %.4f",
               s.interrupted ? "stopped" : s.out_of_time ? "stopped at --max-time" : "done",
               (long long)s.steps_done, train::format_duration(s.seconds).c_str(), s.first_loss, s.final_loss);
  if (s.final_eval_loss >= 0) std::fprintf(stderr, ", eval loss %.4f", s.final_eval_loss);
  std::fprintf(stderr, ", %.0f tokens/s, peak memory %s\n", s.tokens_per_s,
               train::format_bytes(s.peak_memory_bytes).c_str());
  std::fprintf(stderr, "checkpoint: %s\nmetrics:    %s/metrics.jsonl\nloss curve: %s/loss.svg\n", s.checkpoint.c_str(),
               c.out.c_str(), c.out.c_str());
  if (!s.sample.empty())
    std::printf("--- sample ---\n%s\n--------------\n", data::displayable(s.sample).c_str());
  return s.interrupted ? 128 + (g_signal.load() ? g_signal.load() : SIGINT) : 0;
}

}  // namespace kiln::cli
