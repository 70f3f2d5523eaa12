#include "coordinator/kv_store.h"

#include <algorithm>
#include <atomic>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hetpar::coordinator {
namespace {

using ::testing::HasSubstr;

const absl::Time kT0 = absl::FromUnixSeconds(1000);

TEST(KeyValueStoreTest, SetGetCheckDeleteNumKeys) {
  KeyValueStore kv(1);
  EXPECT_EQ(kv.Get(1, "a").status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(kv.Set(1, "a", std::string("\0\1\2", 3)).ok());
  ASSERT_TRUE(kv.Set(1, "b", "xyz").ok());
  EXPECT_EQ(*kv.Get(1, "a"), std::string("\0\1\2", 3));
  EXPECT_EQ(*kv.Get(1, "b"), "xyz");
  EXPECT_TRUE(*kv.Check(1, {"a", "b"}));
  EXPECT_FALSE(*kv.Check(1, {"a", "c"}));
  EXPECT_EQ(*kv.NumKeys(1), 2);
  EXPECT_TRUE(*kv.Delete(1, "a"));
  EXPECT_FALSE(*kv.Delete(1, "a"));
  EXPECT_EQ(*kv.NumKeys(1), 1);
  ASSERT_TRUE(kv.Set(1, "b", "overwritten").ok());
  EXPECT_EQ(*kv.Get(1, "b"), "overwritten");
}

TEST(KeyValueStoreTest, AddKeepsDecimalText) {
  KeyValueStore kv(1);
  EXPECT_EQ(*kv.Add(1, "n", 5), 5);
  EXPECT_EQ(*kv.Add(1, "n", -7), -2);
  EXPECT_EQ(*kv.Get(1, "n"), "-2");
  ASSERT_TRUE(kv.Set(1, "s", "not a number").ok());
  auto bad = kv.Add(1, "s", 1);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("not a decimal integer"));
  ASSERT_TRUE(kv.Set(1, "big", "9223372036854775807").ok());
  EXPECT_EQ(kv.Add(1, "big", 1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(*kv.Get(1, "big"), "9223372036854775807");
}

TEST(KeyValueStoreTest, AddIsAtomicUnderConcurrency) {
  KeyValueStore kv(1);
  constexpr int kThreads = 32;
  constexpr int kAdds = 200;
  std::vector<std::vector<int64_t>> seen(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kAdds; ++i) seen[t].push_back(*kv.Add(1, "counter", 1));
    });
  }
  for (auto& thread : threads) thread.join();
  std::vector<int64_t> all;
  for (const auto& s : seen) all.insert(all.end(), s.begin(), s.end());
  std::sort(all.begin(), all.end());
  ASSERT_EQ(all.size(), static_cast<size_t>(kThreads * kAdds));
  // Every intermediate value was returned to exactly one caller.
  for (size_t i = 0; i < all.size(); ++i) ASSERT_EQ(all[i], static_cast<int64_t>(i + 1));
  EXPECT_EQ(*kv.Get(1, "counter"), std::to_string(kThreads * kAdds));
}

TEST(KeyValueStoreTest, CompareSetFollowsC10d) {
  KeyValueStore kv(1);
  // Absent with a non-empty expectation: nothing is set and the expectation comes back.
  EXPECT_EQ(*kv.CompareSet(1, "k", "old", "new"), "old");
  EXPECT_FALSE(*kv.Check(1, {"k"}));
  // Absent with an empty expectation: set.
  EXPECT_EQ(*kv.CompareSet(1, "k", "", "v1"), "v1");
  EXPECT_EQ(*kv.Get(1, "k"), "v1");
  // Present, mismatch: unchanged, current value returned.
  EXPECT_EQ(*kv.CompareSet(1, "k", "zzz", "v2"), "v1");
  EXPECT_EQ(*kv.Get(1, "k"), "v1");
  // Present, match: swapped.
  EXPECT_EQ(*kv.CompareSet(1, "k", "v1", "v2"), "v2");
  EXPECT_EQ(*kv.Get(1, "k"), "v2");
}

TEST(KeyValueStoreTest, WaitCompletesWhenEveryKeyExists) {
  KeyValueStore kv(1);
  std::vector<absl::Status> results;
  kv.Wait(kv.NewWaitId(), 1, {"a", "b"}, kT0 + absl::Seconds(5),
          [&](absl::Status s) { results.push_back(s); });
  EXPECT_EQ(kv.pending_waits(), 1);
  ASSERT_TRUE(kv.Set(1, "a", "1").ok());
  EXPECT_TRUE(results.empty());
  ASSERT_TRUE(kv.Set(1, "b", "2").ok());
  ASSERT_EQ(results.size(), 1u);
  EXPECT_TRUE(results[0].ok());
  EXPECT_EQ(kv.pending_waits(), 0);
  // Already there: completes on the calling thread.
  kv.Wait(kv.NewWaitId(), 1, {"a"}, kT0, [&](absl::Status s) { results.push_back(s); });
  ASSERT_EQ(results.size(), 2u);
  EXPECT_TRUE(results[1].ok());
}

