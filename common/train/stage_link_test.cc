// StageLink over the in-process transport: rows arrive where they were posted, in any order of
// send and post, and a message of another microbatch or size is refused, naming both. Over UCX:
// an attempt that ended mid-pipeline leaves the link usable for the retry.
#include "common/train/stage_link.h"

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>
#include <memory>

#include "absl/time/clock.h"
#include "common/transport/faulty_transport.h"
#include "common/transport/inproc/inproc_transport.h"
#include "common/transport/ucx/ucx_transport.h"
#include "tests/util/inproc_pair.h"

namespace hetpar::train {
namespace {

using ::testing::HasSubstr;

class StageLinkTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto pair = testing::ConnectInprocPair("stage 0", "stage 1");
    ASSERT_TRUE(pair.ok()) << pair.status();
    a_ = std::move(pair->a);
    b_ = std::move(pair->b);
    // World ranks 4 (stage 0) and 6 (stage 1).
    first_ = std::make_unique<StageLink>(
        a_.get(), std::map<int64_t, transport::PeerId>{{6, pair->a_to_b}}, absl::Seconds(10));
    second_ = std::make_unique<StageLink>(
        b_.get(), std::map<int64_t, transport::PeerId>{{4, pair->b_to_a}}, absl::Seconds(10));
  }

  std::unique_ptr<transport::Transport> a_, b_;
  std::unique_ptr<StageLink> first_, second_;
};

TEST_F(StageLinkTest, ActivationsAndGradientsArriveInPlace) {
  const at::Tensor activations = at::arange(12, at::kDouble).reshape({3, 4});
  // Posted before the send for microbatch 0, after it for microbatch 1.
  at::Tensor in0 = at::zeros({3, 4}, at::kDouble);
  ASSERT_TRUE(second_->Post(4, 7, plan::Direction::kForward, 0, in0).ok());
  ASSERT_TRUE(first_->Send(6, 7, plan::Direction::kForward, 0, activations).ok());
  ASSERT_TRUE(first_->Send(6, 7, plan::Direction::kForward, 1, activations * 2).ok());
  at::Tensor in1 = at::zeros({3, 4}, at::kDouble);
  ASSERT_TRUE(second_->Post(4, 7, plan::Direction::kForward, 1, in1).ok());
  auto got1 = second_->Receive(4, 7, plan::Direction::kForward, 1);
  auto got0 = second_->Receive(4, 7, plan::Direction::kForward, 0);
  ASSERT_TRUE(got0.ok()) << got0.status();
  ASSERT_TRUE(got1.ok()) << got1.status();
  EXPECT_TRUE(got0->is_same(in0));
  EXPECT_TRUE(at::equal(in0, activations));
  EXPECT_TRUE(at::equal(in1, activations * 2));
  // Send 0 had completed (its receive was posted first) when send 1 was posted, which dropped
  // its message; send 1 has completed since, and the next send drops it.
  EXPECT_EQ(first_->held_sends(), 1);
  at::Tensor in2 = at::zeros({3, 4}, at::kDouble);
  ASSERT_TRUE(second_->Post(4, 7, plan::Direction::kForward, 2, in2).ok());
  ASSERT_TRUE(first_->Send(6, 7, plan::Direction::kForward, 2, activations * 3).ok());
  EXPECT_EQ(first_->held_sends(), 1);
  ASSERT_TRUE(second_->Receive(4, 7, plan::Direction::kForward, 2).ok());
  EXPECT_TRUE(at::equal(in2, activations * 3));
  // The gradient goes back; a transposed (non-contiguous) tensor is sent as its values.
  const at::Tensor grad = at::arange(12, at::kDouble).reshape({4, 3}).t();
  at::Tensor back = at::zeros({3, 4}, at::kDouble);
  ASSERT_TRUE(first_->Post(6, 7, plan::Direction::kBackward, 0, back).ok());
  ASSERT_TRUE(second_->Send(4, 7, plan::Direction::kBackward, 0, grad).ok());
  ASSERT_TRUE(first_->Receive(6, 7, plan::Direction::kBackward, 0).ok());
  EXPECT_TRUE(at::equal(back, grad));
  EXPECT_TRUE(first_->WaitSends().ok());
  EXPECT_TRUE(second_->WaitSends().ok());
  EXPECT_EQ(first_->held_sends(), 0);
  EXPECT_EQ(first_->bytes_sent(), 3 * 12 * 8);
  EXPECT_EQ(first_->bytes_received(), 12 * 8);
}

TEST_F(StageLinkTest, AMessageOfAnotherSizeIsRefused) {
  at::Tensor in = at::zeros({3, 4}, at::kDouble);
  ASSERT_TRUE(second_->Post(4, 2, plan::Direction::kForward, 5, in).ok());
  // Two rows where the receiver expects three: the plans disagree.
  ASSERT_TRUE(first_->Send(6, 2, plan::Direction::kForward, 5, at::ones({2, 4}, at::kDouble)).ok());
  auto got = second_->Receive(4, 2, plan::Direction::kForward, 5);
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(got.status().message(),
              HasSubstr("activations of step 2 (attempt 0) microbatch 5 (2 rows); expected the "
                        "activations of step 2 (attempt 0) microbatch 5 (3 rows)"));
}

