// The step plan: everything the workers of one step need, built from the global batch by pure
// functions, and each rank's part of it.
//
//   auto options = StepPlanOptionsFromRunSpec(spec, step, generation);
//   auto plan = BuildStepPlan(placement, samples, *options);   // the coordinator, once per step
//   auto mine = ExtractRankPlan(*plan, rank);                  // what one worker receives
//
// N_global (n_global) is the number of loss tokens in the global batch: each LLM microbatch
// contributes sum(token losses) / N_global, so gradients do not depend on DP sizes or waves.
#ifndef HETPAR_COMMON_PLAN_STEP_PLAN_H_
#define HETPAR_COMMON_PLAN_STEP_PLAN_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/plan/boundary_plan.h"
#include "common/plan/cost_model.h"
#include "common/plan/layout.h"
#include "common/plan/message_header.h"
#include "common/plan/sample.h"
#include "common/plan/schedule.h"
#include "hetpar/v1/run_spec.pb.h"

namespace hetpar::plan {

struct StepPlanOptions {
  int64_t step = 0;
  int64_t generation = 0;
  uint64_t seed = 0;
  int64_t waves = 1;        // M = global_batch / (micro_batch * llm dp), rounded up (LlmWaves)
  int64_t micro_batch = 1;  // samples per LLM replica per wave
  // run.global_batch: the batch's size, checked by BuildStepPlan (0: whatever size AssignLlm
  // takes for the waves, which may leave replicas a wave short).
  int64_t global_batch = 0;
  int64_t seq_len = 0;      // llm.model.seq_len
  int64_t row_bytes = 0;    // llm.model.hidden x dtype size
  CostModel encoder_cost;   // per image
  CostModel llm_cost;       // per sample
  // Whether gradients of the image rows go back to the encoder; without them the rank plans
  // carry no backward transfers.
  bool image_gradients = true;
};

// Whether the encoder takes the gradients of its output rows: false for encoder.frozen without
// encoder.train_projector.
bool ImageGradientsCross(const hetpar::v1::RunSpec& spec);

// Bytes per element: float32 4, float64 8, bfloat16 2; 0 for an unspecified dtype.
int64_t DtypeBytes(hetpar::v1::Dtype dtype);

// The waves of a step. With llm_replicas = 0 (llm.layout.dp replicas): run.global_batch /
// (run.micro_batch x llm.layout.dp), InvalidArgument when the batch does not divide. With
// `llm_replicas` > 0 (the replicas taking part after some left the run): the batch's
// run.global_batch / run.micro_batch microbatches spread over them, ceil(microbatches /
// llm_replicas) waves, some replicas taking one wave fewer (AssignLlm); InvalidArgument when
// there are fewer microbatches than replicas.
absl::StatusOr<int64_t> LlmWaves(const hetpar::v1::RunSpec& spec, int64_t llm_replicas = 0);

// Options from a RunSpec with defaults applied: seed = run.seed, waves = run.global_batch /
// (run.micro_batch x llm.layout.dp), global_batch = run.global_batch, seq_len =
// llm.model.seq_len, row_bytes = llm.model.hidden x dtype size, cost models from both models.
// InvalidArgument when the batch does not divide.
// `llm_replicas` > 0: the LLM DP replicas taking part when fewer than llm.layout.dp (some left
// the run); the waves follow them (LlmWaves).
absl::StatusOr<StepPlanOptions> StepPlanOptionsFromRunSpec(const hetpar::v1::RunSpec& spec,
                                                           int64_t step, int64_t generation,
                                                           int64_t llm_replicas = 0);

struct StepPlan {
  int64_t step = 0;
  int64_t generation = 0;
  int64_t attempt = 0;  // the coordinator's step attempt id (MessageHeader::attempt)
  Placement placement;
  StepPlanOptions options;
  std::vector<SampleDescriptor> samples;  // the global batch; positions are batch indices
  int64_t n_global = 0;                   // loss tokens in the global batch
  LlmAssignment llm;
  EncoderAssignment encoder;
  BoundaryPlan boundary;
};

// Validates the batch (every sample fits seq_len; options.global_batch samples where set, and a
// size AssignLlm takes for the waves, micro_batch and llm dp) and builds the assignments and the
// boundary plan.
absl::StatusOr<StepPlan> BuildStepPlan(const Placement& placement,
                                       std::vector<SampleDescriptor> samples,
                                       const StepPlanOptions& options);

// One rank's part of a step plan: copies, so it can be shipped on its own. Transfers and jobs
// refer to samples by batch index; `samples` holds the descriptors of exactly the samples they
// mention (Sample() finds one).
struct RankStepPlan {
  int64_t rank = 0;
  int64_t step = 0;
  int64_t generation = 0;
  int64_t attempt = 0;  // set by the coordinator when it sends the plan
  int64_t waves = 0;    // the step's; an LLM rank's replica may take one fewer (microbatches)
  int64_t n_global = 0;
  int64_t seq_len = 0;
  int64_t row_bytes = 0;

  bool encoder_role = false;
  RankCoords encoder_coords;
  std::vector<EncoderJob> encoder_jobs;     // its replica's non-empty jobs, by wave
  std::vector<Transfer> forward_sends;      // by (wave, dst_rank)
  std::vector<Transfer> backward_receives;  // by (wave, src_rank)
  std::vector<ShareStep> encoder_shares;    // gradient share steps of its TP group, by wave

