#include "coordinator/membership.h"

#include <set>
#include <tuple>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hetpar::coordinator {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

v1::RunSpec Spec(v1::Placement placement, int64_t enc_dp, int64_t enc_tp, int64_t llm_dp,
                 int64_t llm_tp, int64_t llm_cp = 1, int64_t llm_pp = 1) {
  v1::RunSpec spec;
  spec.set_placement(placement);
  auto* e = spec.mutable_encoder()->mutable_layout();
  e->set_dp(enc_dp);
  e->set_tp(enc_tp);
  e->set_cp(1);
  e->set_pp(1);
  auto* l = spec.mutable_llm()->mutable_layout();
  l->set_dp(llm_dp);
  l->set_tp(llm_tp);
  l->set_cp(llm_cp);
  l->set_pp(llm_pp);
  return spec;
}

v1::RegisterRequest Request(v1::WorkerRole role, const std::string& host = "h") {
  v1::RegisterRequest request;
  request.set_role(role);
  request.set_host(host);
  request.set_data_address(host + ":9000");
  return request;
}

TEST(CoordinatesTest, TpFastestThenCpDpPp) {
  GridShape grid{/*dp=*/3, /*tp=*/2, /*cp=*/2, /*pp=*/2};
  std::set<std::tuple<int64_t, int64_t, int64_t, int64_t>> seen;
  for (int64_t rank = 0; rank < grid.size(); ++rank) {
    const v1::RankCoordinates c = CoordinatesOf(v1::MODULE_LLM, grid, rank);
    EXPECT_EQ(c.rank(), rank);
    EXPECT_EQ(c.module(), v1::MODULE_LLM);
    EXPECT_EQ(c.tp() + grid.tp * (c.cp() + grid.cp * (c.dp() + grid.dp * c.pp())), rank)
        << "rank " << rank;
    EXPECT_LT(c.tp(), grid.tp);
    EXPECT_LT(c.cp(), grid.cp);
    EXPECT_LT(c.dp(), grid.dp);
    EXPECT_LT(c.pp(), grid.pp);
    seen.insert({c.dp(), c.tp(), c.cp(), c.pp()});
  }
  EXPECT_EQ(static_cast<int64_t>(seen.size()), grid.size());
  const v1::RankCoordinates r5 = CoordinatesOf(v1::MODULE_LLM, grid, 5);
  EXPECT_EQ(r5.tp(), 1);
  EXPECT_EQ(r5.cp(), 0);
  EXPECT_EQ(r5.dp(), 1);
  EXPECT_EQ(r5.pp(), 0);
}

