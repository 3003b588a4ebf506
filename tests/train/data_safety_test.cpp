// What a careful but hostile new user found (issue 30), each in the code it touches: the run
// folder lock (two processes), resume and --overwrite rules, full disks, stale checkpoint
// temporaries, data folders holding runs and binaries, tied lm_head files, the trained sequence
// length, divergence, the memory estimate, stopping during an evaluation, and clear messages.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "kiln/core/profile.h"
#include "kiln/data/dataset.h"
#include "kiln/data/default_corpus.h"
#include "kiln/data/tokenizer.h"
#include "kiln/io/json.h"
#include "kiln/train/checkpoint.h"
#include "kiln/train/memory_estimate.h"
#include "kiln/train/report.h"
#include "kiln/train/run_folder.h"
#include "kiln/train/trainer.h"
#include "tests/train/train_test_util.h"

using namespace kiln;
namespace fs = std::filesystem;
using test::quiet;
using test::temp_dir;
using test::tiny_run;

namespace {

using test::error_of;

std::string read_text(const fs::path& p) {
  std::ifstream f(p);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

// A pid that is certainly not running: a child that has exited and been reaped.
pid_t dead_pid() {
  const pid_t pid = ::fork();
  if (pid == 0) ::_exit(0);
  ::waitpid(pid, nullptr, 0);
  return pid;
}

}  // namespace

// Item 1: a second writer of a run folder is refused with the holder's pid, while the holder
// lives (another process, forked); once it is killed, its lock is free again.
TEST(RunFolder, LockRefusesASecondWriterUntilTheFirstDies) {
  const fs::path out = temp_dir("lock");
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  const pid_t child = ::fork();
  if (child == 0) {
    ::alarm(20);  // bounded whatever the parent does
    try {
      train::RunLock lock(out.string());
      char c = 1;
      if (::write(ready[1], &c, 1) != 1) ::_exit(2);
      ::pause();
    } catch (...) {
      ::_exit(3);
    }
    ::_exit(0);
  }
  char c = 0;
  ASSERT_EQ(::read(ready[0], &c, 1), 1);
  const std::string want = out.string() + " is in use by pid " + std::to_string(child);
  EXPECT_NE(error_of([&] { train::RunLock second(out.string()); }).find(want), std::string::npos);
  EXPECT_EQ(train::run_folder_holder(out.string()), child);
  // a fresh run, an --overwrite and a resume are all refused before they touch anything
  train::TrainConfig c1 = tiny_run(out, 2);
  c1.overwrite = true;
  EXPECT_NE(error_of([&] { train::run_training(c1, quiet()); }).find(want), std::string::npos);
  EXPECT_FALSE(fs::exists(out / "metrics.jsonl"));
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
  EXPECT_EQ(train::run_folder_holder(out.string()), 0);
  { train::RunLock mine(out.string()); }  // the dead holder's lock is recovered
  EXPECT_FALSE(fs::exists(out / train::RunLock::kFileName));  // released: removed
  train::run_training(tiny_run(out, 2), quiet());
  EXPECT_TRUE(fs::exists(out / "step-2" / "model.safetensors"));
  ::close(ready[0]);
  ::close(ready[1]);
  // A lock on a folder it had to create, released unused, leaves no folder behind.
  const fs::path fresh = out / "a" / "b";
  { train::RunLock l(fresh.string()); }
  EXPECT_FALSE(fs::exists(out / "a"));
  fs::remove_all(out);
}

// Item 2: --resume A --out B, where B holds another run, is refused (it truncated B's metrics
// and repointed its latest); into A itself or an empty folder it goes on.
TEST(RunFolder, ResumeNeverWritesIntoAnotherRun) {
  const fs::path a = temp_dir("resume_a"), b = temp_dir("resume_b"), e = temp_dir("resume_e");
  train::run_training(tiny_run(a, 3), quiet());
  train::run_training(tiny_run(b, 2), quiet());
  const std::string b_metrics = read_text(b / "metrics.jsonl"), b_latest = read_text(b / "latest");
  train::TrainConfig r = tiny_run(b, 4);
  r.resume = a.string();
  const std::string m = error_of([&] { train::run_training(r, quiet()); });
  EXPECT_NE(m.find("--out " + b.string() + " holds another run (checkpoint step-2)"), std::string::npos) << m;
  EXPECT_EQ(read_text(b / "metrics.jsonl"), b_metrics);
  EXPECT_EQ(read_text(b / "latest"), b_latest);
  r.out = e.string();  // an empty folder
  train::run_training(r, quiet());
  EXPECT_EQ(train::find_checkpoint(e.string()), (e / "step-4").string());
  r.out = a.string();  // its own run folder
  r.resume = (a / "step-3").string();
  train::run_training(r, quiet());
  EXPECT_EQ(train::find_checkpoint(a.string()), (a / "step-4").string());
  for (const auto& d : {a, b, e}) fs::remove_all(d);
}

// Item 3: --overwrite removes only the checkpoints kiln wrote, and a folder of the user's that
// starts with step- is not called a checkpoint.
TEST(RunFolder, OverwriteRemovesOnlyWhatKilnWrote) {
  const fs::path out = temp_dir("overwrite");
  fs::create_directories(out / "step-notes");
  std::ofstream(out / "step-notes" / "ideas.txt") << "mine";
  fs::create_directories(out / "step-5-old");
  std::ofstream(out / "step-5-old" / "config.json") << "{}";
  EXPECT_FALSE(train::earlier_run(out.string()).exists()) << train::earlier_run(out.string()).what;
  train::run_training(tiny_run(out, 2), quiet());  // no --overwrite needed: nothing of a run there
  train::TrainConfig c = tiny_run(out, 2);
  const std::string m = error_of([&] { train::run_training(c, quiet()); });
  EXPECT_NE(m.find("holds an earlier run (checkpoint step-2"), std::string::npos) << m;
  c.overwrite = true;
  train::run_training(c, quiet());
  EXPECT_EQ(read_text(out / "step-notes" / "ideas.txt"), "mine");
  EXPECT_TRUE(fs::exists(out / "step-5-old" / "config.json"));
  EXPECT_TRUE(fs::exists(out / "step-2" / "model.safetensors"));
  fs::remove_all(out);
}

// Item 4: a full disk (/dev/full gives ENOSPC) is never silent: a checkpoint file's write error
// names errno's text, the metrics log warns once and stops, and the run stops at its next
// checkpoint boundary with an error.
TEST(RunFolder, FullDisksAreReportedWithErrno) {
  if (::access("/dev/full", W_OK) != 0) GTEST_SKIP() << "no writable /dev/full here";
  const std::string enospc = std::strerror(ENOSPC);
  EXPECT_NE(error_of([] { train::write_text_file_synced("/dev/full", std::string(100000, 'x')); }).find(enospc),
            std::string::npos);
  const fs::path out = temp_dir("full");
  fs::create_symlink("/dev/full", out / "m.jsonl");
  {
    train::MetricsLog log((out / "m.jsonl").string(), -1);
    json::Value v = json::Value::object();
    v["step"] = 7;
    log.write(v);
    EXPECT_FALSE(log.ok());
    EXPECT_NE(log.error().find("could not be written at step 7 (" + enospc + ")"), std::string::npos) << log.error();
    EXPECT_NE(log.take_warning().find("warning: "), std::string::npos);
    EXPECT_EQ(log.take_warning(), "");  // once
  }
  // In a run: metrics.jsonl's descriptor is pointed at /dev/full after step 2's line.
  const fs::path run = out / "run";
  train::TrainConfig c = tiny_run(run, 20);
  c.ckpt_every = 4;
  train::TrainHooks h = quiet();
  h.on_step = [&](int64_t step) {
    if (step != 2) return;
    for (const auto& fd : fs::directory_iterator("/proc/self/fd")) {
      std::error_code ec;
      if (fs::read_symlink(fd.path(), ec).filename() != "metrics.jsonl") continue;
      const int full = ::open("/dev/full", O_WRONLY);
      ::dup2(full, std::stoi(fd.path().filename().string()));
      ::close(full);
    }
  };
  const std::string m = error_of([&] { train::run_training(c, h); });
  EXPECT_NE(m.find("metrics.jsonl could not be written at step 3 (" + enospc + ")"), std::string::npos) << m;
  EXPECT_NE(m.find("the run stopped at step 4"), std::string::npos) << m;
  EXPECT_EQ(train::find_checkpoint(run.string()), (run / "step-4").string());
  fs::remove_all(out);
}

// Item 5: checkpoint temporaries of a killed writer are removed when a run starts there (they
// were never removed: ~12 GB each at 1b); a live writer's are kept.
TEST(RunFolder, StaleCheckpointTemporariesAreRemoved) {
  const fs::path out = temp_dir("stale");
  const pid_t dead = dead_pid();
  for (const std::string name : {".tmp-step-3-", ".old-step-2-"}) {
    fs::create_directories(out / (name + std::to_string(dead)));
    std::ofstream(out / (name + std::to_string(dead)) / "model.safetensors") << std::string(5000, 'w');
  }
  const fs::path live = out / (".tmp-step-9-" + std::to_string(::getppid()));
  fs::create_directories(live);
  const std::string note = train::remove_stale_temporaries(out.string());
  EXPECT_NE(note.find("removed 2 checkpoint temporaries"), std::string::npos) << note;
  EXPECT_NE(note.find(".tmp-step-3-" + std::to_string(dead)), std::string::npos) << note;
  EXPECT_TRUE(fs::exists(live));
  fs::create_directories(out / (".tmp-step-1-" + std::to_string(dead)));
  train::run_training(tiny_run(out, 2), quiet());  // a run starting there removes them too
  EXPECT_FALSE(fs::exists(out / (".tmp-step-1-" + std::to_string(dead))));
  EXPECT_TRUE(fs::exists(live));
  fs::remove_all(out);
}

// Item 6: a data folder's kiln runs, checkpoints and binary files are skipped and named (a
// second `--data .` run read 1.63 M tokens of weights and metrics instead of 112 K).
TEST(Data, FoldersSkipRunsCheckpointsAndBinaries) {
  const fs::path d = temp_dir("data_skip");
  std::ofstream(d / "a.txt") << "hello text";
  std::ofstream(d / "weights.bin", std::ios::binary) << std::string("ab\0cd", 5);
  fs::create_directories(d / "runs" / "kiln" / "step-2");
  std::ofstream(d / "runs" / "kiln" / "latest") << "step-2\n";
  std::ofstream(d / "runs" / "kiln" / "metrics.jsonl") << "{\"step\": 1}\n";
  std::ofstream(d / "runs" / "kiln" / "step-2" / "config.json") << "{}";
  fs::create_directories(d / "hf");
  std::ofstream(d / "hf" / "config.json") << "{}";
  std::ofstream(d / "hf" / "model.safetensors") << "text-looking weights";
  data::ByteTokenizer tok;
  const data::TokenStream s = data::load_corpus(d.string(), tok, "", nullptr, false);
  EXPECT_EQ(s.size(), 10u + 2u);  // "hello text" with <bos> and <eos>
  ASSERT_EQ(s.notes.size(), 2u);
  EXPECT_NE(s.notes[0].find("skipped 2 folder(s) of kiln runs or checkpoints"), std::string::npos) << s.notes[0];
  EXPECT_NE(s.notes[0].find("hf, runs/kiln"), std::string::npos) << s.notes[0];
  EXPECT_NE(s.notes[1].find("skipped 1 file(s) that are not text"), std::string::npos) << s.notes[1];
  fs::remove(d / "a.txt");
  const std::string m = error_of([&] { data::load_corpus(d.string(), tok, "", nullptr, false); });
  EXPECT_NE(m.find("holds no text files"), std::string::npos) << m;
  // /proc/self/ is not text: the error names the file and errno's text (it was basic_filebuf's)
  const std::string p = error_of([&] { data::load_corpus("/proc/self/", tok, "", nullptr, false); });
  EXPECT_EQ(p.find("basic_filebuf"), std::string::npos) << p;
  EXPECT_NE(p.find("/proc/self/"), std::string::npos) << p;
  fs::remove_all(d);
}

// Unclear messages: no temporary directory means no token cache (eval failed on
// "temp_directory_path"), and an eval cache folder is bounded (a 100 MB text left 800 MB).
TEST(Data, TokenCacheSurvivesNoTmpdirAndIsBounded) {
  const char* old = std::getenv("TMPDIR");
  const std::string saved = old ? old : "";
  const fs::path d = temp_dir("cache_bound");
  for (const std::string& bad : {(d / "missing").string(), (d / "a-file").string()}) {
    std::ofstream(d / "a-file") << "x";
    ::setenv("TMPDIR", bad.c_str(), 1);
    EXPECT_FALSE(data::user_cache_dir("kiln-test-cache").has_value()) << bad;
  }
  if (old) ::setenv("TMPDIR", saved.c_str(), 1);
  else ::unsetenv("TMPDIR");
  fs::create_directories(d / "cache");
  std::ofstream(d / "one.txt") << std::string(1000, 'a');
  std::ofstream(d / "two.txt") << std::string(1000, 'b');
  data::ByteTokenizer tok;
  constexpr uint64_t kOneCache = 24 + 8 * 1002;
  data::load_corpus((d / "one.txt").string(), tok, (d / "cache").string(), nullptr, true, kOneCache + 100);
  data::load_corpus((d / "two.txt").string(), tok, (d / "cache").string(), nullptr, true, kOneCache + 100);
  int caches = 0;
  for (const auto& e : fs::directory_iterator(d / "cache")) caches += e.path().filename().string().rfind("tokens-", 0) == 0;
  EXPECT_EQ(caches, 1);  // the older one went
  bool hit = true;  // a cache larger than the bound is not written at all
  data::load_corpus((d / "two.txt").string(), tok, (d / "small").string(), &hit, true, 100);
  EXPECT_FALSE(fs::exists(d / "small"));
  fs::remove_all(d);
}

// Item 7: tie_word_embeddings true with a real lm_head.weight in the file dropped the lm_head
// silently (perplexity 264 instead of 19.7); one equal to the embedding is fine.
TEST(Checkpoint, TiedConfigWithADifferentLmHeadIsAnError) {
  nn::LlamaConfig cfg = tiny_run("/tmp/unused", 1).model_config(259);
  cfg.tie_word_embeddings = true;
  nn::LlamaForCausalLM model(cfg, 1);
  auto state = train::model_state(model);
  Tensor emb;
  for (const auto& [n, t] : state)
    if (n == "model.embed_tokens.weight") emb = t;
  auto equal = state;
  equal.emplace_back("lm_head.weight", emb.clone());
  train::load_model_state(model, equal);
  auto different = state;
  different.emplace_back("lm_head.weight", mul(emb, 2.0));
  const std::string m = error_of([&] { train::load_model_state(model, different); });
  EXPECT_NE(m.find("'lm_head.weight' differs from 'model.embed_tokens.weight'"), std::string::npos) << m;
  EXPECT_NE(m.find("tie_word_embeddings"), std::string::npos) << m;
}

// Item 8 (the record; the CLI's default is in tests/e2e): a checkpoint says the length it was
// trained at. Unclear messages: a damaged `latest` falls back to the newest whole checkpoint,
// and num_attention_heads 0 or negative is named with its value.
TEST(Checkpoint, RecordsTrainedLengthAndSurvivesADamagedLatest) {
  const fs::path out = temp_dir("trained_len");
  train::TrainConfig c = tiny_run(out, 4);
  c.ckpt_every = 2;
  train::run_training(c, quiet());
  EXPECT_EQ(train::trained_seq_len((out / "step-4").string()), 32);
  for (const std::string latest : {"", "step-", "step-9\n"}) {
    std::ofstream(out / "latest") << latest;
    std::string note;
    EXPECT_EQ(train::find_checkpoint(out.string(), &note), (out / "step-4").string()) << latest;
    EXPECT_NE(note.find("using the newest whole checkpoint there"), std::string::npos) << note;
  }
  fs::remove_all(out / "step-4" / "model.safetensors");  // the newest is not whole: the one before
  EXPECT_EQ(train::find_checkpoint(out.string()), (out / "step-2").string());
  for (const int heads : {0, -2}) {
    json::Value cj = train::read_json_file((out / "step-2" / "config.json").string());
    cj["num_attention_heads"] = heads;
    train::write_text_file_synced((out / "step-2" / "config.json").string(), cj.dump());
    const std::string m = error_of([&] { train::load_model((out / "step-2").string()); });
    EXPECT_NE(m.find("num_attention_heads=" + std::to_string(heads) + " must be positive"), std::string::npos) << m;
  }
  fs::remove_all(out);
}

// Item 9: a loss grown by orders of magnitude (--lr 100: 5.5 -> 1.1 M, "done") is an error
// naming the step and --lr.
TEST(Train, LossGrownByOrdersOfMagnitudeIsDivergence) {
  train::DivergenceWatch w;
  for (double l : {5.5, 4.0, 600.0}) w.observe(l);
  EXPECT_TRUE(w.last_diverged());
  const std::string m = w.message("x", 3, 100);
  EXPECT_NE(m.find("loss 600 at step 3"), std::string::npos) << m;
  EXPECT_NE(m.find("lower --lr (it is 100)"), std::string::npos) << m;
  w.observe(5);
  EXPECT_FALSE(w.last_diverged());
  for (int k = 0; k < train::DivergenceWatch::kMaxSteps; ++k) w.observe(1e6);
  EXPECT_TRUE(w.in_a_row_limit());
  const fs::path out = temp_dir("grown");
  train::TrainConfig c = tiny_run(out, 2);
  c.lr = 100;
  const std::string e = error_of([&] { train::run_training(c, quiet()); });
  EXPECT_NE(e.find("the loss has grown by orders of magnitude"), std::string::npos) << e;
  EXPECT_NE(e.find("at step 2"), std::string::npos) << e;
  EXPECT_NE(e.find("(it is 100)"), std::string::npos) << e;
  fs::remove_all(out);
}

// Item 11: a run that cannot fit is refused before its first step with the estimate, the memory
// available and the flags to change (--layers 100000, --batch 100000, --accum 1e9 and --preset 1b
// on a CPU were killed by the kernel after 30-170 s); the default runs fit.
TEST(Train, MemoryEstimateRefusesRunsThatCannotFit) {
  train::TrainConfig c = tiny_run("/tmp/unused", 1);
  const nn::LlamaConfig m = c.model_config(259);
  nn::LlamaForCausalLM model(m, 1);
  const train::MemoryEstimate e = train::estimate_training_memory(c, m, false);
  EXPECT_EQ(e.parameters, model.num_parameters() * 4);  // the parameter count is exact
  EXPECT_EQ(e.optimizer, model.num_parameters() * 8);
  // Activation checkpointing lowers the activations' estimate (the field is a string: an earlier
  // estimate looked for a bool and never saw it): block keeps each layer's input and one layer's
  // activations, mlp the attention's part of each layer and one MLP's.
  {
    const int64_t T = c.batch * c.seq, d = m.hidden_size, I = m.intermediate_size, L = m.num_hidden_layers;
    const int64_t kv = d / m.num_attention_heads * m.num_key_value_heads;
    const int64_t attention = T * (4 * d + 2 * kv), mlp = T * 3 * I, logits = T * m.vocab_size * 8;
    nn::LlamaConfig block = m, mlp_only = m;
    block.checkpoint_activations = "block";
    mlp_only.checkpoint_activations = "mlp";
    EXPECT_EQ(e.activations, (attention + mlp) * L * 4 + logits);
    EXPECT_EQ(train::estimate_training_memory(c, block, false).activations, (T * d * L + attention + mlp) * 4 + logits);
    EXPECT_EQ(train::estimate_training_memory(c, mlp_only, false).activations,
              ((attention + T * d) * L + mlp) * 4 + logits);
  }
  const train::AvailableMemory here = train::available_memory(kCPU);
  ASSERT_GT(here.bytes, 0);
  for (const std::string p : {"tiny", "small"}) {
    const train::TrainConfig d = train::preset(p);
    EXPECT_NO_THROW(train::check_memory_fits(d, d.model_config(259), false, kCPU, here)) << p;
  }
  train::TrainConfig big = c;
  big.layers = 100000;
  const std::string msg =
      error_of([&] { train::check_memory_fits(big, big.model_config(259), false, kCPU, {int64_t{1} << 30, "test"}); });
  EXPECT_NE(msg.find("more than the 1.00 GiB available (test)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("--layers 100000"), std::string::npos) << msg;
  EXPECT_NE(msg.find("a smaller model (--preset, --layers"), std::string::npos) << msg;
  // Where one switch alone makes the run fit, the message names it.
  {
    train::TrainConfig wide = c;
    wide.optimizer_in_backward = true;
    const int64_t with_in_backward = train::estimate_training_memory(wide, m, false).total();
    const int64_t plain = train::estimate_training_memory(c, m, false).total();
    ASSERT_LT(with_in_backward, plain);
    const std::string fits =
        error_of([&] { train::check_memory_fits(c, m, false, kCPU, {with_in_backward, "test"}); });
    EXPECT_NE(fits.find("It would fit with "), std::string::npos) << fits;
    EXPECT_NE(fits.find("--optimizer-in-backward --clip 0 (each gradient freed"), std::string::npos) << fits;
    nn::LlamaConfig block = m;
    block.checkpoint_activations = "block";
    const int64_t checkpointed = train::estimate_training_memory(c, block, false).total();
    const std::string ck = error_of([&] { train::check_memory_fits(c, m, false, kCPU, {checkpointed, "test"}); });
    EXPECT_NE(ck.find("--checkpoint-activations block (each block's"), std::string::npos) << ck;
    // Too little for either: no such advice.
    const std::string neither = error_of([&] { train::check_memory_fits(c, m, false, kCPU, {1024, "test"}); });
    EXPECT_EQ(neither.find("It would fit with"), std::string::npos) << neither;
  }
  train::TrainConfig accum = c;
  accum.accum = 1000000000;
  EXPECT_NE(error_of([&] { train::check_memory_fits(accum, m, false, kCPU, here); }).find("Use a smaller --accum"),
            std::string::npos);
  // through run_training: refused before the model is built, no run folder left
  const fs::path out = temp_dir("oom") / "run";
  train::TrainConfig run = tiny_run(out, 1);
  run.batch = 1000000;
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_NE(error_of([&] { train::run_training(run, quiet()); }).find("--batch 1000000 x --seq 32"), std::string::npos);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 10.0);
  EXPECT_FALSE(fs::exists(out));
  // /proc/meminfo and a cgroup limit, read from a sample tree
  const fs::path root = temp_dir("meminfo");
  fs::create_directories(root / "proc");
  std::ofstream(root / "proc" / "meminfo") << "MemTotal: 100 kB\nMemAvailable:    2048 kB\nSwapFree: 1024 kB\n";
  EXPECT_EQ(train::available_memory(kCPU, root.string()).bytes, 3072 * 1024);
  fs::create_directories(root / "sys" / "fs" / "cgroup");
  std::ofstream(root / "sys" / "fs" / "cgroup" / "memory.max") << "2097152\n";
  std::ofstream(root / "sys" / "fs" / "cgroup" / "memory.current") << "1048576\n";
  EXPECT_EQ(train::available_memory(kCPU, root.string()).bytes, 1048576);
  fs::remove_all(root);
  fs::remove_all(out.parent_path());
}

// Item 12: a stop request is honoured between evaluation batches (SIGINT waited for the whole
// evaluation), and --eval-batches beyond the validation split is clamped with a note.
TEST(Train, StopIsHonouredDuringEvaluationAndEvalBatchesAreClamped) {
  const fs::path out = temp_dir("eval_stop");
  train::TrainConfig c = tiny_run(out, 5);
  c.eval_every = 1;
  c.eval_batches = 100000;
  std::atomic<bool> stop{true};  // set before the first evaluation starts
  train::TrainHooks h = test::stop_hooks(&stop);
  FILE* log = std::tmpfile();
  h.progress = log;
  const auto t0 = std::chrono::steady_clock::now();
  const train::TrainSummary s = train::run_training(c, h);
  EXPECT_TRUE(s.interrupted);
  EXPECT_EQ(s.steps_done, 1);
  EXPECT_LT(s.final_eval_loss, 0);  // the evaluation was cut short, not finished
  EXPECT_EQ(read_text(out / "metrics.jsonl").find("eval_loss"), std::string::npos);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 20.0);
  std::rewind(log);
  std::string text;
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, log)) > 0;) text.append(buf, n);
  std::fclose(log);
  EXPECT_NE(text.find("note: --eval-batches 100000 is more than the"), std::string::npos) << text;
  int64_t batches = 100000;
  EXPECT_NE(data::clamp_batches(1000, 4, 32, "--eval-batches", batches).find("evaluating 7"), std::string::npos);
  EXPECT_EQ(batches, 7);
  EXPECT_EQ(data::clamp_batches(1000, 4, 32, "--eval-batches", batches), "");
  fs::remove_all(out);
}

