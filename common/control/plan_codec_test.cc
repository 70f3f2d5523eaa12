#include "common/control/plan_codec.h"

#include "common/plan/synthetic_batch.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hetpar::coordinator {
namespace {

using ::testing::HasSubstr;

void ExpectSame(const plan::RankStepPlan& a, const plan::RankStepPlan& b) {
  EXPECT_EQ(a.rank, b.rank);
  EXPECT_EQ(a.step, b.step);
  EXPECT_EQ(a.generation, b.generation);
  EXPECT_EQ(a.attempt, b.attempt);
  EXPECT_EQ(a.waves, b.waves);
  EXPECT_EQ(a.n_global, b.n_global);
  EXPECT_EQ(a.seq_len, b.seq_len);
  EXPECT_EQ(a.row_bytes, b.row_bytes);
  EXPECT_EQ(a.encoder_role, b.encoder_role);
  EXPECT_TRUE(a.encoder_coords == b.encoder_coords);
  EXPECT_TRUE(a.encoder_jobs == b.encoder_jobs);
  EXPECT_TRUE(a.forward_sends == b.forward_sends);
  EXPECT_TRUE(a.backward_receives == b.backward_receives);
  EXPECT_TRUE(a.encoder_shares == b.encoder_shares);
  EXPECT_EQ(a.llm_role, b.llm_role);
  EXPECT_TRUE(a.llm_coords == b.llm_coords);
  EXPECT_TRUE(a.microbatches == b.microbatches);
  EXPECT_EQ(a.image_rows, b.image_rows);
  EXPECT_TRUE(a.forward_receives == b.forward_receives);
  EXPECT_TRUE(a.backward_sends == b.backward_sends);
  EXPECT_TRUE(a.llm_shares == b.llm_shares);
  EXPECT_EQ(a.sample_indices, b.sample_indices);
  EXPECT_TRUE(a.samples == b.samples);
}

// A step plan with encoder TP (encoder shares), LLM TP x CP without SP (pieces split over CP
// ranks, LLM shares) and several waves.
plan::StepPlan MakePlan(plan::PlacementKind kind) {
  plan::Layout encoder;
  encoder.dp = kind == plan::PlacementKind::kColocated ? 4 : 3;
  encoder.tp = 2;
  plan::Layout llm;
  llm.dp = 2;
  llm.tp = 2;
  llm.cp = 2;
  auto placement = plan::MakePlacement(kind, encoder, llm);
  EXPECT_TRUE(placement.ok()) << placement.status();
  plan::SyntheticBatchOptions batch;
  batch.samples = 8;
  batch.tokens_per_image = 16;
  batch.seq_len = 128;
  batch.max_images = 3;
  auto samples = plan::SyntheticBatch(batch);
  EXPECT_TRUE(samples.ok()) << samples.status();
  // Checksums as a data index gives them, the top bit set in some (fixed32 on the wire).
  for (size_t i = 0; i < samples->size(); ++i) {
    (*samples)[i].id_checksum = 0x9e3779b9u * static_cast<uint32_t>(i + 1);
    (*samples)[i].token_checksum = 0x85ebca6bu * static_cast<uint32_t>(i + 3);
  }
  plan::StepPlanOptions options;
  options.step = 5;
  options.generation = 2;
  options.seed = 11;
  options.waves = 2;
  options.micro_batch = 2;
  options.seq_len = 128;
  options.row_bytes = 256;
  options.encoder_cost.per_token = 1;
  options.llm_cost.per_token = 1;
  auto step_plan = plan::BuildStepPlan(*placement, *samples, options);
  EXPECT_TRUE(step_plan.ok()) << step_plan.status();
  return *step_plan;
}

TEST(PlanCodecTest, EveryRankRoundTripsThroughTheWire) {
  for (auto kind : {plan::PlacementKind::kNonColocated, plan::PlacementKind::kColocated}) {
    const plan::StepPlan step_plan = MakePlan(kind);
    int64_t transfers = 0;
    int64_t shares = 0;
    for (int64_t rank = 0; rank < step_plan.placement.world_size; ++rank) {
      auto original = plan::ExtractRankPlan(step_plan, rank);
      ASSERT_TRUE(original.ok()) << original.status();
      original->attempt = 17 + rank;  // as the coordinator sets it
      const v1::RankStepPlan proto = RankStepPlanToProto(*original);
      EXPECT_EQ(proto.attempt(), 17 + rank);
      v1::RankStepPlan parsed;
      ASSERT_TRUE(parsed.ParseFromString(proto.SerializeAsString()));
      auto decoded = RankStepPlanFromProto(parsed);
      ASSERT_TRUE(decoded.ok()) << decoded.status();
      ExpectSame(*original, *decoded);
      transfers +=
          static_cast<int64_t>(original->forward_sends.size() + original->forward_receives.size());
      shares += static_cast<int64_t>(original->llm_shares.size() + original->encoder_shares.size());
    }
    // The plans exercised every kind of entry.
    EXPECT_GT(transfers, 0);
    EXPECT_GT(shares, 0);
  }
}

TEST(PlanCodecTest, InconsistentMessagesAreRejected) {
  const plan::StepPlan step_plan = MakePlan(plan::PlacementKind::kNonColocated);
  // An LLM rank of the first stage: it receives transfers.
  auto original = plan::ExtractRankPlan(step_plan, step_plan.placement.llm.rank_offset);
  ASSERT_TRUE(original.ok());
  ASSERT_FALSE(original->forward_receives.empty());
  v1::RankStepPlan proto = RankStepPlanToProto(*original);

  v1::RankStepPlan missing_sample = proto;
  missing_sample.mutable_forward_receives(0)->mutable_pieces(0)->set_sample(1000);
  auto a = RankStepPlanFromProto(missing_sample);
  EXPECT_EQ(a.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(a.status().message()),
              HasSubstr("forward_receives names batch index 1000"));

  v1::RankStepPlan unsorted = proto;
  ASSERT_GE(unsorted.sample_indices_size(), 2);
  unsorted.set_sample_indices(1, unsorted.sample_indices(0));
  EXPECT_EQ(RankStepPlanFromProto(unsorted).status().code(), absl::StatusCode::kInvalidArgument);

  v1::RankStepPlan short_samples = proto;
  short_samples.mutable_samples()->RemoveLast();
  EXPECT_THAT(std::string(RankStepPlanFromProto(short_samples).status().message()),
              HasSubstr("one descriptor per index"));

  v1::RankStepPlan bad_module = proto;
  ASSERT_GT(bad_module.llm_shares_size(), 0);
  bad_module.mutable_llm_shares(0)->set_module(v1::MODULE_UNSPECIFIED);
  EXPECT_THAT(std::string(RankStepPlanFromProto(bad_module).status().message()),
              HasSubstr("llm_shares.module=0"));
}

}  // namespace
}  // namespace hetpar::coordinator
