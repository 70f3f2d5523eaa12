// Step planning for the coordinator: each step's global batch from a batch source, the step plan
// from the plan library (common/plan/step_plan.h), and each worker's part of it.
//
// A step's batch starts at the committed position of the batch source. An aborted step is
// planned again from the same position, so it trains the same samples; the position moves only
// when the step commits.
#ifndef HETPAR_COORDINATOR_STEP_PLANNER_H_
#define HETPAR_COORDINATOR_STEP_PLANNER_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/config/config.h"
#include "common/data/batch_source.h"
#include "common/data/sampler.h"
#include "common/plan/sample.h"
#include "common/plan/step_plan.h"
#include "coordinator/sample_ledger.h"
#include "coordinator/step_orchestrator.h"
#include "hetpar/v1/run_spec.pb.h"

namespace hetpar::coordinator {

// Where each step's global batch comes from. Not thread-safe (the planner's caller serialises).
class BatchSource {
 public:
  virtual ~BatchSource() = default;
  // The `count` samples after the committed position. Without a Commit in between, every call
  // returns the same samples.
  virtual absl::StatusOr<std::vector<plan::SampleDescriptor>> Next(int64_t count) = 0;
  // The samples last returned by Next were trained: the position moves past them.
  virtual void Commit() = 0;
  // The committed position, e.g. "epoch=0,offset=16".
  virtual std::string Position() const = 0;
  // The committed position as a sampler cursor, and the cursor after the samples of the last
  // successful Next (the committed one when none is pending): what a step trained, for the
  // SampleLedger.
  virtual data::SamplerCursor CommittedCursor() const = 0;
  virtual data::SamplerCursor PendingCursor() const = 0;
  // Opens what Next reads when that may take long (StepPlanner::Prepare); Next before a
  // successful Open fails. Sources with nothing to open return OK and need no Open.
  virtual absl::Status Open() { return absl::OkStatus(); }
  virtual bool NeedsOpen() const { return false; }
  // Ends an Open running on another thread early where it waits (StepPlanner::CancelPreparation).
  virtual void CancelOpen() {}
  // Samples in the data index, once open; 0 for a source without one (synthetic batches).
  virtual int64_t IndexSamples() const { return 0; }
  // data::DataIndex::IdDigest of the index, once open; 0 without one.
  virtual uint32_t IndexDigest() const { return 0; }
  // Moves the committed position to `cursor` (a resume at an epoch boundary of a data index
  // that changed: see ResumeCursor). Only for a source with an index.
  virtual void Restore(const data::SamplerCursor& cursor) { (void)cursor; }
};

// Seeded synthetic samples (common/plan/synthetic_batch.h) sized from the RunSpec: consecutive
// ids from 0, 0 to 3 images of encoder.model's tokens per image, text filling up to
// llm.model.seq_len.
class SyntheticBatchSource : public BatchSource {
 public:
  static absl::StatusOr<std::unique_ptr<SyntheticBatchSource>> Create(const v1::RunSpec& spec);
  absl::StatusOr<std::vector<plan::SampleDescriptor>> Next(int64_t count) override;
  void Commit() override;
  std::string Position() const override;
  // One epoch of unbounded size: {0, samples committed}.
  data::SamplerCursor CommittedCursor() const override;
  data::SamplerCursor PendingCursor() const override;

