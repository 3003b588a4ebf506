// Slow end-to-end training tests (label e2e): the loss falls on a small corpus, two
// deterministic runs give bitwise-identical loss curves, a resumed run continues bitwise, and
// the kiln program itself: a short run, Ctrl-C (checkpoint and exit 130), bad flags.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <tuple>

#include "kiln/autograd/grad_mode.h"
#include "kiln/core/device.h"
#include "kiln/io/json.h"
#include "kiln/io/safetensors.h"
#include "kiln/ops/ops.h"
#include "kiln/train/checkpoint.h"
#include "kiln/train/report.h"
#include "kiln/train/trainer.h"
#include "tests/train/train_test_util.h"

using namespace kiln;
namespace fs = std::filesystem;

namespace {

using test::temp_dir;
using test::tiny_run;

// "step:value" of `key` for each metrics line that has it.
std::vector<std::string> metric_lines(const fs::path& out, const std::string& key) {
  std::vector<std::string> v;
  std::ifstream f(out / "metrics.jsonl");
  std::string line;
  while (std::getline(f, line)) {
    json::Value j = json::parse(line);
    if (const json::Value* x = j.find(key)) v.push_back(std::to_string(j.find("step")->as_int()) + ":" + x->dump());
  }
  return v;
}

using test::logits_of;
using test::quiet;
using test::stop_hooks;

}  // namespace

TEST(TrainE2E, LossFallsOnASmallCorpus) {
  fs::path out = temp_dir("falls");
  train::TrainConfig c = tiny_run(out, 60);
  c.hidden = 64;
  c.intermediate = 128;
  c.lr = 5e-3;
  c.eval_every = 30;
  train::TrainSummary s = train::run_training(c, quiet());
  ASSERT_EQ(s.losses.size(), 60u);
  EXPECT_NEAR(s.first_loss, std::log(259.0), 0.3);  // starts near uniform
  double tail = 0;
  for (size_t i = 55; i < 60; ++i) tail += s.losses[i] / 5;
  EXPECT_LT(tail, s.first_loss - 1.5) << "loss did not fall: " << s.first_loss << " -> " << tail;
  EXPECT_GT(s.final_eval_loss, 0);
  EXPECT_TRUE(fs::exists(out / "loss.svg"));
  EXPECT_TRUE(fs::exists(out / "step-60" / "model.safetensors"));
  fs::remove_all(out);
}


TEST(TrainE2E, DeterministicRunsAreBitwiseIdenticalAndResumeContinuesBitwise) {
  fs::path a = temp_dir("det_a"), b = temp_dir("det_b"), r = temp_dir("det_r");
  train::TrainConfig ca = tiny_run(a, 12), cb = tiny_run(b, 12);
  ca.accum = cb.accum = 2;
  train::run_training(ca, quiet());
  train::run_training(cb, quiet());
  auto la = metric_lines(a, "loss"), lb = metric_lines(b, "loss");
  ASSERT_EQ(la.size(), 12u);
  EXPECT_EQ(la, lb);

  // stop at step 6 (as Ctrl-C does: a checkpoint), resume to 12: the same curve
  train::TrainConfig c1 = tiny_run(r, 12);
  c1.accum = 2;
  std::atomic<bool> stop{false};
  train::TrainHooks h = stop_hooks(&stop);
  h.on_step = [&](int64_t step) { stop.store(step == 6); };
  train::TrainSummary s1 = train::run_training(c1, h);
  EXPECT_TRUE(s1.interrupted);
  EXPECT_EQ(s1.steps_done, 6);
  train::TrainConfig c2 = tiny_run(r, 12);
  c2.resume = r.string();
  train::TrainSummary s2 = train::run_training(c2, quiet());
  EXPECT_EQ(s2.start_step, 6);
  EXPECT_EQ(metric_lines(r, "loss"), la);
  auto ma = train::load_model((a / "step-12").string()), mr = train::load_model((r / "step-12").string());
  EXPECT_EQ(logits_of(*ma), logits_of(*mr));
  for (auto& p : {a, b, r}) fs::remove_all(p);
}


namespace {
struct CliRun {
  int status;
  std::string output;
};
// Runs `kiln ARGS` (in `cwd` when given) with stderr folded into the output.
CliRun run_cli(const std::string& args, const fs::path& cwd = {}) {
  std::string cmd = (cwd.empty() ? "" : "cd '" + cwd.string() + "' && ") + KILN_CLI_COMMAND + " " + args + " 2>&1";
  FILE* p = ::popen(cmd.c_str(), "r");
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  int st = ::pclose(p);
  return {WIFEXITED(st) ? WEXITSTATUS(st) : -1, out};
}
}  // namespace

