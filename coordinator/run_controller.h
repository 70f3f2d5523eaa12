// The coordinator's state machine for one run: membership, run state, generations, heartbeat
// deadlines and step orchestration, with no gRPC in it.
//
// States: waiting -> running -> stopping -> done | failed.
//  * waiting: workers register into the ranks of the RunSpec layouts. When every rank is held
//    the run starts (running) and every worker gets its Assignment with all its peers. If ranks
//    are still missing register_timeout after the coordinator started, the run fails with a
//    message listing them.
//  * A worker whose heartbeats stop for heartbeat_timeout, or whose session ends while the run
//    is running, is dead. In a non-colocated run its DP replica leaves the run (its other ranks
//    are ended too): the generation is bumped, the others are told (MembershipChange), the step
//    in flight is aborted and planned again over the replicas left, as long as
//    failure.min_encoder_replicas / min_llm_replicas remain (for the LLM, each takes at least one
//    of the batch's microbatches: plan::LlmWaves). Any other loss (a colocated rank, an LLM without
//    another replica, a pool below its minimum) fails the run at once, with a message saying how to
//    resume it from its newest checkpoint. Every aborted attempt bumps the generation. While
//    waiting, a lost worker's rank is freed for another.
//  * Steps run while every rank is held and every worker's session is open: plan, StepPlan to
//    each worker, grad norm, reports, commit or abort (see step_orchestrator.h). A step aborted
//    max_step_attempts times in a row fails the run; a report of a failure that every attempt
//    would meet (StepReport.ends_run: a worker's data set that is not the plan's) fails it at
//    once. After run.steps commits the run stops.
//  * stopping: StopRun has been sent; the run is done when every session has closed, or at
//    the stop's deadline: stop_timeout after the stop; a worker that says it began its outputs
//    (Progress.phase kOutputsPhase: its wait for its last checkpoint, the model's gather, the
//    upload) moves it to a step's timeout from then, and each chunk of outputs to stop_timeout
//    from then (OutputProgress).
//
// Every method takes the current time and appends what the server must do to `Actions`. Not
// thread-safe: the server calls it with its own lock held.
#ifndef HETPAR_COORDINATOR_RUN_CONTROLLER_H_
#define HETPAR_COORDINATOR_RUN_CONTROLLER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "coordinator/membership.h"
#include "coordinator/step_orchestrator.h"
#include "hetpar/v1/coordinator.pb.h"
#include "hetpar/v1/run_spec.pb.h"

namespace hetpar::coordinator {

struct ControllerOptions {
  // Zero: from the RunSpec (coordinator.heartbeat_timeout_s, coordinator.register_timeout_s).
  absl::Duration heartbeat_timeout = absl::ZeroDuration();
  absl::Duration register_timeout = absl::ZeroDuration();
  // Zero: heartbeat_timeout / 5, at most 1 s.
  absl::Duration heartbeat_interval = absl::ZeroDuration();
  absl::Duration stop_timeout = absl::Seconds(10);
  // Zero: from the RunSpec (failure.step_timeout_s, failure.max_step_attempts); 10 minutes and 3
  // attempts where it has none.
  absl::Duration step_timeout = absl::ZeroDuration();
  int max_step_attempts = 0;
  std::string listen_address;  // shown in Status
  // The first generation (a coordinator restarted on its journal continues past the lost one's,
  // so nothing addressed to the old generation is taken for the new).
  int64_t initial_generation = 1;
  // Keep every committed step's timing until TakeCommittedSteps takes it: set by whoever writes
  // metrics.jsonl, which must see every step however fast they commit (Status shows the latest
  // 32 attempts only).
  bool keep_committed_steps = false;
  // A coordinator restarted on its journal: the run trained before, and a worker lost while no
  // coordinator ran cannot be told apart from one lost mid-run. When register_timeout passes
  // before the first step with ranks of DP replicas still missing, the run starts without those
  // replicas (a pool change, as a loss mid-run) if enough are left (failure.min_encoder_replicas,
  // failure.min_llm_replicas) instead of failing.
  bool continues_lost_run = false;
};

// What the server must do after a call, in order: send messages, then end sessions.
struct Actions {
  Outbox messages;
  // (worker id, status to end its session stream with) once its queued messages are sent.
  std::vector<std::pair<std::string, absl::Status>> end_sessions;
};

class RunController {
 public:
  // `spec` is normalised and valid. `planner` may be null: the run then admits workers, starts
  // and stays running without steps until stopped.
  static absl::StatusOr<std::unique_ptr<RunController>> Create(const v1::RunSpec& spec,
                                                               ControllerOptions options,
                                                               std::unique_ptr<StepPlanner> planner,
                                                               absl::Time now);

