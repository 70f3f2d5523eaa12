// CollectiveAborter aborts the tracked process groups of one generation, once, off the calling
// thread, and keeps each alive through its abort; CommGroup::Adopt aborts an abandoned NCCL
// group before destroying it and leaks an abandoned Gloo one. ProcessGroupNCCL needs a GPU, so
// the backend here is a c10d::Backend that records its abort and its destruction.
#include "common/nn/collective_aborter.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>

#include "absl/synchronization/notification.h"
#include "common/nn/communicator.h"

namespace hetpar::nn {
namespace {

// What happened to one RecordingBackend (shared, so that it outlives the backend).
struct Record {
  std::atomic<int> aborts{0};
  std::atomic<bool> destroyed{false};
  std::atomic<c10d::ErrorType> error{c10d::ErrorType::SUCCESS};
  absl::Notification abort_entered;
  // When set, abort() returns only once it is notified (an abort that takes a while).
  absl::Notification* hold_abort = nullptr;
};

class RecordingBackend : public c10d::Backend {
 public:
  explicit RecordingBackend(std::shared_ptr<Record> record)
      : c10d::Backend(/*rank=*/0, /*size=*/2), record_(std::move(record)) {}
  ~RecordingBackend() override { record_->destroyed.store(true); }
  const std::string getBackendName() const override { return "recording"; }
  c10d::ErrorType getError() override { return record_->error.load(); }
  void abort() override {
    record_->abort_entered.Notify();
    if (record_->hold_abort != nullptr) record_->hold_abort->WaitForNotification();
    record_->aborts.fetch_add(1);
  }

