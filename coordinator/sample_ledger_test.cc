// The sample ledger: contiguous steps neither repeat nor lose, a step committed twice repeats its
// samples, a skipped range is lost by exactly its size, batches that cross one or several epochs
// are split where the sampler splits them, old epochs are dropped without forgetting their lost
// positions, inconsistent input is clamped, and a long run stays correct. Every expected number
// is worked out by hand in the comment beside it.
#include "coordinator/sample_ledger.h"

#include <algorithm>
#include <cstdint>

#include "common/data/sampler.h"
#include "gtest/gtest.h"

namespace hetpar::coordinator {
namespace {

using data::SamplerCursor;

// The cursor `count` samples after `from` in epochs of `epoch_size`, as EpochSampler::Take moves
// it (a batch that ends exactly at an epoch's end leaves the cursor at {epoch, epoch_size}).
SamplerCursor Advance(SamplerCursor from, int64_t count, int64_t epoch_size) {
  while (count > 0) {
    if (from.offset == epoch_size) {
      ++from.epoch;
      from.offset = 0;
    }
    const int64_t take = std::min(count, epoch_size - from.offset);
    from.offset += take;
    count -= take;
  }
  return from;
}

void ExpectCounts(const SampleLedger& ledger, int64_t trained, int64_t repeated, int64_t lost) {
  const LedgerCounts counts = ledger.counts();
  EXPECT_EQ(counts.trained, trained);
  EXPECT_EQ(counts.repeated, repeated);
  EXPECT_EQ(counts.lost, lost);
}

TEST(SampleLedgerTest, NothingRecordedCountsNothing) { ExpectCounts(SampleLedger(), 0, 0, 0); }

TEST(SampleLedgerTest, ContiguousRecordsNeitherRepeatNorLose) {
  SampleLedger ledger;
  ledger.Record({0, 0}, {0, 8}, 8);
  ledger.Record({0, 8}, {0, 16}, 8);
  ledger.Record({0, 16}, {0, 24}, 8);
  ExpectCounts(ledger, 24, 0, 0);
}

TEST(SampleLedgerTest, AStepCommittedTwiceRepeatsItsSamples) {
  SampleLedger ledger;
  ledger.Record({0, 0}, {0, 8}, 8);
  ledger.Record({0, 8}, {0, 16}, 8);
  ledger.Record({0, 8}, {0, 16}, 8);  // offsets 8..15 again
  ExpectCounts(ledger, 24, 8, 0);
  ledger.Record({0, 16}, {0, 24}, 8);
  ExpectCounts(ledger, 32, 8, 0);
}

TEST(SampleLedgerTest, APartialOverlapRepeatsOnlyTheOverlap) {
  SampleLedger ledger;
  ledger.Record({0, 0}, {0, 8}, 8);
  ledger.Record({0, 4}, {0, 12}, 8);  // 4..7 again, 8..11 new
  ExpectCounts(ledger, 16, 4, 0);
}

TEST(SampleLedgerTest, ASkippedRangeIsLostUntilItIsTrained) {
  SampleLedger ledger;
  ledger.Record({0, 0}, {0, 8}, 8);
  ledger.Record({0, 13}, {0, 21}, 8);  // 8..12 passed: 5
  ExpectCounts(ledger, 16, 0, 5);
  // Lost means never trained: the gap trained later is no longer lost, and is no repeat.
  ledger.Record({0, 8}, {0, 13}, 5);
  ExpectCounts(ledger, 21, 0, 0);
}

TEST(SampleLedgerTest, TheRunStartsAtItsFirstRecordedPosition) {
  // A resumed run starts mid-epoch: the offsets before it were trained by the run it resumed.
  SampleLedger ledger;
  ledger.Record({3, 40}, {3, 48}, 8);
  ledger.Record({3, 48}, {3, 56}, 8);
  ExpectCounts(ledger, 16, 0, 0);
}

TEST(SampleLedgerTest, ABatchCrossingIntoTheNextEpochSplitsAtTheEpochEnd) {
  // Epochs of 20 samples, batches of 8: the third batch is 16..19 of epoch 0 and 0..3 of epoch 1.
  SampleLedger ledger;
  ledger.Record({0, 0}, {0, 8}, 8);
  ledger.Record({0, 8}, {0, 16}, 8);
  ledger.Record({0, 16}, {1, 4}, 8);
  ledger.Record({1, 4}, {1, 12}, 8);
  ExpectCounts(ledger, 32, 0, 0);
  // The crossing batch again: all 8 (4 in each epoch) were trained.
  ledger.Record({0, 16}, {1, 4}, 8);
  ExpectCounts(ledger, 40, 8, 0);
}

TEST(SampleLedgerTest, ACrossingBatchTellsWhereTheOldEpochEnded) {
  // The last batch ended at 12 of epoch 0; the next starts at 16 and crosses with 4 samples in
  // epoch 1, so epoch 0 has 16 + 8 - 4 = 20 samples and 12..15 were passed: 4 lost.
  SampleLedger ledger;
  ledger.Record({0, 4}, {0, 12}, 8);
  ledger.Record({0, 16}, {1, 4}, 8);
  ExpectCounts(ledger, 16, 0, 4);
}

TEST(SampleLedgerTest, ARecordStartingInALaterEpochLosesItsHeadButNotTheUnknownTail) {
  // 0..7 of epoch 0, then 4..11 of epoch 1: 0..3 of epoch 1 are lost (4). Where epoch 0 ended is
  // unknown (no batch crossed out of it), so its tail after 8 is not counted.
  SampleLedger ledger;
  ledger.Record({0, 0}, {0, 8}, 8);
  ledger.Record({1, 4}, {1, 12}, 8);
  ExpectCounts(ledger, 16, 0, 4);
}

TEST(SampleLedgerTest, ABatchAcrossSeveralEpochsLocatesOnlyItsLastEpoch) {
  // Epochs of 3 samples, batches of 8 (the cursors Take gives):
  //   {0,0} -> {2,2}: 3 + 3 + 2;  {2,2} -> {5,1}: 1 + 3 + 3 + 1;  {5,1} -> {7,3}: 2 + 3 + 3.
  SampleLedger ledger;
  ASSERT_EQ(Advance({0, 0}, 8, 3), (SamplerCursor{2, 2}));
  ASSERT_EQ(Advance({2, 2}, 8, 3), (SamplerCursor{5, 1}));
  ASSERT_EQ(Advance({5, 1}, 8, 3), (SamplerCursor{7, 3}));
  ledger.Record({0, 0}, {2, 2}, 8);
  ledger.Record({2, 2}, {5, 1}, 8);
  ledger.Record({5, 1}, {7, 3}, 8);
  ExpectCounts(ledger, 24, 0, 0);
  // The last batch again: only its samples in epoch 7 (0..2) are located, so 3 of its 8 count as
  // repeated (the documented approximation for batches across more than one epoch).
  ledger.Record({5, 1}, {7, 3}, 8);
  ExpectCounts(ledger, 32, 3, 0);
}

TEST(SampleLedgerTest, DroppedEpochsKeepTheirLostPositions) {
  // Epochs of 10, batches of 5. Epoch 0: 0..4, then 7..9 with 0..1 of epoch 1 (7..9 start
  // past 5: 5..6 lost, 2).
  SampleLedger ledger;
  ledger.Record({0, 0}, {0, 5}, 5);
  ledger.Record({0, 7}, {1, 2}, 5);
  SamplerCursor cursor = {1, 2};
  for (int i = 0; i < 6; ++i) {  // to {4, 2}
    const SamplerCursor next = Advance(cursor, 5, 10);
    ledger.Record(cursor, next, 5);
    cursor = next;
  }
  ASSERT_EQ(cursor, (SamplerCursor{4, 2}));
  // 8 batches of 5; epoch 0 is dropped by now (only epochs 3 and 4 are kept), its 2 still lost.
  ExpectCounts(ledger, 40, 0, 2);
  // Back into the dropped epoch 0: the ledger no longer knows those offsets, so its 2 samples
  // count as repeated and the lost 5..6 stay lost.
  ledger.Record({0, 5}, {0, 7}, 2);
  ExpectCounts(ledger, 42, 2, 2);
  // Back into epoch 3, which is kept: 2..6 of epoch 3 were trained, exactly 5 repeated.
  ledger.Record({3, 2}, {3, 7}, 5);
  ExpectCounts(ledger, 47, 7, 2);
}

TEST(SampleLedgerTest, InconsistentInputIsClamped) {
  {
    SCOPED_TRACE("negative count, no move");
    SampleLedger ledger;
    ledger.Record({0, 4}, {0, 4}, -3);
    ExpectCounts(ledger, 0, 0, 0);
  }
  {
    SCOPED_TRACE("to before from: the samples follow from");
    SampleLedger ledger;
    ledger.Record({0, 0}, {0, 8}, 8);
    ledger.Record({0, 8}, {0, 2}, 4);  // taken as 8..11
    ledger.Record({0, 12}, {0, 20}, 8);
    ExpectCounts(ledger, 20, 0, 0);
  }
  {
    SCOPED_TRACE("fewer samples than to - from: the rest was passed");
    SampleLedger ledger;
    ledger.Record({0, 0}, {0, 8}, 5);  // 0..4 trained, 5..7 lost
    ExpectCounts(ledger, 5, 0, 3);
  }
  {
    SCOPED_TRACE("more samples than to - from: the surplus is not located");
    SampleLedger ledger;
    ledger.Record({0, 0}, {0, 4}, 6);  // 0..3, and 2 samples nowhere
    ledger.Record({0, 4}, {0, 8}, 4);
    ExpectCounts(ledger, 10, 0, 0);
  }
  {
    SCOPED_TRACE("negative cursor fields count as 0");
    SampleLedger ledger;
    ledger.Record({-1, -5}, {0, 8}, 8);  // {0,0} -> {0,8}
    ledger.Record({0, 8}, {0, 16}, 8);
    ExpectCounts(ledger, 16, 0, 0);
  }
  {
    SCOPED_TRACE("a crossing batch with fewer samples than to.offset");
    SampleLedger ledger;
    ledger.Record({0, 0}, {1, 6}, 4);  // 0..3 of epoch 1; 4..5 of epoch 1 lost
    ExpectCounts(ledger, 4, 0, 2);
  }
}

TEST(SampleLedgerTest, TheRealSamplersCursorsNeitherRepeatNorLose) {
  // 10 samples, batches of 4: batches cross epochs every few steps, and some end exactly at an
  // epoch's end ({1,10} after 20 samples).
  auto sampler = data::EpochSampler::Create(10, /*seed=*/7);
  ASSERT_TRUE(sampler.ok()) << sampler.status();
  SampleLedger ledger;
  SamplerCursor committed;
  for (int step = 0; step < 20; ++step) {
    auto batch = (*sampler)->Take(committed, 4);
    ASSERT_TRUE(batch.ok()) << batch.status();
    ledger.Record(committed, batch->next, static_cast<int64_t>(batch->samples.size()));
    committed = batch->next;
  }
  EXPECT_EQ(committed, (SamplerCursor{7, 10}));  // 80 samples = 8 epochs of 10
  ExpectCounts(ledger, 80, 0, 0);
}

TEST(SampleLedgerTest, AMillionContiguousRecordsStayExact) {
  // Epochs of 1003 (not a multiple of 8, so batches cross epochs at varying offsets).
  constexpr int64_t kEpoch = 1003;
  constexpr int64_t kRecords = 1000000;
  SampleLedger ledger;
  SamplerCursor cursor;
  for (int64_t i = 0; i < kRecords; ++i) {
    const SamplerCursor next = Advance(cursor, 8, kEpoch);
    ledger.Record(cursor, next, 8);
    cursor = next;
  }
  // 8'000'000 = 7976 x 1003 + 72.
  ASSERT_EQ(cursor, (SamplerCursor{7976, 72}));
  ExpectCounts(ledger, 8000000, 0, 0);
  // The last batch again: 8 repeated. Then one starting 3 past the cursor: 3 lost.
  ledger.Record({7976, 64}, {7976, 72}, 8);
  ExpectCounts(ledger, 8000008, 8, 0);
  ledger.Record({7976, 75}, {7976, 83}, 8);
  ExpectCounts(ledger, 8000016, 8, 3);
}

}  // namespace
}  // namespace hetpar::coordinator
