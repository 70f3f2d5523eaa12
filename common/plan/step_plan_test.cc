#include "common/plan/step_plan.h"

#include <map>
#include <set>

#include "common/plan/synthetic_batch.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hetpar::plan {
namespace {

using ::testing::HasSubstr;

hetpar::v1::RunSpec TinySpec() {
  hetpar::v1::RunSpec spec;
  spec.set_placement(hetpar::v1::PLACEMENT_NON_COLOCATED);
  spec.mutable_run()->set_global_batch(8);
  spec.mutable_run()->set_micro_batch(2);
  spec.mutable_run()->set_seed(1234);
  spec.mutable_run()->set_dtype(hetpar::v1::DTYPE_FLOAT32);
  auto* em = spec.mutable_encoder()->mutable_model();
  em->set_image_size(32);
  em->set_patch(8);
  em->set_hidden(64);
  em->set_layers(2);
  em->set_heads(4);
  em->set_mlp(128);
  em->set_out_hidden(64);
  auto* el = spec.mutable_encoder()->mutable_layout();
  el->set_dp(2);
  el->set_tp(2);
  el->set_cp(1);
  el->set_pp(1);
  auto* lm = spec.mutable_llm()->mutable_model();
  lm->set_hidden(64);
  lm->set_layers(2);
  lm->set_heads(4);
  lm->set_kv_heads(2);
  lm->set_ffn(128);
  lm->set_vocab(256);
  lm->set_seq_len(128);
  auto* ll = spec.mutable_llm()->mutable_layout();
  ll->set_dp(2);
  ll->set_tp(2);
  ll->set_cp(2);
  ll->set_pp(2);
  return spec;
}

// The global batch of step `step`: samples of 0 to 3 images of 16 tokens, text up to 60 tokens.
std::vector<SampleDescriptor> TinyBatch(const hetpar::v1::RunSpec& spec, int64_t step,
                                        int64_t min_images) {
  SyntheticBatchOptions batch;
  batch.samples = spec.run().global_batch();
  batch.first_id = step * batch.samples;
  batch.min_images = min_images;
  batch.max_images = 3;
  batch.tokens_per_image = 16;
  batch.seq_len = 128;
  batch.min_text_tokens = 8;
  batch.max_text_tokens = 60;
  auto samples = SyntheticBatch(batch);
  EXPECT_TRUE(samples.ok()) << samples.status();
  return samples.ok() ? *samples : std::vector<SampleDescriptor>();
}

StepPlan TinyPlan(const hetpar::v1::RunSpec& spec, int64_t step, int64_t generation = 0) {
  auto placement = PlacementFromRunSpec(spec);
  EXPECT_TRUE(placement.ok()) << placement.status();
  auto options = StepPlanOptionsFromRunSpec(spec, step, generation);
  EXPECT_TRUE(options.ok()) << options.status();
  auto plan = BuildStepPlan(*placement, TinyBatch(spec, step, /*min_images=*/0), *options);
  EXPECT_TRUE(plan.ok()) << plan.status();
  return *plan;
}

TEST(StepPlanTest, OptionsFromRunSpec) {
  auto options = StepPlanOptionsFromRunSpec(TinySpec(), 5, 2);
  ASSERT_TRUE(options.ok()) << options.status();
  EXPECT_EQ(options->waves, 2);  // 8 / (2 x dp 2)
  // One of the two LLM replicas left: it takes every wave.
  auto one_replica = StepPlanOptionsFromRunSpec(TinySpec(), 5, 2, /*llm_replicas=*/1);
  ASSERT_TRUE(one_replica.ok()) << one_replica.status();
  EXPECT_EQ(one_replica->waves, 4);  // 8 / (2 x 1)
  // The 4 microbatches of 2 samples over 3 replicas: 2 waves, one replica taking only the first.
  auto three = StepPlanOptionsFromRunSpec(TinySpec(), 5, 2, /*llm_replicas=*/3);
  ASSERT_TRUE(three.ok()) << three.status();
  EXPECT_EQ(three->waves, 2);
  auto five = StepPlanOptionsFromRunSpec(TinySpec(), 5, 2, /*llm_replicas=*/5);
  EXPECT_THAT(std::string(five.status().message()),
              HasSubstr("run.global_batch=8 does not split into microbatches of "
                        "run.micro_batch=2 for each of 5 LLM replicas taking part"));
  EXPECT_EQ(options->micro_batch, 2);
  EXPECT_EQ(options->seq_len, 128);
  EXPECT_EQ(options->row_bytes, 256);  // 64 x float32
  EXPECT_EQ(options->seed, 1234u);
  EXPECT_EQ(options->step, 5);
  EXPECT_EQ(options->generation, 2);
  // Encoder: 2 layers x 2 x (4 x 64^2 + 2 x 64 x 128) + 2 x 64 x 64 per token; 2 x 4 x 64 per
  // token pair.
  EXPECT_DOUBLE_EQ(options->encoder_cost.per_token, 2 * 2.0 * (4 * 4096 + 2 * 64 * 128) + 8192);
  EXPECT_DOUBLE_EQ(options->encoder_cost.per_token_squared, 2 * 4.0 * 64);
  EXPECT_DOUBLE_EQ(options->llm_cost.per_token_squared, 2 * 2.0 * 64);

  auto bad = TinySpec();
  bad.mutable_run()->set_global_batch(6);
  auto r = StepPlanOptionsFromRunSpec(bad, 0, 0);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("run.global_batch=6"));
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("multiple of 4"));
}

