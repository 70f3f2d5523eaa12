#include "coordinator/step_planner.h"

#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/config/config.h"
#include "common/control/plan_codec.h"
#include "common/logging.h"
#include "common/plan/flops.h"
#include "common/plan/synthetic_batch.h"

namespace hetpar::coordinator {

// ------------------------------------------------------------------------------------------------
// SyntheticBatchSource

absl::StatusOr<std::unique_ptr<SyntheticBatchSource>> SyntheticBatchSource::Create(
    const v1::RunSpec& spec) {
  std::unique_ptr<SyntheticBatchSource> source(new SyntheticBatchSource());
  source->tokens_per_image_ = config::TokensPerImage(spec.encoder().model());
  source->seq_len_ = spec.llm().model().seq_len();
  source->seed_ = static_cast<uint64_t>(spec.run().seed());
  if (source->tokens_per_image_ <= 0 || source->seq_len_ <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "synthetic batches need encoder.model.image_size / patch and llm.model.seq_len; got ",
        source->tokens_per_image_, " tokens per image and seq_len ", source->seq_len_));
  }
  return source;
}

absl::StatusOr<std::vector<plan::SampleDescriptor>> SyntheticBatchSource::Next(int64_t count) {
  plan::SyntheticBatchOptions options;
  options.samples = count;
  options.first_id = committed_;
  options.tokens_per_image = tokens_per_image_;
  options.seq_len = seq_len_;
  options.min_images = 0;
  options.max_images = 3;
  options.min_text_tokens = std::min<int64_t>(8, seq_len_);
  options.max_text_tokens = std::max<int64_t>(options.min_text_tokens, seq_len_ / 2);
  options.seed = seed_;
  absl::StatusOr<std::vector<plan::SampleDescriptor>> batch = plan::SyntheticBatch(options);
  if (batch.ok()) pending_ = count;
  return batch;
}

void SyntheticBatchSource::Commit() {
  committed_ += pending_;
  pending_ = 0;
}

std::string SyntheticBatchSource::Position() const {
  return absl::StrCat("synthetic sample ", committed_);
}

data::SamplerCursor SyntheticBatchSource::CommittedCursor() const { return {0, committed_}; }

data::SamplerCursor SyntheticBatchSource::PendingCursor() const {
  return {0, committed_ + pending_};
}

// ------------------------------------------------------------------------------------------------
// PlanLibraryPlanner

absl::StatusOr<std::unique_ptr<PlanLibraryPlanner>> PlanLibraryPlanner::Create(
    const v1::RunSpec& spec, std::unique_ptr<BatchSource> batches, int64_t ledger_from_step) {
  absl::StatusOr<plan::Placement> placement = plan::PlacementFromRunSpec(spec);
  if (!placement.ok()) return placement.status();
  // Checks the batch divides into waves now rather than at the first step.
  absl::StatusOr<plan::StepPlanOptions> options = plan::StepPlanOptionsFromRunSpec(spec, 0, 1);
  if (!options.ok()) return options.status();
  std::unique_ptr<PlanLibraryPlanner> planner(new PlanLibraryPlanner());
  planner->spec_ = spec;
  planner->placement_ = *std::move(placement);
  planner->batches_ = std::move(batches);
  if (!spec.checkpoint().resume_from().empty()) {
    absl::StatusOr<config::CheckpointSummary> checkpoint =
        config::ReadCheckpointSummary(spec.checkpoint().resume_from());
    if (!checkpoint.ok()) return checkpoint.status();
    planner->skip_steps_ = checkpoint->step;
    planner->resume_ = *std::move(checkpoint);
  }
  planner->ledger_from_step_ = ledger_from_step;
  return planner;
}

