// SelectProgressThreadDevice, on any machine: nothing to do for the CPU, a bounded wait on a busy
// progress thread, and a CUDA device bound where there is one, refused by name where there is
// none. (tests/gpu/ send CUDA buffers through a thread it bound.)
#include "common/nn/ucx_progress_device.h"

#include <torch/cuda.h>

#include <memory>
#include <string>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hetpar::nn {
namespace {

using ::testing::HasSubstr;

constexpr absl::Duration kWait = absl::Seconds(20);

// A UCX transport of its own per test, whose progress thread the test may hold busy.
class UcxProgressDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    transport::ucx::UcxTransport::Options options;
    options.name = "device";
    auto ucx = transport::ucx::UcxTransport::Create(options);
    ASSERT_TRUE(ucx.ok()) << ucx.status();
    ucx_ = std::move(ucx).value();
  }
  void TearDown() override {
    if (holding_) release_.Notify();
    ucx_.reset();  // joins the thread, which waited on release_
  }

  // Keeps the progress thread busy until the test ends; true once it is.
  bool HoldProgressThread() {
    holding_ = true;
    (void)ucx_->RunOnProgressThread(
        [this] {
          held_.Notify();
          release_.WaitForNotification();
        },
        absl::Now() + absl::Milliseconds(1));
    return held_.WaitForNotificationWithTimeout(kWait);
  }

  absl::Notification held_, release_;
  bool holding_ = false;
  std::unique_ptr<transport::ucx::UcxTransport> ucx_;
};

TEST_F(UcxProgressDeviceTest, TheCpuNeedsNothingOfTheThread) {
  ASSERT_TRUE(HoldProgressThread());  // a CPU device does not wait for it
  EXPECT_TRUE(SelectProgressThreadDevice(*ucx_, c10::Device(c10::kCPU), absl::Now()).ok());
}

TEST_F(UcxProgressDeviceTest, ABusyProgressThreadEndsTheWaitAtItsDeadline) {
  ASSERT_TRUE(HoldProgressThread());
  const absl::Status s = SelectProgressThreadDevice(*ucx_, c10::Device(c10::kCUDA, 0),
                                                    absl::Now() + absl::Milliseconds(100));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  // The call still runs once the thread is free, after this function returned: what it writes
  // is its own.
}

// With CUDA, cuda:0 is made current there; without, the refusal names the device.
TEST_F(UcxProgressDeviceTest, ACudaDeviceIsBoundWhereThereIsOneAndRefusedByNameElsewhere) {
  const absl::Status s =
      SelectProgressThreadDevice(*ucx_, c10::Device(c10::kCUDA, 0), absl::Now() + kWait);
  if (torch::cuda::is_available()) {
    EXPECT_TRUE(s.ok()) << s;
  } else {
    ASSERT_FALSE(s.ok());
    EXPECT_THAT(std::string(s.message()), HasSubstr("selecting cuda:0 on UCX's progress thread"));
  }
}

}  // namespace
}  // namespace hetpar::nn