TEST(StepPlanTest, NGlobalIsTheBatchLossTokens) {
  const StepPlan plan = TinyPlan(TinySpec(), 0);
  int64_t loss = 0;
  for (const SampleDescriptor& s : plan.samples) loss += s.loss_tokens;
  EXPECT_EQ(plan.n_global, loss);
  EXPECT_GT(plan.n_global, 0);
  int64_t from_microbatches = 0;
  for (const LlmMicrobatch& mb : plan.llm.microbatches) from_microbatches += mb.loss_tokens;
  EXPECT_EQ(from_microbatches, loss);
}

// The parts of all ranks together are the whole plan, and every message each rank sends
// passes the receiver's header check after encoding.
void CheckRankPlans(const StepPlan& plan) {
  std::map<int64_t, RankStepPlan> parts;
  for (int64_t r = 0; r < plan.placement.world_size; ++r) {
    auto part = ExtractRankPlan(plan, r);
    ASSERT_TRUE(part.ok()) << part.status();
    parts.emplace(r, std::move(*part));
  }
  size_t sends = 0, receives = 0, backward_sends = 0, backward_receives = 0;
  for (const auto& [rank, part] : parts) {
    EXPECT_EQ(part.n_global, plan.n_global);
    EXPECT_EQ(part.encoder_role, plan.placement.encoder.Contains(rank));
    EXPECT_EQ(part.llm_role, plan.placement.llm.Contains(rank));
    sends += part.forward_sends.size();
    receives += part.forward_receives.size();
    backward_sends += part.backward_sends.size();
    backward_receives += part.backward_receives.size();
    if (part.llm_role) {
      ASSERT_EQ(static_cast<int64_t>(part.microbatches.size()), plan.llm.waves);
      for (int64_t m = 0; m < plan.llm.waves; ++m) {
        EXPECT_EQ(part.image_rows[m], plan.boundary.LlmBufferRows(rank, m));
        EXPECT_TRUE(part.microbatches[m] == plan.llm.At(part.llm_coords.dp, m));
      }
    }
    // Every sample the part mentions has its descriptor, equal to the plan's.
    auto check_sample = [&](int64_t s) {
      const SampleDescriptor* d = part.Sample(s);
      ASSERT_NE(d, nullptr) << "rank " << rank << " sample " << s;
      EXPECT_TRUE(*d == plan.samples[s]);
    };
    for (const EncoderJob& job : part.encoder_jobs) {
      EXPECT_EQ(job.replica, part.encoder_coords.dp);
      for (const ImageRef& ref : job.images) check_sample(ref.sample);
    }
    for (const auto* list : {&part.forward_sends, &part.forward_receives, &part.backward_sends,
                             &part.backward_receives}) {
      for (const Transfer& t : *list) {
        for (const BlockPiece& p : t.pieces) check_sample(p.sample);
      }
    }
    EXPECT_EQ(part.Sample(static_cast<int64_t>(plan.samples.size())), nullptr);
    // Headers: every send is accepted by its receiver, bit for bit.
    for (const Transfer& t : part.forward_sends) {
      EXPECT_EQ(t.src_rank, rank);
      const MessageHeader sent = HeaderFor(part, Direction::kForward, t);
      EXPECT_TRUE(sent == HeaderFor(plan, Direction::kForward, t));
      auto decoded = DecodeHeader(EncodeHeader(sent));
      ASSERT_TRUE(decoded.ok()) << decoded.status();
      EXPECT_TRUE(CheckReceivedHeader(parts.at(t.dst_rank), *decoded).ok());
      EXPECT_EQ(decoded->payload_rows(), t.rows);
    }
    for (const Transfer& t : part.backward_sends) {
      EXPECT_EQ(t.src_rank, rank);
      auto decoded = DecodeHeader(EncodeHeader(HeaderFor(part, Direction::kBackward, t)));
      ASSERT_TRUE(decoded.ok()) << decoded.status();
      absl::Status s = CheckReceivedHeader(parts.at(t.dst_rank), *decoded);
      EXPECT_TRUE(s.ok()) << s;
    }
  }
  EXPECT_EQ(sends, plan.boundary.forward.size());
  EXPECT_EQ(receives, plan.boundary.forward.size());
  EXPECT_EQ(backward_sends, plan.boundary.backward.size());
  EXPECT_EQ(backward_receives, plan.boundary.backward.size());
}