  absl::StatusOr<v1::RegisterResponse> Register(const v1::RegisterRequest& request, absl::Time now,
                                                Actions* actions);
  // The first message of a session stream. NotFound for an unknown worker; FailedPrecondition
  // for a dead one or one that already has a session.
  absl::Status OpenSession(const std::string& worker_id, absl::Time now, Actions* actions);
  // Any later message of the worker's session.
  absl::Status HandleMessage(const std::string& worker_id, const v1::WorkerMessage& message,
                             absl::Time now, Actions* actions);
  // The worker's session stream ended (`why` says how).
  void SessionEnded(const std::string& worker_id, const std::string& why, absl::Time now,
                    Actions* actions);
  // Deadlines: heartbeats, missing ranks, the step in flight, stopping.
  void Tick(absl::Time now, Actions* actions);

  // The planner, for StepPlanner::Prepare, which the server runs on a thread of its own without
  // its lock while the controller starts no step; null when the run has none or it needs no
  // preparation.
  StepPlanner* planner_to_prepare() const {
    return planner_ != nullptr && !planner_prepared_ ? planner_.get() : nullptr;
  }
  // Prepare has returned: the first step may start, or the run fails with its error.
  void PlannerPrepared(const absl::Status& status, absl::Time now, Actions* actions);

  // A chunk of a worker's outputs arrived: while the run stops, its deadline moves to at least
  // stop_timeout from now, so a large model still uploading is not cut off.
  void OutputProgress(absl::Time now);
  // The workers whose sessions were still open at the stop's deadline and were ended: their
  // outputs may be missing. Empty when every worker closed its session itself.
  const std::vector<std::string>& cut_at_stop() const { return cut_at_stop_; }

  v1::StatusResponse Status(absl::Time now) const;
  // With ControllerOptions::keep_committed_steps: the timings of the steps committed since the
  // last call, oldest first; otherwise none.
  std::vector<v1::StepTiming> TakeCommittedSteps() { return orchestrator_.TakeCommitted(); }
  const v1::RunSpec& spec() const { return spec_; }
  // Stops the run. With `checkpoint` (and checkpoint.dir set) the step in flight commits first,
  // with a checkpoint, and the stop follows its commit (or its abort, without one).
  v1::StopResponse Stop(const std::string& reason, bool checkpoint, absl::Time now,
                        Actions* actions);
  // Resizes the encoder pool (non-colocated runs): the target becomes request.encoder_replicas
  // (failure.min_encoder_replicas to encoder.layout.dp, else InvalidArgument naming the bounds).
  // A smaller pool retires its highest replicas at the next step boundary (their workers are
  // stopped and leave cleanly); a larger one opens vacant replicas to registering workers, each
  // joining at a step boundary once all its ranks are registered. FailedPrecondition for a
  // colocated run or one that is not waiting or running.
  absl::StatusOr<v1::ScaleResponse> Scale(const v1::ScaleRequest& request, absl::Time now,
                                          Actions* actions);