TEST(TrainCli, ShortRunWritesMetricsCheckpointCurveAndSample) {
  fs::path out = temp_dir("cli");
  CliRun r = run_cli("train --preset tiny --steps 6 --eval-every 3 --sample-tokens 20 --prompt 'The ' --out " +
                  out.string());
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("--- sample ---"), std::string::npos) << r.output;
  auto lines = metric_lines(out, "lr");
  EXPECT_EQ(lines.size(), 6u);
  EXPECT_TRUE(fs::exists(out / "loss.svg"));
  EXPECT_EQ(train::find_checkpoint(out.string()), (out / "step-6").string());
  CliRun e = run_cli("eval --ckpt " + out.string() + " --ids 1,2,3 --logits-out " + (out / "l.safetensors").string());
  ASSERT_EQ(e.status, 0) << e.output;
  EXPECT_EQ(io::load_safetensors((out / "l.safetensors").string())[0].second.shape(), (Shape{1, 3, 259}));
  CliRun in = run_cli("inspect " + out.string());  // a run folder, as eval takes it (it failed)
  ASSERT_EQ(in.status, 0) << in.output;
  EXPECT_NE(in.output.find("step-6/model.safetensors"), std::string::npos) << in.output;
  EXPECT_NE(in.output.find("model.layers.0.self_attn.q_proj.weight"), std::string::npos) << in.output;
  CliRun ej = run_cli("eval --json --ckpt " + out.string() + " --ids 1,2 --logits-out " + (out / "l2.safetensors").string());
  ASSERT_EQ(ej.status, 0) << ej.output;
  EXPECT_EQ(json::parse(ej.output).find("logits_shape")->size(), 3u) << ej.output;  // --json applies here too
  // --logits-out never replaces a file of the checkpoint it reads
  const fs::path weights = out / "step-6" / "model.safetensors";
  const auto weights_bytes = fs::file_size(weights);
  CliRun over = run_cli("eval --ckpt " + out.string() + " --ids 1,2 --logits-out " + weights.string());
  EXPECT_NE(over.status, 0) << over.output;
  EXPECT_NE(over.output.find("is the checkpoint's own model.safetensors"), std::string::npos) << over.output;
  EXPECT_EQ(fs::file_size(weights), weights_bytes);
  std::ofstream(out / "held_out.txt") << "kiln trains language models. kiln trains language models again.";
  // --logits-out with --data was accepted and wrote nothing; an --ids list ending in a comma was taken
  CliRun lo = run_cli("eval --seq 16 --ckpt " + out.string() + " --data " + (out / "held_out.txt").string() +
                      " --logits-out " + (out / "lo.safetensors").string());
  EXPECT_EQ(lo.status, 1) << lo.output;
  EXPECT_NE(lo.output.find("--logits-out writes the logits of --ids"), std::string::npos) << lo.output;
  CliRun comma = run_cli("eval --ckpt " + out.string() + " --ids 1,2, --logits-out " + (out / "c.safetensors").string());
  EXPECT_EQ(comma.status, 1) << comma.output;
  EXPECT_NE(comma.output.find("--ids: an empty item in '1,2,'"), std::string::npos) << comma.output;
  CliRun ev = run_cli("eval --json --seq 16 --ckpt " + out.string() + " --data " + (out / "held_out.txt").string());
  ASSERT_EQ(ev.status, 0) << ev.output;
  json::Value evj = json::parse(ev.output);  // with --json off a terminal, no progress lines
  CliRun plain = run_cli("eval --seq 16 --ckpt " + out.string() + " --data " + (out / "held_out.txt").string());
  ASSERT_EQ(plain.status, 0) << plain.output;
  EXPECT_NE(plain.output.find("step 1/"), std::string::npos) << plain.output;  // eval shows its progress
  EXPECT_NEAR(std::exp(evj.find("loss")->as_double()), evj.find("perplexity")->as_double(), 1e-3);
  // a negative --max-batches is an error, not "the whole text" (0 is)
  CliRun neg = run_cli("eval --max-batches -3 --seq 16 --ckpt " + out.string() + " --data " +
                       (out / "held_out.txt").string());
  EXPECT_EQ(neg.status, 1) << neg.output;
  EXPECT_NE(neg.output.find("--max-batches must be >= 0 (0: the whole text), got -3"), std::string::npos)
      << neg.output;
  for (const auto& f : fs::directory_iterator(out))  // eval caches tokens in the temp dir, not next to the text
    EXPECT_NE(f.path().filename().string().rfind("tokens-", 0), 0u) << f.path();
  // a run directory whose 'latest' is damaged: the error lists the checkpoints there
  {
    const fs::path copy = out.string() + "-latest";
    fs::create_directories(copy);
    fs::copy(out / "step-6", copy / "step-6", fs::copy_options::recursive);
    std::ofstream(copy / "latest") << "";
    // (it was refused: the newest whole checkpoint is the run's, and the resume says so)
    CliRun empty = run_cli("train --resume " + copy.string() + " --steps 7 --sample-tokens 0");
    EXPECT_EQ(empty.status, 0) << empty.output;
    EXPECT_NE(empty.output.find("is empty: using the newest whole checkpoint there"), std::string::npos)
        << empty.output;
    // eval evaluates at the length the model was trained at (256-token windows on a 64-token
    // model disagreed with the in-training eval); generate says when it goes past it
    CliRun ev = run_cli("eval --ckpt " + copy.string() + " --data " + (out / "held_out.txt").string());
    EXPECT_NE(ev.output.find("windows of 64)"), std::string::npos) << ev.output;
    CliRun gen = run_cli("generate --ckpt " + copy.string() + " --max-tokens 80 --seed 1");
    EXPECT_NE(gen.output.find("the model was trained on sequences of 64 tokens"), std::string::npos) << gen.output;
    fs::remove_all(copy);
  }
  // a flag that would change a saved setting is an error (it was dropped without a word);
  // one that repeats it is fine
  CliRun lr = run_cli("train --resume " + out.string() + " --steps 8 --lr 0.5 --hidden 128 --sample-tokens 0");
  EXPECT_EQ(lr.status, 1) << lr.output;
  // (named in the order of `kiln train --help`, the config's field table)
  EXPECT_NE(lr.output.find("which these flags would change: --lr 0.5 (the run has 0.003), --hidden 128 (the run has "
                           "64)"),
            std::string::npos)
      << lr.output;
  std::ofstream(out / "more.toml") << "lr = 0.1\n";
  CliRun cfg = run_cli("train --resume " + out.string() + " --config " + (out / "more.toml").string());
  EXPECT_EQ(cfg.status, 1) << cfg.output;
  EXPECT_NE(cfg.output.find("so --config does not apply"), std::string::npos) << cfg.output;
  EXPECT_EQ(metric_lines(out, "lr").size(), 6u);  // neither ran a step
  // resume the run directory (no --out: it continues there) for two more steps, repeating a
  // saved setting
  CliRun rr = run_cli("train --resume " + out.string() + " --steps 8 --sample-tokens 0 --preset tiny");
  ASSERT_EQ(rr.status, 0) << rr.output;
  EXPECT_EQ(metric_lines(out, "lr").size(), 8u);
  EXPECT_EQ(train::find_checkpoint(out.string()), (out / "step-8").string());
  CliRun g = run_cli("generate --ckpt " + out.string() + " --prompt 'ab' --max-tokens 10 --seed 3");
  ASSERT_EQ(g.status, 0) << g.output;
  EXPECT_EQ(g.output, run_cli("generate --ckpt " + out.string() + " --prompt 'ab' --max-tokens 10 --seed 3").output);
  // past the context (256 positions here) generation stops, and says so
  CliRun full = run_cli("generate --ckpt " + out.string() + " --prompt 'ab' --max-tokens 500 --seed 3");
  ASSERT_EQ(full.status, 0) << full.output;
  EXPECT_NE(full.output.find("of --max-tokens 500: the model's context of"), std::string::npos) << full.output;
  fs::remove_all(out);
}

