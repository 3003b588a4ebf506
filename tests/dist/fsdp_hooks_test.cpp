// The hooks FSDP attaches to: module forward pre/post hooks (Module::call, in registration
// order, a post-hook replacing the output, removal), post-accumulate-grad hooks on leaves (after
// the .grad holds the sum, once per backward, kept by the accumulator), and end-of-backward
// callbacks (after the last node, once for nested backwards, dropped when the backward fails).
#include <gtest/gtest.h>

#include "kiln/autograd/grad_mode.h"
#include "kiln/nn/checkpoint.h"
#include "kiln/nn/module.h"
#include "kiln/ops/backward.h"
#include "kiln/ops/ops.h"

using namespace kiln;

TEST(ModuleHooks, RunInOrderAroundTheForwardAndMayReplaceTheOutput) {
  Generator gen(5);
  nn::Linear lin(3, 2, false, gen);
  std::vector<std::string> log;
  const int a = lin.register_forward_pre_hook([&](const nn::Module&) { log.push_back("pre-a"); });
  lin.register_forward_pre_hook([&](const nn::Module&) { log.push_back("pre-b"); });
  const int post = lin.register_forward_hook([&](const nn::Module& m, const Tensor& out) {
    EXPECT_EQ(&m, &lin);
    log.push_back("post");
    return mul(out, 2.0);
  });
  const Tensor x = randn({4, 3}, gen);
  const Tensor y = lin.call([&] {
    log.push_back("forward");
    return lin.forward(x);
  });
  EXPECT_EQ(log, (std::vector<std::string>{"pre-a", "pre-b", "forward", "post"}));
  const auto got = y.to_vector<float>(), plain = lin.forward(x).to_vector<float>();
  for (size_t i = 0; i < got.size(); ++i) EXPECT_EQ(got[i], 2 * plain[i]);
  lin.remove_hook(post);
  lin.remove_hook(a);
  EXPECT_THROW(lin.remove_hook(a), Error);
  log.clear();
  lin.call([&] { return lin.forward(x); });
  EXPECT_EQ(log, (std::vector<std::string>{"pre-b"}));
  // named_modules walks the tree with paths.
  auto names = lin.named_modules("root");
  ASSERT_EQ(names.size(), 1u);
  EXPECT_EQ(names[0].first, "root");
}

TEST(GradHooks, PostAccumulateRunsOnceWithTheSumAndEndCallbacksAfterTheLastNode) {
  Generator gen(6);
  Tensor w = randn({3}, gen).requires_grad_();
  std::vector<double> seen;
  int callbacks = 0;
  auto acc = register_post_accumulate_grad_hook(w, [&](const Tensor& leaf) {
    seen.push_back(leaf.grad().to_vector<float>()[0]);
    EXPECT_EQ(callbacks, static_cast<int>(seen.size()) - 1);  // before this backward's end callback
    queue_backward_callback([&] { ++callbacks; });
  });
  EXPECT_THROW(queue_backward_callback([] {}), Error);  // no backward running
  EXPECT_FALSE(in_backward());
  // w used twice: its gradient is summed before the hook runs, once.
  Tensor y = sum(add(mul(w, 3.0), mul(w, 4.0)));
  y.backward();
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_EQ(seen[0], 7.0);
  EXPECT_EQ(callbacks, 1);
  // Accumulated across backwards: the hook sees the running sum.
  sum(mul(w, 2.0)).backward();
  ASSERT_EQ(seen.size(), 2u);
  EXPECT_EQ(seen[1], 9.0);
  EXPECT_EQ(callbacks, 2);
  EXPECT_THROW(grad_accumulator(mul(w, 1.0)), Error);  // not a leaf
}

TEST(GradHooks, NestedBackwardsRunTheCallbacksOnceAtTheOuterEnd) {
  Generator gen(7);
  Tensor w = randn({4}, gen).requires_grad_();
  Tensor x = randn({4}, gen).requires_grad_();
  int hook_calls = 0, callbacks = 0;
  auto acc = register_post_accumulate_grad_hook(w, [&](const Tensor&) {
    ++hook_calls;
    EXPECT_TRUE(in_backward());
    queue_backward_callback([&] { ++callbacks; });
  });
  // Activation checkpointing runs a backward inside the backward.
  Tensor y = nn::checkpoint([&](const Tensor& v) { return mul(v, w); }, x);
  sum(y).backward();
  EXPECT_EQ(hook_calls, 1);
  EXPECT_EQ(callbacks, 1);
  EXPECT_FALSE(in_backward());
}
