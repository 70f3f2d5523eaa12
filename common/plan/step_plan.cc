#include "common/plan/step_plan.h"

#include <algorithm>
#include <functional>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/plan/flops.h"

namespace hetpar::plan {
namespace {

double MaxOverMean(const std::vector<double>& values) {
  if (values.empty()) return 1.0;
  double total = 0;
  double max = 0;
  for (double v : values) {
    total += v;
    max = std::max(max, v);
  }
  if (total <= 0) return 1.0;
  return max / (total / static_cast<double>(values.size()));
}

MessageHeader MakeHeader(int64_t step, int64_t generation, int64_t attempt, int64_t row_bytes,
                         Direction direction, const Transfer& transfer,
                         const std::function<int64_t(int64_t)>& sample_id) {
  MessageHeader h;
  h.direction = direction;
  h.step = step;
  h.generation = generation;
  h.attempt = attempt;
  h.wave = transfer.wave;
  h.src_rank = transfer.src_rank;
  h.dst_rank = transfer.dst_rank;
  h.row_bytes = row_bytes;
  h.blocks.reserve(transfer.pieces.size());
  for (const BlockPiece& p : transfer.pieces) {
    h.blocks.push_back({sample_id(p.sample), p.image, p.row_begin, p.rows, p.dst_offset});
  }
  return h;
}

std::vector<Transfer> Copy(const std::vector<const Transfer*>& transfers) {
  std::vector<Transfer> out;
  out.reserve(transfers.size());
  for (const Transfer* t : transfers) out.push_back(*t);
  return out;
}

}  // namespace

int64_t DtypeBytes(hetpar::v1::Dtype dtype) {
  if (dtype == hetpar::v1::DTYPE_FLOAT32) return 4;
  if (dtype == hetpar::v1::DTYPE_FLOAT64) return 8;
  if (dtype == hetpar::v1::DTYPE_BFLOAT16) return 2;
  return 0;
}

absl::StatusOr<int64_t> LlmWaves(const hetpar::v1::RunSpec& spec, int64_t llm_replicas) {
  const int64_t micro_batch = spec.run().micro_batch();
  const int64_t llm_dp = llm_replicas > 0 ? llm_replicas : spec.llm().layout().dp();
  const int64_t global_batch = spec.run().global_batch();
  if (llm_replicas <= 0) {
    // The configured layout: every replica takes the same waves.
    if (micro_batch < 1 || llm_dp < 1 || global_batch < 1 ||
        global_batch % (micro_batch * llm_dp) != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "run.global_batch=", global_batch, " is not divisible into run.micro_batch=", micro_batch,
          " per LLM replica x llm.layout.dp=", llm_dp, "; expected a positive multiple of ",
          micro_batch * llm_dp));
    }
    return global_batch / (micro_batch * llm_dp);
  }
  // Fewer replicas taking part (some left the run): the batch's microbatches of run.micro_batch
  // samples spread over them as evenly as they go; a replica may take one wave fewer.
  if (micro_batch < 1 || global_batch < 1 || global_batch % micro_batch != 0 ||
      global_batch / micro_batch < llm_replicas) {
    return absl::InvalidArgumentError(absl::StrCat(
        "run.global_batch=", global_batch, " does not split into microbatches of run.micro_batch=",
        micro_batch, " for each of ", llm_replicas, " LLM replicas taking part"));
  }
  const int64_t microbatches = global_batch / micro_batch;
  return (microbatches + llm_replicas - 1) / llm_replicas;
}

