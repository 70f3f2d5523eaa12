// The step protocol a worker speaks with the coordinator, written once for every role (encoder,
// LLM, colocated): a small state machine over a ControlChannel (the coordinator session) and a
// ModuleRuntime (the module or modules this rank runs).
//
//   kAwaitingPlan --plan--> kComputing --RunStep ok, partials sent--> kAwaitingNorm
//         ^  ^                  | error: report !ok, Discard               | grad norm:
//         |  +------------------+                                          v report sent
//         |                                                         kAwaitingCommit
//         |                                                                | commit
//         +------------------ kApplying (clip, optimizer) <---------------+
//
//   abort while awaiting the norm or the commit: Discard, back to kAwaitingPlan
//   stop while a step is in flight: Discard, kStopped
//
// Parameters and optimizer state change only in kApplying, on the coordinator's commit of that
// step, which comes once every rank has reported it; until then an abort (a lost worker, a
// deadline, a failed report, a loss-token mismatch) discards the step's gradients and leaves the
// rank exactly as before the step, so the coordinator can re-run it. The report's optimizer_s is
// the optimizer step that applied the previous step (at the start of this one). A commit of a
// step whose norm was not finite (GradNorm.skip) discards its gradients instead of applying them.
// Every wait for the coordinator has a deadline. A step that fails on this rank (a peer lost, a
// wait interrupted by the coordinator's abort) is reported and discarded; the coordinator then
// aborts it and plans it again, or stops the run. Each plan carries its generation (every
// attempt has its own): before the first step of a new generation the rank forms its groups
// anew (ModuleRuntime::Regroup), over the replicas the plan names. The interrupt, when
// given, is armed with the plan's generation as each step starts, so that an abort of that
// attempt which arrived before the plan was taken still ends it. A membership change is logged; the
// plans that follow it say what changed. A stop of a newer generation (one that aborted a step in
// flight, StopRun.generation) has the rank form its groups anew in it, over the replicas of its
// last plan, before Run returns, so that the final outputs' gathers meet nothing the abort left
// half done. One thread calls Run.
#ifndef HETPAR_COMMON_WORKER_STEP_DRIVER_H_
#define HETPAR_COMMON_WORKER_STEP_DRIVER_H_

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/control/client.h"
#include "common/step_interrupt.h"
#include "common/worker/module_runtime.h"
#include "hetpar/v1/coordinator.pb.h"

namespace hetpar::worker {

// What the driver needs of the coordinator: its messages and three kinds of reply.
class ControlChannel {
 public:
  virtual ~ControlChannel() = default;
  // The next coordinator message; DeadlineExceeded after `timeout`.
  virtual absl::StatusOr<v1::CoordinatorMessage> Next(absl::Duration timeout) = 0;
  virtual absl::Status SendGradNormPartial(const v1::GradNormPartial& partial) = 0;
  virtual absl::Status SendReport(const v1::StepReport& report) = 0;
  virtual absl::Status SendProgress(const v1::Progress& progress) = 0;
};

// The channel of a registered worker: its coordinator session (borrowed).
class SessionChannel : public ControlChannel {
 public:
  explicit SessionChannel(coordinator::WorkerSession* session) : session_(session) {}
  absl::StatusOr<v1::CoordinatorMessage> Next(absl::Duration timeout) override;
  absl::Status SendGradNormPartial(const v1::GradNormPartial& partial) override;
  absl::Status SendReport(const v1::StepReport& report) override;
  absl::Status SendProgress(const v1::Progress& progress) override;

 private:
  coordinator::WorkerSession* session_;
};

struct StepDriverOptions {
  // Bound of each wait for the coordinator (the next plan, the step's decision).
  absl::Duration timeout = absl::Seconds(300);
  // The coordinator's bound on a step attempt (failure.step_timeout_s, or its --step-timeout, as
  // the registration's RunSpec has it). Each wait is bounded by timeout + step_timeout: the
  // coordinator ends every attempt by then (a rank that finished its part early, a frozen
  // encoder, waits while the others compute), and after an abort holds the next plan at most
  // that long for a stuck worker.
  absl::Duration step_timeout = absl::ZeroDuration();
  // Called after each committed and applied step with the rank's per-module split (the
  // report's timings).
  std::function<void(int64_t step, const std::vector<ModuleTimings>& timings)> on_applied;
  // Called after each committed step, applied or skipped (a non-finite gradient norm), after
  // on_applied.
  std::function<void(int64_t step)> on_committed;
  // The generation the rank's groups were formed in at its start (the Assignment's), and the
  // replicas they were formed over.
  int64_t initial_generation = 0;
  StepReplicas initial_replicas;
  // Armed with each plan's generation as its step starts, cleared for the final outputs (may be
  // null; the session raises it on an abort or a stop).
  StepInterrupt* interrupt = nullptr;
  // Called with each membership change before the plans that follow it (workers that joined
  // are connected to here); an error is logged, and the step that needs the peer fails.
  std::function<absl::Status(const v1::MembershipChange& change)> on_membership_change;
  // Called after a step's compute succeeded (its host read done), with the plan's generation,
  // before its gradient-norm partials go out: an error fails the step on this rank (a collective
  // group that reports an error, nn::CollectiveAborter::CheckGeneration). May be null.
  std::function<absl::Status(int64_t generation)> check_collectives;
};

class StepDriver {
 public:
  enum class State {
    kAwaitingPlan,
    kComputing,
    kAwaitingNorm,
    kAwaitingCommit,
    kApplying,
    kStopped,
    kFailed
  };