TEST(StepPlanTest, RankPlansPartitionThePlanAndHeadersCheckOut) {
  for (int64_t step = 0; step < 4; ++step) {
    CheckRankPlans(TinyPlan(TinySpec(), step, step % 2));
  }
  auto sp = TinySpec();
  sp.mutable_llm()->mutable_layout()->set_sequence_parallel(true);
  CheckRankPlans(TinyPlan(sp, 1));
}

// A frozen encoder takes no gradients: the rank plans carry the forward transfers only; with a
// trainable projector the gradients go back as usual.
TEST(StepPlanTest, FrozenEncoderPlansNoBackwardTransfers) {
  auto spec = TinySpec();
  spec.mutable_encoder()->set_frozen(true);
  EXPECT_FALSE(ImageGradientsCross(spec));
  const StepPlan frozen = TinyPlan(spec, 0);
  int64_t forward = 0;
  for (int64_t rank = 0; rank < frozen.placement.world_size; ++rank) {
    auto part = ExtractRankPlan(frozen, rank);
    ASSERT_TRUE(part.ok()) << part.status();
    forward += static_cast<int64_t>(part->forward_sends.size());
    EXPECT_TRUE(part->backward_sends.empty()) << "rank " << rank;
    EXPECT_TRUE(part->backward_receives.empty()) << "rank " << rank;
  }
  EXPECT_GT(forward, 0);
  spec.mutable_encoder()->set_train_projector(true);
  EXPECT_TRUE(ImageGradientsCross(spec));
  const StepPlan projector = TinyPlan(spec, 0);
  int64_t backward = 0;
  for (int64_t rank = 0; rank < projector.placement.world_size; ++rank) {
    backward += static_cast<int64_t>(ExtractRankPlan(projector, rank)->backward_sends.size());
  }
  EXPECT_EQ(backward, forward);
}