absl::StatusOr<StepPlanOptions> StepPlanOptionsFromRunSpec(const hetpar::v1::RunSpec& spec,
                                                           int64_t step, int64_t generation,
                                                           int64_t llm_replicas) {
  absl::StatusOr<int64_t> waves = LlmWaves(spec, llm_replicas);
  if (!waves.ok()) return waves.status();
  const int64_t dtype_bytes = DtypeBytes(spec.run().dtype());
  if (dtype_bytes == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "run.dtype=", spec.run().dtype(), " is not set; expected float32, float64 or bfloat16"));
  }
  if (step < 0 || generation < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("step=", step, " and generation=", generation, " must be >= 0"));
  }
  StepPlanOptions o;
  o.step = step;
  o.generation = generation;
  o.seed = static_cast<uint64_t>(spec.run().seed());
  o.waves = *waves;
  o.micro_batch = spec.run().micro_batch();
  o.global_batch = spec.run().global_batch();
  o.seq_len = spec.llm().model().seq_len();
  o.row_bytes = spec.llm().model().hidden() * dtype_bytes;
  o.encoder_cost = EncoderCostModel(spec.encoder().model());
  o.llm_cost = LlmCostModel(spec.llm().model());
  o.image_gradients = ImageGradientsCross(spec);
  return o;
}

bool ImageGradientsCross(const hetpar::v1::RunSpec& spec) {
  return EncoderTrainingOf(spec.encoder()) != EncoderTraining::kNone;
}

absl::StatusOr<StepPlan> BuildStepPlan(const Placement& placement,
                                       std::vector<SampleDescriptor> samples,
                                       const StepPlanOptions& options) {
  if (absl::Status s = ValidatePlacement(placement); !s.ok()) return s;
  if (absl::Status s = ValidateBatch(samples, options.seq_len); !s.ok()) return s;
  if (options.global_batch > 0 && static_cast<int64_t>(samples.size()) != options.global_batch) {
    return absl::InvalidArgumentError(
        absl::StrCat("the global batch has ", samples.size(),
                     " samples; expected run.global_batch=", options.global_batch));
  }
  StepPlan plan;
  plan.step = options.step;
  plan.generation = options.generation;
  plan.placement = placement;
  plan.options = options;
  for (const SampleDescriptor& s : samples) plan.n_global += s.loss_tokens;
  auto llm = AssignLlm(samples, placement.llm.dp, options.waves, options.micro_batch,
                       options.llm_cost, options.encoder_cost, options.seed, options.step);
  if (!llm.ok()) return llm.status();
  plan.llm = std::move(*llm);
  auto encoder = AssignEncoder(samples, plan.llm, placement.encoder.dp, options.encoder_cost,
                               options.seed, options.step);
  if (!encoder.ok()) return encoder.status();
  plan.encoder = std::move(*encoder);
  BoundaryPlanOptions boundary_options;
  boundary_options.seq_len = options.seq_len;
  boundary_options.row_bytes = options.row_bytes;
  auto boundary = BuildBoundaryPlan(placement, samples, plan.llm, plan.encoder, boundary_options);
  if (!boundary.ok()) return boundary.status();
  plan.boundary = std::move(*boundary);
  plan.samples = std::move(samples);
  return plan;
}

const SampleDescriptor* RankStepPlan::Sample(int64_t batch_index) const {
  auto it = std::lower_bound(sample_indices.begin(), sample_indices.end(), batch_index);
  if (it == sample_indices.end() || *it != batch_index) return nullptr;
  return &samples[it - sample_indices.begin()];
}

