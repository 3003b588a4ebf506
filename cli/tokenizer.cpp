// `kiln tokenizer train`: trains a SentencePiece model (BPE or unigram) on text files.
#include <cstdio>

#include "cli/args.h"
#include "cli/commands.h"
#include "kiln/core/error.h"
#include "kiln/data/tokenizer.h"

namespace kiln::cli {

int run_tokenizer(const Args& args) {
  if (args.empty() || args[0] == "--help" || args[0] == "-h") {
    // A missing subcommand is a usage error (stderr, status 2, as kiln bench); --help is not.
    std::fprintf(args.empty() ? stderr : stdout,
                 "usage: kiln tokenizer train [--vocab N] [--model-type bpe|unigram] [--out PREFIX] FILE...\n"
                 "Trains a SentencePiece tokenizer; writes PREFIX.model (use it with --tokenizer).\n");
    return args.empty() ? 2 : 0;
  }
  KILN_CHECK(args[0] == "train", "tokenizer: unknown subcommand '", args[0], "' (expected: train)");
  data::SentencePieceTrainOptions o;
  std::string type = o.model_type;
  std::vector<std::string> files;
  Args rest;
  for (size_t i = 1; i < args.size(); ++i) {
    if (!args[i].empty() && args[i][0] == '-') {
      rest.push_back(args[i]);
      if (args[i].find('=') == std::string::npos && i + 1 < args.size() && args[i] != "--help") rest.push_back(args[++i]);
    } else {
      files.push_back(args[i]);
    }
  }
  ArgParser p("tokenizer train", "Train a SentencePiece tokenizer (needs kiln built with libsentencepiece).");
  p.option("--vocab", &o.vocab_size, "N", "vocabulary size");
  p.option("--model-type", &type, "TYPE", "bpe or unigram");
  p.option("--out", &o.output_prefix, "PREFIX", "writes PREFIX.model and PREFIX.vocab");
  p.epilog("FILE... are the text files to train on.");
  if (!p.parse(rest)) return 0;
  o.model_type = type;
  KILN_CHECK(!files.empty(), "tokenizer train: no input FILE given");
  data::train_sentencepiece(files, o);
  std::printf("wrote %s.model and %s.vocab\n", o.output_prefix.c_str(), o.output_prefix.c_str());
  return 0;
}

}  // namespace kiln::cli