TEST(StepPlanTest, ColocatedRanksHaveBothParts) {
  auto spec = TinySpec();
  spec.set_placement(hetpar::v1::PLACEMENT_COLOCATED);
  spec.mutable_encoder()->mutable_layout()->set_dp(8);  // 8 x 2 = 16 = 2 x 2 x 2 x 2
  const StepPlan plan = TinyPlan(spec, 0);
  EXPECT_EQ(plan.placement.world_size, 16);
  CheckRankPlans(plan);
  auto part = ExtractRankPlan(plan, 3);
  ASSERT_TRUE(part.ok());
  EXPECT_TRUE(part->encoder_role);
  EXPECT_TRUE(part->llm_role);
}

TEST(StepPlanTest, ReceiverRejectsForeignHeaders) {
  const StepPlan plan = TinyPlan(TinySpec(), 2, 1);
  ASSERT_FALSE(plan.boundary.forward.empty());
  const Transfer& t = plan.boundary.forward.front();
  auto receiver = ExtractRankPlan(plan, t.dst_rank);
  ASSERT_TRUE(receiver.ok());
  const MessageHeader good = HeaderFor(plan, Direction::kForward, t);
  ASSERT_TRUE(CheckReceivedHeader(*receiver, good).ok());

  MessageHeader stale = good;
  stale.generation = 0;
  absl::Status s = CheckReceivedHeader(*receiver, stale);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("generation is 0 in the header but 1 in the plan"));

  MessageHeader shifted = good;
  shifted.blocks[0].offset += 1;
  s = CheckReceivedHeader(*receiver, shifted);
  EXPECT_THAT(std::string(s.message()), HasSubstr("block 0 is sample"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("in the plan"));

  MessageHeader stranger = good;
  stranger.src_rank = plan.placement.world_size - 1;  // an LLM rank never sends forward
  s = CheckReceivedHeader(*receiver, stranger);
  EXPECT_THAT(std::string(s.message()), HasSubstr("expects no forward message from rank " +
                                                  std::to_string(plan.placement.world_size - 1)));

  MessageHeader backward = good;
  backward.direction = Direction::kBackward;
  EXPECT_FALSE(CheckReceivedHeader(*receiver, backward).ok());
}

TEST(StepPlanTest, StatsAddUp) {
  const StepPlan plan = TinyPlan(TinySpec(), 3);
  const PlanStats stats = ComputePlanStats(plan);
  ASSERT_EQ(static_cast<int64_t>(stats.ranks.size()), plan.placement.world_size);
  int64_t image_rows = 0;
  for (const SampleDescriptor& s : plan.samples) image_rows += s.image_tokens();
  EXPECT_EQ(stats.image_rows, image_rows);
  // Without SP every image row crosses the boundary exactly once.
  EXPECT_EQ(stats.boundary_bytes, image_rows * plan.options.row_bytes);
  int64_t sent = 0, received = 0, link_bytes = 0, link_messages = 0;
  for (const RankLoad& r : stats.ranks) {
    sent += r.bytes_sent;
    received += r.bytes_received;
    if (!r.encoder_role) {
      EXPECT_EQ(r.bytes_sent, 0);
    }
    if (!r.llm_role) {
      EXPECT_EQ(r.bytes_received, 0);
    }
  }
  for (const Link& l : stats.links) {
    link_bytes += l.bytes;
    link_messages += l.messages;
  }
  EXPECT_EQ(sent, stats.boundary_bytes);
  EXPECT_EQ(received, stats.boundary_bytes);
  EXPECT_EQ(link_bytes, stats.boundary_bytes);
  EXPECT_EQ(link_messages, stats.messages);
  EXPECT_EQ(stats.messages, static_cast<int64_t>(plan.boundary.forward.size()));
  EXPECT_GE(stats.send_imbalance, 1.0);
  EXPECT_GE(stats.encoder_step_imbalance, 1.0);
  // Share bytes: LLM groups of tp 2 copy each row once, encoder groups of tp 2 too.
  int64_t share = 0;
  for (const RankLoad& r : stats.ranks) share += r.share_bytes_sent;
  EXPECT_EQ(share, 2 * image_rows * plan.options.row_bytes);
  double encoder_cost = 0;
  for (const RankLoad& r : stats.ranks) encoder_cost += r.encoder_cost;
  double model_cost = 0;
  for (const SampleDescriptor& s : plan.samples) {
    model_cost +=
        static_cast<double>(s.image_count()) * plan.options.encoder_cost.Cost(s.tokens_per_image);
  }
  EXPECT_NEAR(encoder_cost, model_cost, 1e-6 * model_cost);
}