absl::StatusOr<PlannedStep> PlanLibraryPlanner::Plan(int64_t step, int64_t generation,
                                                     const Membership& membership) {
  // What an earlier Plan took is replaced (its step aborted); a failed Plan leaves nothing for
  // Committed to record.
  planned_.reset();
  // Replicas that left the run: the step is planned over the others (each LLM replica left
  // takes more waves of the same global batch), and each worker's part is given back in its own
  // world rank (plan::ReplicaSubset).
  std::optional<plan::ReplicaSubset> subset;
  std::vector<int64_t> encoder_replicas = membership.Replicas(v1::MODULE_ENCODER);
  std::vector<int64_t> llm_replicas = membership.Replicas(v1::MODULE_LLM);
  if (placement_.kind == plan::PlacementKind::kNonColocated &&
      (static_cast<int64_t>(encoder_replicas.size()) < placement_.encoder.dp ||
       static_cast<int64_t>(llm_replicas.size()) < placement_.llm.dp)) {
    absl::StatusOr<plan::ReplicaSubset> made =
        plan::ReplicaSubset::Create(placement_, encoder_replicas, llm_replicas);
    if (!made.ok()) return made.status();
    subset = *std::move(made);
  }
  absl::StatusOr<plan::StepPlanOptions> options = plan::StepPlanOptionsFromRunSpec(
      spec_, step, generation, subset ? subset->planned().llm.dp : 0);
  if (!options.ok()) return options.status();
  const data::SamplerCursor from = batches_->CommittedCursor();
  absl::StatusOr<std::vector<plan::SampleDescriptor>> samples =
      batches_->Next(spec_.run().global_batch());
  if (!samples.ok()) return samples.status();
  planned_ = PlannedSamples{from, batches_->PendingCursor(), static_cast<int64_t>(samples->size())};
  PlannedStep planned;
  if (const int64_t index_samples = batches_->IndexSamples(); index_samples > 0) {
    planned.data_after.set_index_samples(index_samples);
    planned.data_after.set_index_digest(batches_->IndexDigest());
    planned.data_after.set_epoch(planned_->to.epoch);
    planned.data_after.set_offset(planned_->to.offset);
  }
  absl::StatusOr<plan::StepPlan> step_plan =
      plan::BuildStepPlan(subset ? subset->planned() : placement_, *std::move(samples), *options);
  if (!step_plan.ok()) return step_plan.status();
  planned.global_loss_tokens = step_plan->n_global;
  for (const plan::SampleDescriptor& sample : step_plan->samples) {
    planned.tokens += sample.sequence_length();
    planned.images += sample.image_count();
  }
  const plan::StepFlops flops = plan::BatchFlops(spec_, step_plan->samples);
  planned.model_flops = {{"encoder", flops.encoder.total()}, {"llm", flops.llm.total()}};
  if (subset) {
    planned.encoder_replicas = subset->encoder_replicas();
    planned.llm_replicas = subset->llm_replicas();
  }
  for (const WorkerRecord* worker : membership.LiveWorkers()) {
    const int64_t rank = subset ? subset->PlannedRank(worker->world_rank) : worker->world_rank;
    if (rank < 0) continue;  // a worker of a replica that left (about to be ended): no part
    absl::StatusOr<plan::RankStepPlan> rank_plan = plan::ExtractRankPlan(*step_plan, rank);
    if (!rank_plan.ok()) return rank_plan.status();
    if (subset) subset->ToFullRanks(&*rank_plan);
    planned.worker_plans[worker->worker_id] = RankStepPlanToProto(*rank_plan);
  }
  return planned;
}

void PlanLibraryPlanner::Committed(int64_t step) {
  (void)step;
  if (planned_.has_value()) ledger_.Record(planned_->from, planned_->to, planned_->count);
  planned_.reset();
  batches_->Commit();
}

LedgerCounts PlanLibraryPlanner::Ledger() const { return ledger_.counts(); }