  // Borrows `channel` and `modules`.
  StepDriver(ControlChannel* channel, ModuleRuntime* modules, StepDriverOptions options)
      : channel_(channel),
        modules_(modules),
        options_(std::move(options)),
        formed_generation_(options_.initial_generation),
        replicas_(options_.initial_replicas) {}
  StepDriver(const StepDriver&) = delete;
  StepDriver& operator=(const StepDriver&) = delete;

  // Runs steps until the coordinator says stop (OK) or the session fails (the error). A step
  // that fails in RunStep (or in forming its groups) is reported to the coordinator and
  // discarded; the driver then waits for the coordinator's next word. A stop of a failed run
  // (StopRun.run_failed) ends Run with Aborted and the stop's reason, forming no groups; so does
  // a send that fails because the coordinator ended the session after such a stop.
  absl::Status Run();

  State state() const { return state_; }
  int64_t steps_applied() const { return steps_applied_; }
  int64_t steps_discarded() const { return steps_discarded_; }
  // Committed without an update: the coordinator's norm was not finite (GradNorm.skip).
  int64_t steps_skipped() const { return steps_skipped_; }
  // Steps that failed on this rank (reported, discarded).
  int64_t steps_failed() const { return steps_failed_; }
  // The stop that ended Run was for this worker alone (StopRun.leave_run): its replica left a
  // run that goes on, and it writes no final outputs.
  bool left_run() const { return left_run_; }
  // The stop that ended Run was StopRun.replica_left: a worker of this worker's replica was lost
  // and the replica left a run that goes on. Run returned the stop's reason as a failure.
  bool replica_left() const { return replica_left_; }
  // Run's failure came from the coordinator (a failed run's stop, or its replica's): the
  // coordinator knows why, and the worker has nothing to tell it.
  bool ended_by_coordinator() const { return !run_failed_.ok(); }

 private:
  // Waits for the next message other than heartbeat acks, assignments and membership changes
  // (logged).
  absl::StatusOr<v1::CoordinatorMessage> NextRelevant();
  // kComputing through kApplying for one plan; returns with state_ set to what follows.
  absl::Status RunOneStep(const v1::StepPlan& step_plan);
  // Handles an abort (discard) or a stop of step `step` in flight; false for other messages.
  bool EndsStep(const v1::CoordinatorMessage& message, int64_t step);
  // A stop: logs it and keeps what it says (leave_run, generation).
  void Stopped(const v1::StopRun& stop);
  // After a stop of a newer generation than the groups': forms them anew in it (interrupt cleared).
  absl::Status RegroupForOutputs();
  // `sent` of a message to the coordinator. A send fails once the session has ended; the
  // coordinator's last word then says why better than the send does: a failed run's stop queued
  // before the end (its reason), else the session's final status.
  absl::Status Sent(absl::Status sent);
  absl::Status Fail(absl::Status status);
  // Tells the coordinator this rank gave the attempt of `generation` up (Progress.ended): the
  // next attempt waits for it. A send that fails is logged: the session's end shows at the next
  // wait.
  void SendEnded(int64_t step, int64_t generation);

  ControlChannel* channel_;
  ModuleRuntime* modules_;
  StepDriverOptions options_;
  State state_ = State::kAwaitingPlan;
  int64_t steps_applied_ = 0;
  int64_t steps_discarded_ = 0;
  int64_t steps_skipped_ = 0;
  int64_t steps_failed_ = 0;
  // The last attempt that failed on this rank (step, generation); -1: none.
  int64_t failed_step_ = -1;
  int64_t failed_generation_ = -1;
  int64_t formed_generation_ = 0;
  StepReplicas replicas_;        // those of the last plan (or initial_replicas)
  int64_t stop_generation_ = 0;  // StopRun.generation of the stop that ended Run
  double last_optimizer_s_ = 0;  // the last Apply, reported with the next step
  bool left_run_ = false;
  bool replica_left_ = false;
  // Aborted with the reason of a failed run's stop (StopRun.run_failed); OK otherwise.
  absl::Status run_failed_;
};

const char* StateName(StepDriver::State state);

}  // namespace hetpar::worker

#endif  // HETPAR_COMMON_WORKER_STEP_DRIVER_H_