TEST(StepPlanTest, RejectsBadBatchesWithClearErrors) {
  const auto spec = TinySpec();
  auto placement = PlacementFromRunSpec(spec);
  auto options = StepPlanOptionsFromRunSpec(spec, 0, 0);
  ASSERT_TRUE(placement.ok() && options.ok());
  std::vector<SampleDescriptor> samples;
  for (int64_t i = 0; i < 8; ++i) samples.push_back(MakeSample(i, 1, 16, 10, 4));

  auto wrong_size = samples;
  wrong_size.pop_back();
  auto r = BuildStepPlan(*placement, wrong_size, *options);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()),
              HasSubstr("has 7 samples; expected run.global_batch=8"));
  // Six would fill the waves with one replica a wave short, as after a loss; with every replica
  // taking part the batch is the configured one.
  wrong_size.pop_back();
  r = BuildStepPlan(*placement, wrong_size, *options);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()),
              HasSubstr("has 6 samples; expected run.global_batch=8"));
  StepPlanOptions unchecked = *options;
  unchecked.global_batch = 0;
  r = BuildStepPlan(*placement, wrong_size, unchecked);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->llm.At(1, 1).samples.empty());

  // A sample twice (a batch across an epoch's end): planned at both positions.
  auto duplicate = samples;
  duplicate[5] = samples[2];
  r = BuildStepPlan(*placement, duplicate, *options);
  ASSERT_TRUE(r.ok()) << r.status();
  int64_t placed = 0;
  for (const LlmMicrobatch& mb : r->llm.microbatches) {
    for (int64_t s : mb.samples) placed += (s == 2 || s == 5) ? 1 : 0;
  }
  EXPECT_EQ(placed, 2);

  auto too_long = samples;
  too_long[3] = MakeSample(3, 7, 16, 20, 4);
  r = BuildStepPlan(*placement, too_long, *options);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()),
              HasSubstr("sample 3 (batch position 3) is 132 tokens (20 text + 7 images x 16); "
                        "expected at most llm seq_len=128"));

  auto overlap = samples;
  overlap[1] = MakeSample(1, 2, 16, 10, 4);
  overlap[1].image_starts[1] = 8;
  r = BuildStepPlan(*placement, overlap, *options);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()),
              HasSubstr("image 1 starts at position 8 (16 tokens); expected a start >= 16"));

  auto loss = samples;
  loss[0].loss_tokens = 11;
  r = BuildStepPlan(*placement, loss, *options);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("loss_tokens=11 is more than"));

  auto no_tokens = samples;
  no_tokens[0].tokens_per_image = 0;
  r = BuildStepPlan(*placement, no_tokens, *options);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("tokens_per_image=0"));

  auto plan = BuildStepPlan(*placement, samples, *options);
  ASSERT_TRUE(plan.ok());
  auto outside = ExtractRankPlan(*plan, plan->placement.world_size);
  ASSERT_FALSE(outside.ok());
  EXPECT_THAT(std::string(outside.status().message()), HasSubstr("rank 20 is outside"));
}

