// env_integer / env_string: unset and empty give the fallback, a set value parses completely
// and in range or the error names the variable, its value and the range.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <string>

#include "kiln/core/env.h"
#include "kiln/core/error.h"

namespace {

constexpr const char* kVar = "KILN_TEST_ENV_INTEGER";

std::string error_of(const char* value) {
  ::setenv(kVar, value, 1);
  try {
    kiln::env_integer(kVar, -5, 100);
  } catch (const kiln::Error& e) {
    ::unsetenv(kVar);
    return e.what();
  }
  ::unsetenv(kVar);
  return "";
}

TEST(Env, UnsetOrEmptyGivesTheFallback) {
  ::unsetenv(kVar);
  EXPECT_FALSE(kiln::env_integer(kVar, 0, 10).has_value());
  EXPECT_EQ(kiln::env_integer(kVar, 0, 10, 7), 7);
  EXPECT_FALSE(kiln::env_string(kVar).has_value());
  ::setenv(kVar, "", 1);
  EXPECT_EQ(kiln::env_integer(kVar, 0, 10, 7), 7);
  EXPECT_FALSE(kiln::env_string(kVar).has_value());
  ::unsetenv(kVar);
}

TEST(Env, ValuesInRangeParse) {
  for (const char* v : {"-5", "0", "42", "100", "+3"}) {
    ::setenv(kVar, v, 1);
    EXPECT_EQ(kiln::env_integer(kVar, -5, 100, 99), std::stoll(v)) << v;
    EXPECT_EQ(kiln::env_string(kVar).value_or(""), v);
  }
  ::unsetenv(kVar);
}

TEST(Env, BadValuesNameTheVariableAndTheRange) {
  for (const char* v : {"abc", "12x", "1.5", " ", "-6", "101", "99999999999999999999999", "0x10"}) {
    const std::string e = error_of(v);
    EXPECT_NE(e.find(std::string(kVar) + "='" + v + "'"), std::string::npos) << v << ": " << e;
    EXPECT_NE(e.find("expected an integer in [-5, 100]"), std::string::npos) << v << ": " << e;
  }
}

}  // namespace
