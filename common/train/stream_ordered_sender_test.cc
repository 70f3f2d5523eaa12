// StreamOrderedSender over the in-process transport: a send is posted only once its mark is
// reached, in the order handed over, and a send withdrawn or shut down before its post never
// reaches the peer. The marks here are flags the test raises (on a GPU they are CUDA events).
#include "common/train/stream_ordered_sender.h"

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <string>

#include "tests/util/inproc_pair.h"

namespace hetpar::train {
namespace {

using ::testing::HasSubstr;

class StreamOrderedSenderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto pair = testing::ConnectInprocPair("sender", "receiver");
    ASSERT_TRUE(pair.ok()) << pair.status();
    a_ = std::move(pair->a);
    b_ = std::move(pair->b);
    to_b_ = pair->a_to_b;
    to_a_ = pair->b_to_a;
    sender_ = std::make_unique<StreamOrderedSender>(a_.get());
  }

  // A message of `n` bytes valued `seed + i`, owned by the returned tensor.
  static at::Tensor Message(int64_t n, int seed) {
    return at::arange(n, at::kInt).add_(seed).remainder_(251).to(at::kByte);
  }

  static transport::ConstBuffer BufferOf(const at::Tensor& t) {
    return transport::ConstBuffer::Host(t.data_ptr(), static_cast<size_t>(t.numel()));
  }

  std::unique_ptr<transport::Transport> a_, b_;
  transport::PeerId to_b_ = 0, to_a_ = 0;
  std::unique_ptr<StreamOrderedSender> sender_;
};

TEST_F(StreamOrderedSenderTest, PostsOnlyOnceTheMarkIsReachedAndInOrder) {
  std::atomic<bool> first_ready{false}, second_ready{true};
  const at::Tensor first = Message(4096, 1);
  const at::Tensor second = Message(100, 7);
  auto op1 = sender_->Post(to_b_, 5, BufferOf(first), first, [&] { return first_ready.load(); });
  // Ready at once, but handed over after the first: it waits for the first's post.
  auto op2 = sender_->Post(to_b_, 6, BufferOf(second), second, [&] { return second_ready.load(); });

  std::string in1(4096, '\0'), in2(100, '\0');
  auto recv2 = b_->Recv(to_a_, 6, transport::MutableBuffer::Host(in2.data(), in2.size()));
  ASSERT_TRUE(recv2.ok()) << recv2.status();
  // Nothing is posted while the first mark is not reached: the receive of the second, ready
  // send stays pending, and both Operations time out waiting to be posted.
  EXPECT_EQ((*recv2)->Wait(absl::Now() + absl::Milliseconds(200)).code(),
            absl::StatusCode::kDeadlineExceeded);
  absl::Status early = op1->Wait(absl::Now() + absl::Milliseconds(50));
  EXPECT_EQ(early.code(), absl::StatusCode::kDeadlineExceeded) << early;
  EXPECT_THAT(early.message(), HasSubstr("waiting for the device"));
  EXPECT_FALSE(op1->Done());
  EXPECT_FALSE(op2->Done());
  EXPECT_EQ(op1->bytes(), 0u);
  EXPECT_EQ(sender_->pending(), 2u);

  first_ready = true;
  auto recv1 = b_->Recv(to_a_, 5, transport::MutableBuffer::Host(in1.data(), in1.size()));
  ASSERT_TRUE(recv1.ok()) << recv1.status();
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  ASSERT_TRUE((*recv1)->Wait(deadline).ok());
  ASSERT_TRUE((*recv2)->Wait(deadline).ok());
  ASSERT_TRUE(op1->Wait(deadline).ok());
  ASSERT_TRUE(op2->Wait(deadline).ok());
  EXPECT_TRUE(op1->Done());
  EXPECT_EQ(op1->bytes(), 4096u);
  EXPECT_EQ(op2->bytes(), 100u);
  EXPECT_NE(op1->completed_at(), absl::InfinitePast());
  for (int64_t i = 0; i < 4096; ++i) {
    ASSERT_EQ(static_cast<uint8_t>(in1[i]), (i + 1) % 251) << "byte " << i;
  }
  for (int64_t i = 0; i < 100; ++i) {
    ASSERT_EQ(static_cast<uint8_t>(in2[i]), (i + 7) % 251) << "byte " << i;
  }
}

