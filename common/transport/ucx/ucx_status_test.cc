#include "common/transport/ucx/ucx_status.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hetpar::transport::ucx {
namespace {

using ::testing::HasSubstr;

TEST(UcsToStatusTest, MapsEveryFamily) {
  EXPECT_TRUE(UcsToStatus(UCS_OK, "x").ok());
  EXPECT_EQ(UcsToStatus(UCS_ERR_CANCELED, "x").code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(UcsToStatus(UCS_ERR_MESSAGE_TRUNCATED, "x").code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(UcsToStatus(UCS_ERR_TIMED_OUT, "x").code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(UcsToStatus(UCS_ERR_NO_MEMORY, "x").code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(UcsToStatus(UCS_ERR_INVALID_PARAM, "x").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(UcsToStatus(UCS_ERR_UNSUPPORTED, "x").code(), absl::StatusCode::kUnimplemented);
  EXPECT_EQ(UcsToStatus(UCS_ERR_NO_DEVICE, "x").code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(UcsToStatus(UCS_ERR_NO_MESSAGE, "x").code(), absl::StatusCode::kInternal);
  for (ucs_status_t dead :
       {UCS_ERR_UNREACHABLE, UCS_ERR_CONNECTION_RESET, UCS_ERR_ENDPOINT_TIMEOUT, UCS_ERR_IO_ERROR,
        UCS_ERR_REJECTED, UCS_ERR_NOT_CONNECTED, UCS_ERR_FIRST_LINK_FAILURE}) {
    EXPECT_EQ(UcsToStatus(dead, "x").code(), absl::StatusCode::kUnavailable) << dead;
    EXPECT_TRUE(IsPeerFailure(dead)) << dead;
  }
  EXPECT_FALSE(IsPeerFailure(UCS_ERR_CANCELED));
}

TEST(UcsToStatusTest, MessageHasContextUcxTextAndCode) {
  absl::Status status = UcsToStatus(UCS_ERR_CONNECTION_RESET, "send to peer 'b' tag 3");
  EXPECT_THAT(std::string(status.message()), HasSubstr("send to peer 'b' tag 3: "));
  EXPECT_THAT(std::string(status.message()),
              HasSubstr(ucs_status_string(UCS_ERR_CONNECTION_RESET)));
  EXPECT_THAT(std::string(status.message()), HasSubstr("(UCX status -25)"));
}

}  // namespace
}  // namespace hetpar::transport::ucx