TEST(MembershipTest, NonColocatedAdmitsIntoLowestFreeRankPerRole) {
  auto m = Membership::Create(Spec(v1::PLACEMENT_NON_COLOCATED, 2, 1, 1, 2));
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->expected_workers(), 4);
  EXPECT_THAT(
      m->Missing(),
      ElementsAre("encoder rank 0 (dp 0, tp 0)", "encoder rank 1 (dp 1, tp 0)",
                  "llm rank 0 (dp 0, tp 0, cp 0, pp 0)", "llm rank 1 (dp 0, tp 1, cp 0, pp 0)"));
  auto e0 = m->Admit(Request(v1::WORKER_ROLE_ENCODER, "a"), 1, absl::UnixEpoch());
  auto l0 = m->Admit(Request(v1::WORKER_ROLE_LLM, "b"), 1, absl::UnixEpoch());
  auto e1 = m->Admit(Request(v1::WORKER_ROLE_ENCODER, "c"), 1, absl::UnixEpoch());
  ASSERT_TRUE(e0.ok() && l0.ok() && e1.ok());
  EXPECT_EQ((*e0)->slot, 0);
  EXPECT_EQ((*e1)->slot, 1);
  EXPECT_EQ((*l0)->slot, 0);
  ASSERT_EQ((*e1)->ranks.size(), 1u);
  EXPECT_EQ((*e1)->ranks[0].module(), v1::MODULE_ENCODER);
  EXPECT_EQ((*e1)->ranks[0].dp(), 1);
  // World ranks: encoder ranks first, then the LLM's.
  EXPECT_EQ((*e0)->world_rank, 0);
  EXPECT_EQ((*e1)->world_rank, 1);
  EXPECT_EQ((*l0)->world_rank, 2);
  EXPECT_EQ((*e0)->worker_id, "enc0-1");
  EXPECT_EQ((*l0)->worker_id, "llm0-2");
  EXPECT_EQ((*e1)->worker_id, "enc1-3");
  EXPECT_FALSE(m->Complete());
  EXPECT_THAT(m->Missing(), ElementsAre("llm rank 1 (dp 0, tp 1, cp 0, pp 0)"));

  auto third = m->Admit(Request(v1::WORKER_ROLE_ENCODER), 1, absl::UnixEpoch());
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(third.status().message()), HasSubstr("every encoder rank is taken"));

  auto colocated = m->Admit(Request(v1::WORKER_ROLE_COLOCATED), 1, absl::UnixEpoch());
  EXPECT_EQ(colocated.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(colocated.status().message()), HasSubstr("expected role encoder or llm"));

  auto l1 = m->Admit(Request(v1::WORKER_ROLE_LLM, "d"), 1, absl::UnixEpoch());
  ASSERT_TRUE(l1.ok());
  EXPECT_TRUE(m->Complete());
  EXPECT_TRUE(m->Missing().empty());
  EXPECT_EQ(m->alive_workers(), 4);

  // A dead worker frees its rank; the next one of its role takes it.
  m->MarkDead("enc0-1", "no heartbeat");
  EXPECT_FALSE(m->Complete());
  EXPECT_THAT(m->Missing(), ElementsAre("encoder rank 0 (dp 0, tp 0)"));
  EXPECT_FALSE(m->Find("enc0-1")->alive);
  EXPECT_EQ(m->Find("enc0-1")->dead_reason, "no heartbeat");
  auto replacement = m->Admit(Request(v1::WORKER_ROLE_ENCODER, "e"), 2, absl::UnixEpoch());
  ASSERT_TRUE(replacement.ok());
  EXPECT_EQ((*replacement)->slot, 0);
  EXPECT_EQ((*replacement)->generation, 2);
  EXPECT_TRUE(m->Complete());
  EXPECT_EQ(m->workers().size(), 5u);
}