TEST(StepPlanTest, SyntheticBatchIsSeededAndFits) {
  SyntheticBatchOptions o;
  o.samples = 200;
  o.first_id = 50;
  o.dataset_size = 220;
  o.min_images = 0;
  o.max_images = 5;
  o.tokens_per_image = 20;
  o.min_text_tokens = 1;
  o.max_text_tokens = 80;
  o.seq_len = 128;
  auto a = SyntheticBatch(o);
  auto b = SyntheticBatch(o);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(*a == *b);
  EXPECT_TRUE(ValidateBatch(*a, 128).ok());
  std::set<int64_t> counts;
  for (const auto& s : *a) counts.insert(s.image_count());
  EXPECT_EQ(counts, (std::set<int64_t>{0, 1, 2, 3, 4, 5}));
  EXPECT_EQ((*a)[169].id, 219);
  EXPECT_EQ((*a)[170].id, 0);  // wraps around the dataset
  o.seed = 8;
  EXPECT_FALSE(*SyntheticBatch(o) == *a);
  o.samples = 221;
  EXPECT_FALSE(SyntheticBatch(o).ok());
  o.samples = 10;
  o.min_images = 7;
  o.max_images = 7;
  auto too_big = SyntheticBatch(o);
  ASSERT_FALSE(too_big.ok());
  EXPECT_THAT(std::string(too_big.status().message()), HasSubstr("does not fit in seq_len=128"));
}

}  // namespace
}  // namespace hetpar::plan

