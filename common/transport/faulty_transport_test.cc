#include "common/transport/faulty_transport.h"

#include <cstring>
#include <vector>

#include "absl/time/clock.h"
#include "common/transport/inproc/inproc_transport.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hetpar::transport {
namespace {

using ::testing::HasSubstr;

constexpr absl::Duration kWait = absl::Seconds(10);

std::vector<uint8_t> Bytes(uint8_t seed, size_t size) {
  std::vector<uint8_t> bytes(size);
  for (size_t i = 0; i < size; ++i) bytes[i] = static_cast<uint8_t>(seed * 31 + i * 7);
  return bytes;
}

// Rank "a" wrapped in a FaultyTransport, rank "b" plain, connected both ways.
class FaultyTransportTest : public ::testing::Test {
 protected:
  void Start(const FaultPlan& plan) {
    auto a = inproc::InprocTransport::Create({"a"});
    auto b = inproc::InprocTransport::Create({"b"});
    ASSERT_TRUE(a.ok() && b.ok());
    auto faulty = FaultyTransport::Create(std::move(a).value(), plan);
    ASSERT_TRUE(faulty.ok()) << faulty.status();
    a_ = std::move(faulty).value();
    b_ = std::move(b).value();
    auto a_to_b = a_->Connect(b_->LocalAddress(), absl::Now() + kWait);
    auto b_to_a = b_->Connect(a_->LocalAddress(), absl::Now() + kWait);
    ASSERT_TRUE(a_to_b.ok() && b_to_a.ok());
    b_at_a_ = *a_to_b;
    a_at_b_ = *b_to_a;
  }

