// `kiln eval`: the loss and perplexity of a checkpoint on a text (consecutive windows), or
// the logits of one token sequence written as safetensors (to compare implementations).
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <sstream>

#include "cli/args.h"
#include "cli/commands.h"
#include "kiln/autograd/grad_mode.h"
#include "kiln/data/dataset.h"
#include "kiln/io/safetensors.h"
#include "kiln/ops/ops.h"
#include "kiln/train/checkpoint.h"
#include "kiln/train/report.h"

namespace kiln::cli {

int run_eval(const Args& args) {
  std::string ckpt, data, ids_text, logits_out, device = "cpu", tokenizer;
  int64_t seq = 0, batch = 4, max_batches = 0;
  bool as_json = false;
  ArgParser p("eval", "Evaluate a checkpoint (kiln's or a Hugging Face Llama directory): loss and perplexity\n"
                      "on a text, or the logits of a token sequence.");
  p.option("--ckpt", &ckpt, "DIR", "checkpoint directory (config.json + model.safetensors or shards)");
  p.option("--data", &data, "FILE", "text file or folder to evaluate on");
  p.option("--tokenizer", &tokenizer, "SPEC",
           "tokenizer: 'byte', a tokenizer.model or a folder (default: the checkpoint's)");
  p.option("--seq", &seq, "N", "tokens per window (0: the length the model was trained at, else 256)");
  p.option("--batch", &batch, "N", "windows per forward pass");
  p.option("--max-batches", &max_batches, "N", "evaluate at most N batches (0: the whole text)");
  p.option("--ids", &ids_text, "LIST", "comma-separated token ids, e.g. 1,17,42 (with --logits-out)");
  p.option("--logits-out", &logits_out, "FILE", "write the logits [1, T, vocab] (f32) of --ids here");
  p.option("--device", &device, "DEV", "cpu, cuda or cuda:N");
  p.flag("--json", &as_json, "print one JSON object");
  if (!p.parse(args)) return 0;
  KILN_CHECK(!ckpt.empty(), "--ckpt is required");
  KILN_CHECK(data.empty() != ids_text.empty(), "give exactly one of --data and --ids");
  KILN_CHECK(ids_text.empty() || !logits_out.empty(), "--ids needs --logits-out FILE");
  KILN_CHECK(logits_out.empty() || !ids_text.empty(),
             "--logits-out writes the logits of --ids; with --data it has nothing to write (give --ids instead, "
             "or leave --logits-out out)");
  KILN_CHECK(ids_text.empty() || (ids_text.back() != ',' && ids_text.front() != ','),
             "--ids: an empty item in '", ids_text, "' (a comma at its start or end)");
  KILN_CHECK(max_batches >= 0, "--max-batches must be >= 0 (0: the whole text), got ", max_batches);
  const Device dev = Device::parse(device);
  check_device_available(dev, "eval");
  std::string note;
  std::string dir = train::find_checkpoint(ckpt, &note);
  KILN_CHECK(!dir.empty(), "--ckpt: no checkpoint (config.json) in '", ckpt, "'", train::why_no_checkpoint(ckpt));
  if (!note.empty()) std::fprintf(stderr, "%s\n", note.c_str());
  if (!logits_out.empty()) {
    std::error_code ec;  // equivalent() is false (ec set) while --logits-out does not exist
    for (const auto& file : std::filesystem::directory_iterator(dir))
      KILN_CHECK(!std::filesystem::equivalent(file.path(), logits_out, ec), "--logits-out ", logits_out,
                 " is the checkpoint's own ", file.path().filename().string(),
                 ", which writing would replace; choose another FILE");
  }
  auto model = train::load_model(dir, dev);
  model->eval();
  NoGradGuard ng;

  if (!ids_text.empty()) {
    std::vector<int64_t> ids;
    std::stringstream ss(ids_text);
    std::string item;
    while (std::getline(ss, item, ',')) {
      size_t used = 0;
      long long v = -1;
      try {
        v = std::stoll(item, &used);
      } catch (...) {
        used = 0;
      }
      KILN_CHECK(used == item.size() && !item.empty(), "--ids: '", item, "' is not an integer");
      KILN_CHECK(v >= 0 && v < model->config.vocab_size, "--ids: id ", v, " out of range [0, ",
                 model->config.vocab_size, ")");
      ids.push_back(v);
    }
    KILN_CHECK(!ids.empty(), "--ids: no ids");
    Tensor logits = model->logits(from_vector(ids, {1, static_cast<int64_t>(ids.size())}, dev));
    io::save_safetensors(logits_out, {{"logits", logits.to(DType::f32).to(kCPU).contiguous()}});
    if (as_json)  // --json applies here too (it printed the sentence)
      std::printf("{\"logits_shape\": %s, \"path\": %s}\n", shape_str(logits.shape()).c_str(),
                  json::quote(logits_out).c_str());
    else
      std::printf("wrote logits %s to %s\n", shape_str(logits.shape()).c_str(), logits_out.c_str());
    return 0;
  }

  auto tok = train::load_tokenizer_for(*model, dir, tokenizer, "eval");
  // The token cache goes to the temporary directory, not next to the user's text, within a
  // bound (a 100 MB text left an 800 MB cache there for good); no temporary directory, no cache.
  constexpr uint64_t kMaxEvalCacheBytes = uint64_t{512} << 20;
  const std::optional<std::string> cache = data::user_cache_dir("kiln-token-cache");
  data::TokenStream stream =
      data::load_corpus(data, *tok, cache.value_or(""), nullptr, cache.has_value(), kMaxEvalCacheBytes);
  for (const std::string& n : stream.notes) std::fprintf(stderr, "note: %s\n", n.c_str());
  // By default the length the model was trained at (the in-training eval's windows): 256-token
  // windows on a 64-token model disagreed with it (perplexity 17.4 against 13.3).
  if (!p.given("--seq")) seq = train::trained_seq_len(dir) > 0 ? train::trained_seq_len(dir) : 256;
  KILN_CHECK(seq > 0, "--seq ", seq, " must be positive");
  KILN_CHECK(batch > 0, "--batch ", batch, " must be positive");
  if (seq > model->config.max_position_embeddings) {  // clamped with only "(windows of N)" to tell
    std::fprintf(stderr, "note: --seq %lld is longer than the model's context; windows of %lld\n",
                 static_cast<long long>(seq), static_cast<long long>(model->config.max_position_embeddings));
    seq = model->config.max_position_embeddings;
  }
  KILN_CHECK(static_cast<int64_t>(stream.size()) > seq, "eval: the text has ", stream.size(),
             " tokens, fewer than --seq ", seq, " + 1");
  const int64_t windows = (static_cast<int64_t>(stream.size()) - 1) / seq;
  double loss = 0;
  int64_t count = 0, done = 0;
  // Progress on stderr as training shows it (a long text showed nothing until the end).
  const int64_t batches = (windows + batch - 1) / batch;
  const int64_t total = max_batches > 0 ? std::min(max_batches, batches) : batches;
  // (With --json only on a terminal: `kiln eval --json ... 2>&1 | jq` takes one JSON line.)
  train::Progress progress(as_json && !::isatty(STDERR_FILENO) ? nullptr : stderr, total, 1);
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t w0 = 0; w0 < windows; w0 += batch) {
    if (max_batches > 0 && done >= max_batches) break;
    ++done;
    const int64_t nb = std::min(batch, windows - w0);
    std::vector<int64_t> in(static_cast<size_t>(nb * seq)), tg(in.size());
    for (int64_t b = 0; b < nb; ++b)
      for (int64_t t = 0; t < seq; ++t) {
        size_t src = static_cast<size_t>((w0 + b) * seq + t);
        in[static_cast<size_t>(b * seq + t)] = stream.tokens[src];
        tg[static_cast<size_t>(b * seq + t)] = stream.tokens[src + 1];
      }
    loss += model->loss_sum(from_vector(in, {nb, seq}, dev), from_vector(tg, {nb, seq}, dev)).item();
    count += nb * seq;
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    progress.update(done, loss / static_cast<double>(count), static_cast<double>(count) / s,
                    s / static_cast<double>(done) * static_cast<double>(total - done), memory_stats(dev).current_bytes);
  }
  progress.finish();
  const double mean = loss / static_cast<double>(count);
  // As generate refuses non-finite logits: a NaN loss printed as a result (exit 0) read as one.
  KILN_CHECK(std::isfinite(mean), "eval: the loss is ", mean, " over ", count,
             " tokens: the model's outputs are not finite (are the checkpoint's weights?)");
  if (as_json)
    std::printf("{\"loss\": %.6f, \"perplexity\": %.6f, \"tokens\": %lld}\n", mean, std::exp(mean), (long long)count);
  else
    std::printf("loss %.4f  perplexity %.3f  (%lld tokens, windows of %lld)\n", mean, std::exp(mean),
                (long long)count, (long long)seq);
  return 0;
}

}  // namespace kiln::cli