absl::Status PlanLibraryPlanner::Prepare() {
  if (batches_->NeedsOpen()) {
    absl::Status opened = batches_->Open();
    if (!opened.ok()) return opened;
  }
  // Where the checkpoint says the data stood, when it says so. Not checked for a checkpoint of the
  // run's last step (a restart that only writes the outputs: nothing is left to train).
  std::optional<data::SamplerCursor> recorded;
  if (resume_.has_value() && skip_steps_ > 0 && skip_steps_ < spec_.run().steps()) {
    absl::StatusOr<std::optional<data::SamplerCursor>> cursor =
        ResumeCursor(spec_, *resume_, batches_->IndexSamples(), batches_->IndexDigest());
    if (!cursor.ok()) return cursor.status();
    recorded = *cursor;
    if (recorded.has_value() &&
        !resume_->data->SameIndex(batches_->IndexSamples(), batches_->IndexDigest())) {
      // The steps before the checkpoint trained over another index: none of them is replayed
      // (nor recorded in the ledger); the run goes on with a new epoch over this one.
      HETPAR_LOG(WARNING)
          << "the data index changed since checkpoint " << spec_.checkpoint().resume_from() << " ("
          << resume_->data->index_samples << " samples, now " << batches_->IndexSamples()
          << (resume_->data->index_samples == batches_->IndexSamples() ? " other ones" : "")
          << "); it ended an epoch, so the run goes on with epoch " << recorded->epoch
          << " over the new index";
      batches_->Restore(*recorded);
      skip_steps_ = 0;
      return absl::OkStatus();
    }
  }
  // A resumed run continues after the samples its checkpoint's steps trained: the position its
  // steps reach in the epoch orders of this index, as the checkpoint records it.
  SampleLedger replayed;
  for (int64_t step = 0; skip_steps_ > 0; --skip_steps_, ++step) {
    if (preparation_cancelled_.load(std::memory_order_acquire)) {
      return absl::CancelledError("stopped while skipping the samples of the resumed steps");
    }
    const data::SamplerCursor from = batches_->CommittedCursor();
    absl::StatusOr<std::vector<plan::SampleDescriptor>> samples =
        batches_->Next(spec_.run().global_batch());
    if (!samples.ok()) return samples.status();
    if (ledger_from_step_ >= 0 && step >= ledger_from_step_) {
      replayed.Record(from, batches_->PendingCursor(), static_cast<int64_t>(samples->size()));
    }
    batches_->Commit();
  }
  if (recorded.has_value() && !(batches_->CommittedCursor() == *recorded)) {
    // The run (or one it resumed from) went on with a new epoch when its index changed: the
    // position no longer follows from the step, and the replayed steps are not its order.
    HETPAR_LOG(WARNING) << "checkpoint " << spec_.checkpoint().resume_from()
                        << " records the data position " << recorded->ToString() << ", not "
                        << batches_->Position()
                        << " that its steps reach from the start (its run went on with a new "
                           "epoch when the data index changed); continuing from the recorded one";
    batches_->Restore(*recorded);
    return absl::OkStatus();
  }
  ledger_ = std::move(replayed);
  return absl::OkStatus();
}

void PlanLibraryPlanner::CancelPreparation() {
  preparation_cancelled_.store(true, std::memory_order_release);
  batches_->CancelOpen();
}

bool PlanLibraryPlanner::NeedsPreparation() const {
  return batches_->NeedsOpen() || skip_steps_ > 0;
}

std::string PlanLibraryPlanner::DataPosition() const { return batches_->Position(); }

absl::StatusOr<std::optional<data::SamplerCursor>> ResumeCursor(
    const v1::RunSpec& spec, const config::CheckpointSummary& checkpoint, int64_t index_samples,
    uint32_t index_digest) {
  if (!checkpoint.data.has_value() || index_samples <= 0) return std::nullopt;
  const config::CheckpointDataPosition& at = *checkpoint.data;
  if (at.SameIndex(index_samples, index_digest)) return data::SamplerCursor{at.epoch, at.offset};
  if (at.AtEpochBoundary()) {
    return data::SamplerCursor{at.offset == 0 ? at.epoch : at.epoch + 1, 0};
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "checkpoint.resume_from='", spec.checkpoint().resume_from(), "' stopped ", at.offset,
      " samples into epoch ", at.epoch, " of a data index of ", at.index_samples,
      " samples, and data.manifest='", spec.data().manifest(), "' now indexes ", index_samples,
      at.index_samples == index_samples ? " other samples (their ids differ)" : "",
      ": the rest of epoch ", at.epoch,
      " would follow another order, training some of its samples twice and others never. Resume "
      "over the data index it was trained on (the same samples, and the same ones skipped as bad), "
      "or from a checkpoint at the end of an epoch, or start a new run from its parameters "
      "(`hetpar-reference export`, then encoder.init_from and llm.init_from)"));
}

absl::StatusOr<std::unique_ptr<StepPlanner>> MakeStepPlanner(
    const v1::RunSpec& spec, bool synthetic_batches, std::unique_ptr<data::BatchSource> opened,
    int64_t ledger_from_step) {
  std::unique_ptr<BatchSource> batches;
  if (synthetic_batches) {
    absl::StatusOr<std::unique_ptr<SyntheticBatchSource>> synthetic =
        SyntheticBatchSource::Create(spec);
    if (!synthetic.ok()) return synthetic.status();
    batches = *std::move(synthetic);
  } else {
    absl::StatusOr<std::unique_ptr<BatchSource>> index =
        MakeIndexBatchSource(spec, std::move(opened));
    if (!index.ok()) return index.status();
    batches = *std::move(index);
  }
  absl::StatusOr<std::unique_ptr<PlanLibraryPlanner>> planner =
      PlanLibraryPlanner::Create(spec, std::move(batches), ledger_from_step);
  if (!planner.ok()) return planner.status();
  return std::unique_ptr<StepPlanner>(*std::move(planner));
}

}  // namespace hetpar::coordinator