namespace hetpar::plan {
namespace {

// Builds a step over `subset` and checks every worker's part, given back in its own world rank:
// its coordinates and replica numbers are its own, every message it sends is one its receiver
// expects (the headers check out), it hears only from ranks taking part, and the batch's images
// and loss tokens are covered once. Returns the parts by world rank.
std::map<int64_t, RankStepPlan> CheckSubsetPlan(const hetpar::v1::RunSpec& spec,
                                                const Placement& full,
                                                const ReplicaSubset& subset) {
  auto options = StepPlanOptionsFromRunSpec(spec, 3, 7, subset.planned().llm.dp);
  EXPECT_TRUE(options.ok()) << options.status();
  const std::vector<SampleDescriptor> samples = TinyBatch(spec, 0, /*min_images=*/1);
  auto plan = BuildStepPlan(subset.planned(), samples, *options);
  EXPECT_TRUE(plan.ok()) << plan.status();
  std::map<int64_t, RankStepPlan> parts;
  if (!plan.ok()) return parts;
  for (int64_t r = 0; r < full.world_size; ++r) {
    const int64_t planned = subset.PlannedRank(r);
    if (planned < 0) continue;
    EXPECT_EQ(subset.FullRank(planned), r);
    auto part = ExtractRankPlan(*plan, planned);
    EXPECT_TRUE(part.ok()) << part.status();
    subset.ToFullRanks(&*part);
    EXPECT_EQ(part->rank, r);
    parts[r] = *std::move(part);
  }
  int64_t images = 0;
  int64_t loss_tokens = 0;
  for (const auto& [r, part] : parts) {
    if (part.encoder_role) {
      EXPECT_EQ(part.encoder_coords.dp, full.encoder.CoordsOf(r).dp) << r;
      EXPECT_EQ(part.encoder_coords.tp, full.encoder.CoordsOf(r).tp) << r;
      for (const EncoderJob& job : part.encoder_jobs) {
        EXPECT_EQ(job.replica, part.encoder_coords.dp);
        if (part.encoder_coords.tp == 0) images += static_cast<int64_t>(job.images.size());
      }
      for (const ShareStep& share : part.encoder_shares) {
        EXPECT_EQ(share.replica, part.encoder_coords.dp);
        EXPECT_EQ(share.ranks, full.encoder.TpGroup(r));
      }
    }
    if (part.llm_role) {
      const RankCoords own = full.llm.CoordsOf(r);
      EXPECT_EQ(part.llm_coords.dp, own.dp) << r;
      EXPECT_EQ(part.llm_coords.pp, own.pp) << r;
      for (const LlmMicrobatch& mb : part.microbatches) {
        EXPECT_EQ(mb.replica, own.dp);
        if (own.tp == 0 && own.cp == 0 && own.pp == 0) loss_tokens += mb.loss_tokens;
      }
      for (const ShareStep& share : part.llm_shares) EXPECT_EQ(share.replica, own.dp);
    }
    for (const Transfer& t : part.forward_sends) {
      EXPECT_EQ(t.src_rank, r);
      EXPECT_TRUE(parts.count(t.dst_rank)) << t.dst_rank;
      if (!parts.count(t.dst_rank)) continue;
      EXPECT_TRUE(
          CheckReceivedHeader(parts.at(t.dst_rank), HeaderFor(part, Direction::kForward, t)).ok())
          << r << " -> " << t.dst_rank;
    }
    for (const Transfer& t : part.backward_sends) {
      EXPECT_TRUE(parts.count(t.dst_rank)) << t.dst_rank;
      if (!parts.count(t.dst_rank)) continue;
      EXPECT_TRUE(
          CheckReceivedHeader(parts.at(t.dst_rank), HeaderFor(part, Direction::kBackward, t)).ok());
    }
    for (const Transfer& t : part.forward_receives) {
      EXPECT_TRUE(parts.count(t.src_rank))
          << "a receive from rank " << t.src_rank << ", which is not taking part";
    }
  }
  int64_t batch_images = 0;
  for (const SampleDescriptor& s : samples) batch_images += s.image_count();
  EXPECT_EQ(images, batch_images);
  EXPECT_EQ(loss_tokens, plan->n_global);
  return parts;
}

// Encoder replica 1 of three left the run: the step is planned over replicas 0 and 2.
TEST(ReplicaSubsetTest, AStepOverSomeEncoderReplicasAddressesEveryRankByItsOwnWorldRank) {
  hetpar::v1::RunSpec spec = TinySpec();
  spec.mutable_encoder()->mutable_layout()->set_dp(3);  // encoder ranks [0, 6), tp 2
  auto full = PlacementFromRunSpec(spec);
  ASSERT_TRUE(full.ok()) << full.status();
  ASSERT_EQ(full->llm.rank_offset, 6);
  auto subset = ReplicaSubset::Create(*full, {0, 2}, {0, 1});
  ASSERT_TRUE(subset.ok()) << subset.status();
  EXPECT_EQ(subset->planned().encoder.dp, 2);
  EXPECT_EQ(subset->planned().llm.rank_offset, 4);
  // Replica 0 keeps ranks 0 and 1; replica 2 (world ranks 4, 5) is planned as 2, 3; the LLM
  // moves down by one replica.
  const std::vector<int64_t> expected_planned = {0, 1, -1, -1, 2, 3, 4, 5};
  for (int64_t r = 0; r < 8; ++r) EXPECT_EQ(subset->PlannedRank(r), expected_planned[r]) << r;
  EXPECT_EQ(subset->PlannedRank(21), 19);
  EXPECT_EQ(CheckSubsetPlan(spec, *full, *subset).size(), 20u);  // 4 encoder + 16 LLM ranks
}

// LLM replica 0 of two left the run (dp 2 x tp 2 x cp 2 x pp 2): the step is planned over
// replica 1 alone, which takes twice the waves.
TEST(ReplicaSubsetTest, AStepOverSomeLlmReplicasAddressesEveryRankByItsOwnWorldRank) {
  hetpar::v1::RunSpec spec = TinySpec();
  auto full = PlacementFromRunSpec(spec);
  ASSERT_TRUE(full.ok()) << full.status();
  auto subset = ReplicaSubset::Create(*full, {0, 1}, {1});
  ASSERT_TRUE(subset.ok()) << subset.status();
  EXPECT_EQ(subset->planned().llm.dp, 1);
  // LLM rank (dp 1, tp 1, cp 0, pp 1) of the full layout is (dp 0, tp 1, cp 0, pp 1) planned.
  const int64_t rank = full->llm.RankOf(1, 1, 0, 1);
  EXPECT_EQ(subset->PlannedRank(rank), subset->planned().llm.RankOf(0, 1, 0, 1));
  EXPECT_EQ(subset->PlannedRank(full->llm.RankOf(0, 1, 0, 1)), -1);
  const auto parts = CheckSubsetPlan(spec, *full, *subset);
  EXPECT_EQ(parts.size(), 4u + 8u);                   // 4 encoder + the 8 ranks of LLM replica 1
  EXPECT_EQ(parts.at(rank).microbatches.size(), 4u);  // 8 samples / (micro_batch 2 x 1 replica)
}

// LLM replica 1 of three left the run: the batch's three microbatches do not divide over the two
// left, so replica 0 takes two waves and replica 2 one, its second wave empty on every stage.
TEST(ReplicaSubsetTest, LlmReplicasLeftTakeTheMicrobatchesThatDoNotDivideOneWaveApart) {
  hetpar::v1::RunSpec spec = TinySpec();
  spec.mutable_llm()->mutable_layout()->set_dp(3);
  spec.mutable_run()->set_global_batch(6);  // micro_batch 2: three microbatches
  auto full = PlacementFromRunSpec(spec);
  ASSERT_TRUE(full.ok()) << full.status();
  auto subset = ReplicaSubset::Create(*full, {0, 1}, {0, 2});
  ASSERT_TRUE(subset.ok()) << subset.status();
  const auto parts = CheckSubsetPlan(spec, *full, *subset);
  EXPECT_EQ(parts.size(), 4u + 16u);  // 4 encoder + the 8 ranks of each LLM replica left
  for (int64_t tp = 0; tp < 2; ++tp) {
    for (int64_t cp = 0; cp < 2; ++cp) {
      for (int64_t pp = 0; pp < 2; ++pp) {
        const RankStepPlan& first = parts.at(full->llm.RankOf(0, tp, cp, pp));
        const RankStepPlan& last = parts.at(full->llm.RankOf(2, tp, cp, pp));
        ASSERT_EQ(first.microbatches.size(), 2u);
        ASSERT_EQ(last.microbatches.size(), 1u);
        EXPECT_EQ(last.microbatches[0].wave, 0);
        EXPECT_EQ(first.microbatches[1].samples.size(), 2u);
        EXPECT_EQ(last.microbatches[0].samples.size(), 2u);
        if (pp == 0) {
          EXPECT_EQ(last.image_rows.at(1), 0);  // nothing lands in its second wave
        }
      }
    }
  }
}

TEST(ReplicaSubsetTest, RefusesWhatItCannotPlan) {
  hetpar::v1::RunSpec spec = TinySpec();
  auto full = PlacementFromRunSpec(spec);
  ASSERT_TRUE(full.ok());
  EXPECT_THAT(std::string(ReplicaSubset::Create(*full, {}, {0}).status().message()),
              HasSubstr("at least one encoder replica"));
  EXPECT_THAT(std::string(ReplicaSubset::Create(*full, {1, 0}, {0}).status().message()),
              HasSubstr("increasing order"));
  EXPECT_THAT(std::string(ReplicaSubset::Create(*full, {2}, {0}).status().message()),
              HasSubstr("[0, 2)"));
  EXPECT_THAT(std::string(ReplicaSubset::Create(*full, {0}, {}).status().message()),
              HasSubstr("at least one llm replica"));
  Placement colocated = *full;
  colocated.kind = PlacementKind::kColocated;
  EXPECT_THAT(std::string(ReplicaSubset::Create(colocated, {0}, {0}).status().message()),
              HasSubstr("non_colocated"));
}

}  // namespace
}  // namespace hetpar::plan
