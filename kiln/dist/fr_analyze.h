// The analyzer behind `kiln comms analyze DIR`: reads the flight-recorder dumps of all ranks
// (kiln_fr_rank<R>.json), matches entries by (communicator, sequence number) and reports, per
// communicator, the first operation the ranks disagree on: ranks that never joined it, or a
// mismatched op, element count or dtype; and each rank's last completed sequence number.
#pragma once
#include <string>
#include <vector>

#include "kiln/io/json.h"

namespace kiln::dist {

struct FrAnalysis {
  json::Value report;  // {"ok": bool, "dumps": n, "comms": [...]}
  std::string text;    // the human report, one line per finding
  bool ok = true;      // no mismatch and no unfinished operation found
};

FrAnalysis analyze_flight_records(const std::vector<json::Value>& dumps);
// Reads every kiln_fr_rank*.json of dir; throws when there is none or one is not a dump.
FrAnalysis analyze_dump_dir(const std::string& dir);

}  // namespace kiln::dist
