#include "common/transport/address.h"

#include <string>

#include "common/transport/completion.h"
#include "common/transport/transport.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hetpar::transport {
namespace {

using ::testing::HasSubstr;

AddressEnvelope Sample() {
  AddressEnvelope envelope;
  envelope.backend = "ucx";
  envelope.instance_id = 0x0123456789abcdefull;
  envelope.name = "enc r1";
  envelope.payload = std::string("\x00\x01\xff worker", 10);
  return envelope;
}

TEST(AddressTest, RoundTripsEveryField) {
  const std::string bytes = EncodeAddress(Sample());
  auto decoded = DecodeAddress(bytes, "ucx");
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->backend, "ucx");
  EXPECT_EQ(decoded->instance_id, 0x0123456789abcdefull);
  EXPECT_EQ(decoded->name, "enc r1");
  EXPECT_EQ(decoded->payload, Sample().payload);
}

TEST(AddressTest, RejectsAnotherBackendNamingBoth) {
  auto decoded = DecodeAddress(EncodeAddress(Sample()), "inproc");
  EXPECT_EQ(decoded.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(decoded.status().message()), HasSubstr("'enc r1'"));
  EXPECT_THAT(std::string(decoded.status().message()), HasSubstr("backend 'ucx'"));
  EXPECT_THAT(std::string(decoded.status().message()), HasSubstr("'inproc'"));
}

TEST(AddressTest, RejectsEveryTruncationAndPadding) {
  const std::string bytes = EncodeAddress(Sample());
  for (size_t length = 0; length < bytes.size(); ++length) {
    auto decoded = DecodeAddress(bytes.substr(0, length), "ucx");
    EXPECT_EQ(decoded.status().code(), absl::StatusCode::kInvalidArgument) << "length " << length;
  }
  auto padded = DecodeAddress(bytes + "x", "ucx");
  EXPECT_EQ(padded.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(padded.status().message()), HasSubstr("payload length"));
}

TEST(AddressTest, RejectsWrongMagicAndVersion) {
  std::string bytes = EncodeAddress(Sample());
  std::string bad_magic = bytes;
  bad_magic[0] = 'X';
  EXPECT_THAT(std::string(DecodeAddress(bad_magic, "ucx").status().message()), HasSubstr("magic"));
  std::string bad_version = bytes;
  bad_version[4] = 9;
  EXPECT_THAT(std::string(DecodeAddress(bad_version, "ucx").status().message()),
              HasSubstr("version 9"));
}

TEST(AddressTest, InstanceIdsAreNonZeroAndDistinct) {
  const uint64_t a = NewInstanceId(), b = NewInstanceId();
  EXPECT_NE(a, 0u);
  EXPECT_NE(b, 0u);
  EXPECT_NE(a, b);
}

TEST(CompletionTest, FirstOutcomeWinsAndWaitHonoursTheDeadline) {
  Completion completion("receive from peer 'x' tag 1 (8 bytes)");
  const absl::Time start = absl::Now();
  absl::Status pending = completion.Wait(start + absl::Milliseconds(30));
  EXPECT_EQ(pending.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(std::string(pending.message()), HasSubstr("receive from peer 'x' tag 1"));
  // Not before the deadline (by more than the clocks' disagreement; see conformance_test.cc).
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(29));
  EXPECT_TRUE(completion.Complete(absl::OkStatus(), 8));
  EXPECT_FALSE(completion.Complete(absl::CancelledError("late"), 0));
  EXPECT_TRUE(completion.Wait(absl::InfinitePast()).ok());
  EXPECT_EQ(completion.bytes(), 8u);
}

TEST(ValidationTest, TagsAndBuffers) {
  EXPECT_TRUE(ValidateTag(kMaxTag, "x").ok());
  EXPECT_EQ(ValidateTag(kMaxTag + 1, "x").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(ValidateBuffer(nullptr, 0, MemoryKind::kHost, "x").ok());
  EXPECT_EQ(ValidateBuffer(nullptr, 1, MemoryKind::kHost, "x").code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateBuffer("", 0, static_cast<MemoryKind>(7), "x").code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MemoryKindName(MemoryKind::kCuda), "cuda");
}

}  // namespace
}  // namespace hetpar::transport