TEST(MembershipTest, RequestedRank) {
  auto m = Membership::Create(Spec(v1::PLACEMENT_NON_COLOCATED, 4, 1, 1, 1));
  ASSERT_TRUE(m.ok());
  v1::RegisterRequest request = Request(v1::WORKER_ROLE_ENCODER);
  request.set_requested_rank(2);
  auto w = m->Admit(request, 1, absl::UnixEpoch());
  ASSERT_TRUE(w.ok());
  EXPECT_EQ((*w)->slot, 2);
  auto again = m->Admit(request, 1, absl::UnixEpoch());
  EXPECT_EQ(again.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(std::string(again.status().message()), HasSubstr("encoder rank 2 is already held"));
  request.set_requested_rank(4);
  auto out_of_range = m->Admit(request, 1, absl::UnixEpoch());
  EXPECT_EQ(out_of_range.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(out_of_range.status().message()), HasSubstr("expected 0..3"));
  // Unrequested admissions skip the taken rank.
  auto a = m->Admit(Request(v1::WORKER_ROLE_ENCODER), 1, absl::UnixEpoch());
  auto b = m->Admit(Request(v1::WORKER_ROLE_ENCODER), 1, absl::UnixEpoch());
  auto c = m->Admit(Request(v1::WORKER_ROLE_ENCODER), 1, absl::UnixEpoch());
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_EQ((*a)->slot, 0);
  EXPECT_EQ((*b)->slot, 1);
  EXPECT_EQ((*c)->slot, 3);
}

TEST(MembershipTest, PeersAreTheBoundaryRanksAndPipelineNeighbours) {
  // Encoder dp 2; LLM tp 2 x pp 2: only the first pipeline stage talks to the encoder.
  auto m = Membership::Create(Spec(v1::PLACEMENT_NON_COLOCATED, 2, 1, 1, 2, 1, 2));
  ASSERT_TRUE(m.ok());
  std::vector<WorkerRecord*> llm;
  std::vector<WorkerRecord*> enc;
  for (int i = 0; i < 4; ++i) llm.push_back(*m->Admit(Request(v1::WORKER_ROLE_LLM), 1, {}));
  for (int i = 0; i < 2; ++i) enc.push_back(*m->Admit(Request(v1::WORKER_ROLE_ENCODER), 1, {}));
  auto ids = [](const std::vector<const WorkerRecord*>& peers) {
    std::vector<std::string> out;
    for (const auto* p : peers) out.push_back(p->worker_id);
    return out;
  };
  // LLM ranks 0, 1 are pp 0; ranks 2, 3 are pp 1.
  EXPECT_THAT(ids(m->PeersOf(*enc[0])), ElementsAre(llm[0]->worker_id, llm[1]->worker_id));
  // A first-stage LLM rank also talks to its next stage (same dp and tp), a later stage only to
  // its neighbours.
  EXPECT_THAT(ids(m->PeersOf(*llm[1])),
              ElementsAre(enc[0]->worker_id, enc[1]->worker_id, llm[3]->worker_id));
  EXPECT_THAT(ids(m->PeersOf(*llm[2])), ElementsAre(llm[0]->worker_id));
  const v1::PeerInfo info = m->PeerInfoOf(*llm[3]);
  EXPECT_EQ(info.worker_id(), llm[3]->worker_id);
  EXPECT_EQ(info.ranks(0).pp(), 1);
  EXPECT_EQ(info.ranks(0).tp(), 1);
  EXPECT_EQ(info.data_address(), "h:9000");
  EXPECT_EQ(info.world_rank(), 2 + 3);
  // Dead peers are not listed.
  m->MarkDead(llm[0]->worker_id, "gone");
  EXPECT_THAT(ids(m->PeersOf(*enc[1])), ElementsAre(llm[1]->worker_id));
}

TEST(MembershipTest, ColocatedWorkersHoldARankOfBothModules) {
  auto m = Membership::Create(Spec(v1::PLACEMENT_COLOCATED, 2, 2, 1, 4));
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->expected_workers(), 4);
  EXPECT_THAT(m->roles(), ElementsAre(v1::WORKER_ROLE_COLOCATED));
  auto w = m->Admit(Request(v1::WORKER_ROLE_COLOCATED), 1, {});
  ASSERT_TRUE(w.ok());
  ASSERT_EQ((*w)->ranks.size(), 2u);
  EXPECT_EQ((*w)->ranks[0].module(), v1::MODULE_ENCODER);
  EXPECT_EQ((*w)->ranks[1].module(), v1::MODULE_LLM);
  auto w3 = m->Admit(Request(v1::WORKER_ROLE_COLOCATED), 1, {});
  auto w2 = m->Admit(Request(v1::WORKER_ROLE_COLOCATED), 1, {});
  auto w1 = m->Admit(Request(v1::WORKER_ROLE_COLOCATED), 1, {});
  ASSERT_TRUE(w1.ok() && w2.ok() && w3.ok());
  EXPECT_EQ((*w1)->world_rank, 3);
  // Slot 3: encoder dp 1 tp 1; llm dp 0 tp 3.
  EXPECT_EQ((*w1)->ranks[0].dp(), 1);
  EXPECT_EQ((*w1)->ranks[0].tp(), 1);
  EXPECT_EQ((*w1)->ranks[1].tp(), 3);
  EXPECT_EQ(m->PeersOf(**w).size(), 3u);
  EXPECT_EQ(m->Admit(Request(v1::WORKER_ROLE_LLM), 1, {}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(MembershipTest, DataAddressText) {
  EXPECT_EQ(DataAddressText("10.0.0.1:7000"), "10.0.0.1:7000");
  EXPECT_EQ(DataAddressText(std::string("\x00\x01ucx\xff", 6)), "<6-byte address>");
  EXPECT_EQ(DataAddressText(""), "-");
}

TEST(MembershipTest, ColocatedNeedsEqualWorlds) {
  auto m = Membership::Create(Spec(v1::PLACEMENT_COLOCATED, 2, 1, 1, 4));
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(m.status().message()), HasSubstr("encoder 2 ranks, llm 4 ranks"));
}

}  // namespace
}  // namespace hetpar::coordinator