TEST(TrainCli, EvalWithoutValidationTextSaysSo) {
  // --val-fraction 0 with --eval-every 1 ran no eval and said nothing
  fs::path out = temp_dir("noval");
  CliRun r = run_cli("train --preset tiny --steps 2 --val-fraction 0 --eval-every 1 --sample-tokens 0 --out " +
                     out.string());
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("note: no validation text (--val-fraction 0 of this text), so no eval runs: --eval-every 1 "
                          "is ignored"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(metric_lines(out, "loss").size(), 2u);
  EXPECT_EQ(metric_lines(out, "eval_loss").size(), 0u);
  fs::remove_all(out);
}

TEST(TrainCli, BadValuesGiveClearMessages) {
  CliRun r = run_cli("train --lr -1 --steps 1 --out /nonexistent/x");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.output.find("lr=-1"), std::string::npos) << r.output;
  r = run_cli("train --steps many");
  EXPECT_NE(r.output.find("--steps: expected an integer, got 'many'"), std::string::npos) << r.output;
  r = run_cli("train --lr 1e-320 --steps -1");  // a subnormal is a double (it was "out of range")
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.output.find("steps=-1 must be positive"), std::string::npos) << r.output;
  r = run_cli("train --lr 1e-400 --steps 1");
  EXPECT_NE(r.output.find("--lr: '1e-400' is smaller than a double can hold"), std::string::npos) << r.output;
  r = run_cli("train --data '' --steps 1");  // trained on the built-in corpus without a word
  EXPECT_NE(r.output.find("--data: the path is empty ('')"), std::string::npos) << r.output;
  r = run_cli("help train");  // printed the top-level help
  EXPECT_NE(r.output.find("usage: kiln train"), std::string::npos) << r.output;
  r = run_cli("train --preset galaxy");
  EXPECT_NE(r.output.find("preset 'galaxy'"), std::string::npos) << r.output;
  if (cuda_device_count() == 0) {  // a preset's own device, never named by the user, is named as the preset's
    r = run_cli("train --preset 125m --steps 1");
    EXPECT_EQ(r.status, 1);
    EXPECT_NE(r.output.find("the '125m' preset trains on cuda"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("pass --device cpu"), std::string::npos) << r.output;
  }
  r = run_cli("train --batch 100000000000 --steps 1");  // was "out of host memory", naming no flag
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.output.find("batch=100000000000 x seq=128 x accum=1 is more than 2^40 tokens per step; use a smaller "
                          "--batch, --seq or --accum"),
            std::string::npos)
      << r.output;
  r = run_cli("train --kv-heads 3 --steps 1");
  EXPECT_NE(r.output.find("num_key_value_heads=3"), std::string::npos) << r.output;
  // input refused before the run starts leaves no run directory behind (it was created first)
  fs::path d = temp_dir("refused");
  r = run_cli("train --steps 1 --data " + (d / "missing.txt").string() + " --out " + (d / "run").string());
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.output.find("missing.txt' does not exist"), std::string::npos) << r.output;
  r = run_cli("train --steps 1 --tokenizer " + (d / "missing.model").string() + " --out " + (d / "run").string());
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.output.find("missing.model' is neither"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(d / "run"));
  fs::remove_all(d);
  r = run_cli("train --help");
  EXPECT_EQ(r.status, 0);
  for (const char* f : {"--preset", "--data", "--steps", "--out", "--seed", "--deterministic", "--resume", "--device",
                        "--accum", "--attention", "--fused-loss", "--config"})
    EXPECT_NE(r.output.find(f), std::string::npos) << f;
  for (const train::ConfigField& f : train::config_fields())  // the flags are the config's field table
    EXPECT_NE(r.output.find("  " + f.flag + (f.is_switch() ? "" : " " + f.metavar)), std::string::npos) << f.flag;
}