TEST_F(StreamOrderedSenderTest, WithdrawnBeforeItsPostTheSendNeverArrives) {
  std::atomic<bool> ready{false};
  const at::Tensor withdrawn = Message(64, 3);
  const at::Tensor cancelled = Message(64, 4);
  auto op1 = sender_->Post(to_b_, 8, BufferOf(withdrawn), withdrawn, [&] { return ready.load(); });
  auto op2 = sender_->Post(to_b_, 9, BufferOf(cancelled), cancelled, [&] { return ready.load(); });
  op2->Cancel();
  EXPECT_TRUE(op2->Done());
  EXPECT_EQ(op2->Wait(absl::Now() + absl::Seconds(5)).code(), absl::StatusCode::kCancelled);
  op1.reset();
  ready = true;
  // A third send, posted after both: once it arrives, the poster has passed the other two.
  const at::Tensor last = Message(64, 5);
  auto op3 = sender_->Post(to_b_, 10, BufferOf(last), last, nullptr);
  std::string in(64, '\0');
  auto recv3 = b_->Recv(to_a_, 10, transport::MutableBuffer::Host(in.data(), in.size()));
  ASSERT_TRUE(recv3.ok());
  ASSERT_TRUE((*recv3)->Wait(absl::Now() + absl::Seconds(30)).ok());
  ASSERT_TRUE(op3->Wait(absl::Now() + absl::Seconds(30)).ok());
  EXPECT_EQ(static_cast<uint8_t>(in[0]), 5);
  for (transport::Tag tag : {transport::Tag{8}, transport::Tag{9}}) {
    std::string none(64, '\0');
    auto recv = b_->Recv(to_a_, tag, transport::MutableBuffer::Host(none.data(), none.size()));
    ASSERT_TRUE(recv.ok());
    EXPECT_EQ((*recv)->Wait(absl::Now() + absl::Milliseconds(200)).code(),
              absl::StatusCode::kDeadlineExceeded)
        << "tag " << tag;
  }
}

TEST_F(StreamOrderedSenderTest, ShuttingDownWithdrawsTheSendsNotPosted) {
  const at::Tensor message = Message(32, 2);
  auto op = sender_->Post(to_b_, 11, BufferOf(message), message, [] { return false; });
  sender_.reset();
  EXPECT_TRUE(op->Done());
  absl::Status status = op->Wait(absl::Now() + absl::Seconds(5));
  EXPECT_EQ(status.code(), absl::StatusCode::kCancelled) << status;
  EXPECT_THAT(status.message(), HasSubstr("shut down"));
}

TEST_F(StreamOrderedSenderTest, ASendTheTransportRefusesFailsWithItsReason) {
  const at::Tensor message = Message(32, 2);
  auto op = sender_->Post(/*peer=*/12345, 12, BufferOf(message), message, nullptr);
  absl::Status status = op->Wait(absl::Now() + absl::Seconds(30));
  EXPECT_FALSE(status.ok());
  EXPECT_NE(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
  EXPECT_TRUE(op->Done());
}

// A mark whose query throws (as a CUDA event query does after a device fault) fails its send with
// the error, instead of ending the process from the poster thread; the next send still posts.
TEST_F(StreamOrderedSenderTest, AMarkThatThrowsFailsItsSendAndTheNextOnePosts) {
  const at::Tensor faulted = Message(32, 2);
  auto op1 = sender_->Post(to_b_, 13, BufferOf(faulted), faulted, []() -> bool {
    TORCH_CHECK(false, "CUDA error: an illegal memory access was encountered");
  });
  const at::Tensor next = Message(48, 9);
  auto op2 = sender_->Post(to_b_, 14, BufferOf(next), next, [] { return true; });
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  absl::Status status = op1->Wait(deadline);
  EXPECT_FALSE(status.ok());
  EXPECT_NE(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
  EXPECT_THAT(status.message(), HasSubstr("illegal memory access"));
  EXPECT_THAT(status.message(), HasSubstr("waiting for the device work a send reads"));
  std::string in(48, '\0');
  auto recv = b_->Recv(to_a_, 14, transport::MutableBuffer::Host(in.data(), in.size()));
  ASSERT_TRUE(recv.ok()) << recv.status();
  ASSERT_TRUE((*recv)->Wait(deadline).ok());
  ASSERT_TRUE(op2->Wait(deadline).ok());
  EXPECT_EQ(static_cast<uint8_t>(in[0]), 9);
  EXPECT_EQ(static_cast<uint8_t>(in[47]), (47 + 9) % 251);
  // The faulted send never reached the peer.
  std::string none(32, '\0');
  auto lost = b_->Recv(to_a_, 13, transport::MutableBuffer::Host(none.data(), none.size()));
  ASSERT_TRUE(lost.ok());
  EXPECT_EQ((*lost)->Wait(absl::Now() + absl::Milliseconds(200)).code(),
            absl::StatusCode::kDeadlineExceeded);
}

}  // namespace
}  // namespace hetpar::train