  v1::RunState state() const { return state_; }
  const std::string& state_message() const { return state_message_; }
  int64_t generation() const { return generation_; }
  int64_t committed_steps() const { return committed_steps_; }
  const Membership& membership() const { return membership_; }
  const ControllerOptions& options() const { return options_; }

 private:
  RunController(const v1::RunSpec& spec, Membership membership, ControllerOptions options,
                std::unique_ptr<StepPlanner> planner, absl::Time now);

  v1::Assignment AssignmentOf(const WorkerRecord& worker, bool with_peers) const;
  void SendAssignments(Actions* actions);
  // Why losing `worker` would end the run (its shard held nowhere else, a pool below its
  // minimum, a global batch that no longer splits); empty when the run goes on without it.
  std::string WhyALossEndsTheRun(const WorkerRecord& worker) const;
  // How long after an abort a worker that heartbeats but has not given the attempt up is taken
  // for stuck: failure.peer_timeout_s (which bounds a worker's waits for its peers), at most the
  // step timeout.
  absl::Duration StuckAfter() const;
  // The workers of the aborted attempt still in not_ended_since_abort_ are stuck: each whose loss
  // the run survives is lost (so the retry runs without its replica), the others are kept; then
  // the next attempt starts.
  void DropStuckWorkers(absl::Time now, Actions* actions);
  // `replica_may_hang`: the replica's other ranks may be hung too (a stuck worker), so their
  // sessions end as declared dead, which makes a hung process restart or exit.
  void LoseWorker(WorkerRecord* worker, const std::string& reason, bool end_session, absl::Time now,
                  Actions* actions, bool replica_may_hang = false);
  // A worker asked to leave (Leave: SIGTERM): its encoder replica leaves at the next step
  // boundary when the pool may shrink; any other worker stops the run (after a checkpoint of the
  // step in flight when checkpoint.dir is set).
  void Leave(WorkerRecord* worker, const std::string& reason, absl::Time now, Actions* actions);
  // A worker told why it is about to exit (WorkerFailure): it is lost with its error as the
  // reason, or, when the error would meet every replica (ends_run), the run fails with it, even
  // when the worker was already ended with its replica. While the run stops, the error is kept
  // for the run's final message (stop_failure_) and the others finish their outputs.
  void WorkerFailed(WorkerRecord* worker, const v1::WorkerFailure& failure, absl::Time now,
                    Actions* actions);
  // How a failed run goes on: from its newest checkpoint, or from the start without any.
  std::string HowToResume() const;
  // After an error the user must fix first: "fix the cause, then <HowToResume>", or, without
  // checkpoints, "fix the cause and start the run again".
  std::string FixThenResume() const;
  // Opens vacant encoder replicas (lowest first) until the replicas training and open reach the
  // target; closes open ones beyond it (stopping their joining workers).
  void RebalanceOpen(Actions* actions);
  // At a step boundary (no step in flight): replicas leave (a smaller target, Leave requests),
  // then every open replica whose ranks are all registered joins. Each change bumps the
  // generation and tells the workers.
  void ChangePoolAtBoundary(absl::Time now, Actions* actions);
  // Retires encoder replica `dp` (its workers get a StopRun with leave_run).
  void RemoveEncoderReplica(int64_t dp, const std::string& cause, absl::Time now, Actions* actions);
  // ControllerOptions::continues_lost_run at register_timeout: retires the DP replicas with
  // missing ranks and starts the run, returning true; false (nothing changed) when too few
  // replicas of a module would be left, or an LLM replica cannot leave (a batch that no longer
  // splits over those left).
  bool StartWithoutMissingReplicas(absl::Time now, Actions* actions);
  // Marks the live workers of `module`'s DP replica `replica` dead (the replica leaves the run)
  // and ends their open sessions with `cause` (as declared dead with `replica_may_hang`); returns
  // them as peers.
  std::vector<v1::PeerInfo> EndReplicaWorkers(v1::Module module, int64_t replica,
                                              const std::string& cause, Actions* actions,
                                              bool replica_may_hang = false);
  // The replicas of `module` in the run, `replica` aside, that hold its state (those that joined
  // and have not trained a committed step yet aside).
  int64_t HoldersWithout(v1::Module module, int64_t replica) const;
  void RecordPoolChange(v1::Module module, int64_t replica, v1::PoolChangeKind kind,
                        const std::string& cause, absl::Time now);
  void HandleOutcome(StepOrchestrator::Outcome outcome, absl::Time now, Actions* actions);
  void MaybeStartStep(absl::Time now, Actions* actions);
  // Every worker of the run has its session open (its assignment went out on it).
  bool EverySessionOpen() const;
  void BeginStopping(const std::string& reason, absl::Time now, Actions* actions);
  void Fail(const std::string& reason, absl::Time now, Actions* actions);
  void MaybeFinishStopping(absl::Time now, Actions* actions);
  // Every session closed, or the stop's deadline passed: DONE, its message naming stop_failure_.
  void EndStopping();