TEST(TrainCli, ResumeFromAForeignTrainerStateIsAnError) {
  // A Hugging Face Trainer checkpoint also holds config.json and a trainer_state.json, with
  // other keys: resuming from it (or from a damaged state) segfaulted on the missing keys.
  fs::path d = temp_dir("foreign_state");
  nn::LlamaForCausalLM m(train::preset("tiny").model_config(259), 1);
  train::CheckpointData cd;
  cd.model = &m;
  cd.trainer_state = json::parse(R"({"global_step": 2, "log_history": []})");
  train::save_checkpoint((d / "ck").string(), cd);
  CliRun r = run_cli("train --resume " + (d / "ck").string() + " --steps 3 --sample-tokens 0");
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("trainer_state.json has no 'step'"), std::string::npos) << r.output;
  train::TrainConfig c = tiny_run(d / "run", 3);
  c.resume = (d / "ck").string();
  EXPECT_THROW(train::run_training(c, quiet()), Error);
  // kiln's keys with damaged values: named with the file, not "value: expected an integer"
  // (a string) or taken (a negative sampler position)
  for (const auto& [state, needle] : std::vector<std::pair<std::string, std::string>>{
           {R"({"step": 2, "sampler_position": 0, "tokens_seen": "x", "elapsed_s": 1, "config": {}, "optimizer": {}})",
            "'tokens_seen' is \"x\", not a count"},
           {R"({"step": 2, "sampler_position": -1, "tokens_seen": 0, "elapsed_s": 1, "config": {}, "optimizer": {}})",
            "'sampler_position' is -1, not a count"},
           {R"({"step": 2, "sampler_position": 0, "tokens_seen": 0, "elapsed_s": -1e300, "config": {}, "optimizer": {}})",
            "'elapsed_s' is -1e+300, not a number of seconds"}}) {
    cd.trainer_state = json::parse(state);
    train::save_checkpoint((d / "ck").string(), cd);
    CliRun bad = run_cli("train --resume " + (d / "ck").string() + " --steps 3 --sample-tokens 0");
    EXPECT_EQ(bad.status, 1) << bad.output;
    EXPECT_NE(bad.output.find("trainer_state.json: " + needle), std::string::npos) << bad.output;
  }
  fs::remove_all(d);
}

