// ArgParser: the flag parser every subcommand uses. Flags are declared with a help line and
// bound to variables; `--help` prints them all; unknown flags and bad values are errors that
// name the flag. Supports `--flag value`, `--flag=value`, boolean switches and positionals.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace kiln::cli {

class ArgParser {
 public:
  ArgParser(std::string command, std::string description);

  ArgParser& flag(const std::string& name, bool* out, const std::string& help);
  ArgParser& option(const std::string& name, std::string* out, const std::string& metavar, const std::string& help);
  ArgParser& option(const std::string& name, int64_t* out, const std::string& metavar, const std::string& help);
  ArgParser& option(const std::string& name, double* out, const std::string& metavar, const std::string& help);
  ArgParser& positional(const std::string& name, std::string* out, const std::string& help, bool required = true);
  // The option declared last shows no default in --help (its unset value means "not given").
  ArgParser& without_default();
  // Extra text printed at the end of --help (examples).
  ArgParser& epilog(const std::string& text);

  // Parses args. Returns false when --help was printed (the command should exit 0).
  // Throws kiln::Error on an unknown flag, a missing value or a bad number.
  bool parse(const std::vector<std::string>& args);
  // Whether a flag or option was given on the command line.
  bool given(const std::string& name) const;
  std::string help() const;

 private:
  struct Spec {
    std::string name, metavar, help, default_text;
    bool is_flag = false;
    bool is_positional = false;
    bool required = false;
    bool seen = false;
    std::function<void(const std::string&)> set{};
  };
  Spec* find(const std::string& name);
  std::string command_, description_, epilog_;
  std::vector<Spec> specs_;
};

// Parses sizes like "5GB", "512MiB", "1024" into bytes.
int64_t parse_bytes(const std::string& text);

}  // namespace kiln::cli