TEST_F(StageLinkTest, UnknownPeersAndUnpostedReceivesAreErrors) {
  EXPECT_EQ(first_->Send(9, 0, plan::Direction::kForward, 0, at::ones({1, 1})).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(second_->Receive(4, 0, plan::Direction::kForward, 3).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // Distinct from the boundary's tag of the same step, direction and wave.
  EXPECT_NE(StageTag(3, 0, plan::Direction::kForward, 1),
            BoundaryTag(3, 0, plan::Direction::kForward, 1));
  // And from another attempt's.
  EXPECT_NE(StageTag(3, 1, plan::Direction::kForward, 1),
            StageTag(3, 2, plan::Direction::kForward, 1));
}

TEST_F(StageLinkTest, ALateMessageOfAnAbortedAttemptIsNotTakenForTheRetrys) {
  // Attempt 1 of step 4: stage 0 sends microbatch 0, but stage 1 never receives it (the
  // coordinator aborted the attempt).
  first_->BeginAttempt(1);
  second_->BeginAttempt(1);
  const absl::Status late =
      first_->Send(6, 4, plan::Direction::kForward, 0, at::full({3, 4}, -1.0));
  ASSERT_TRUE(late.ok()) << late;
  // Attempt 2 of the same step: the receiver posts first, so the old message (already there)
  // would be matched if it could.
  first_->BeginAttempt(2);
  second_->BeginAttempt(2);
  at::Tensor in = at::zeros({3, 4}, at::kDouble);
  ASSERT_TRUE(second_->Post(4, 4, plan::Direction::kForward, 0, in).ok());
  const at::Tensor fresh = at::arange(12, at::kDouble).reshape({3, 4});
  ASSERT_TRUE(first_->Send(6, 4, plan::Direction::kForward, 0, fresh).ok());
  auto got = second_->Receive(4, 4, plan::Direction::kForward, 0);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(at::equal(in, fresh));
}

// A middle stage (world rank 5) between stage 0 (rank 4) and stage 2 (rank 6): a send to the
// previous stage that fails (that stage died) is reported by the next Send, and a forward send
// to the next stage still in flight then stays: it is neither withdrawn nor lost, and its
// receiver gets it.
TEST(StageLinkMiddleTest, AFailedSendLeavesTheSendsStillInFlight) {
  auto prev = transport::inproc::InprocTransport::Create({"stage 0"});
  auto next = transport::inproc::InprocTransport::Create({"stage 2"});
  auto inner = transport::inproc::InprocTransport::Create({"stage 1"});
  ASSERT_TRUE(prev.ok() && next.ok() && inner.ok());
  auto middle = transport::FaultyTransport::Create(std::move(inner).value(), {});
  ASSERT_TRUE(middle.ok()) << middle.status();
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  auto to_prev = (*middle)->Connect((*prev)->LocalAddress(), deadline);
  auto to_next = (*middle)->Connect((*next)->LocalAddress(), deadline);
  auto next_to_middle = (*next)->Connect((*middle)->LocalAddress(), deadline);
  ASSERT_TRUE(to_prev.ok() && to_next.ok() && next_to_middle.ok());
  StageLink link(middle->get(), {{4, *to_prev}, {6, *to_next}}, absl::Seconds(10));
  StageLink after(next->get(), {{5, *next_to_middle}}, absl::Seconds(10));

  const at::Tensor rows = at::arange(12, at::kDouble).reshape({3, 4});
  // Neither is received yet: an in-process send waits for its receive.
  ASSERT_TRUE(link.Send(6, 2, plan::Direction::kForward, 0, rows).ok());
  ASSERT_TRUE(link.Send(4, 2, plan::Direction::kBackward, 0, rows * 3).ok());
  (*middle)->FailPeer(*to_prev);
  const absl::Status failed = link.Send(6, 2, plan::Direction::kForward, 1, rows * 2);
  EXPECT_TRUE(absl::IsUnavailable(failed)) << failed;
  EXPECT_THAT(failed.message(), HasSubstr("sending to a neighbouring pipeline stage"));
  EXPECT_EQ(link.held_sends(), 1);

  at::Tensor in = at::zeros({3, 4}, at::kDouble);
  ASSERT_TRUE(after.Post(5, 2, plan::Direction::kForward, 0, in).ok());
  auto got = after.Receive(5, 2, plan::Direction::kForward, 0);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(at::equal(in, rows));
  EXPECT_TRUE(link.WaitSends().ok());
  EXPECT_EQ(link.held_sends(), 0);
  // The attempt's end finds no send to drain.
  link.Abandon(2, {}, 4 * 8);
  link.Reset();
  EXPECT_EQ(link.draining_sends(), 0);
}

// Two stages over UCX, whose sends of large messages wait for their receiver (rendezvous) and
// cannot be withdrawn once the receiver holds them.
class StageLinkUcxTest : public ::testing::Test {
 protected:
  void SetUp() override {
    transport::ucx::UcxTransport::Options a_options, b_options;
    a_options.name = "stage 0";
    b_options.name = "stage 1";
    auto a = transport::ucx::UcxTransport::Create(a_options);
    auto b = transport::ucx::UcxTransport::Create(b_options);
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(b.ok()) << b.status();
    a_ = std::move(a).value();
    b_ = std::move(b).value();
    auto b_at_a = a_->Connect(b_->LocalAddress(), absl::Now() + absl::Seconds(20));
    auto a_at_b = b_->Connect(a_->LocalAddress(), absl::Now() + absl::Seconds(20));
    ASSERT_TRUE(b_at_a.ok()) << b_at_a.status();
    ASSERT_TRUE(a_at_b.ok()) << a_at_b.status();
    first_ = std::make_unique<StageLink>(
        a_.get(), std::map<int64_t, transport::PeerId>{{6, *b_at_a}}, absl::Seconds(20));
    second_ = std::make_unique<StageLink>(
        b_.get(), std::map<int64_t, transport::PeerId>{{4, *a_at_b}}, absl::Seconds(20));
  }

  std::unique_ptr<transport::Transport> a_, b_;
  std::unique_ptr<StageLink> first_, second_;
};

TEST_F(StageLinkUcxTest, AnAttemptEndedMidPipelineLeavesTheLinkToTheRetry) {
  constexpr int64_t kRows = 2048, kHidden = 64;  // 1 MiB of float64 rows per message
  constexpr int64_t kRowBytes = kHidden * 8;
  const auto rows = [](double seed) {
    return at::arange(kRows * kHidden, at::kDouble).reshape({kRows, kHidden}) + seed;
  };
  // Attempt 7 of step 3: stage 0 sends the activations of microbatches 0 and 1; stage 1 takes
  // microbatch 0, and the attempt is aborted before it posts microbatch 1 or sends any gradient.
  first_->BeginAttempt(7);
  second_->BeginAttempt(7);
  ASSERT_TRUE(first_->Send(6, 3, plan::Direction::kForward, 0, rows(0)).ok());
  ASSERT_TRUE(first_->Send(6, 3, plan::Direction::kForward, 1, rows(1)).ok());
  at::Tensor in0 = at::zeros({kRows, kHidden}, at::kDouble);
  ASSERT_TRUE(second_->Post(4, 3, plan::Direction::kForward, 0, in0).ok());
  auto got0 = second_->Receive(4, 3, plan::Direction::kForward, 0);
  ASSERT_TRUE(got0.ok()) << got0.status();
  // Both sides give the attempt up, each naming what it expected from the other.
  second_->Abandon(
      3, {{4, plan::Direction::kForward, 0, kRows}, {4, plan::Direction::kForward, 1, kRows}},
      kRowBytes);
  first_->Abandon(
      3, {{6, plan::Direction::kBackward, 0, kRows}, {6, plan::Direction::kBackward, 1, kRows}},
      kRowBytes);

  // Attempt 8: a microbatch each way, as a retry exchanges them.
  first_->BeginAttempt(8);
  second_->BeginAttempt(8);
  at::Tensor forward_in = at::zeros({kRows, kHidden}, at::kDouble);
  at::Tensor backward_in = at::zeros({kRows, kHidden}, at::kDouble);
  ASSERT_TRUE(second_->Post(4, 3, plan::Direction::kForward, 0, forward_in).ok());
  ASSERT_TRUE(first_->Post(6, 3, plan::Direction::kBackward, 0, backward_in).ok());
  const absl::Status sent_forward = first_->Send(6, 3, plan::Direction::kForward, 0, rows(10));
  ASSERT_TRUE(sent_forward.ok()) << sent_forward;
  const absl::Status sent_backward = second_->Send(4, 3, plan::Direction::kBackward, 0, rows(20));
  ASSERT_TRUE(sent_backward.ok()) << sent_backward;
  auto forward = second_->Receive(4, 3, plan::Direction::kForward, 0);
  ASSERT_TRUE(forward.ok()) << forward.status();
  auto backward = first_->Receive(6, 3, plan::Direction::kBackward, 0);
  ASSERT_TRUE(backward.ok()) << backward.status();
  EXPECT_TRUE(at::equal(forward_in, rows(10)));
  EXPECT_TRUE(at::equal(backward_in, rows(20)));
  ASSERT_TRUE(first_->WaitSends().ok());
  ASSERT_TRUE(second_->WaitSends().ok());
  // Stage 0's scratch receives of attempt 7's gradients, never sent, stay posted through the
  // two attempts after it, then are withdrawn.
  first_->BeginAttempt(9);
  EXPECT_EQ(first_->stale_receives(), 2);
  first_->BeginAttempt(10);
  EXPECT_EQ(first_->stale_receives(), 0);
  // The late send of attempt 7 was taken by stage 1's scratch receive: it completes, and the
  // link lets it go at a later attempt.
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  int64_t attempt = 11;
  while (first_->draining_sends() > 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(1));  // leaves the core to UCX's progress thread
    first_->BeginAttempt(attempt++);
  }
  EXPECT_EQ(first_->draining_sends(), 0);
}

}  // namespace
}  // namespace hetpar::train
