// kiln: the command-line program. Dispatches to one subcommand per file of cli/.
#include <cstdio>
#include <cstring>
#include <exception>
#include <new>
#include <string>
#include <string_view>
#include <vector>

#include "cli/commands.h"
#include "kiln/core/error.h"
#include "kiln/kernels/blas_core.h"
#include "kiln/kernels/blas_threads.h"

namespace {

struct Command {
  const char* name;
  const char* summary;
  int (*run)(const std::vector<std::string>& args);
};

constexpr Command kCommands[] = {
    {"info", "version, build options, devices, threads and BLAS", kiln::cli::run_info},
    {"inspect", "list a checkpoint's tensors, dtypes, shapes, bytes and metadata", kiln::cli::run_inspect},
    {"convert", "convert a checkpoint (.pt/.bin, sharded, safetensors) to safetensors", kiln::cli::run_convert},
    {"telemetry", "device memory, utilization, power, clocks, temperature", kiln::cli::run_telemetry},
    {"bench", "benchmarks of the hot paths (JSON lines on stdout)", kiln::cli::run_bench},
    {"train", "train a Llama-style model (no arguments: a small demo run)", kiln::cli::run_train},
    {"eval", "loss and perplexity of a checkpoint, or its logits for given ids", kiln::cli::run_eval},
    {"generate", "sample text from a checkpoint (KV cache, streaming)", kiln::cli::run_generate},
    {"tokenizer", "train a SentencePiece tokenizer (BPE or unigram)", kiln::cli::run_tokenizer},
    {"launch", "run a program as N ranks (torchrun's variables, restarts, failure report)", kiln::cli::run_launch},
    {"comms", "communication tools: analyze flight-recorder dumps", kiln::cli::run_comms},
    {"tokenize", "tokenize text files into a token file for train --data FILE.bin", kiln::cli::run_tokenize},
    {"precompile", "compile the kernels of run-time attention mods into the JIT cache", kiln::cli::run_precompile},
};

void print_usage() {
  std::printf("kiln %s: train language models in less memory and less time\n\n", KILN_VERSION);
  std::printf("usage: kiln <command> [options]   (kiln <command> --help for its options)\n\ncommands:\n");
  for (const auto& c : kCommands) std::printf("  %-12s %s\n", c.name, c.summary);
  std::printf("\n  --version    print the version and exit\n");
}

}  // namespace

int main(int argc, char** argv) {
  // The OpenMP wait policy is the runtime's (libgomp spins a while at a barrier, then sleeps):
  // libgomp reads OMP_WAIT_POLICY when it is loaded, before main, so a setenv here would reach
  // only the processes kiln starts. It did: launched ranks slept at every barrier (a world of
  // one 0.85 x the same run unlaunched, on 2 cores). docs/training.md: passive on a shared machine.
  kiln::kernels::cpu::own_blas_core();     // an OpenBLAS older than the CPU falls back to SSE3 kernels
  kiln::kernels::cpu::own_blas_threads();  // a pthreads OpenBLAS's threads would fight OpenMP's
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty()) {
    print_usage();
    return 0;
  }
  if (args[0] == "help" && args.size() > 1) args = {args[1], "--help"};  // `kiln help train`
  if (args[0] == "--help" || args[0] == "-h" || args[0] == "help") {
    print_usage();
    return 0;
  }
  if (args[0] == "--version") {
    std::printf("kiln %s\n", KILN_VERSION);
    return 0;
  }
  for (const auto& c : kCommands) {
    if (args[0] == c.name) {
      try {
        return c.run(std::vector<std::string>(args.begin() + 1, args.end()));
      } catch (const kiln::Error& e) {
        // A message that starts with the command's own name says it once ("kiln train: error:
        // train: ..." said it twice).
        std::string_view what = e.what();
        const std::string own = std::string(c.name) + ": ";
        if (what.substr(0, own.size()) == own) what.remove_prefix(own.size());
        std::fprintf(stderr, "kiln %s: error: %.*s\n", c.name, static_cast<int>(what.size()), what.data());
        return 1;
      } catch (const std::bad_alloc&) {  // a host allocation beyond this machine's memory
        // The sizes the user gave are what to lower: name them (the message named no flag).
        std::string sizes;
        for (size_t i = 1; i + 1 < args.size(); ++i)
          if (args[i].rfind("--", 0) == 0 && !args[i + 1].empty() &&
              args[i + 1].find_first_not_of("0123456789") == std::string::npos)
            sizes += (sizes.empty() ? "" : " ") + args[i] + " " + args[i + 1];
        std::fprintf(stderr, "kiln %s: error: out of host memory (a host allocation failed)%s%s\n", c.name,
                     sizes.empty() ? "" : "; lower the sizes given: ", sizes.c_str());
        return 1;
      } catch (const std::exception& e) {  // from the standard library: still a message, not an abort
        std::fprintf(stderr, "kiln %s: error: %s\n", c.name, e.what());
        return 1;
      }
    }
  }
  std::fprintf(stderr, "kiln: unknown command '%s' (run 'kiln --help' for the list)\n", args[0].c_str());
  return 2;
}