namespace hetpar::coordinator {
namespace {

TEST(MembershipTest, ARetiredEncoderReplicaIsNeitherMissingNorTakenAgain) {
  auto m = Membership::Create(Spec(v1::PLACEMENT_NON_COLOCATED, 3, 2, 1, 1));
  ASSERT_TRUE(m.ok());
  std::vector<WorkerRecord*> encoders;
  for (int i = 0; i < 6; ++i) {
    auto w = m->Admit(Request(v1::WORKER_ROLE_ENCODER), 1, absl::UnixEpoch());
    ASSERT_TRUE(w.ok());
    encoders.push_back(*w);
  }
  ASSERT_TRUE(m->Admit(Request(v1::WORKER_ROLE_LLM), 1, absl::UnixEpoch()).ok());
  EXPECT_THAT(m->Replicas(v1::MODULE_ENCODER), ElementsAre(0, 1, 2));
  EXPECT_EQ(Membership::ReplicaOf(*encoders[3], v1::MODULE_ENCODER), 1);  // rank 3: dp 1, tp 1
  // Replica 1 (ranks 2 and 3) leaves.
  m->MarkDead(encoders[3]->worker_id, "killed");
  m->MarkDead(encoders[2]->worker_id, "its replica left");
  EXPECT_FALSE(m->Complete());
  m->RetireReplica(v1::MODULE_ENCODER, 1);
  EXPECT_TRUE(m->Complete());
  EXPECT_TRUE(m->Missing().empty());
  EXPECT_THAT(m->Replicas(v1::MODULE_ENCODER), ElementsAre(0, 2));
  EXPECT_THAT(m->Replicas(v1::MODULE_LLM), ElementsAre(0));
  auto again = m->Admit(Request(v1::WORKER_ROLE_ENCODER), 2, absl::UnixEpoch());
  EXPECT_EQ(again.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(again.status().message()), HasSubstr("admit no one now"));
  v1::RegisterRequest asked = Request(v1::WORKER_ROLE_ENCODER);
  asked.set_requested_rank(2);
  again = m->Admit(asked, 2, absl::UnixEpoch());
  EXPECT_EQ(again.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(again.status().message()), HasSubstr("encoder replica 1"));
  // Another replica's free rank is still taken.
  m->MarkDead(encoders[5]->worker_id, "killed");
  auto replacement = m->Admit(Request(v1::WORKER_ROLE_ENCODER), 2, absl::UnixEpoch());
  ASSERT_TRUE(replacement.ok()) << replacement.status();
  EXPECT_EQ((*replacement)->slot, 5);
}

// An open encoder replica admits joining workers after the replicas in the run are full; it
// joins once all its ranks are registered with open sessions, and its workers then train.
TEST(MembershipTest, AnOpenEncoderReplicaAdmitsJoiningWorkersAndJoinsWhenComplete) {
  auto m = Membership::Create(Spec(v1::PLACEMENT_NON_COLOCATED, 2, 2, 1, 1));  // encoder 2 x tp 2
  ASSERT_TRUE(m.ok());
  m->RetireReplica(v1::MODULE_ENCODER, 1);
  m->SetOpen(v1::MODULE_ENCODER, 0, true);  // a replica in the run is never open
  EXPECT_TRUE(m->OpenReplicas(v1::MODULE_ENCODER).empty());
  m->SetOpen(v1::MODULE_ENCODER, 1, true);
  EXPECT_THAT(m->OpenReplicas(v1::MODULE_ENCODER), ElementsAre(1));
  std::vector<WorkerRecord*> encoders;
  for (int i = 0; i < 4; ++i) {
    auto w = m->Admit(Request(v1::WORKER_ROLE_ENCODER), 1, absl::UnixEpoch());
    ASSERT_TRUE(w.ok()) << w.status();
    encoders.push_back(*w);
  }
  ASSERT_TRUE(m->Admit(Request(v1::WORKER_ROLE_LLM), 1, absl::UnixEpoch()).ok());
  // Replica 0's ranks first, then the open replica's, joining.
  EXPECT_EQ(encoders[1]->slot, 1);
  EXPECT_FALSE(encoders[1]->joining);
  EXPECT_EQ(encoders[2]->slot, 2);
  EXPECT_TRUE(encoders[2]->joining);
  EXPECT_TRUE(encoders[3]->joining);
  EXPECT_EQ(m->joining_workers(), 2);
  EXPECT_TRUE(m->Complete());  // the joiners are not waited for
  EXPECT_EQ(m->TrainingWorkers().size(), 3u);
  EXPECT_FALSE(m->ReadyToJoin(v1::MODULE_ENCODER, 1));  // sessions not open yet
  encoders[2]->session_open = true;
  EXPECT_FALSE(m->ReadyToJoin(v1::MODULE_ENCODER, 1));
  encoders[3]->session_open = true;
  EXPECT_TRUE(m->ReadyToJoin(v1::MODULE_ENCODER, 1));
  EXPECT_THAT(m->Activate(v1::MODULE_ENCODER, 1), ElementsAre(encoders[2], encoders[3]));
  EXPECT_THAT(m->Replicas(v1::MODULE_ENCODER), ElementsAre(0, 1));
  EXPECT_TRUE(m->OpenReplicas(v1::MODULE_ENCODER).empty());
  EXPECT_EQ(m->joining_workers(), 0);
  EXPECT_EQ(m->TrainingWorkers().size(), 5u);
  // A replica retired again (the pool shrank): its live workers no longer train.
  m->RetireReplica(v1::MODULE_ENCODER, 1);
  EXPECT_EQ(m->TrainingWorkers().size(), 3u);
  EXPECT_EQ(m->LiveWorkers().size(), 5u);
}

TEST(MembershipTest, ARetiredLlmReplicaTakesAllItsRanksOut) {
  // llm dp 2 x tp 2 x pp 2: replica 1 holds slots 2, 3 (stage 0) and 6, 7 (stage 1).
  auto m = Membership::Create(Spec(v1::PLACEMENT_NON_COLOCATED, 1, 1, 2, 2, 1, 2));
  ASSERT_TRUE(m.ok());
  ASSERT_TRUE(m->Admit(Request(v1::WORKER_ROLE_ENCODER), 1, absl::UnixEpoch()).ok());
  std::vector<WorkerRecord*> llm;
  for (int i = 0; i < 8; ++i) {
    auto w = m->Admit(Request(v1::WORKER_ROLE_LLM), 1, absl::UnixEpoch());
    ASSERT_TRUE(w.ok());
    llm.push_back(*w);
  }
  EXPECT_EQ(Membership::ReplicaOf(*llm[6], v1::MODULE_LLM), 1);
  EXPECT_EQ(Membership::ReplicaOf(*llm[5], v1::MODULE_LLM), 0);
  for (int slot : {2, 3, 6, 7}) m->MarkDead(llm[slot]->worker_id, "gone");
  EXPECT_FALSE(m->Complete());
  m->RetireReplica(v1::MODULE_LLM, 1);
  EXPECT_TRUE(m->Complete());
  EXPECT_THAT(m->Replicas(v1::MODULE_LLM), ElementsAre(0));
  auto again = m->Admit(Request(v1::WORKER_ROLE_LLM), 2, absl::UnixEpoch());
  EXPECT_EQ(again.status().code(), absl::StatusCode::kResourceExhausted);
}

}  // namespace
}  // namespace hetpar::coordinator