  v1::RunSpec spec_;
  Membership membership_;
  ControllerOptions options_;
  std::unique_ptr<StepPlanner> planner_;
  StepOrchestrator orchestrator_;
  absl::Time created_;

  v1::RunState state_ = v1::RUN_STATE_WAITING;
  std::string state_message_;
  int64_t generation_;
  // When ranks became missing (creation); InfiniteFuture once complete.
  absl::Time incomplete_since_;
  absl::Time stop_deadline_ = absl::InfiniteFuture();
  std::vector<std::string> cut_at_stop_;  // see cut_at_stop()
  int64_t committed_steps_ = 0;
  int64_t first_step_ = 0;  // committed_steps_ when this controller started (a resume's step)
  // A stop waiting for the step in flight, or for the next attempt of an aborted one, to commit
  // with a checkpoint (Stop with checkpoint).
  std::string stop_after_step_;
  bool stop_retry_taken_ = false;  // an attempt under stop_after_step_ was aborted once already
  // The first worker's error (WorkerFailure) while the run stopped: the run's final message
  // names it (its last checkpoint may be missing).
  std::string stop_failure_;
  int step_attempts_ = 0;         // aborts of the current step in a row
  bool planner_prepared_ = true;  // false until StepPlanner::Prepare has returned OK
  std::vector<v1::PoolChange> pool_changes_;  // replicas that left or joined, oldest first
  // The encoder pool size wanted (encoder.initial_replicas, then Scale); 0 in colocated runs.
  int64_t encoder_target_ = 0;
  // Encoder replicas that joined and have not yet trained a committed step: every attempt until
  // then starts with their state broadcast from a live replica (StepPlan.encoder_joining).
  std::vector<int64_t> encoder_joining_;
  std::vector<int64_t> llm_joining_;  // the same for the LLM's replicas (replacements)
  // Encoder replicas whose worker asked to leave (Leave), retired at the next step boundary.
  std::vector<int64_t> leave_requested_;
  // After an abort: the aborted attempt's workers not yet heard from since it (each sends a
  // heartbeat as the abort reaches it). The next attempt waits for them, or for their loss.
  std::vector<std::string> unheard_since_abort_;
  // After an abort: the aborted attempt's workers whose step driver has not yet given it up
  // (Progress.ended for aborted_generation_). The next attempt waits for them, their loss, or
  // StuckAfter().
  std::vector<std::string> not_ended_since_abort_;
  int64_t aborted_generation_ = 0;
  // While DropStuckWorkers loses workers, no attempt starts (MaybeStartStep).
  bool dropping_stuck_ = false;
  absl::Time aborted_at_ = absl::InfinitePast();
};

const char* RunStateName(v1::RunState state);

}  // namespace hetpar::coordinator

#endif  // HETPAR_COORDINATOR_RUN_CONTROLLER_H_