TEST(TrainCli, EvalAndGenerateRefuseATokenizerLargerThanTheVocabulary) {
  // generate found the mismatch only in the embedding, after printing the prompt
  fs::path d = temp_dir("vocab_mismatch");
  nn::LlamaForCausalLM m(train::preset("tiny").model_config(64), 1);
  train::CheckpointData cd;
  cd.model = &m;
  train::save_checkpoint((d / "ck").string(), cd);
  std::ofstream(d / "text.txt") << "kiln trains language models. kiln trains language models again.";
  const std::string ck = " --tokenizer byte --ckpt " + (d / "ck").string();
  CliRun g = run_cli("generate --prompt 'ab' --max-tokens 4" + ck);
  EXPECT_EQ(g.status, 1) << g.output;
  EXPECT_EQ(g.output.rfind("kiln generate: error: the tokenizer has 259 ids, the model only 64", 0), 0u)
      << g.output;
  CliRun e = run_cli("eval --seq 16 --data " + (d / "text.txt").string() + ck);
  EXPECT_EQ(e.status, 1) << e.output;
  EXPECT_NE(e.output.find("kiln eval: error: the tokenizer has 259 ids, the model only 64"), std::string::npos) << e.output;
  // Weights that hold NaN: an error, as generate's (eval printed "loss nan" and exited 0).
  nn::LlamaForCausalLM nan_model(train::preset("tiny").model_config(300), 1);
  {
    NoGradGuard ng;
    nan_model.named_parameters().back().second->fill_(NAN);
  }
  cd.model = &nan_model;
  train::save_checkpoint((d / "nan").string(), cd);
  CliRun n = run_cli("eval --seq 16 --tokenizer byte --data " + (d / "text.txt").string() + " --ckpt " +
                     (d / "nan").string());
  EXPECT_EQ(n.status, 1) << n.output;
  EXPECT_NE(n.output.find("kiln eval: error: the loss is nan"), std::string::npos) << n.output;
  fs::remove_all(d);
}

