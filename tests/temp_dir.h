// A fresh, empty folder under the system's temporary directory for one test process
// (kiln_test_<name>_<pid>: ctest runs the cases of one program in parallel processes), shared by
// the test folders that write runs and checkpoints.
#pragma once
#include <unistd.h>

#include <filesystem>
#include <string>

namespace kiln::test {

inline std::filesystem::path fresh_temp_dir(const std::string& name) {
  const std::filesystem::path d =
      std::filesystem::temp_directory_path() / ("kiln_test_" + name + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(d);
  std::filesystem::create_directories(d);
  return d;
}

}  // namespace kiln::test