 private:
  std::shared_ptr<Record> record_;
};

c10::intrusive_ptr<c10d::Backend> MakeBackend(const std::shared_ptr<Record>& record) {
  return c10::make_intrusive<RecordingBackend>(record);
}

TEST(CollectiveAborterTest, AbortsTheLiveBackendsOfTheAbortedGenerationOnce) {
  auto old1 = std::make_shared<Record>();
  auto old2 = std::make_shared<Record>();
  auto released = std::make_shared<Record>();
  auto newer = std::make_shared<Record>();
  c10::intrusive_ptr<c10d::Backend> b1 = MakeBackend(old1);
  c10::intrusive_ptr<c10d::Backend> b2 = MakeBackend(old2);
  c10::intrusive_ptr<c10d::Backend> b3 = MakeBackend(released);
  c10::intrusive_ptr<c10d::Backend> b4 = MakeBackend(newer);
  CollectiveAborter aborter;
  aborter.Track(b1, 3);
  aborter.Track(b2, 3);
  aborter.Track(b3, 3);
  aborter.Track(b4, 4);
  b3.reset();  // its group let it go before the abort

  EXPECT_EQ(aborter.AbortGeneration(3), 2);
  aborter.WaitIdle();
  EXPECT_EQ(old1->aborts.load(), 1);
  EXPECT_EQ(old2->aborts.load(), 1);
  EXPECT_EQ(released->aborts.load(), 0);
  EXPECT_TRUE(released->destroyed.load()) << "a released backend outlived the abort";
  EXPECT_EQ(newer->aborts.load(), 0) << "a later generation's group must keep running";
  EXPECT_EQ(aborter.aborted(), 2);

  // A second abort of the same generation (the coordinator's, repeated) finds nothing left.
  EXPECT_EQ(aborter.AbortGeneration(3), 0);
  EXPECT_EQ(aborter.AbortGeneration(5), 0);
  aborter.WaitIdle();
  EXPECT_EQ(old1->aborts.load(), 1);
  EXPECT_EQ(newer->aborts.load(), 0);

  EXPECT_EQ(aborter.AbortGeneration(4), 1);
  aborter.WaitIdle();
  EXPECT_EQ(newer->aborts.load(), 1);
  EXPECT_FALSE(old1->destroyed.load()) << "the group still owns its backend";
}

// The abort can arrive while the worker still forms the generation's groups: one formed after it
// is aborted as it is tracked; another generation's is not.
TEST(CollectiveAborterTest, AGroupFormedAfterItsGenerationWasAbortedIsAbortedAtOnce) {
  auto late = std::make_shared<Record>();
  auto next = std::make_shared<Record>();
  c10::intrusive_ptr<c10d::Backend> b1 = MakeBackend(late);
  c10::intrusive_ptr<c10d::Backend> b2 = MakeBackend(next);
  CollectiveAborter aborter;
  EXPECT_EQ(aborter.AbortGeneration(6), 0);
  aborter.Track(b1, 6);
  aborter.Track(b2, 7);
  aborter.WaitIdle();
  EXPECT_EQ(late->aborts.load(), 1);
  EXPECT_EQ(next->aborts.load(), 0);
  EXPECT_EQ(aborter.aborted(), 1);
  EXPECT_FALSE(late->destroyed.load()) << "the group still owns its backend";
}

// The session's gRPC thread calls AbortGeneration and must not block: the abort runs on the
// aborter's thread, which holds the backend alive even after its group has released it.
TEST(CollectiveAborterTest, ReturnsBeforeTheAbortAndHoldsTheBackendUntilItEnds) {
  absl::Notification hold;
  auto record = std::make_shared<Record>();
  record->hold_abort = &hold;
  c10::intrusive_ptr<c10d::Backend> backend = MakeBackend(record);
  CollectiveAborter aborter;
  aborter.Track(backend, 7);
  // Returns although the abort will not end before `hold` (which this thread notifies below).
  EXPECT_EQ(aborter.AbortGeneration(7), 1);
  record->abort_entered.WaitForNotification();
  backend.reset();  // the group's new generation replaces it meanwhile
  EXPECT_FALSE(record->destroyed.load()) << "destroyed while its abort was running";
  EXPECT_EQ(record->aborts.load(), 0);
  hold.Notify();
  aborter.WaitIdle();
  EXPECT_EQ(record->aborts.load(), 1);
  EXPECT_TRUE(record->destroyed.load()) << "the aborter's reference was the last";
}

// The destructor lets an abort in progress finish (a hung group would otherwise outlive it).
// A generation whose backend reports an error fails its check, naming the group and the error;
// other generations, and released backends, are not asked.
TEST(CollectiveAborterTest, CheckGenerationReportsTheErrorOfALiveBackendOfThatGeneration) {
  auto healthy = std::make_shared<Record>();
  auto timed_out = std::make_shared<Record>();
  auto released = std::make_shared<Record>();
  c10::intrusive_ptr<c10d::Backend> b1 = MakeBackend(healthy);
  c10::intrusive_ptr<c10d::Backend> b2 = MakeBackend(timed_out);
  c10::intrusive_ptr<c10d::Backend> b3 = MakeBackend(released);
  CollectiveAborter aborter;
  aborter.Track(b1, 4);
  aborter.Track(b2, 5);
  aborter.Track(b3, 4);
  released->error.store(c10d::ErrorType::COMM_ERROR);
  b3.reset();
  EXPECT_TRUE(aborter.CheckGeneration(4).ok());
  EXPECT_TRUE(aborter.CheckGeneration(5).ok());
  timed_out->error.store(c10d::ErrorType::TIMEOUT);
  const absl::Status status = aborter.CheckGeneration(5);
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(status.message()),
              ::testing::AllOf(::testing::HasSubstr("recording group of rank 0 of 2"),
                               ::testing::HasSubstr("generation 5"),
                               ::testing::HasSubstr("a collective timed out")));
  EXPECT_TRUE(aborter.CheckGeneration(4).ok());
  healthy->error.store(c10d::ErrorType::REMOTE_ERROR);
  EXPECT_THAT(std::string(aborter.CheckGeneration(4).message()),
              ::testing::HasSubstr("a peer reported an error"));
  // Checking aborts nothing.
  EXPECT_EQ(healthy->aborts.load() + timed_out->aborts.load(), 0);
}

TEST(CollectiveAborterTest, DestructionWaitsForTheAbortsStarted) {
  auto record = std::make_shared<Record>();
  c10::intrusive_ptr<c10d::Backend> backend = MakeBackend(record);
  {
    CollectiveAborter aborter;
    aborter.Track(backend, 1);
    EXPECT_EQ(aborter.AbortGeneration(1), 1);
  }
  EXPECT_EQ(record->aborts.load(), 1);
}

CommGroupPtr Group(c10::intrusive_ptr<c10d::Backend> backend, Backend kind) {
  return c10::make_intrusive<CommGroup>(std::move(backend), 0, 2, kind,
                                        std::chrono::milliseconds(1000));
}

// Replaces `group`'s process group by an empty one (a group of one), as a new generation does.
void AdoptEmpty(CommGroup& group, Backend kind) {
  CommGroupPtr fresh =
      c10::make_intrusive<CommGroup>(nullptr, 0, 1, kind, std::chrono::milliseconds(1000));
  group.Adopt(*fresh);
}

TEST(CommGroupReleaseTest, AnAbandonedNcclGroupIsAbortedThenDestroyed) {
  auto record = std::make_shared<Record>();
  CommGroupPtr group = Group(MakeBackend(record), Backend::kNccl);
  group->Abandon();
  AdoptEmpty(*group, Backend::kNccl);
  EXPECT_EQ(record->aborts.load(), 1);
  EXPECT_TRUE(record->destroyed.load());
  EXPECT_FALSE(group->abandoned());
}

TEST(CommGroupReleaseTest, AHealthyGroupIsDestroyedWithoutAnAbort) {
  for (Backend kind : {Backend::kNccl, Backend::kGloo}) {
    auto record = std::make_shared<Record>();
    CommGroupPtr group = Group(MakeBackend(record), kind);
    AdoptEmpty(*group, kind);
    EXPECT_EQ(record->aborts.load(), 0);
    EXPECT_TRUE(record->destroyed.load());
  }
}

// Gloo cannot abort a collective: its backend thread may still be blocked in the one given up,
// and destroying it would wait for that thread.
TEST(CommGroupReleaseTest, AnAbandonedGlooGroupIsLeaked) {
  auto record = std::make_shared<Record>();
  c10::intrusive_ptr<c10d::Backend> backend = MakeBackend(record);
  c10::weak_intrusive_ptr<c10d::Backend> weak(backend);
  CommGroupPtr group = Group(std::move(backend), Backend::kGloo);
  group->Abandon();
  AdoptEmpty(*group, Backend::kGloo);
  EXPECT_EQ(record->aborts.load(), 0);
  EXPECT_FALSE(record->destroyed.load());
  EXPECT_FALSE(weak.expired());
}

}  // namespace
}  // namespace hetpar::nn