TEST(TrainCli, AFreshRunNeverMixesIntoAnEarlierOne) {
  // Before, a second run into a run directory rewrote its metrics and its checkpoint pruning
  // deleted the first run's step-1 among its own.
  fs::path out = temp_dir("earlier");
  const std::string run = "train --preset tiny --eval-every 0 --sample-tokens 0 --ckpt-every 1 --keep-ckpts 2 ";
  ASSERT_EQ(run_cli(run + "--steps 2 --out " + out.string()).status, 0);
  CliRun again = run_cli(run + "--steps 1 --out " + out.string());
  EXPECT_EQ(again.status, 1) << again.output;
  EXPECT_NE(again.output.find("holds an earlier run (checkpoint step-2); continue it with --resume"), std::string::npos)
      << again.output;
  EXPECT_NE(again.output.find("kiln train: error: --out"), std::string::npos) << again.output;  // not "error: train:"
  EXPECT_TRUE(fs::exists(out / "step-1") && fs::exists(out / "step-2"));
  EXPECT_EQ(metric_lines(out, "lr").size(), 2u);
  // --overwrite replaces the earlier run: only the new one's checkpoint and metrics remain
  CliRun over = run_cli(run + "--steps 1 --overwrite --out " + out.string());
  ASSERT_EQ(over.status, 0) << over.output;
  EXPECT_TRUE(fs::exists(out / "step-1"));
  EXPECT_FALSE(fs::exists(out / "step-2"));
  EXPECT_EQ(metric_lines(out, "lr").size(), 1u);
  // The default directory moves on to runs/kiln-2 (the working directory is `out`).
  ASSERT_EQ(run_cli(run + "--steps 1", out).status, 0);
  CliRun next = run_cli(run + "--steps 1", out);
  ASSERT_EQ(next.status, 0) << next.output;
  EXPECT_NE(next.output.find("runs/kiln holds an earlier run: this one goes to runs/kiln-2"), std::string::npos)
      << next.output;
  EXPECT_TRUE(fs::exists(out / "runs" / "kiln" / "step-1") && fs::exists(out / "runs" / "kiln-2" / "step-1"));
  // Resuming a finished run says so and changes nothing (it printed "done after 1 steps: loss
  // 0.0000 -> 0.0000, 0 tokens/s" and sampled again).
  CliRun done = run_cli("train --resume " + (out / "runs" / "kiln").string());
  EXPECT_EQ(done.status, 0) << done.output;
  EXPECT_NE(done.output.find("is already at its last step, 1: nothing to train"), std::string::npos) << done.output;
  EXPECT_EQ(done.output.find("--- sample ---"), std::string::npos) << done.output;
  // A folder with metrics but no checkpoint (a run stopped before its first save) is not
  // offered to --resume, which could not take it.
  fs::remove_all(out / "runs" / "kiln-2" / "step-1");
  fs::remove(out / "runs" / "kiln-2" / "latest");
  CliRun dead = run_cli(run + "--steps 1 --out " + (out / "runs" / "kiln-2").string());
  EXPECT_EQ(dead.status, 1);
  EXPECT_NE(dead.output.find("holds an earlier run (metrics.jsonl and no checkpoint, so it cannot be resumed)"),
            std::string::npos) << dead.output;
  fs::remove_all(out);
}

// A resume on changed data says so (it resumed silently, so the run no longer matched an
// uninterrupted one); a run stopped by --max-time says so in its summary (it said "done").
TEST(TrainCli, ResumeOnChangedDataAndTimeLimitSaySo) {
  fs::path out = temp_dir("changed");
  std::string text;
  for (int i = 0; i < 200; ++i) text += "line " + std::to_string(i) + " of a small corpus for kiln\n";
  std::ofstream(out / "d.txt") << text;
  const std::string run = "train --preset tiny --eval-every 0 --sample-tokens 0 --data " + (out / "d.txt").string() +
                          " --out " + (out / "run").string();
  ASSERT_EQ(run_cli(run + " --steps 1").status, 0);
  std::ofstream(out / "d.txt", std::ios::app) << "one more line\n";
  CliRun again = run_cli("train --resume " + (out / "run").string() + " --steps 2");
  ASSERT_EQ(again.status, 0) << again.output;
  EXPECT_NE(again.output.find("note: the training data differs from the run's"), std::string::npos) << again.output;
  EXPECT_NE(again.output.find("note: --steps 2 (the run had 1)"), std::string::npos) << again.output;
  CliRun timed = run_cli(run + "2 --steps 100000 --max-time 1");
  ASSERT_EQ(timed.status, 0) << timed.output;
  EXPECT_NE(timed.output.find("stopped at --max-time after"), std::string::npos) << timed.output;
  fs::remove_all(out);
}

TEST(TrainCli, RepeatedPresetUsesTheLastOne) {
  // The model was built on the first --preset while the run was labelled (and saved) with the
  // last one: here a "tiny model" of the small preset's shape.
  fs::path out = temp_dir("preset_twice");
  CliRun r = run_cli("train --preset small --preset tiny --steps 1 --eval-every 0 --sample-tokens 0 --out " +
                     out.string());
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("tiny model"), std::string::npos) << r.output;
  json::Value cfg = train::read_json_file((out / "step-1" / "config.json").string());
  EXPECT_EQ(cfg.find("hidden_size")->as_int(), train::preset("tiny").hidden);
  fs::remove_all(out);
}

