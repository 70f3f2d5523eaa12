#include "common/plan/layout.h"

#include <set>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hetpar::plan {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

Layout Grid(int64_t dp, int64_t tp, int64_t cp = 1, int64_t pp = 1, int64_t offset = 0) {
  Layout l;
  l.dp = dp;
  l.tp = tp;
  l.cp = cp;
  l.pp = pp;
  l.rank_offset = offset;
  return l;
}

TEST(LayoutTest, RankOrderIsTpThenCpThenDpThenPp) {
  const Layout l = Grid(2, 2, 2, 2, 10);
  EXPECT_EQ(l.size(), 16);
  EXPECT_EQ(l.RankOf(0, 0, 0, 0), 10);
  EXPECT_EQ(l.RankOf(0, 1, 0, 0), 11);  // tp fastest
  EXPECT_EQ(l.RankOf(0, 0, 1, 0), 12);  // then cp
  EXPECT_EQ(l.RankOf(1, 0, 0, 0), 14);  // then dp
  EXPECT_EQ(l.RankOf(0, 0, 0, 1), 18);  // then pp
  EXPECT_EQ(l.RankOf(1, 1, 1, 1), 25);
  EXPECT_EQ(l.first_stage_size(), 8);
}

TEST(LayoutTest, PipelineStagesSplitTheLayersEvenly) {
  using Range = std::pair<int64_t, int64_t>;
  EXPECT_EQ(PipelineStageLayers(2, 2, 0), Range(0, 1));
  EXPECT_EQ(PipelineStageLayers(2, 2, 1), Range(1, 2));
  // 4 layers over 3 stages: 1, 1, 2 (never an empty stage).
  EXPECT_EQ(PipelineStageLayers(4, 3, 0), Range(0, 1));
  EXPECT_EQ(PipelineStageLayers(4, 3, 1), Range(1, 2));
  EXPECT_EQ(PipelineStageLayers(4, 3, 2), Range(2, 4));
  for (int64_t layers = 1; layers <= 9; ++layers) {
    for (int64_t stages = 1; stages <= layers; ++stages) {
      int64_t next = 0;
      for (int64_t s = 0; s < stages; ++s) {
        const auto [first, last] = PipelineStageLayers(layers, stages, s);
        EXPECT_EQ(first, next);
        EXPECT_GE(last - first, layers / stages);
        EXPECT_LE(last - first, (layers + stages - 1) / stages);
        next = last;
      }
      EXPECT_EQ(next, layers);
    }
  }
}

TEST(LayoutTest, CoordsRoundTripOverManyGrids) {
  for (int64_t dp = 1; dp <= 3; ++dp) {
    for (int64_t tp = 1; tp <= 3; ++tp) {
      for (int64_t cp = 1; cp <= 3; ++cp) {
        for (int64_t pp = 1; pp <= 3; ++pp) {
          const Layout l = Grid(dp, tp, cp, pp, 7);
          std::set<int64_t> seen;
          for (int64_t d = 0; d < dp; ++d) {
            for (int64_t t = 0; t < tp; ++t) {
              for (int64_t c = 0; c < cp; ++c) {
                for (int64_t p = 0; p < pp; ++p) {
                  const int64_t rank = l.RankOf(d, t, c, p);
                  ASSERT_TRUE(l.Contains(rank));
                  ASSERT_TRUE(seen.insert(rank).second) << rank;
                  const RankCoords back = l.CoordsOf(rank);
                  ASSERT_EQ(back, (RankCoords{d, t, c, p}));
                  // pp = 0 ranks are the contiguous first stage.
                  ASSERT_EQ(p == 0, rank < l.rank_offset + l.first_stage_size());
                }
              }
            }
          }
          EXPECT_EQ(static_cast<int64_t>(seen.size()), l.size());
          EXPECT_EQ(*seen.begin(), 7);
          EXPECT_EQ(*seen.rbegin(), l.end_rank() - 1);
        }
      }
    }
  }
}

TEST(LayoutTest, Groups) {
  const Layout l = Grid(2, 2, 2, 2, 0);
  const int64_t rank = l.RankOf(1, 1, 0, 1);  // 1 + 2 * (0 + 2 * (1 + 2 * 1)) = 13
  ASSERT_EQ(rank, 13);
  EXPECT_THAT(l.TpGroup(rank), ElementsAre(12, 13));
  EXPECT_THAT(l.CpGroup(rank), ElementsAre(13, 15));
  EXPECT_THAT(l.DpGroup(rank), ElementsAre(9, 13));
  EXPECT_THAT(l.PpGroup(rank), ElementsAre(5, 13));
  EXPECT_EQ(l.PpStage(rank), 1);
  EXPECT_THAT(l.ReplicaRanks(1), ElementsAre(4, 5, 6, 7, 12, 13, 14, 15));
}

