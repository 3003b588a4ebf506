// The skip every test suite uses when this machine lacks a GPU: KILN_SKIP_WITHOUT_CUDA() ends the
// calling test as skipped, with the reason, where no CUDA device is visible (CI, the developer
// machine); the GPU machine runs it. (Suites that need more, two GPUs or Gloo, have their own
// KILN_SKIP_WITHOUT_* beside their helpers.)
#pragma once
#include <gtest/gtest.h>

#include "kiln/core/device.h"

#define KILN_SKIP_WITHOUT_CUDA()                                              \
  do {                                                                        \
    if (::kiln::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";  \
  } while (0)