absl::StatusOr<RankStepPlan> ExtractRankPlan(const StepPlan& plan, int64_t rank) {
  const Placement& placement = plan.placement;
  if (rank < 0 || rank >= placement.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", rank,
                                                   " is outside the world; expected a rank in "
                                                   "[0, ",
                                                   placement.world_size, ")"));
  }
  RankStepPlan out;
  out.rank = rank;
  out.step = plan.step;
  out.generation = plan.generation;
  out.attempt = plan.attempt;
  out.waves = plan.llm.waves;
  out.n_global = plan.n_global;
  out.seq_len = plan.options.seq_len;
  out.row_bytes = plan.options.row_bytes;
  std::vector<int64_t> referenced;

  if (placement.encoder.Contains(rank)) {
    out.encoder_role = true;
    out.encoder_coords = placement.encoder.CoordsOf(rank);
    const auto [begin, end] = plan.encoder.JobsOf(out.encoder_coords.dp);
    out.encoder_jobs.assign(plan.encoder.jobs.begin() + begin, plan.encoder.jobs.begin() + end);
    for (const EncoderJob& job : out.encoder_jobs) {
      for (const ImageRef& ref : job.images) referenced.push_back(ref.sample);
    }
    out.forward_sends = Copy(ForwardFrom(plan.boundary, rank));
    if (plan.options.image_gradients) out.backward_receives = Copy(BackwardTo(plan.boundary, rank));
    for (const ShareStep* share : EncoderSharesOf(plan.boundary, placement.encoder, rank)) {
      out.encoder_shares.push_back(*share);
    }
  }
  if (placement.llm.Contains(rank)) {
    out.llm_role = true;
    out.llm_coords = placement.llm.CoordsOf(rank);
    out.microbatches.reserve(plan.llm.waves);
    out.image_rows.reserve(plan.llm.waves);
    for (int64_t m = 0; m < plan.llm.waves; ++m) {
      out.image_rows.push_back(plan.boundary.LlmBufferRows(rank, m));
      const LlmMicrobatch& mb = plan.llm.At(out.llm_coords.dp, m);
      if (mb.samples.empty()) continue;  // the last wave of a replica taking one fewer
      out.microbatches.push_back(mb);
      for (int64_t s : mb.samples) referenced.push_back(s);
    }
    out.forward_receives = Copy(ForwardTo(plan.boundary, rank));
    if (plan.options.image_gradients) out.backward_sends = Copy(BackwardFrom(plan.boundary, rank));
    for (const ShareStep* share : LlmSharesOf(plan.boundary, placement.llm, rank)) {
      out.llm_shares.push_back(*share);
    }
  }
  std::sort(referenced.begin(), referenced.end());
  referenced.erase(std::unique(referenced.begin(), referenced.end()), referenced.end());
  out.samples.reserve(referenced.size());
  for (int64_t s : referenced) out.samples.push_back(plan.samples[s]);
  out.sample_indices = std::move(referenced);
  return out;
}

namespace {

absl::Status CheckReplicas(const std::vector<int64_t>& replicas, int64_t dp, const char* module) {
  if (replicas.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("a step needs at least one ", module, " replica"));
  }
  for (size_t i = 0; i < replicas.size(); ++i) {
    if (replicas[i] < 0 || replicas[i] >= dp || (i > 0 && replicas[i] <= replicas[i - 1])) {
      return absl::InvalidArgumentError(
          absl::StrCat(module, " replicas [", absl::StrJoin(replicas, ", "),
                       "]: expected distinct replicas in increasing order, each in [0, ", dp, ")"));
    }
  }
  return absl::OkStatus();
}

// `rank` of `from` at the same coordinates in `to`, its DP replica mapped by `dp_of`; -1 when
// `dp_of` gives -1.
template <typename DpOf>
int64_t MoveRank(const Layout& from, const Layout& to, int64_t rank, DpOf dp_of) {
  RankCoords coords = from.CoordsOf(rank);
  coords.dp = dp_of(coords.dp);
  return coords.dp < 0 ? -1 : to.RankOf(coords);
}

int64_t IndexOf(const std::vector<int64_t>& values, int64_t value) {
  auto it = std::find(values.begin(), values.end(), value);
  return it == values.end() ? -1 : it - values.begin();
}

}  // namespace

absl::StatusOr<ReplicaSubset> ReplicaSubset::Create(const Placement& full,
                                                    std::vector<int64_t> encoder_replicas,
                                                    std::vector<int64_t> llm_replicas) {
  if (full.kind != PlacementKind::kNonColocated) {
    return absl::InvalidArgumentError(
        "a step over some DP replicas needs a non_colocated placement");
  }
  if (absl::Status s = CheckReplicas(encoder_replicas, full.encoder.dp, "encoder"); !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckReplicas(llm_replicas, full.llm.dp, "llm"); !s.ok()) return s;
  Layout encoder = full.encoder;
  encoder.dp = static_cast<int64_t>(encoder_replicas.size());
  Layout llm = full.llm;
  llm.dp = static_cast<int64_t>(llm_replicas.size());
  absl::StatusOr<Placement> planned = MakePlacement(full.kind, encoder, llm);
  if (!planned.ok()) return planned.status();
  ReplicaSubset subset;
  subset.full_ = full;
  subset.planned_ = *std::move(planned);
  subset.encoder_replicas_ = std::move(encoder_replicas);
  subset.llm_replicas_ = std::move(llm_replicas);
  return subset;
}

