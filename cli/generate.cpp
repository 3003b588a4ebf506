// `kiln generate`: streams text sampled from a checkpoint (KV-cache decoding).
#include <algorithm>
#include <cstdio>

#include "cli/args.h"
#include "cli/commands.h"
#include "kiln/data/tokenizer.h"
#include "kiln/nn/generate.h"
#include "kiln/train/checkpoint.h"

namespace kiln::cli {

int run_generate(const Args& args) {
  std::string ckpt, prompt, device = "cpu", tokenizer;
  int64_t max_tokens = 200, top_k = 40, seed = 0;
  double temperature = 0.8, top_p = 0.95;
  ArgParser p("generate", "Sample text from a checkpoint, printing tokens as they are generated.");
  p.option("--ckpt", &ckpt, "DIR", "checkpoint directory, or a run directory (its latest checkpoint)");
  p.option("--prompt", &prompt, "TEXT", "the text to continue");
  p.option("--max-tokens", &max_tokens, "N", "tokens to generate at most");
  p.option("--temperature", &temperature, "T", "sampling temperature (0: greedy)");
  p.option("--top-k", &top_k, "K", "sample among the K most likely tokens (0: all)");
  p.option("--top-p", &top_p, "P", "sample among the most likely tokens holding probability P (1: all)");
  p.option("--seed", &seed, "S", "sampling seed (the same seed gives the same text)");
  p.option("--tokenizer", &tokenizer, "SPEC",
           "tokenizer: 'byte', a tokenizer.model or a folder (default: the checkpoint's)");
  p.option("--device", &device, "DEV", "cpu, cuda or cuda:N");
  if (!p.parse(args)) return 0;
  KILN_CHECK(!ckpt.empty(), "--ckpt is required");
  // checked before the model loads and the prompt is printed
  nn::GenerateOptions o = nn::generate_options(max_tokens, temperature, top_k, top_p, seed, "generate: --seed");
  const Device dev = Device::parse(device);
  check_device_available(dev, "generate");
  std::string note;
  std::string dir = train::find_checkpoint(ckpt, &note);
  KILN_CHECK(!dir.empty(), "--ckpt: no checkpoint (config.json) in '", ckpt, "'", train::why_no_checkpoint(ckpt));
  if (!note.empty()) std::fprintf(stderr, "%s\n", note.c_str());
  auto model = train::load_model(dir, dev);
  model->eval();
  auto tok = train::load_tokenizer_for(*model, dir, tokenizer, "generate");
  const std::vector<int32_t> ids = nn::encode_prompt(*tok, prompt, o);
  const int64_t context = model->config.max_position_embeddings;
  const int64_t kept = nn::prompt_tokens_kept(static_cast<int64_t>(ids.size()), max_tokens, context);
  if (kept < static_cast<int64_t>(ids.size()) && context >= 2)
    std::fprintf(stderr, "note: the prompt's %zu tokens and --max-tokens %lld do not fit the model's context of %lld "
                 "positions; generating from the prompt's last %lld\n", ids.size(), static_cast<long long>(max_tokens),
                 static_cast<long long>(context), static_cast<long long>(kept));
  // Past the length it was trained at the model has seen no position: it may run, but say so.
  if (const int64_t trained = train::trained_seq_len(dir);
      trained > 0 && static_cast<int64_t>(ids.size()) + max_tokens > trained)
    std::fprintf(stderr, "note: the model was trained on sequences of %lld tokens; the prompt's %zu tokens and "
                 "--max-tokens %lld go past that, where its text may fall apart\n", static_cast<long long>(trained),
                 ids.size(), static_cast<long long>(max_tokens));
  std::printf("%s", prompt.c_str());
  std::fflush(stdout);
  // Each token prints what it adds to the decoded text after the prompt (spaces SentencePiece
  // puts between pieces, characters made of several byte tokens), held back while the text ends
  // inside a character.
  std::vector<int32_t> generated;
  size_t printed = 0;
  // The prompt's last few tokens are context enough (a piece's space, a character's bytes) and
  // keep each token's decode short.
  const std::vector<int32_t> prompt_tail(ids.end() - std::min<std::ptrdiff_t>(8, std::ssize(ids)), ids.end());
  auto print_new = [&](bool last) {
    const std::string text = tok->decode_continuation(prompt_tail, generated);
    if (text.size() <= printed || (!last && data::ends_mid_character(text))) return;
    std::printf("%s", data::displayable(std::string_view(text).substr(printed)).c_str());
    std::fflush(stdout);
    printed = text.size();
  };
  const std::vector<int32_t> out = nn::generate(*model, ids, o, [&](int32_t t) {
    if (t == tok->eos_id()) return;
    generated.push_back(t);
    print_new(false);
  });
  print_new(true);
  std::printf("\n");
  if (static_cast<int64_t>(out.size()) < max_tokens && (out.empty() || out.back() != tok->eos_id()))
    std::fprintf(stderr, "note: stopped after %zu of --max-tokens %lld: the model's context of %lld positions is full\n",
                 out.size(), static_cast<long long>(max_tokens), static_cast<long long>(context));
  return 0;
}

}  // namespace kiln::cli
