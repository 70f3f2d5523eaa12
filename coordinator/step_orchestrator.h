// One step at a time: send each worker its part of the plan, combine the global gradient norm
// from the modules' partial sums, collect the reports, and commit the step when every rank
// reports success or abort it on a failure report, a dead worker, a bad message or the step
// deadline.
//
// Protocol of a step (generation g, step s), as the workers see it:
//   StepPlan(s, g) -> [DP replica 0 ranks] GradNormPartial(s, g, module, sum of squares)
//   -> GradNorm(s, g, norm, clip coefficient) to every worker -> StepReport(s, g, ok, loss)
//   -> StepCommit(s, g, loss), on which workers clip and take their optimizer step; or, at any
//   point before it, StepAbort(s, g), on which they drop the step's gradients. Workers change no
//   state before the commit, so an aborted step can be planned again.
// Grad-norm contributions are counted per (module, rank): every rank of DP replica 0 of each
// module (the first of the step's replicas, when some left the run) sends one (a colocated worker
// sends one per module). The loss is counted from the LLM ranks with tp 0 on the last pipeline
// stage; their loss_tokens must add up to the plan's global_loss_tokens.
//
// Pure state machine: no clock, no I/O, no locking (RunController owns one and locks around it).
#ifndef HETPAR_COORDINATOR_STEP_ORCHESTRATOR_H_
#define HETPAR_COORDINATOR_STEP_ORCHESTRATOR_H_

#include <cstdint>
#include <deque>
#include <map>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "coordinator/membership.h"
#include "coordinator/sample_ledger.h"
#include "hetpar/v1/coordinator.pb.h"

namespace hetpar::coordinator {

// Messages to send, in order: (worker id, message).
using Outbox = std::vector<std::pair<std::string, v1::CoordinatorMessage>>;

// One step planned for the current membership.
struct PlannedStep {
  // Loss tokens in the global batch (the divisor of every microbatch loss).
  int64_t global_loss_tokens = 0;
  // Sequence positions and images of the global batch (for the step's record).
  int64_t tokens = 0;
  int64_t images = 0;
  // Model FLOPs of the step's samples, forward and backward (common/plan/flops.h), by module
  // ("encoder", "llm").
  std::map<std::string, double> model_flops;
  // Each live worker's part of the plan, by worker id. Every live worker gets a StepPlan; a
  // worker missing here gets one without a rank_plan.
  std::map<std::string, v1::RankStepPlan> worker_plans;
  // The DP replicas taking part (StepPlan.encoder_replicas, llm_replicas); empty: every one.
  std::vector<int64_t> encoder_replicas;
  std::vector<int64_t> llm_replicas;
  // Encoder replicas that joined and take their module's state from a live replica before the
  // step (StepPlan.encoder_joining).
  std::vector<int64_t> encoder_joining;
  std::vector<int64_t> llm_joining;  // the same for the LLM (StepPlan.llm_joining)
  // Where the data stands once the step commits (StepCommit.data); unset without a data index.
  v1::DataPosition data_after;
};

// Builds step plans. Plan, Committed and DataPosition are called with the RunController's lock
// held, on the thread that completed the previous step; Prepare is not (it may read or write a
// data set).
class StepPlanner {
 public:
  virtual ~StepPlanner() = default;
  // Work before the first Plan that may take long (opening the data index, generating a
  // synthetic data set): the coordinator runs it on a thread of its own, without its lock, and
  // starts no step until it has returned OK. Called once; no other method runs meanwhile except
  // DataPosition.
  virtual absl::Status Prepare() { return absl::OkStatus(); }
  // Asks a Prepare running on another thread to end early (Cancelled) where it waits or loops
  // (a wait for another process's data set generation, the skipped steps of a resume): the
  // coordinator is shutting down. Thread-safe; may come before Prepare starts.
  virtual void CancelPreparation() {}
  // Whether Prepare still has to run.
  virtual bool NeedsPreparation() const { return false; }
  // Plans step `step` (0-based; an aborted step is planned again with the same number, over the
  // same samples) for the live workers of a complete `membership`.
  virtual absl::StatusOr<PlannedStep> Plan(int64_t step, int64_t generation,
                                           const Membership& membership) = 0;
  // The step last planned was committed: the next one trains the following samples.
  virtual void Committed(int64_t step) { (void)step; }
  // Where the next step's samples start ("epoch=0,offset=16"), for Status; empty if untracked.
  virtual std::string DataPosition() const { return ""; }
  // The samples the committed steps trained, repeated and lost (SampleLedger); 0s if untracked.
  virtual LedgerCounts Ledger() const { return {}; }
};

class StepOrchestrator {
 public:
  struct Options {
    double grad_clip = 0;  // RunOptions.grad_clip; 0: off
    absl::Duration step_timeout = absl::Minutes(10);
    size_t recent_steps = 32;  // StepTimings kept for Status
    // Keep every committed step's StepTiming until TakeCommitted takes it (for the one reader
    // that writes metrics.jsonl; without a reader they would pile up).
    bool keep_committed = false;
  };
  enum class Outcome { kPending, kCommitted, kAborted };

  StepOrchestrator(const Membership& membership, Options options);