int64_t ReplicaSubset::PlannedRank(int64_t rank) const {
  if (full_.encoder.Contains(rank)) {
    return MoveRank(full_.encoder, planned_.encoder, rank,
                    [&](int64_t dp) { return IndexOf(encoder_replicas_, dp); });
  }
  return MoveRank(full_.llm, planned_.llm, rank,
                  [&](int64_t dp) { return IndexOf(llm_replicas_, dp); });
}

int64_t ReplicaSubset::FullRank(int64_t planned_rank) const {
  if (planned_.encoder.Contains(planned_rank)) {
    return MoveRank(planned_.encoder, full_.encoder, planned_rank,
                    [&](int64_t dp) { return encoder_replicas_[dp]; });
  }
  return MoveRank(planned_.llm, full_.llm, planned_rank,
                  [&](int64_t dp) { return llm_replicas_[dp]; });
}

void ReplicaSubset::ToFullRanks(RankStepPlan* plan) const {
  plan->rank = FullRank(plan->rank);
  if (plan->encoder_role) plan->encoder_coords.dp = encoder_replicas_[plan->encoder_coords.dp];
  if (plan->llm_role) plan->llm_coords.dp = llm_replicas_[plan->llm_coords.dp];
  for (EncoderJob& job : plan->encoder_jobs) job.replica = encoder_replicas_[job.replica];
  for (LlmMicrobatch& microbatch : plan->microbatches) {
    microbatch.replica = llm_replicas_[microbatch.replica];
  }
  for (auto* transfers : {&plan->forward_sends, &plan->backward_receives, &plan->forward_receives,
                          &plan->backward_sends}) {
    for (Transfer& t : *transfers) {
      t.src_rank = FullRank(t.src_rank);
      t.dst_rank = FullRank(t.dst_rank);
    }
  }
  for (auto* shares : {&plan->encoder_shares, &plan->llm_shares}) {
    for (ShareStep& share : *shares) {
      share.replica = share.module == Module::kEncoder ? encoder_replicas_[share.replica]
                                                       : llm_replicas_[share.replica];
      for (int64_t& r : share.ranks) r = FullRank(r);
      for (ShareSegment& segment : share.segments) {
        segment.holder_rank = FullRank(segment.holder_rank);
      }
    }
  }
}

MessageHeader HeaderFor(const StepPlan& plan, Direction direction, const Transfer& transfer) {
  return MakeHeader(plan.step, plan.generation, plan.attempt, plan.options.row_bytes, direction,
                    transfer, [&](int64_t s) { return plan.samples[s].id; });
}

MessageHeader HeaderFor(const RankStepPlan& plan, Direction direction, const Transfer& transfer) {
  return MakeHeader(plan.step, plan.generation, plan.attempt, plan.row_bytes, direction, transfer,
                    [&](int64_t s) {
                      const SampleDescriptor* sample = plan.Sample(s);
                      return sample != nullptr ? sample->id : -1;
                    });
}

absl::Status CheckReceivedHeader(const RankStepPlan& plan, const MessageHeader& header) {
  const std::vector<Transfer>& expected_list =
      header.direction == Direction::kForward ? plan.forward_receives : plan.backward_receives;
  for (const Transfer& t : expected_list) {
    if (t.wave == header.wave && t.src_rank == header.src_rank) {
      return ValidateHeader(header, HeaderFor(plan, header.direction, t));
    }
  }
  return absl::FailedPreconditionError(
      absl::StrCat("boundary message rejected: rank ", plan.rank, " expects no ",
                   std::string(DirectionName(header.direction)), " message from rank ",
                   header.src_rank, " in wave ", header.wave, " of step ", plan.step,
                   " generation ", plan.generation, " (header: ", DescribeHeader(header), ")"));
}

