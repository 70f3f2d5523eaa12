// ComputeSpans on any machine: host spans count what lies between their marks and nothing
// outside, misuse is reported rather than thrown, and a CUDA device is timed by its own events
// where there is one and refused by name where there is none.
#include "common/nn/compute_spans.h"

#include <ATen/ATen.h>
#include <torch/cuda.h>

#include <chrono>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hetpar::nn {
namespace {

using ::testing::HasSubstr;
using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// Work on the host whose length the test measures: products of a 192x192 matrix.
void Work() {
  at::Tensor a = at::rand({192, 192}, at::kDouble);
  for (int i = 0; i < 20; ++i) a = at::tanh(at::matmul(a, a));
}

TEST(ComputeSpansTest, HostSpansCountTheirWorkAndNothingBetweenThem) {
  ComputeSpans spans;  // host time
  const auto start = Clock::now();
  spans.Begin();
  const auto first = Clock::now();
  Work();
  const double first_s = SecondsSince(first);
  spans.End();
  const auto between = Clock::now();
  Work();
  Work();  // outside every span: not counted
  const double between_s = SecondsSince(between);
  spans.Begin();
  const auto second = Clock::now();
  Work();
  const double second_s = SecondsSince(second);
  spans.End();
  const double total_s = SecondsSince(start);

  absl::StatusOr<double> seconds = spans.Seconds();
  ASSERT_TRUE(seconds.ok()) << seconds.status();
  EXPECT_FALSE(spans.on_device());
  EXPECT_EQ(spans.spans(), 2);
  EXPECT_GE(*seconds, first_s + second_s);
  EXPECT_LE(*seconds, total_s - between_s);
  EXPECT_DOUBLE_EQ(*seconds, spans.host_seconds());
}

TEST(ComputeSpansTest, AnEmptyStepTookNoTime) {
  ComputeSpans spans(c10::Device(c10::kCPU));
  absl::StatusOr<double> seconds = spans.Seconds();
  ASSERT_TRUE(seconds.ok()) << seconds.status();
  EXPECT_EQ(*seconds, 0.0);
}

TEST(ComputeSpansTest, MisusedMarksAreReportedNotThrown) {
  ComputeSpans open;
  open.Begin();
  EXPECT_THAT(open.Seconds().status().message(), HasSubstr("span 0 is still open"));

  ComputeSpans twice;
  twice.Begin();
  twice.Begin();
  twice.End();
  EXPECT_EQ(twice.Seconds().status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(twice.Seconds().status().message(), HasSubstr("opened twice"));

  ComputeSpans unopened;
  unopened.Begin();
  unopened.End();
  unopened.End();
  EXPECT_THAT(unopened.Seconds().status().message(),
              HasSubstr("closed with none open, after 1 spans"));
}

// A CUDA device: where there is one, its spans hold the GPU's time, which for a long run of
// products is far longer than the host took to queue them, and no longer than the host waited
// for them; where there is none, the first mark fails and Seconds says so, naming the device.
TEST(ComputeSpansTest, CudaSpansTimeTheDeviceWhereThereIsOne) {
  const c10::Device cuda(c10::kCUDA, 0);
  ComputeSpans spans(cuda);
  EXPECT_TRUE(spans.on_device());
  if (!torch::cuda::is_available()) {
    spans.Begin();  // throws nothing
    spans.End();
    absl::StatusOr<double> seconds = spans.Seconds();
    ASSERT_FALSE(seconds.ok());
    EXPECT_THAT(seconds.status().message(), HasSubstr("cuda:0"));
    RecordProperty("cuda", "absent: the marks were refused");
    return;
  }
  at::Tensor a = at::rand({4096, 4096}, at::TensorOptions().device(cuda));
  at::Tensor b = at::matmul(a, a);  // cuBLAS set up outside the span
  torch::cuda::synchronize();
  const auto start = Clock::now();
  spans.Begin();
  for (int i = 0; i < 20; ++i) b = at::matmul(a, b) * (1.0 / 4096);
  spans.End();
  torch::cuda::synchronize();
  const double waited_s = SecondsSince(start);
  absl::StatusOr<double> seconds = spans.Seconds();
  ASSERT_TRUE(seconds.ok()) << seconds.status();
  EXPECT_GT(*seconds, spans.host_seconds());
  EXPECT_LE(*seconds, waited_s);
  RecordProperty("cuda", "present: spans timed by CUDA events");
}

}  // namespace
}  // namespace hetpar::nn