  // Starts step `step` in `generation` for `participants` (the live workers) and queues each
  // one its StepPlan. Requires !in_flight().
  void Begin(int64_t step, int64_t generation, PlannedStep plan,
             const std::vector<const WorkerRecord*>& participants, absl::Time now, Outbox* out);

  // Messages of a worker about a step. A message for a step or generation that is not the one in
  // flight is stale and ignored (kPending). A malformed or duplicate one aborts the step.
  Outcome OnGradNormPartial(const WorkerRecord& worker, const v1::GradNormPartial& partial,
                            absl::Time now, Outbox* out);
  Outcome OnReport(const WorkerRecord& worker, const v1::StepReport& report, absl::Time now,
                   Outbox* out);
  // A participant died or left: the step in flight is aborted.
  Outcome OnWorkerLost(const WorkerRecord& worker, absl::Time now, Outbox* out);
  // Aborts the step in flight when its deadline has passed.
  Outcome CheckDeadline(absl::Time now, Outbox* out);
  // Aborts the step in flight (run stopping, failing).
  Outcome Abort(const std::string& reason, absl::Time now, Outbox* out);

  bool in_flight() const { return in_flight_; }
  // The step in flight's commit tells the workers to checkpoint after applying it.
  void CheckpointAtCommit() { checkpoint_at_commit_ = true; }
  int64_t step() const { return step_; }  // the step in flight, or the last one
  // The workers of the step in flight, or of the last one (less those lost during it).
  const std::vector<std::string>& participants() const { return participants_; }
  // The generation of the step in flight (or of the last one).
  int64_t generation() const { return generation_; }
  absl::Time deadline() const {
    return in_flight_ ? started_ + options_.step_timeout : absl::InfiniteFuture();
  }
  // Why the last step was aborted (empty after a commit).
  const std::string& last_abort_reason() const { return last_abort_reason_; }
  // Committed steps whose gradient norm was not finite.
  int64_t skipped_steps() const { return skipped_steps_; }
  // Totals since the start: aborted attempts; positions and images of committed steps.
  int64_t aborted_steps() const { return aborted_steps_; }
  int64_t tokens_total() const { return tokens_total_; }
  int64_t images_total() const { return images_total_; }
  // Most recent first.
  const std::deque<v1::StepTiming>& recent() const { return recent_; }
  // With Options::keep_committed: the committed steps' timings since the last call, oldest
  // first, however many committed in between.
  std::vector<v1::StepTiming> TakeCommitted();

 private:
  struct ContributorKey {
    v1::Module module;
    int64_t rank;
    bool operator<(const ContributorKey& other) const {
      return std::tie(module, rank) < std::tie(other.module, other.rank);
    }
  };
  void Broadcast(const v1::CoordinatorMessage& message, Outbox* out) const;
  Outcome DoAbort(std::string reason, absl::Time now, Outbox* out);
  Outcome MaybeCommit(absl::Time now, Outbox* out);
  bool CountsLoss(const v1::RankCoordinates& rank) const;
  void Record(bool committed, double loss, absl::Time now, const std::string& reason);
  void AddTimings(const v1::StepReport& report);
  // StepCommit.commit_id: random, never 0.
  uint64_t NewCommitId();

  GridShape encoder_grid_;
  GridShape llm_grid_;
  Options options_;

  std::random_device random_;
  bool in_flight_ = false;
  bool checkpoint_at_commit_ = false;
  int64_t step_ = -1;
  // The step's first replica of each module: its ranks send the module's partials.
  int64_t first_encoder_replica_ = 0;
  int64_t first_llm_replica_ = 0;
  int64_t generation_ = 0;
  absl::Time started_;
  int64_t global_loss_tokens_ = 0;
  v1::DataPosition data_after_;  // PlannedStep.data_after of the step in flight
  int64_t tokens_ = 0;
  int64_t images_ = 0;
  std::map<std::string, double> model_flops_;
  std::vector<std::string> participants_;
  std::set<ContributorKey> expected_contributors_;
  std::set<ContributorKey> contributed_;
  double sum_squares_ = 0;
  bool non_finite_ = false;  // a partial of this step was NaN or infinite
  bool grad_norm_sent_ = false;
  double grad_norm_ = 0;
  absl::flat_hash_set<std::string> reported_;
  // Per module, combined from the reports' timings so far (idle_s filled in at commit).
  std::map<std::string, v1::ModuleStepSplit> splits_;
  std::map<std::string, double> busiest_;
  double loss_sum_ = 0;
  int64_t loss_tokens_ = 0;
  bool any_loss_reported_ = false;
  std::string last_abort_reason_;
  std::deque<v1::StepTiming> recent_;
  std::vector<v1::StepTiming> committed_untaken_;
  int64_t skipped_steps_ = 0;
  int64_t aborted_steps_ = 0;
  int64_t attempt_ = 0;  // the id of the latest attempt (1, 2, ... in the order begun)
  int64_t tokens_total_ = 0;
  int64_t images_total_ = 0;
};

}  // namespace hetpar::coordinator

#endif  // HETPAR_COORDINATOR_STEP_ORCHESTRATOR_H_