  std::unique_ptr<FaultyTransport> a_;
  std::unique_ptr<Transport> b_;
  PeerId b_at_a_ = 0, a_at_b_ = 0;
};

TEST_F(FaultyTransportTest, PeerFailsAfterNOperations) {
  FaultPlan plan;
  plan.fail_after_ops = 2;
  Start(plan);
  std::vector<uint8_t> pending_buffer(8), out = Bytes(1, 64), in(64);
  auto pending = a_->Recv(b_at_a_, 1, MutableBuffer::Host(pending_buffer.data(), 8));  // op 1
  ASSERT_TRUE(pending.ok());
  auto recv = b_->Recv(a_at_b_, 2, MutableBuffer::Host(in.data(), in.size()));
  auto send = a_->Send(b_at_a_, 2, ConstBuffer::Host(out.data(), out.size()));  // op 2
  ASSERT_TRUE(recv.ok() && send.ok());
  ASSERT_TRUE((*recv)->Wait(absl::Now() + kWait).ok());
  EXPECT_EQ(in, out);
  auto third = a_->Send(b_at_a_, 2, ConstBuffer::Host(out.data(), out.size()));  // op 3
  EXPECT_EQ(third.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(third.status().message()),
              HasSubstr("peer 'b' is unavailable: injected failure after 2 operations"));
  const absl::Time start = absl::Now();
  absl::Status status = (*pending)->Wait(start + kWait);
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("receive from peer 'b' tag 1"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
  EXPECT_TRUE((*pending)->Done());
}

TEST_F(FaultyTransportTest, EveryNthSendIsDropped) {
  FaultPlan plan;
  plan.drop_every_nth_send = 2;
  Start(plan);
  std::vector<std::vector<uint8_t>> outs = {Bytes(1, 100), Bytes(2, 100), Bytes(3, 100)};
  std::vector<std::vector<uint8_t>> ins(3, std::vector<uint8_t>(100, 0));
  std::vector<std::unique_ptr<Operation>> recvs, sends;
  for (int k = 0; k < 3; ++k) {
    recvs.push_back(*b_->Recv(a_at_b_, 4, MutableBuffer::Host(ins[k].data(), 100)));
  }
  for (int k = 0; k < 3; ++k) {
    sends.push_back(*a_->Send(b_at_a_, 4, ConstBuffer::Host(outs[k].data(), 100)));
  }
  for (auto& send : sends) EXPECT_TRUE(send->Wait(absl::Now() + kWait).ok());
  EXPECT_EQ(sends[1]->bytes(), 100u);  // the dropped one looks sent
  ASSERT_TRUE(recvs[0]->Wait(absl::Now() + kWait).ok());
  ASSERT_TRUE(recvs[1]->Wait(absl::Now() + kWait).ok());
  EXPECT_EQ(ins[0], outs[0]);
  EXPECT_EQ(ins[1], outs[2]);  // message 2 never arrived
  EXPECT_EQ(recvs[2]->Wait(absl::Now() + absl::Milliseconds(100)).code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(ins[2], std::vector<uint8_t>(100, 0));
}

TEST_F(FaultyTransportTest, SendsAreDelayed) {
  FaultPlan plan;
  plan.send_delay = absl::Milliseconds(500);  // more than a loaded machine's pause between calls
  Start(plan);
  std::vector<uint8_t> out = Bytes(5, 4096), in(4096, 0);
  auto recv = b_->Recv(a_at_b_, 6, MutableBuffer::Host(in.data(), in.size()));
  const absl::Time start = absl::Now();
  auto send = a_->Send(b_at_a_, 6, ConstBuffer::Host(out.data(), out.size()));
  ASSERT_TRUE(recv.ok() && send.ok());
  EXPECT_FALSE((*send)->Done());
  ASSERT_TRUE((*recv)->Wait(start + kWait).ok());
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(500));
  ASSERT_TRUE((*send)->Wait(start + kWait).ok());
  EXPECT_EQ(in, out);
  EXPECT_EQ((*send)->bytes(), 4096u);
}

TEST_F(FaultyTransportTest, ASendCanBeCancelledWhileItsDelayRuns) {
  FaultPlan plan;
  plan.send_delay = absl::Hours(1);  // the send stays withheld whenever the cancel comes
  Start(plan);
  std::vector<uint8_t> out = Bytes(5, 4096), in(4096, 0);
  auto recv = b_->Recv(a_at_b_, 7, MutableBuffer::Host(in.data(), in.size()));
  auto send = a_->Send(b_at_a_, 7, ConstBuffer::Host(out.data(), out.size()));
  ASSERT_TRUE(recv.ok() && send.ok());
  (*send)->Cancel();
  EXPECT_EQ((*send)->Wait(absl::Now() + kWait).code(), absl::StatusCode::kCancelled);
  EXPECT_EQ((*recv)->Wait(absl::Now() + absl::Milliseconds(300)).code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(in, std::vector<uint8_t>(4096, 0));
}

TEST_F(FaultyTransportTest, FailPeerFailsPendingAndLaterOperations) {
  Start(FaultPlan{});
  std::vector<uint8_t> in(16, 0);
  auto pending = a_->Recv(b_at_a_, 8, MutableBuffer::Host(in.data(), in.size()));
  ASSERT_TRUE(pending.ok());
  a_->FailPeer(b_at_a_);
  absl::Status status = (*pending)->Wait(absl::Now() + kWait);
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(status.message()), HasSubstr("peer 'b' is unavailable"));
  EXPECT_EQ(a_->Recv(b_at_a_, 8, MutableBuffer::Host(in.data(), in.size())).status().code(),
            absl::StatusCode::kUnavailable);
}

TEST(FaultyTransportCreateTest, RejectsBadInput) {
  EXPECT_EQ(FaultyTransport::Create(nullptr, FaultPlan{}).status().code(),
            absl::StatusCode::kInvalidArgument);
  FaultPlan plan;
  plan.drop_every_nth_send = -1;
  auto inner = inproc::InprocTransport::Create({"x"});
  ASSERT_TRUE(inner.ok());
  EXPECT_EQ(FaultyTransport::Create(std::move(inner).value(), plan).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace hetpar::transport
