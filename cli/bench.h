// `kiln bench <case>`: the benchmark cases (one file cli/bench_<case>.cpp each) and the helpers
// they share: timing of one forward+backward step on a device, the median, the JSON record.
#pragma once
#include <functional>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "kiln/core/device.h"
#include "kiln/io/json.h"

namespace kiln::cli {

int run_bench_lce(const Args& args);
int run_bench_attention(const Args& args);

// Milliseconds of one call of f on `device` (CPU: steady_clock; CUDA: events on its stream).
double bench_time_ms(const Device& device, const std::function<void()>& f);
double median(std::vector<double> v);
// Prints one JSON record on stdout (one line), flushing.
void print_record(const json::Value& record);

}  // namespace kiln::cli
