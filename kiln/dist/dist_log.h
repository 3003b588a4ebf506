// Structured logs of the communication layer: one JSON object per line, one file per rank
// (<KILN_DIST_LOG_DIR>/rank<R>.jsonl) and one for the launcher (launcher.jsonl). Every line
// has "ts" (Unix seconds), "event" and, for ranks, "rank". Nothing is written when no folder
// is set. KILN_DIST_TRACE=1 adds each operation's start and end (op_start / op_end).
#pragma once
#include <string>

#include "kiln/io/json.h"

namespace kiln::dist {

// Appends `event` (an object) to <dir>/launcher.jsonl, when dir is not empty.
void launcher_event(const std::string& dir, json::Value event);
// Appends `event` to this rank's log (KILN_DIST_LOG_DIR, RANK from the environment).
void rank_event(json::Value event);
// Whether KILN_DIST_TRACE=1 asks for per-operation lines.
bool trace_ops();
double unix_seconds();

}  // namespace kiln::dist
