// The subcommands of the kiln program, one per file of cli/.
#pragma once
#include <string>
#include <vector>

namespace kiln::cli {

using Args = std::vector<std::string>;

int run_info(const Args& args);
int run_inspect(const Args& args);
int run_convert(const Args& args);
int run_telemetry(const Args& args);
int run_bench(const Args& args);
int run_train(const Args& args);
int run_eval(const Args& args);
int run_generate(const Args& args);
int run_tokenizer(const Args& args);
int run_launch(const Args& args);
int run_comms(const Args& args);
int run_tokenize(const Args& args);
int run_precompile(const Args& args);

}  // namespace kiln::cli
