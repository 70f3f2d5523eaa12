// Behaviour specific to the in-process backend; the shared semantics are in the conformance
// suite (common/transport/conformance_test.cc).
#include "common/transport/inproc/inproc_transport.h"

#include <unistd.h>

#include <cstring>
#include <vector>

#include "absl/time/clock.h"
#include "common/transport/address.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hetpar::transport::inproc {
namespace {

using ::testing::HasSubstr;

constexpr absl::Duration kWait = absl::Seconds(10);

TEST(InprocTransportTest, RejectsAnAddressFromAnotherProcess) {
  auto a = InprocTransport::Create({"a"});
  auto b = InprocTransport::Create({"b"});
  ASSERT_TRUE(a.ok() && b.ok());
  auto envelope = DecodeAddress((*b)->LocalAddress(), "inproc");
  ASSERT_TRUE(envelope.ok());
  const uint32_t other_pid = static_cast<uint32_t>(getpid()) + 1;
  envelope->payload.assign(reinterpret_cast<const char*>(&other_pid), sizeof(other_pid));
  auto peer = (*a)->Connect(EncodeAddress(*envelope), absl::Now() + kWait);
  EXPECT_EQ(peer.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(peer.status().message()), HasSubstr("belongs to process"));
}

TEST(InprocTransportTest, ConnectingToADestroyedTransportIsUnavailable) {
  auto a = InprocTransport::Create({"a"});
  auto b = InprocTransport::Create({"b"});
  ASSERT_TRUE(a.ok() && b.ok());
  const std::string address = (*b)->LocalAddress();
  b->reset();
  auto peer = (*a)->Connect(address, absl::Now() + kWait);
  EXPECT_EQ(peer.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(peer.status().message()), HasSubstr("peer 'b'"));
}

TEST(InprocTransportTest, SendsAreRendezvousAndDestructionCancelsPendingOperations) {
  auto a = InprocTransport::Create({"a"});
  auto b = InprocTransport::Create({"b"});
  ASSERT_TRUE(a.ok() && b.ok());
  auto b_at_a = (*a)->Connect((*b)->LocalAddress(), absl::Now() + kWait);
  auto a_at_b = (*b)->Connect((*a)->LocalAddress(), absl::Now() + kWait);
  ASSERT_TRUE(b_at_a.ok() && a_at_b.ok());
  std::vector<uint8_t> out(1000), in(1000, 0);
  for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<uint8_t>(i * 13);
  auto send = (*a)->Send(*b_at_a, 1, ConstBuffer::Host(out.data(), out.size()));
  ASSERT_TRUE(send.ok());
  EXPECT_FALSE((*send)->Done());  // no receive yet
  auto recv = (*b)->Recv(*a_at_b, 1, MutableBuffer::Host(in.data(), in.size()));
  ASSERT_TRUE(recv.ok());
  EXPECT_TRUE((*send)->Done());  // the receive's thread moved the data
  EXPECT_TRUE((*recv)->Wait(absl::Now()).ok());
  EXPECT_EQ(in, out);

  auto pending = (*a)->Recv(*b_at_a, 2, MutableBuffer::Host(in.data(), in.size()));
  ASSERT_TRUE(pending.ok());
  a->reset();
  absl::Status status = (*pending)->Wait(absl::Now() + kWait);
  EXPECT_EQ(status.code(), absl::StatusCode::kCancelled) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("transport was destroyed"));
}

}  // namespace
}  // namespace hetpar::transport::inproc