// Unclear messages: KILN_PROFILE=banana turned profiling on; the tokenizer given to generate or
// eval must be the checkpoint's own (a byte tokenizer on a SentencePiece model printed only the
// prompt).
TEST(Train, ProfileValuesAndForeignTokenizersAreNamed) {
  for (const auto& [v, on] : std::vector<std::pair<std::string, bool>>{
           {"1", true}, {"ON", true}, {"true", true}, {"0", false}, {"off", false}, {"", false}}) {
    ::setenv("KILN_PROFILE", v.c_str(), 1);
    EXPECT_EQ(profile::env_requested(), on) << v;
  }
  ::setenv("KILN_PROFILE", "banana", 1);
  EXPECT_NE(error_of([] { profile::env_requested(); }).find("KILN_PROFILE='banana' is not 1 or 0"), std::string::npos);
  ::unsetenv("KILN_PROFILE");
  if (!data::sentencepiece_available()) GTEST_SKIP() << "kiln built without SentencePiece";
  const fs::path d = temp_dir("foreign_tok");
  std::ofstream(d / "corpus.txt") << data::default_corpus().substr(0, 20000);
  data::SentencePieceTrainOptions o;
  o.vocab_size = 600;
  o.output_prefix = (d / "sp").string();
  data::train_sentencepiece({(d / "corpus.txt").string()}, o);
  auto sp = data::load_tokenizer(o.output_prefix + ".model");
  nn::LlamaForCausalLM model(tiny_run(d, 1).model_config(sp->vocab_size()), 1);
  train::CheckpointData cd;
  cd.model = &model;
  cd.tokenizer = sp.get();
  train::save_checkpoint((d / "ck").string(), cd);
  EXPECT_EQ(train::load_tokenizer_for(model, (d / "ck").string(), "", "generate")->kind(), "sentencepiece");
  const std::string m = error_of([&] { train::load_tokenizer_for(model, (d / "ck").string(), "byte", "generate"); });
  EXPECT_NE(m.find("generate: --tokenizer byte (byte, 259 ids) is not the tokenizer the checkpoint was trained with "
                   "(sentencepiece, 600 ids"),
            std::string::npos)
      << m;
  fs::remove_all(d);
}
