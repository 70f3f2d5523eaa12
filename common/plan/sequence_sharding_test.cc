#include "common/plan/sequence_sharding.h"

#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hetpar::plan {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// The rule written out position by position, independent of the implementation.
struct Owner {
  int64_t cp_rank;
  int64_t tp_rank;  // -1 without SP
  int64_t local;    // index in the owner's local sequence
};

Owner BruteForceOwner(int64_t seq_len, int64_t cp, int64_t tp, bool sp, int64_t pos) {
  int64_t cp_rank = 0;
  int64_t cp_local = pos;
  if (cp > 1) {
    const int64_t chunk_len = seq_len / (2 * cp);
    const int64_t chunk = pos / chunk_len;
    const bool first_half = chunk < cp;
    cp_rank = first_half ? chunk : 2 * cp - 1 - chunk;
    cp_local = (first_half ? 0 : chunk_len) + pos % chunk_len;
  }
  if (!sp) return {cp_rank, -1, cp_local};
  const int64_t piece = seq_len / cp / tp;
  return {cp_rank, cp_local / piece, cp_local % piece};
}

TEST(SequenceShardingTest, LoadBalancedChunks) {
  using Chunks = std::pair<int64_t, int64_t>;
  EXPECT_EQ(LoadBalancedChunks(4, 0), Chunks(0, 7));
  EXPECT_EQ(LoadBalancedChunks(4, 3), Chunks(3, 4));
}

TEST(SequenceShardingTest, CpTwoWithoutSp) {
  auto s = SequenceSharding::Create(16, 2, 4, false);
  ASSERT_TRUE(s.ok()) << s.status();
  // Chunks of 4: rank 0 owns chunks 0 and 3, rank 1 owns chunks 1 and 2 (adjacent: one range).
  EXPECT_THAT(s->Ranges(0, 0), ElementsAre(PositionRange{0, 4}, PositionRange{12, 16}));
  EXPECT_THAT(s->Ranges(0, 3), ElementsAre(PositionRange{0, 4}, PositionRange{12, 16}));
  EXPECT_THAT(s->Ranges(1, 2), ElementsAre(PositionRange{4, 12}));
  EXPECT_EQ(s->shard_length(), 8);
}

TEST(SequenceShardingTest, CpTwoWithSp) {
  auto s = SequenceSharding::Create(24, 2, 3, true);
  ASSERT_TRUE(s.ok()) << s.status();
  // Chunks of 6; CP rank 0's local sequence is [0,6) ++ [18,24), cut into 3 pieces of 4.
  EXPECT_THAT(s->Ranges(0, 0), ElementsAre(PositionRange{0, 4}));
  EXPECT_THAT(s->Ranges(0, 1), ElementsAre(PositionRange{4, 6}, PositionRange{18, 20}));
  EXPECT_THAT(s->Ranges(0, 2), ElementsAre(PositionRange{20, 24}));
  EXPECT_THAT(s->Ranges(1, 0), ElementsAre(PositionRange{6, 10}));
  EXPECT_EQ(s->shard_length(), 4);
}

TEST(SequenceShardingTest, EveryPositionHasExactlyOneOwnerAsTheRuleSays) {
  int64_t checked = 0;
  for (int64_t cp = 1; cp <= 4; ++cp) {
    for (int64_t tp = 1; tp <= 4; ++tp) {
      for (bool sp : {false, true}) {
        for (int64_t units = 1; units <= 3; ++units) {
          const int64_t seq_len = units * 2 * cp * tp;
          auto s = SequenceSharding::Create(seq_len, cp, tp, sp);
          ASSERT_TRUE(s.ok()) << s.status();
          std::vector<int> hits(seq_len, 0);
          for (int64_t c = 0; c < cp; ++c) {
            for (int64_t t = 0; t < tp; ++t) {
              int64_t local = 0;
              int64_t length = 0;
              for (const PositionRange& r : s->Ranges(c, t)) {
                ASSERT_LT(r.begin, r.end);
                for (int64_t pos = r.begin; pos < r.end; ++pos, ++local) {
                  const Owner o = BruteForceOwner(seq_len, cp, tp, sp, pos);
                  ASSERT_EQ(o.cp_rank, c) << "pos " << pos;
                  if (sp) {
                    ASSERT_EQ(o.tp_rank, t) << "pos " << pos;
                  }
                  ASSERT_EQ(o.local, local) << "pos " << pos;
                  if (!sp && t > 0) continue;  // replicated: count once
                  ++hits[pos];
                }
                length += r.size();
              }
              ASSERT_EQ(length, s->shard_length());
            }
          }
          for (int64_t pos = 0; pos < seq_len; ++pos) ASSERT_EQ(hits[pos], 1) << pos;
          // Segments cover the sequence in order and agree with the rule.
          int64_t next = 0;
          for (const auto& seg : s->segments()) {
            ASSERT_EQ(seg.begin, next);
            for (int64_t pos = seg.begin; pos < seg.end; ++pos) {
              const Owner o = BruteForceOwner(seq_len, cp, tp, sp, pos);
              ASSERT_EQ(o.cp_rank, seg.cp_rank);
              ASSERT_EQ(o.tp_rank, seg.tp_rank);
              ASSERT_EQ(o.local, seg.local_begin + pos - seg.begin);
              ASSERT_EQ(&s->segments()[s->SegmentOf(pos)], &seg);
            }
            next = seg.end;
          }
          ASSERT_EQ(next, seq_len);
          ++checked;
        }
      }
    }
  }
  EXPECT_EQ(checked, 96);
}

TEST(SequenceShardingTest, CausalWorkIsBalancedOverCpRanks) {
  // Causal attention cost of position p is p + 1; chunk pairing makes CP ranks equal.
  const int64_t cp = 4;
  const int64_t seq_len = 64;
  auto s = SequenceSharding::Create(seq_len, cp, 1, false);
  ASSERT_TRUE(s.ok());
  std::vector<int64_t> work(cp, 0);
  for (int64_t c = 0; c < cp; ++c) {
    for (const PositionRange& r : s->Ranges(c, 0)) {
      for (int64_t p = r.begin; p < r.end; ++p) work[c] += p + 1;
    }
  }
  for (int64_t c = 1; c < cp; ++c) EXPECT_EQ(work[c], work[0]);
}

TEST(SequenceShardingTest, RejectsUnshardableLengths) {
  auto a = SequenceSharding::Create(10, 2, 1, false);
  ASSERT_FALSE(a.ok());
  EXPECT_THAT(std::string(a.status().message()), HasSubstr("seq_len=10"));
  EXPECT_THAT(std::string(a.status().message()), HasSubstr("2 x cp=4"));
  auto b = SequenceSharding::Create(12, 1, 5, true);
  ASSERT_FALSE(b.ok());
  EXPECT_THAT(std::string(b.status().message()), HasSubstr("not a multiple of tp=5"));
  EXPECT_TRUE(SequenceSharding::Create(12, 1, 5, false).ok());
  EXPECT_FALSE(SequenceSharding::Create(0, 1, 1, false).ok());
}

}  // namespace
}  // namespace hetpar::plan
