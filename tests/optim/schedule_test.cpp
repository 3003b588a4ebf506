// Learning-rate schedules at known points: step 0, the end of warmup, the middle of the
// decay, its end and beyond; and the checks of inconsistent schedules.
#include <gtest/gtest.h>

#include <cmath>
#include <numbers>

#include "kiln/core/error.h"
#include "kiln/optim/schedule.h"

using namespace kiln;
using namespace kiln::optim;

TEST(LrSchedule, CosineAtKnownPoints) {
  LrSchedule s{ScheduleKind::cosine, 6e-4, 6e-5, 10, 110};
  EXPECT_DOUBLE_EQ(s.lr_at(0), 6e-4 * 1 / 10);
  EXPECT_DOUBLE_EQ(s.lr_at(4), 6e-4 * 5 / 10);
  EXPECT_DOUBLE_EQ(s.lr_at(9), 6e-4);    // last warmup step reaches max_lr
  EXPECT_DOUBLE_EQ(s.lr_at(10), 6e-4);   // decay starts at max_lr
  EXPECT_DOUBLE_EQ(s.lr_at(60), (6e-4 + 6e-5) / 2);  // middle
  EXPECT_DOUBLE_EQ(s.lr_at(35), 6e-5 + 0.5 * (1 + std::cos(std::numbers::pi * 0.25)) * (6e-4 - 6e-5));
  EXPECT_DOUBLE_EQ(s.lr_at(110), 6e-5);  // end
  EXPECT_DOUBLE_EQ(s.lr_at(1000), 6e-5);
  for (int64_t t = 10; t < 110; ++t) EXPECT_GE(s.lr_at(t), s.lr_at(t + 1)) << t;  // monotone decay
}

TEST(LrSchedule, AKindOutOfRangeIsAnError) {  // ScheduleKind(9) gave lr 3e-4 without a word
  LrSchedule s{static_cast<ScheduleKind>(9), 6e-4, 6e-5, 10, 110};
  EXPECT_THROW(s.lr_at(50), Error);
  EXPECT_THROW(s.validate(), Error);
}

TEST(LrSchedule, CosineWithoutWarmup) {
  LrSchedule s{ScheduleKind::cosine, 1.0, 0.0, 0, 4};
  EXPECT_DOUBLE_EQ(s.lr_at(0), 1.0);
  EXPECT_DOUBLE_EQ(s.lr_at(2), 0.5);
  EXPECT_NEAR(s.lr_at(4), 0.0, 0.0);
}

TEST(LrSchedule, LinearAndConstant) {
  LrSchedule lin{ScheduleKind::linear, 1.0, 0.1, 2, 12};
  EXPECT_DOUBLE_EQ(lin.lr_at(0), 0.5);
  EXPECT_DOUBLE_EQ(lin.lr_at(1), 1.0);
  EXPECT_DOUBLE_EQ(lin.lr_at(2), 1.0);
  EXPECT_DOUBLE_EQ(lin.lr_at(7), 0.55);
  EXPECT_DOUBLE_EQ(lin.lr_at(12), 0.1);
  EXPECT_DOUBLE_EQ(lin.lr_at(50), 0.1);
  LrSchedule c{ScheduleKind::constant, 3e-4, 0.0, 4, 0};
  EXPECT_DOUBLE_EQ(c.lr_at(0), 3e-4 / 4);
  EXPECT_DOUBLE_EQ(c.lr_at(3), 3e-4);
  EXPECT_DOUBLE_EQ(c.lr_at(1000000), 3e-4);
}

TEST(LrSchedule, ParsesKinds) {
  EXPECT_EQ(parse_schedule_kind("cosine"), ScheduleKind::cosine);
  EXPECT_EQ(parse_schedule_kind("linear"), ScheduleKind::linear);
  EXPECT_EQ(parse_schedule_kind("constant"), ScheduleKind::constant);
  EXPECT_STREQ(schedule_kind_name(ScheduleKind::cosine), "cosine");
  EXPECT_THROW(parse_schedule_kind("cosin"), Error);
}

TEST(LrSchedule, RejectsInconsistentSchedules) {
  EXPECT_THROW((LrSchedule{ScheduleKind::cosine, 1.0, 0.0, 10, 10}.lr_at(0)), Error);  // total <= warmup
  EXPECT_THROW((LrSchedule{ScheduleKind::cosine, 1.0, 2.0, 0, 10}.lr_at(0)), Error);   // min > max
  EXPECT_THROW((LrSchedule{ScheduleKind::linear, -1.0, 0.0, 0, 10}.lr_at(0)), Error);
  EXPECT_THROW((LrSchedule{ScheduleKind::constant, 1.0, 0.0, -1, 0}.lr_at(0)), Error);
  EXPECT_THROW((LrSchedule{ScheduleKind::cosine, 1.0, 0.0, 0, 10}.lr_at(-1)), Error);
  EXPECT_NO_THROW((LrSchedule{ScheduleKind::constant, 1.0, 0.0, 0, 0}.lr_at(5)));
}