TEST(KeyValueStoreTest, AddSatisfiesWaits) {
  KeyValueStore kv(1);
  absl::StatusOr<std::string> value = absl::UnknownError("not called");
  kv.GetAsync(kv.NewWaitId(), 1, "n", kT0 + absl::Seconds(1),
              [&](absl::StatusOr<std::string> v) { value = std::move(v); });
  ASSERT_TRUE(kv.Add(1, "n", 3).ok());
  ASSERT_TRUE(value.ok()) << value.status();
  EXPECT_EQ(*value, "3");
}

TEST(KeyValueStoreTest, WaitTimesOutAtItsDeadline) {
  KeyValueStore kv(1);
  std::vector<absl::Status> results;
  kv.Wait(kv.NewWaitId(), 1, {"never"}, kT0 + absl::Seconds(2),
          [&](absl::Status s) { results.push_back(s); });
  kv.Wait(kv.NewWaitId(), 1, {"later"}, kT0 + absl::Seconds(4),
          [&](absl::Status s) { results.push_back(s); });
  EXPECT_EQ(kv.ExpireWaits(kT0 + absl::Seconds(1)), kT0 + absl::Seconds(2));
  EXPECT_TRUE(results.empty());
  EXPECT_EQ(kv.ExpireWaits(kT0 + absl::Seconds(2)), kT0 + absl::Seconds(4));
  ASSERT_EQ(results.size(), 1u);
  EXPECT_EQ(results[0].code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(std::string(results[0].message()), HasSubstr("'never'"));
  EXPECT_EQ(kv.ExpireWaits(kT0 + absl::Seconds(5)), absl::InfiniteFuture());
  ASSERT_EQ(results.size(), 2u);
  EXPECT_EQ(results[1].code(), absl::StatusCode::kDeadlineExceeded);
}

TEST(KeyValueStoreTest, CancelEndsAWaitOnce) {
  KeyValueStore kv(1);
  int calls = 0;
  absl::Status last;
  const auto id = kv.NewWaitId();
  kv.Wait(id, 1, {"x"}, kT0 + absl::Seconds(1), [&](absl::Status s) {
    ++calls;
    last = s;
  });
  kv.Cancel(id);
  kv.Cancel(id);
  ASSERT_TRUE(kv.Set(1, "x", "1").ok());
  kv.ExpireWaits(kT0 + absl::Hours(1));
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(last.code(), absl::StatusCode::kCancelled);
}

TEST(KeyValueStoreTest, GenerationsAreSeparateAndOldOnesAreDropped) {
  KeyValueStore kv(1);
  ASSERT_TRUE(kv.Set(1, "a", "1").ok());
  auto stale = kv.Set(2, "a", "2");
  EXPECT_EQ(stale.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(stale.message()),
              HasSubstr("generation 2 but the run is in generation 1"));
  absl::Status waited;
  kv.Wait(kv.NewWaitId(), 1, {"b"}, kT0 + absl::Seconds(1), [&](absl::Status s) { waited = s; });
  kv.SetGeneration(2);
  EXPECT_EQ(waited.code(), absl::StatusCode::kAborted);
  // Generations only grow: a late move to an older one changes nothing.
  ASSERT_TRUE(kv.Set(2, "c", "3").ok());
  kv.SetGeneration(1);
  EXPECT_EQ(kv.generation(), 2);
  EXPECT_EQ(*kv.Get(2, "c"), "3");
  ASSERT_TRUE(kv.Delete(2, "c").ok());
  EXPECT_EQ(kv.Get(1, "a").status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(kv.Get(2, "a").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(*kv.NumKeys(2), 0);
  absl::Status wrong_generation;
  kv.Wait(kv.NewWaitId(), 1, {"b"}, kT0, [&](absl::Status s) { wrong_generation = s; });
  EXPECT_EQ(wrong_generation.code(), absl::StatusCode::kFailedPrecondition);
}

TEST(KeyValueStoreTest, ConcurrentWaitersAllWakeOnSet) {
  KeyValueStore kv(1);
  constexpr int kWaiters = 32;
  std::atomic<int> done{0};
  absl::Notification all_done;
  for (int i = 0; i < kWaiters; ++i) {
    kv.Wait(kv.NewWaitId(), 1, {"go"}, kT0 + absl::Seconds(1), [&](absl::Status s) {
      EXPECT_TRUE(s.ok());
      if (done.fetch_add(1) + 1 == kWaiters) all_done.Notify();
    });
  }
  std::thread setter([&] { ASSERT_TRUE(kv.Set(1, "go", "1").ok()); });
  setter.join();
  EXPECT_TRUE(all_done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  EXPECT_EQ(done.load(), kWaiters);
}

}  // namespace
}  // namespace hetpar::coordinator