  bool llm_role = false;
  RankCoords llm_coords;
  std::vector<LlmMicrobatch> microbatches;  // its replica's, one per wave it takes (all or
                                            // all but the last: LlmWaves)
  std::vector<int64_t> image_rows;          // per wave: rows of its image-row buffer
  std::vector<Transfer> forward_receives;   // by (wave, src_rank)
  std::vector<Transfer> backward_sends;     // by (wave, dst_rank)
  std::vector<ShareStep> llm_shares;        // image-row share steps of its TP group, by wave

  std::vector<int64_t> sample_indices;    // increasing batch indices
  std::vector<SampleDescriptor> samples;  // parallel to sample_indices

  // The descriptor of batch index `batch_index`, or nullptr when this part does not mention it.
  const SampleDescriptor* Sample(int64_t batch_index) const;
};

// InvalidArgument when the rank is outside the world.
absl::StatusOr<RankStepPlan> ExtractRankPlan(const StepPlan& plan, int64_t rank);

// A step over some of the modules' DP replicas (the others left the run) is planned on a
// placement whose layouts have only those replicas; each worker keeps its world rank and its
// coordinates in the full layouts. Maps one to the other: `full` is the RunSpec's
// (non-colocated) placement, `encoder_replicas` and `llm_replicas` the DP replicas taking part,
// increasing.
class ReplicaSubset {
 public:
  // InvalidArgument for a colocated placement, an empty or unsorted subset, or a replica out of
  // range.
  static absl::StatusOr<ReplicaSubset> Create(const Placement& full,
                                              std::vector<int64_t> encoder_replicas,
                                              std::vector<int64_t> llm_replicas);

  // The placement the step is planned on: each layout with only the replicas taking part.
  const Placement& planned() const { return planned_; }
  const std::vector<int64_t>& encoder_replicas() const { return encoder_replicas_; }
  const std::vector<int64_t>& llm_replicas() const { return llm_replicas_; }
  // World rank in planned() of the full placement's `rank`; -1 for a rank of a replica that is
  // not taking part.
  int64_t PlannedRank(int64_t rank) const;
  // The full placement's world rank of planned()'s `rank`.
  int64_t FullRank(int64_t planned_rank) const;
  // Rewrites a rank plan extracted from a plan over planned(): its rank, every transfer's and
  // share step's ranks and the replica numbers become the full placement's, so that the worker
  // addresses its peers (and checks headers) by their own world ranks.
  void ToFullRanks(RankStepPlan* plan) const;

 private:
  Placement full_;
  Placement planned_;
  std::vector<int64_t> encoder_replicas_;
  std::vector<int64_t> llm_replicas_;
};

// The header of `transfer` travelling in `direction` (forward transfers from plan.boundary
// .forward, backward ones from .backward).
MessageHeader HeaderFor(const StepPlan& plan, Direction direction, const Transfer& transfer);
MessageHeader HeaderFor(const RankStepPlan& plan, Direction direction, const Transfer& transfer);

// Checks a header received by `plan.rank`: the rank must expect a message in that direction
// from header.src_rank in header.wave, and the header must equal the one its plan gives.
absl::Status CheckReceivedHeader(const RankStepPlan& plan, const MessageHeader& header);

// Load of one world rank in a step. Boundary bytes count the forward direction; backward moves
// the same bytes the other way.
struct RankLoad {
  int64_t rank = 0;
  bool encoder_role = false;
  bool llm_role = false;
  double encoder_cost = 0;     // encoder cost model on this rank: replica cost / encoder tp
  int64_t images = 0;          // images its encoder replica encodes in the step
  int64_t llm_tokens = 0;      // tokens its LLM replica trains in the step
  double llm_cost = 0;         // LLM cost model of its replica's samples
  int64_t bytes_sent = 0;      // forward boundary bytes it sends
  int64_t bytes_received = 0;  // forward boundary bytes it receives
  int64_t messages_sent = 0;
  int64_t messages_received = 0;
  int64_t share_bytes_sent = 0;  // bytes it sends in share steps (LLM forward, encoder backward)
};

// Traffic between two ranks, summed over the step's waves (forward direction).
struct Link {
  int64_t src_rank = 0;
  int64_t dst_rank = 0;
  int64_t bytes = 0;
  int64_t messages = 0;
};

struct PlanStats {
  std::vector<RankLoad> ranks;  // one per world rank
  std::vector<Link> links;      // sorted by (src_rank, dst_rank)
  int64_t images = 0;
  int64_t image_rows = 0;
  int64_t boundary_bytes = 0;  // forward; backward is the same
  int64_t messages = 0;        // forward transfers; backward has as many
  int64_t pieces = 0;
  int64_t share_steps = 0;
  double llm_imbalance = 1;                 // max / mean LLM cost over replicas
  double encoder_step_imbalance = 1;        // max / mean encoder cost over replicas, whole step
  double encoder_worst_wave_imbalance = 1;  // worst wave's max / mean over encoder replicas
  double encoder_mean_wave_imbalance = 1;
  double send_imbalance = 1;     // max / mean forward bytes sent over encoder ranks
  double receive_imbalance = 1;  // max / mean forward bytes received over first-stage LLM ranks
};

PlanStats ComputePlanStats(const StepPlan& plan);

}  // namespace hetpar::plan

#endif  // HETPAR_COMMON_PLAN_STEP_PLAN_H_
