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
int run_bench_comms(const Args& args);
int run_bench_gemm(const Args& args);  // cli/bench_gemm.cpp
int run_bench_jit(const Args& args);   // cli/bench_jit.cpp

// Milliseconds of one call of f on `device` (CPU: steady_clock; CUDA: timing events on its current stream).
double bench_time_ms(const Device& device, const std::function<void()>& f);
double median(std::vector<double> v);
// Prints one JSON record on stdout (one line), flushing.
void print_record(const json::Value& record);
// The implementations of a comma-separated --impl list, in the order given (repeats dropped);
// an error names an entry not in `known` (or an empty list) and lists the known ones.
std::vector<std::string> parse_impls(const std::string& list, const std::vector<std::string>& known,
                                     const char* bench);

}  // namespace kiln::cli
