// `kiln bench lce`'s memory estimate: a shape that cannot fit is refused before any input is
// allocated, with the estimate, the memory available and the flags to lower; one that fits runs.
#include <gtest/gtest.h>

#include <chrono>

#include "kiln/io/json.h"
#include "tests/cli_run.h"

using kiln::test::run_kiln;

TEST(LceBenchCli, AShapeThatCannotFitIsRefusedQuicklyWithTheNumbers) {
  // 2^31 tokens x a 2^20 vocabulary: the reference's logits alone are 2^53 bytes, more than any
  // machine has, so the refusal does not depend on this machine's memory.
  const auto t0 = std::chrono::steady_clock::now();
  auto r = run_kiln("bench lce --tokens 2147483648 --dim 64 --vocab 1048576 --impl fused,reference --iters 1");
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_LT(s, 20.0) << "refused only after " << s << " s: " << r.output;
  for (const char* part : {"bench lce: impl reference at --tokens 2147483648 --dim 64 --vocab 1048576 (f32) needs at least",
                           "more than the", "available (", "the N x V logits and their gradient 16777216.00 GiB",
                           "Lower --tokens, --vocab or --dim", "leave reference out of --impl (fused alone needs at least"})
    EXPECT_NE(r.output.find(part), std::string::npos) << part << "\n" << r.output;
  // The fused impl alone is refused too at this shape (its inputs and gradients alone are
  // 2^31 x 64 x 4 x 2 bytes = 1 TiB), naming the fused impl.
  r = run_kiln("bench lce --tokens 2147483648 --dim 64 --vocab 1048576 --impl fused --iters 1");
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("bench lce: impl fused at --tokens 2147483648"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("leave fused out"), std::string::npos) << r.output;
  // Saturating arithmetic: a product past 2^63 is still refused, not wrapped to a small number.
  r = run_kiln("bench lce --tokens 4611686018427387904 --dim 4 --vocab 4 --impl fused --iters 1");
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("needs at least"), std::string::npos) << r.output;
}

TEST(LceBenchCli, AShapeThatFitsRuns) {
  const auto r = run_kiln("bench lce --tokens 37 --dim 24 --vocab 101 --impl fused,reference --iters 1 --warmup 0");
  ASSERT_EQ(r.status, 0) << r.output;
  int records = 0;
  for (size_t at = r.output.find("{\"bench\":\"lce\""); at != std::string::npos;
       at = r.output.find("{\"bench\":\"lce\"", at + 1)) {
    const kiln::json::Value o = kiln::json::parse(r.output.substr(at, r.output.find('\n', at) - at));
    EXPECT_GT(o.find("ms_median")->as_double(), 0.0);
    ++records;
  }
  EXPECT_EQ(records, 2) << r.output;
}