TEST(LayoutTest, LocateRejectsRanksOutside) {
  const Layout l = Grid(2, 2, 1, 1, 4);
  EXPECT_TRUE(l.Locate(4).ok());
  auto outside = l.Locate(8);
  ASSERT_FALSE(outside.ok());
  EXPECT_THAT(std::string(outside.status().message()), HasSubstr("rank 8"));
  EXPECT_THAT(std::string(outside.status().message()), HasSubstr("[4, 8)"));
}

TEST(LayoutTest, NonColocatedPlacementPutsEncoderFirst) {
  auto placement = MakePlacement(PlacementKind::kNonColocated, Grid(3, 2), Grid(2, 2, 2, 2));
  ASSERT_TRUE(placement.ok()) << placement.status();
  EXPECT_EQ(placement->encoder.rank_offset, 0);
  EXPECT_EQ(placement->llm.rank_offset, 6);
  EXPECT_EQ(placement->world_size, 22);
  EXPECT_TRUE(placement->IsEncoderRank(5));
  EXPECT_FALSE(placement->IsLlmRank(5));
  EXPECT_TRUE(placement->IsLlmRank(6));
  EXPECT_TRUE(placement->IsLlmRank(21));
  EXPECT_FALSE(placement->IsLlmRank(22));
}

TEST(LayoutTest, ColocatedPlacementSharesRanks) {
  auto placement = MakePlacement(PlacementKind::kColocated, Grid(8, 1), Grid(1, 2, 2, 2));
  ASSERT_TRUE(placement.ok()) << placement.status();
  EXPECT_EQ(placement->world_size, 8);
  for (int64_t r = 0; r < 8; ++r) {
    EXPECT_TRUE(placement->IsEncoderRank(r));
    EXPECT_TRUE(placement->IsLlmRank(r));
  }
  auto mismatch = MakePlacement(PlacementKind::kColocated, Grid(3, 1), Grid(1, 2, 2, 1));
  ASSERT_FALSE(mismatch.ok());
  EXPECT_THAT(std::string(mismatch.status().message()), HasSubstr("encoder dp x tp = 3"));
  EXPECT_THAT(std::string(mismatch.status().message()), HasSubstr("= 4"));
}

TEST(LayoutTest, ValidationNamesTheProblem) {
  Layout bad = Grid(2, 0);
  auto a = MakePlacement(PlacementKind::kNonColocated, bad, Grid(1, 1));
  ASSERT_FALSE(a.ok());
  EXPECT_THAT(std::string(a.status().message()), HasSubstr("encoder.layout.tp=0 must be >= 1"));
  auto b = MakePlacement(PlacementKind::kNonColocated, Grid(1, 1, 2), Grid(1, 1));
  ASSERT_FALSE(b.ok());
  EXPECT_THAT(std::string(b.status().message()), HasSubstr("encoder.layout.cp=2"));
  // Sequence parallelism inside the encoder's TP group changes nothing at the boundary: the
  // projector's output is the full rows on every TP rank.
  Layout sp = Grid(1, 2);
  sp.sequence_parallel = true;
  EXPECT_TRUE(MakePlacement(PlacementKind::kNonColocated, sp, Grid(1, 1)).ok());
  // A hand-built placement with overlapping spans.
  Placement overlap;
  overlap.kind = PlacementKind::kNonColocated;
  overlap.encoder = Grid(2, 1, 1, 1, 0);
  overlap.llm = Grid(2, 1, 1, 1, 1);
  overlap.world_size = 4;
  absl::Status s = ValidatePlacement(overlap);
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.message()), HasSubstr("LLM ranks at [2, 4)"));
}

TEST(LayoutTest, FromRunSpec) {
  hetpar::v1::RunSpec spec;
  spec.set_placement(hetpar::v1::PLACEMENT_NON_COLOCATED);
  spec.mutable_encoder()->mutable_layout()->set_dp(2);
  spec.mutable_encoder()->mutable_layout()->set_tp(1);
  spec.mutable_encoder()->mutable_layout()->set_cp(1);
  spec.mutable_encoder()->mutable_layout()->set_pp(1);
  auto* llm = spec.mutable_llm()->mutable_layout();
  llm->set_dp(1);
  llm->set_tp(2);
  llm->set_cp(2);
  llm->set_pp(1);
  llm->set_sequence_parallel(true);
  auto placement = PlacementFromRunSpec(spec);
  ASSERT_TRUE(placement.ok()) << placement.status();
  EXPECT_EQ(placement->llm.rank_offset, 2);
  EXPECT_TRUE(placement->llm.sequence_parallel);
  EXPECT_EQ(placement->world_size, 6);
  spec.set_placement(hetpar::v1::PLACEMENT_UNSPECIFIED);
  EXPECT_FALSE(PlacementFromRunSpec(spec).ok());
}

}  // namespace
}  // namespace hetpar::plan