TEST(BenchCli, AttentionScoreModRunsAndRejectsBadValues) {
  CliRun r = run_cli("bench attention --seq 64 --heads 2 --head-dim 16 --mask causal --score-mod softcap:30 "
                     "--impl flex --backward --iters 1 --warmup 0");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("\"score_mod\":\"softcap:30\""), std::string::npos) << r.output;
  // --backward also times the backward alone (bwd_ms_median, bwd_tflops).
  {
    const size_t line = r.output.find("{\"bench\":\"attention\"");
    ASSERT_NE(line, std::string::npos) << r.output;
    const json::Value o = json::parse(r.output.substr(line, r.output.find('\n', line) - line));
    ASSERT_TRUE(o.contains("bwd_ms_median") && o.contains("bwd_tflops")) << r.output;
    EXPECT_GT(o.find("bwd_ms_median")->as_double(), 0.0);
    EXPECT_GT(o.find("bwd_tflops")->as_double(), 0.0);
  }
  r = run_cli("bench attention --seq 64 --heads 2 --head-dim 16 --mask none --score-mod alibi --impl flex --iters 1");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("\"score_mod\":\"alibi\""), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("bwd_ms_median"), std::string::npos) << "only --backward times the backward: " << r.output;
  for (auto [args, message] : std::vector<std::pair<std::string, std::string>>{
           {"--score-mod softcap:x --impl flex", "softcap:C needs a positive number C, got 'softcap:x'"},
           // not a library mod: a run-time expression (docs/jit.md), here one that is not a value
           {"--score-mod tanh --impl flex", "does not compile"},
           {"--score-mod alibi", "times flex only"},
           {"--score-mod alibi --impl flex --mask window:8", "--mask none or causal, got 'window:8'"}}) {
    r = run_cli("bench attention --seq 64 --heads 2 --head-dim 16 " + args);
    EXPECT_EQ(r.status, 1) << args;
    EXPECT_NE(r.output.find(message), std::string::npos) << args << ": " << r.output;
  }
}

TEST(BenchCli, ImplListsDtypesAndLargeBlocksAreChecked) {
  const std::string attn = "bench attention --seq 64 --heads 2 --head-dim 16 --iters 1 --warmup 0 ";
  // Each --impl entry must be a known one (a substring match ran nothing for 'foo' and flex
  // for 'reflex'); an error names the entry.
  for (auto [args, message] : std::vector<std::pair<std::string, std::string>>{
           {attn + "--impl reflex", "bench attention: unknown impl 'reflex' in --impl 'reflex'"},
           {attn + "--impl flex,,reference", "unknown impl '' in --impl 'flex,,reference'"},
           {attn + "--dtype i32", "bench attention: --dtype must be f32, bf16 or f16, got 'i32'"},
           {"bench attention --seq 64 --heads 2 --head-dim 16 --iters 0", "--iters must be >= 1 and --warmup >= 0, got 0"},
           {"bench attention --seq 0 --heads 2 --head-dim 16", "--seq and --head-dim must be positive, got 1, 2, 0, 16"},
           {"bench lce --tokens 8 --dim 8 --vocab 16 --iters 1 --impl fused,foo", "bench lce: unknown impl 'foo'"},
           // an empty --impl is an empty list, not the defaults
           {"bench lce --tokens 8 --dim 8 --vocab 16 --iters 1 --impl ''", "bench lce: unknown impl '' in --impl ''"}}) {
    CliRun r = run_cli(args);
    EXPECT_EQ(r.status, 1) << args << ": " << r.output;
    EXPECT_NE(r.output.find(message), std::string::npos) << args << ": " << r.output;
  }
  // The implementations run in the order given, each once.
  CliRun r = run_cli(attn + "--impl reference,flex,reference");
  ASSERT_EQ(r.status, 0) << r.output;
  const size_t ref = r.output.find("\"impl\":\"reference\""), flex = r.output.find("\"impl\":\"flex\"");
  ASSERT_NE(ref, std::string::npos) << r.output;
  ASSERT_NE(flex, std::string::npos) << r.output;
  EXPECT_LT(ref, flex) << r.output;
  EXPECT_EQ(r.output.find("\"impl\":\"reference\"", ref + 1), std::string::npos) << r.output;
  // A BlockMask block far larger than the sequence: the CPU kernels size their scratch tiles by
  // the sequence (they allocated block x block floats and aborted with std::bad_alloc).
  r = run_cli(attn + "--impl flex --block 1000000 --backward");
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("\"impl\":\"flex\""), std::string::npos) << r.output;
}

