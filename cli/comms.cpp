// `kiln comms`: tools of the communication layer. `analyze DIR [--json]` reads the flight-
// recorder dumps of every rank (kiln/dist/fr_analyze.h) and names the first operation each
// communicator's ranks disagree on; exit status 0 when none, 1 when one was found.
#include <cstdio>

#include "cli/args.h"
#include "cli/commands.h"
#include "kiln/core/error.h"
#include "kiln/dist/fr_analyze.h"

namespace kiln::cli {

int run_comms(const Args& args) {
  if (args.empty() || args[0] == "--help" || args[0] == "-h") {
    std::printf("usage: kiln comms <tool> [options]   (kiln comms <tool> --help)\n\ntools:\n"
                "  analyze DIR [--json]   the first operation the ranks' flight-recorder dumps disagree on\n");
    return args.empty() ? 2 : 0;
  }
  if (args[0] != "analyze") {
    std::fprintf(stderr, "kiln comms: unknown tool '%s' (expected analyze)\n", args[0].c_str());
    return 2;
  }
  std::string dir;
  bool as_json = false;
  ArgParser p("comms analyze",
              "Read the flight-recorder dumps of every rank (kiln_fr_rank<R>.json, written on a timeout, an\n"
              "abort, SIGUSR1 or on request under KILN_FR_DUMP_DIR or kiln launch --log-dir) and print, per\n"
              "communicator, the first operation the ranks disagree on: ranks that never joined it, or a\n"
              "mismatched op, size or dtype; and each rank's last completed sequence number. Exit status 0\n"
              "when every rank ran the same operations to completion, 1 otherwise.");
  p.positional("DIR", &dir, "folder holding the dumps").flag("--json", &as_json, "print the report as JSON");
  if (!p.parse(Args(args.begin() + 1, args.end()))) return 0;
  const dist::FrAnalysis a = dist::analyze_dump_dir(dir);
  if (as_json) std::printf("%s\n", a.report.dump(1).c_str());
  else std::fputs(a.text.c_str(), stdout);
  return a.ok ? 0 : 1;
}

}  // namespace kiln::cli