 private:
  SyntheticBatchSource() = default;
  int64_t tokens_per_image_ = 0;
  int64_t seq_len_ = 0;
  uint64_t seed_ = 0;
  int64_t committed_ = 0;  // samples trained
  int64_t pending_ = 0;    // samples of the last Next
};

// The run's training batches from the batch source every runtime shares
// (common/train/batch_source.h): the data index in the epoch sampler's order, sample id = index
// position. Opened (the synthetic data set generated, the index read or built) by Open, which the
// coordinator runs on its own thread once it serves, so it can start and admit workers before
// the data set exists and never reads the data set under its lock.
// `opened`, when given, is the data set already opened by the caller (`hetpar run` opens it
// before it starts any process): it is used as it is and needs no Open.
absl::StatusOr<std::unique_ptr<BatchSource>> MakeIndexBatchSource(
    const v1::RunSpec& spec, std::unique_ptr<data::BatchSource> opened = nullptr);

// Where a run resumed from `checkpoint` (checkpoint.resume_from) continues over a data index of
// `index_samples` samples. nullopt: the manifest records no position (the checkpoint's steps are
// replayed over the index, as they always were). The recorded position when the index has the
// size the checkpoint records (where replaying its steps lands too, unless the run went on with a
// new epoch over a changed index before). The start of the checkpoint's next epoch when the index
// has another size and the checkpoint is at an epoch boundary (the new epoch's order is over the
// new index).
// FailedPrecondition, naming both sizes and the epoch, when the index changed mid-epoch: the rest
// of the epoch's order would be another one, training some of its samples twice and others never.
// An index of the recorded size whose ids have another digest (both known) counts as another
// index: other samples, or the same ones in another order.
absl::StatusOr<std::optional<data::SamplerCursor>> ResumeCursor(
    const v1::RunSpec& spec, const config::CheckpointSummary& checkpoint, int64_t index_samples,
    uint32_t index_digest = 0);

// The coordinator's StepPlanner over the plan library. A run resumed from a checkpoint
// (checkpoint.resume_from) starts at the checkpoint's step: Prepare skips the samples of the
// steps before it, so the data position is the one the checkpointed run had reached. Its
// SampleLedger records the samples of the steps this run committed, and of the steps Prepare
// skips from `ledger_from_step` on: a coordinator restarted on its journal continues one run,
// whose steps before the checkpoint its lost coordinator committed. By default (-1) none of
// the skipped steps are recorded: a run resumed by `--resume` is a run of its own.
class PlanLibraryPlanner : public StepPlanner {
 public:
  // InvalidArgument when the RunSpec's batch cannot be planned (global_batch not divisible).
  static absl::StatusOr<std::unique_ptr<PlanLibraryPlanner>> Create(
      const v1::RunSpec& spec, std::unique_ptr<BatchSource> batches, int64_t ledger_from_step = -1);

  absl::StatusOr<PlannedStep> Plan(int64_t step, int64_t generation,
                                   const Membership& membership) override;
  void Committed(int64_t step) override;
  std::string DataPosition() const override;
  absl::Status Prepare() override;
  void CancelPreparation() override;
  bool NeedsPreparation() const override;
  LedgerCounts Ledger() const override;

 private:
  // The samples the last Plan took from the batch source, recorded when its step commits.
  struct PlannedSamples {
    data::SamplerCursor from;
    data::SamplerCursor to;
    int64_t count = 0;
  };

  PlanLibraryPlanner() = default;
  v1::RunSpec spec_;
  plan::Placement placement_;
  std::unique_ptr<BatchSource> batches_;
  // Steps of a resumed run's checkpoint whose samples Prepare skips (checkpoint.resume_from).
  int64_t skip_steps_ = 0;
  std::optional<config::CheckpointSummary> resume_;  // what checkpoint.resume_from's manifest says
  int64_t ledger_from_step_ = -1;  // the first skipped step the ledger records; -1: none
  // Replaced by every Plan (an aborted step is planned again), cleared by Committed.
  std::optional<PlannedSamples> planned_;
  SampleLedger ledger_;
  std::atomic<bool> preparation_cancelled_{false};
};

// The planner `hetpar coordinator` uses: over the data index, or over synthetic samples.
// `opened`: as for MakeIndexBatchSource (ignored with synthetic batches). `ledger_from_step`: as
// for PlanLibraryPlanner::Create.
absl::StatusOr<std::unique_ptr<StepPlanner>> MakeStepPlanner(
    const v1::RunSpec& spec, bool synthetic_batches,
    std::unique_ptr<data::BatchSource> opened = nullptr, int64_t ledger_from_step = -1);

}  // namespace hetpar::coordinator

#endif  // HETPAR_COORDINATOR_STEP_PLANNER_H_
