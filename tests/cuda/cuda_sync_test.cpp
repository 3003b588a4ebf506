// CUDA host synchronisation on the training path: embedding and cross_entropy do not wait
// for the device (their index range checks are deferred), a bad id is still reported with
// the op, position and value at the next host read, the failure is reported once, and the
// profiler counts the synchronisations and times device kernels.
#include "kiln/core/profile.h"
#include "tests/cuda/cuda_test_util.h"

using namespace kiln;
using namespace kiln::test;

namespace {

TEST(CudaSync, EmbeddingAndCrossEntropyDoNotSynchronise) {
  KILN_SKIP_WITHOUT_CUDA();
  Generator gen(3);
  Tensor w = randn({11, 8}, gen).to(gpu()).requires_grad_(true);
  Tensor ids = from_vector(std::vector<int64_t>{1, 4, 10, 0, 7, 3, 2}, {7}).to(gpu());
  Tensor tg = from_vector(std::vector<int64_t>{5, -100, 2, 9, 1, 0, 3}, {7}).to(gpu());
  profile::Profiler prof;
  double loss = 0;
  {
    profile::Session on(prof);
    CrossEntropyOptions o;
    o.reduction = Reduction::sum;
    Tensor l = cross_entropy(linear(embedding(w, ids), w), tg, o);
    l.backward();
    EXPECT_EQ(prof.total_syncs(), 0) << prof.table();
    loss = l.item();  // the one synchronisation
    EXPECT_EQ(prof.total_syncs(), 1) << prof.table();
  }
  EXPECT_TRUE(std::isfinite(loss));
  bool device_time = false;
  for (const auto& e : prof.entries()) device_time = device_time || e.device_time;
  EXPECT_TRUE(device_time);
}

TEST(CudaSync, DeferredBadIdIsReportedAtTheNextHostRead) {
  KILN_SKIP_WITHOUT_CUDA();
  Tensor w = zeros({10, 3}, DType::f32, gpu());
  std::vector<int64_t> ids(20, 1);
  ids[17] = 70000;
  Tensor out = embedding(w, from_vector(ids, {20}).to(gpu()));  // no throw yet: nothing waited
  try {
    (void)out.to(kCPU);
    ADD_FAILURE() << "expected the deferred range error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("embedding: ids[17]=70000 out of range [0, 10)"), std::string::npos)
        << e.what();
  }
  // reported once; the device is still usable
  EXPECT_EQ(embedding(w, from_vector(std::vector<int64_t>{2, 3}, {2}).to(gpu())).to(kCPU).numel(), 6);
  Tensor x = zeros({4, 10}, DType::f32, gpu());
  Tensor bad = from_vector(std::vector<int32_t>{1, 2, 3, -5}, {4}).to(gpu());
  try {
    (void)cross_entropy(x, bad).item();
    ADD_FAILURE() << "expected the deferred range error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cross_entropy: target[3]=-5 out of range [0, 10)"), std::string::npos)
        << e.what();
  }
}

TEST(CudaSync, SynchronizeRaisesTheDeferredFailureOnce) {
  KILN_SKIP_WITHOUT_CUDA();
  synchronize(kCPU);  // nothing to wait for
  Tensor w = zeros({10, 3}, DType::f32, gpu());
  Tensor out = embedding(w, from_vector(std::vector<int64_t>{0, 10}, {2}).to(gpu()));
  try {
    synchronize(gpu());
    ADD_FAILURE() << "expected the deferred range error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("embedding: ids[1]=10 out of range [0, 10)"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(synchronize(gpu()));
}

}  // namespace
