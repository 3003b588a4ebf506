// bench_lce: the `kiln bench lce` case as a standalone program (same flags, same output).
// It compiles the CLI's case and argument parser into this program (bench programs link only
// the library), so there is one implementation of the benchmark.
#include <cstdio>

#include "cli/args.cpp"
#include "cli/bench.cpp"
#include "cli/bench_lce.cpp"

int main(int argc, char** argv) {
  try {
    return kiln::cli::run_bench_lce(std::vector<std::string>(argv + 1, argv + argc));
  } catch (const kiln::Error& e) {
    std::fprintf(stderr, "bench_lce: error: %s\n", e.what());
    return 1;
  }
}
