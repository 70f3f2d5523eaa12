#include "common/data/sampler.h"

#include <algorithm>
#include <set>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hetpar::data {
namespace {

using ::testing::HasSubstr;

std::unique_ptr<EpochSampler> Make(int64_t n, uint64_t seed) {
  absl::StatusOr<std::unique_ptr<EpochSampler>> s = EpochSampler::Create(n, seed);
  EXPECT_TRUE(s.ok()) << s.status();
  return std::move(*s);
}

TEST(SamplerTest, EachEpochIsAPermutation) {
  for (int64_t n : {1, 2, 7, 100, 1024}) {
    std::unique_ptr<EpochSampler> s = Make(n, 5);
    for (int64_t epoch = 0; epoch < 3; ++epoch) {
      std::vector<int64_t> order = s->EpochOrder(epoch);
      ASSERT_EQ(static_cast<int64_t>(order.size()), n);
      std::vector<int64_t> sorted = order;
      std::sort(sorted.begin(), sorted.end());
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(sorted[static_cast<size_t>(i)], i);
    }
  }
}

TEST(SamplerTest, OrderDependsOnlyOnSeedAndEpoch) {
  std::unique_ptr<EpochSampler> a = Make(1000, 42);
  std::unique_ptr<EpochSampler> b = Make(1000, 42);
  std::unique_ptr<EpochSampler> c = Make(1000, 43);
  EXPECT_EQ(a->EpochOrder(0), b->EpochOrder(0));
  EXPECT_EQ(a->EpochOrder(5), b->EpochOrder(5));
  EXPECT_NE(a->EpochOrder(0), a->EpochOrder(1));
  EXPECT_NE(a->EpochOrder(0), c->EpochOrder(0));
}

TEST(SamplerTest, OrderIsPinned) {
  // Checkpoints store cursors into these orders: the shuffle must never change silently.
  EXPECT_EQ(Make(10, 1)->EpochOrder(0), (std::vector<int64_t>{0, 8, 6, 1, 7, 9, 3, 4, 5, 2}));
  EXPECT_EQ(Make(10, 1)->EpochOrder(1), (std::vector<int64_t>{9, 4, 0, 1, 6, 2, 8, 7, 5, 3}));
}

TEST(SamplerTest, EverySampleExactlyOncePerEpochWhateverTheBatchSize) {
  const int64_t n = 23;
  std::unique_ptr<EpochSampler> s = Make(n, 9);
  std::vector<int64_t> expected;
  for (int64_t epoch = 0; epoch < 4; ++epoch) {
    std::vector<int64_t> order = s->EpochOrder(epoch);
    expected.insert(expected.end(), order.begin(), order.end());
  }
  for (int64_t batch : {1, 2, 4, 5, 8, 23, 24, 50}) {
    std::vector<int64_t> seen;
    SamplerCursor cursor;
    while (static_cast<int64_t>(seen.size()) + batch <= 4 * n) {
      absl::StatusOr<SamplerBatch> b = s->Take(cursor, batch);
      ASSERT_TRUE(b.ok()) << b.status();
      ASSERT_EQ(static_cast<int64_t>(b->samples.size()), batch);
      seen.insert(seen.end(), b->samples.begin(), b->samples.end());
      cursor = b->next;
    }
    for (size_t i = 0; i < seen.size(); ++i) {
      ASSERT_EQ(seen[i], expected[i]) << "batch " << batch << " position " << i;
    }
    // Each whole epoch within `seen` holds every sample once.
    for (int64_t e = 0; (e + 1) * n <= static_cast<int64_t>(seen.size()); ++e) {
      std::set<int64_t> epoch(seen.begin() + e * n, seen.begin() + (e + 1) * n);
      EXPECT_EQ(static_cast<int64_t>(epoch.size()), n);
    }
  }
}

// A batch that crosses an epoch's end continues into the next epoch's order, which may start
// with a sample the batch already holds: with configs/tiny.yaml's run.seed (1234) and 16 samples,
// the third batch of 6 (positions 12 to 17) holds one twice. A step plan takes it at both batch
// positions (plan::ValidateBatch); the parity test trains that run against the reference.
TEST(SamplerTest, ABatchAcrossAnEpochsEndCanHoldASampleTwice) {
  auto sampler = EpochSampler::Create(16, 1234);
  ASSERT_TRUE(sampler.ok());
  auto batch = (*sampler)->Take({0, 12}, 6);
  ASSERT_TRUE(batch.ok()) << batch.status();
  ASSERT_EQ(batch->samples.size(), 6u);
  const std::set<int64_t> distinct(batch->samples.begin(), batch->samples.end());
  EXPECT_EQ(distinct.size(), 5u);
  EXPECT_EQ(batch->next.epoch, 1);
  EXPECT_EQ(batch->next.offset, 2);
}

TEST(SamplerTest, ResumesExactlyFromASavedCursor) {
  std::unique_ptr<EpochSampler> s = Make(37, 2024);
  // One run: 20 steps of 8.
  std::vector<int64_t> straight;
  SamplerCursor cursor;
  std::vector<SamplerCursor> saved;
  for (int step = 0; step < 20; ++step) {
    saved.push_back(cursor);
    SamplerBatch b = *s->Take(cursor, 8);
    straight.insert(straight.end(), b.samples.begin(), b.samples.end());
    cursor = b.next;
  }
  // Resume from every saved cursor, through its text form, in a fresh sampler.
  for (int step = 0; step < 20; ++step) {
    absl::StatusOr<SamplerCursor> parsed =
        SamplerCursor::Parse(saved[static_cast<size_t>(step)].ToString());
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    ASSERT_EQ(*parsed, saved[static_cast<size_t>(step)]);
    std::unique_ptr<EpochSampler> fresh = Make(37, 2024);
    std::vector<int64_t> resumed;
    SamplerCursor c = *parsed;
    for (int k = step; k < 20; ++k) {
      SamplerBatch b = *fresh->Take(c, 8);
      resumed.insert(resumed.end(), b.samples.begin(), b.samples.end());
      c = b.next;
    }
    ASSERT_EQ(resumed, std::vector<int64_t>(straight.begin() + step * 8, straight.end()))
        << "resumed at step " << step;
    EXPECT_EQ(c, cursor);
  }
  // An aborted step takes again from the same cursor and gets the same samples.
  EXPECT_EQ(s->Take(saved[7], 8)->samples, s->Take(saved[7], 8)->samples);
  EXPECT_EQ(cursor, (SamplerCursor{4, 12}));  // 160 samples = 4 epochs of 37 + 12
}

TEST(SamplerTest, InvalidInputsAreExplained) {
  EXPECT_EQ(EpochSampler::Create(0, 1).status().code(), absl::StatusCode::kInvalidArgument);
  std::unique_ptr<EpochSampler> s = Make(10, 1);
  absl::StatusOr<SamplerBatch> far = s->Take(SamplerCursor{0, 11}, 1);
  EXPECT_EQ(far.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(far.status().message()), HasSubstr("epoch=0,offset=11"));
  EXPECT_THAT(std::string(far.status().message()), HasSubstr("10 samples"));
  EXPECT_FALSE(s->Take(SamplerCursor{-1, 0}, 1).ok());
  EXPECT_FALSE(s->Take(SamplerCursor{}, -1).ok());
  EXPECT_TRUE(s->Take(SamplerCursor{0, 10}, 0)->samples.empty());
  for (const char* bad :
       {"", "epoch=1", "epoch=x,offset=2", "offset=1,epoch=2,more=3", "e=1,o=2"}) {
    EXPECT_FALSE(SamplerCursor::Parse(bad).ok()) << bad;
  }
  EXPECT_EQ(*SamplerCursor::Parse("offset=3,epoch=2"), (SamplerCursor{2, 3}));
}

TEST(SamplerTest, DeterministicRngBelowIsUniformEnough) {
  DeterministicRng rng(123);
  std::vector<int> counts(6, 0);
  for (int i = 0; i < 60000; ++i) ++counts[rng.Below(6)];
  for (int c : counts) EXPECT_NEAR(c, 10000, 400);
  for (int i = 0; i < 1000; ++i) {
    const double u = rng.Uniform();
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
  }
}

}  // namespace
}  // namespace hetpar::data