PlanStats ComputePlanStats(const StepPlan& plan) {
  const Placement& placement = plan.placement;
  const int64_t row_bytes = plan.options.row_bytes;
  PlanStats stats;
  stats.ranks.resize(placement.world_size);
  for (int64_t r = 0; r < placement.world_size; ++r) {
    RankLoad& load = stats.ranks[r];
    load.rank = r;
    if (placement.encoder.Contains(r)) {
      load.encoder_role = true;
      const int64_t e = placement.encoder.CoordsOf(r).dp;
      load.encoder_cost = plan.encoder.replica_cost[e] / static_cast<double>(placement.encoder.tp);
    }
    if (placement.llm.Contains(r)) {
      load.llm_role = true;
      load.llm_cost = plan.llm.replica_cost[placement.llm.CoordsOf(r).dp];
    }
  }
  std::vector<int64_t> replica_images(placement.encoder.dp, 0);
  for (const EncoderJob& job : plan.encoder.jobs) {
    replica_images[job.replica] += static_cast<int64_t>(job.images.size());
    stats.image_rows += job.rows;
  }
  std::vector<int64_t> replica_tokens(placement.llm.dp, 0);
  for (const LlmMicrobatch& mb : plan.llm.microbatches) replica_tokens[mb.replica] += mb.tokens;
  for (RankLoad& load : stats.ranks) {
    if (load.encoder_role) load.images = replica_images[placement.encoder.CoordsOf(load.rank).dp];
    if (load.llm_role) load.llm_tokens = replica_tokens[placement.llm.CoordsOf(load.rank).dp];
  }
  stats.images = plan.encoder.total_images();

  std::map<std::pair<int64_t, int64_t>, Link> links;
  for (const Transfer& t : plan.boundary.forward) {
    const int64_t bytes = t.rows * row_bytes;
    stats.ranks[t.src_rank].bytes_sent += bytes;
    stats.ranks[t.src_rank].messages_sent += 1;
    stats.ranks[t.dst_rank].bytes_received += bytes;
    stats.ranks[t.dst_rank].messages_received += 1;
    stats.boundary_bytes += bytes;
    stats.messages += 1;
    stats.pieces += static_cast<int64_t>(t.pieces.size());
    Link& link = links[{t.src_rank, t.dst_rank}];
    link.src_rank = t.src_rank;
    link.dst_rank = t.dst_rank;
    link.bytes += bytes;
    link.messages += 1;
  }
  stats.links.reserve(links.size());
  for (auto& [key, link] : links) stats.links.push_back(link);
  for (const auto* shares : {&plan.boundary.llm_shares, &plan.boundary.encoder_shares}) {
    for (const ShareStep& share : *shares) {
      stats.share_steps += 1;
      const int64_t copies = static_cast<int64_t>(share.ranks.size()) - 1;
      for (const ShareSegment& segment : share.segments) {
        stats.ranks[segment.holder_rank].share_bytes_sent += segment.rows * row_bytes * copies;
      }
    }
  }
  stats.llm_imbalance = plan.llm.imbalance;
  stats.encoder_step_imbalance = plan.encoder.step_imbalance;
  stats.encoder_worst_wave_imbalance = plan.encoder.worst_wave_imbalance;
  stats.encoder_mean_wave_imbalance = plan.encoder.mean_wave_imbalance;
  std::vector<double> sent;
  for (int64_t r = placement.encoder.rank_offset; r < placement.encoder.end_rank(); ++r) {
    sent.push_back(static_cast<double>(stats.ranks[r].bytes_sent));
  }
  std::vector<double> received;
  for (int64_t r = placement.llm.rank_offset;
       r < placement.llm.rank_offset + placement.llm.first_stage_size(); ++r) {
    received.push_back(static_cast<double>(stats.ranks[r].bytes_received));
  }
  stats.send_imbalance = MaxOverMean(sent);
  stats.receive_imbalance = MaxOverMean(received);
  return stats;
}

}  // namespace hetpar::plan
