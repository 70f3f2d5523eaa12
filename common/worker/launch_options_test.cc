#include "common/worker/launch_options.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

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
