#include "common/worker/launch_options.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <vector>

namespace hetpar::worker {
namespace {

using ::testing::HasSubstr;

TEST(RequestedRankTest, NothingGivenLetsTheCoordinatorPick) {
  auto rank = RequestedRank({});
  ASSERT_TRUE(rank.ok()) << rank.status();
  EXPECT_FALSE(rank->has_value());
}

TEST(RequestedRankTest, DirectRank) {
  RankRequest r;
  r.rank = 5;
  auto rank = RequestedRank(r);
  ASSERT_TRUE(rank.ok()) << rank.status();
  EXPECT_EQ(**rank, 5);
}

TEST(RequestedRankTest, ReplicaTimesRanksPerReplicaPlusLocalRank) {
  // Pod 3 of an LLM StatefulSet at tp 4, its container 2: rank 3 * 4 + 2 = 14.
  RankRequest r;
  r.replica = 3;
  r.ranks_per_replica = 4;
  r.local_rank = 2;
  auto rank = RequestedRank(r);
  ASSERT_TRUE(rank.ok()) << rank.status();
  EXPECT_EQ(**rank, 14);
  r.replica = 0;
  r.local_rank = 0;
  EXPECT_EQ(**RequestedRank(r), 0);
}

TEST(RequestedRankTest, WithPipelineStagesAPodHoldsOneDpReplicasRanksOfEveryStage) {
  // An LLM at dp 2, tp 2, pp 2: its ranks are tp + 2 * (dp + 2 * pp) (pp outermost), so DP
  // replica 0 holds ranks 0, 1 (stage 0) and 4, 5 (stage 1), replica 1 ranks 2, 3 and 6, 7.
  const std::vector<std::vector<int64_t>> expected = {{0, 1, 4, 5}, {2, 3, 6, 7}};
  for (int64_t replica = 0; replica < 2; ++replica) {
    std::vector<int64_t> ranks;
    for (int64_t local = 0; local < 4; ++local) {
      RankRequest r;
      r.replica = replica;
      r.ranks_per_replica = 4;
      r.local_rank = local;
      r.replicas = 2;
      r.pipeline_stages = 2;
      auto rank = RequestedRank(r);
      ASSERT_TRUE(rank.ok()) << rank.status();
      ranks.push_back(**rank);
    }
    EXPECT_EQ(ranks, expected[replica]) << "replica " << replica;
  }
  RankRequest uneven;
  uneven.replica = 0;
  uneven.ranks_per_replica = 3;
  uneven.local_rank = 0;
  uneven.replicas = 2;
  uneven.pipeline_stages = 2;
  EXPECT_THAT(RequestedRank(uneven).status().message(),
              HasSubstr("--ranks-per-replica=3 does not split into --pipeline-stages=2"));
  RankRequest no_replicas = uneven;
  no_replicas.ranks_per_replica = 4;
  no_replicas.replicas = -1;
  EXPECT_THAT(RequestedRank(no_replicas).status().message(), HasSubstr("needs --replicas"));
}

TEST(RequestedRankTest, RefusesMixedHalfGivenAndOutOfRange) {
  RankRequest mixed;
  mixed.rank = 1;
  mixed.replica = 0;
  EXPECT_THAT(RequestedRank(mixed).status().message(), HasSubstr("both given"));
  RankRequest half;
  half.replica = 2;
  EXPECT_THAT(RequestedRank(half).status().message(), HasSubstr("go together"));
  RankRequest beyond;
  beyond.replica = 1;
  beyond.ranks_per_replica = 2;
  beyond.local_rank = 2;
  EXPECT_THAT(RequestedRank(beyond).status().message(),
              HasSubstr("--local-rank=2 must be below --ranks-per-replica=2"));
}

TEST(InterfaceAddressTest, LoopbackIs127001) {
  auto address = InterfaceAddress("lo");
  ASSERT_TRUE(address.ok()) << address.status();
  EXPECT_EQ(*address, "127.0.0.1");
}

TEST(InterfaceAddressTest, UnknownInterfaceListsTheOthers) {
  auto address = InterfaceAddress("no-such-if0");
  ASSERT_FALSE(address.ok());
  EXPECT_THAT(address.status().message(), HasSubstr("'no-such-if0'"));
  EXPECT_THAT(address.status().message(), HasSubstr("lo"));
}

}  // namespace
}  // namespace hetpar::worker