// Runs `kiln train` until it has trained a few steps, sends it `signals` (microseconds apart),
// and returns its exit status and log.
struct Stopped {
  int status = -1;
  std::string log;
};
Stopped train_then_signal(const fs::path& out, const std::vector<std::pair<int, int>>& signals) {
  std::string cmd = std::string(KILN_CLI_COMMAND) + " train --preset tiny --steps 100000 --sample-tokens 0 --out " +
                    out.string() + " > " + (out / "log.txt").string() + " 2>&1";
  fs::create_directories(out);
  pid_t pid = ::fork();
  if (pid == 0) {
    ::execl("/bin/sh", "sh", "-c", ("exec " + cmd).c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  // wait until it has trained a few steps
  for (int i = 0; i < 600 && !fs::exists(out / "metrics.jsonl"); ++i) ::usleep(100000);
  ::usleep(500000);
  for (auto [sig, after_us] : signals) {
    ::usleep(static_cast<useconds_t>(after_us));
    ::kill(pid, sig);
  }
  int st = 0;
  ::waitpid(pid, &st, 0);
  std::ifstream f(out / "log.txt");
  return {WIFEXITED(st) ? WEXITSTATUS(st) : -1, std::string(std::istreambuf_iterator<char>(f), {})};
}

// Ctrl-C checkpoints and exits 130, saying so at once; SIGTERM (Slurm, docker stop) does the
// same with 143 (it killed the run without a checkpoint); a second signal within a second is
// the same request (timeout signals the child and its group: such a pair aborted the run
// without a checkpoint or a word).
TEST(TrainCli, CtrlCCheckpointsAndExits) {
  for (const auto& [name, signals, want] :
       {std::tuple{"SIGINT", std::vector<std::pair<int, int>>{{SIGINT, 0}}, 130},
        std::tuple{"SIGINT twice", std::vector<std::pair<int, int>>{{SIGINT, 0}, {SIGINT, 50000}}, 130},
        std::tuple{"SIGTERM", std::vector<std::pair<int, int>>{{SIGTERM, 0}}, 143}}) {
    SCOPED_TRACE(name);
    fs::path out = temp_dir("sigint");
    const Stopped r = train_then_signal(out, signals);
    EXPECT_EQ(r.status, want) << r.log;
    EXPECT_NE(r.log.find("stopping after this step and saving a checkpoint"), std::string::npos) << r.log;
    std::string ck = train::find_checkpoint(out.string());
    ASSERT_FALSE(ck.empty()) << r.log;
    json::Value state = train::read_json_file(ck + "/trainer_state.json");
    EXPECT_EQ(state.find("reason")->as_string(), "interrupted");
    EXPECT_GT(state.find("step")->as_int(), 0);
    train::load_model(ck);
    fs::remove_all(out);
  }
}

// Two real kiln train processes on one --out: while the first runs, a second one, an --overwrite
// and a --resume are refused naming its pid (both exited 0 with their metrics interleaved);
// once it is killed, the folder is usable again.
// KILN_TEST_TIME_SCALE (default 1) stretches its waits, for an emulator far slower than a CPU
// (qemu's 256-bit SVE, docs/arm.md).
TEST(TrainCli, ARunFolderHasOneWriter) {
  fs::path out = temp_dir("one_writer");
  const char* scale_env = std::getenv("KILN_TEST_TIME_SCALE");
  const int scale = scale_env ? std::max(1, std::atoi(scale_env)) : 1;
  const pid_t first = ::fork();
  if (first == 0) {
    ::alarm(60 * scale);
    const std::string log = (out.string() + "-log.txt");
    ::freopen(log.c_str(), "w", stderr);
    ::execl(KILN_CLI_PATH, "kiln", "train", "--preset", "tiny", "--steps", "100000", "--sample-tokens", "0",
            "--ckpt-every", "1", "--out", out.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  for (int i = 0; i < 400 * scale && !fs::exists(out / "latest"); ++i) ::usleep(50000);
  ASSERT_TRUE(fs::exists(out / "latest"));
  const std::string in_use = out.string() + " is in use by pid " + std::to_string(first);
  for (const std::string args : {"--preset tiny --steps 2 --sample-tokens 0 --out " + out.string(),
                                 "--preset tiny --steps 2 --sample-tokens 0 --overwrite --out " + out.string(),
                                 "--resume " + out.string() + " --steps 200000"}) {
    CliRun r = run_cli("train " + args);
    EXPECT_EQ(r.status, 1) << args << "\n" << r.output;
    EXPECT_NE(r.output.find(in_use), std::string::npos) << args << "\n" << r.output;
  }
  ::kill(first, SIGKILL);
  ::waitpid(first, nullptr, 0);
  CliRun again = run_cli("train --preset tiny --steps 1 --sample-tokens 0 --overwrite --out " + out.string());
  EXPECT_EQ(again.status, 0) << again.output;
  fs::remove_all(out);
  fs::remove(out.string() + "-log.txt");
}
