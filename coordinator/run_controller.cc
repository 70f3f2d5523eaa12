#include "coordinator/run_controller.h"

#include <algorithm>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/config/config.h"
#include "common/control/client.h"
#include "common/control/grpc_status.h"
#include "common/logging.h"
#include "common/plan/step_plan.h"
#include "common/status.h"
#include "coordinator/limits.h"

namespace hetpar::coordinator {
namespace {

// Dead workers shown in Status, most recent last.
constexpr size_t kDeadWorkersShown = 64;

// A stop in `generation` (StopRun.generation: the groups the final outputs gather over).
v1::CoordinatorMessage StopMessage(const std::string& reason, int64_t generation) {
  v1::CoordinatorMessage message;
  message.mutable_stop()->set_reason(reason);
  message.mutable_stop()->set_generation(generation);
  return message;
}

// The module a (non-colocated) worker role trains; UNSPECIFIED for a colocated worker.
v1::Module ModuleOf(v1::WorkerRole role) {
  return role == v1::WORKER_ROLE_ENCODER ? v1::MODULE_ENCODER
         : role == v1::WORKER_ROLE_LLM   ? v1::MODULE_LLM
                                         : v1::MODULE_UNSPECIFIED;
}

void EraseValue(std::vector<int64_t>& values, int64_t value) {
  values.erase(std::remove(values.begin(), values.end(), value), values.end());
}

// Seconds since the Unix epoch (PoolChange.unix_time).
double UnixSeconds(absl::Time t) { return static_cast<double>(absl::ToUnixMicros(t)) * 1e-6; }

}  // namespace

const char* RunStateName(v1::RunState state) {
  switch (state) {
    case v1::RUN_STATE_WAITING:
      return "waiting";
    case v1::RUN_STATE_RUNNING:
      return "running";
    case v1::RUN_STATE_STOPPING:
      return "stopping";
    case v1::RUN_STATE_DONE:
      return "done";
    case v1::RUN_STATE_FAILED:
      return "failed";
    case v1::RUN_STATE_UNSPECIFIED:
    case v1::RunState_INT_MIN_SENTINEL_DO_NOT_USE_:
    case v1::RunState_INT_MAX_SENTINEL_DO_NOT_USE_:
      break;
  }
  return "unspecified";
}

absl::StatusOr<std::unique_ptr<RunController>> RunController::Create(
    const v1::RunSpec& spec, ControllerOptions options, std::unique_ptr<StepPlanner> planner,
    absl::Time now) {
  absl::StatusOr<Membership> membership = Membership::Create(spec);
  if (!membership.ok()) return membership.status();
  if (options.heartbeat_timeout <= absl::ZeroDuration()) {
    options.heartbeat_timeout = absl::Seconds(spec.coordinator().heartbeat_timeout_s());
  }
  if (options.register_timeout <= absl::ZeroDuration()) {
    options.register_timeout = absl::Seconds(spec.coordinator().register_timeout_s());
  }
  if (options.heartbeat_timeout <= absl::ZeroDuration() ||
      options.register_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "coordinator.heartbeat_timeout_s=", spec.coordinator().heartbeat_timeout_s(),
        " and coordinator.register_timeout_s=", spec.coordinator().register_timeout_s(),
        " must be > 0 seconds (is the RunSpec normalised?)"));
  }
  if (options.heartbeat_interval <= absl::ZeroDuration()) {
    options.heartbeat_interval = std::min(absl::Seconds(1), options.heartbeat_timeout / 5);
  }
  if (options.step_timeout <= absl::ZeroDuration()) {
    options.step_timeout = spec.failure().step_timeout_s() > 0
                               ? absl::Seconds(spec.failure().step_timeout_s())
                               : absl::Minutes(10);
  }
  if (options.max_step_attempts < 1) {
    options.max_step_attempts =
        spec.failure().max_step_attempts() > 0
            ? static_cast<int>(std::min<int64_t>(spec.failure().max_step_attempts(), 1 << 30))
            : 3;
  }
  auto controller = std::unique_ptr<RunController>(
      new RunController(spec, *std::move(membership), std::move(options), std::move(planner), now));
  // A resumed run goes on from its checkpoint's step.
  if (!spec.checkpoint().resume_from().empty()) {
    absl::StatusOr<config::CheckpointSummary> checkpoint =
        config::ReadCheckpointSummary(spec.checkpoint().resume_from());
    if (!checkpoint.ok()) return checkpoint.status();
    controller->committed_steps_ = checkpoint->step;
    controller->first_step_ = checkpoint->step;
  }
  // The encoder pool starts with encoder.initial_replicas of the layout's replicas; the others
  // are vacant until the pool grows (Scale).
  if (controller->membership_.placement() != v1::PLACEMENT_COLOCATED) {
    const int64_t dp = controller->membership_.encoder_grid().dp;
    const int64_t initial = spec.encoder().initial_replicas() > 0
                                ? std::min<int64_t>(dp, spec.encoder().initial_replicas())
                                : dp;
    controller->encoder_target_ = initial;
    for (int64_t d = initial; d < dp; ++d) {
      controller->membership_.RetireReplica(v1::MODULE_ENCODER, d);
    }
  }
  return controller;
}

RunController::RunController(const v1::RunSpec& spec, Membership membership,
                             ControllerOptions options, std::unique_ptr<StepPlanner> planner,
                             absl::Time now)
    : spec_(spec),
      membership_(std::move(membership)),
      options_(std::move(options)),
      planner_(std::move(planner)),
      orchestrator_(membership_,
                    StepOrchestrator::Options{spec.run().grad_clip(), options_.step_timeout, 32,
                                              options_.keep_committed_steps}),
      created_(now),
      generation_(std::max<int64_t>(1, options_.initial_generation)),
      incomplete_since_(now),
      planner_prepared_(planner_ == nullptr || !planner_->NeedsPreparation()) {}

v1::Assignment RunController::AssignmentOf(const WorkerRecord& worker, bool with_peers) const {
  v1::Assignment assignment;
  assignment.set_worker_id(worker.worker_id);
  assignment.set_role(worker.role);
  for (const auto& rank : worker.ranks) *assignment.add_ranks() = rank;
  assignment.set_generation(generation_);
  assignment.set_world_rank(worker.world_rank);
  assignment.set_heartbeat_interval_s(absl::ToDoubleSeconds(options_.heartbeat_interval));
  assignment.set_heartbeat_timeout_s(absl::ToDoubleSeconds(options_.heartbeat_timeout));
  if (membership_.placement() != v1::PLACEMENT_COLOCATED) {
    for (int64_t r : membership_.Replicas(v1::MODULE_ENCODER)) assignment.add_encoder_replicas(r);
    for (int64_t r : membership_.Replicas(v1::MODULE_LLM)) assignment.add_llm_replicas(r);
  }
  if (with_peers) {
    for (const WorkerRecord* peer : membership_.PeersOf(worker)) {
      *assignment.add_peers() = membership_.PeerInfoOf(*peer);
    }
    assignment.set_peers_complete(true);
  }
  return assignment;
}

void RunController::SendAssignments(Actions* actions) {
  for (WorkerRecord* worker : membership_.TrainingWorkers()) {
    if (!worker->session_open) continue;
    v1::CoordinatorMessage message;
    *message.mutable_assignment() = AssignmentOf(*worker, /*with_peers=*/true);
    actions->messages.emplace_back(worker->worker_id, std::move(message));
  }
}

absl::StatusOr<v1::RegisterResponse> RunController::Register(const v1::RegisterRequest& request,
                                                             absl::Time now, Actions* actions) {
  if (state_ != v1::RUN_STATE_WAITING && state_ != v1::RUN_STATE_RUNNING) {
    return absl::FailedPreconditionError(
        absl::StrCat("the run is ", RunStateName(state_), " and admits no workers",
                     state_message_.empty() ? "" : ": " + state_message_));
  }
  // Sizes and characters first: nothing unchecked from the network is stored or logged.
  HETPAR_RETURN_IF_ERROR(CheckRegistration(request));
  // A worker asking for a rank of a vacant encoder replica while the run trains (a pod added to
  // the pool's StatefulSet, a drained pod started again) grows the pool's target by one.
  if (state_ == v1::RUN_STATE_RUNNING && membership_.placement() != v1::PLACEMENT_COLOCATED &&
      request.role() == v1::WORKER_ROLE_ENCODER && request.has_requested_rank() &&
      request.requested_rank() >= 0 &&
      request.requested_rank() < membership_.encoder_grid().size()) {
    const int64_t d =
        CoordinatesOf(v1::MODULE_ENCODER, membership_.encoder_grid(), request.requested_rank())
            .dp();
    const std::vector<int64_t> active = membership_.Replicas(v1::MODULE_ENCODER);
    const std::vector<int64_t> open = membership_.OpenReplicas(v1::MODULE_ENCODER);
    if (std::find(active.begin(), active.end(), d) == active.end() &&
        std::find(open.begin(), open.end(), d) == open.end() &&
        encoder_target_ < membership_.encoder_grid().dp) {
      ++encoder_target_;
      membership_.SetOpen(v1::MODULE_ENCODER, d, true);
      HETPAR_LOG(INFO) << "a worker registers into vacant encoder replica " << d
                       << ": the pool's target grows to " << encoder_target_ << " replicas";
    }
  }
  absl::StatusOr<WorkerRecord*> admitted = membership_.Admit(request, generation_, now);
  if (!admitted.ok()) return admitted.status();
  WorkerRecord* worker = *admitted;
  HETPAR_LOG(INFO)
      << "registered " << worker->Describe() << " data-plane "
      << DataAddressText(worker->data_address) << " (" << membership_.alive_workers() << "/"
      << membership_.expected_workers() << ")"
      << (worker->joining
              ? absl::StrCat("; joining: ", worker->role == v1::WORKER_ROLE_LLM ? "llm" : "encoder",
                             " replica ",
                             Membership::ReplicaOf(*worker, worker->role == v1::WORKER_ROLE_LLM
                                                                ? v1::MODULE_LLM
                                                                : v1::MODULE_ENCODER),
                             " joins the run at a step boundary once all its ranks "
                             "are registered")
              : "");
  // While running, the ranks of the replicas in the run are all held (a loss retires its
  // replica or fails the run): only workers joining an open encoder replica are admitted.
  const bool complete = state_ == v1::RUN_STATE_WAITING && membership_.Complete();
  if (complete) {
    incomplete_since_ = absl::InfiniteFuture();
    state_ = v1::RUN_STATE_RUNNING;
    HETPAR_LOG(INFO) << "every rank registered (" << membership_.expected_workers()
                     << " workers): run " << spec_.run().name() << " is running, generation "
                     << generation_;
    SendAssignments(actions);
  }
  v1::RegisterResponse response;
  *response.mutable_assignment() = AssignmentOf(*worker, /*with_peers=*/complete);
  *response.mutable_spec() = spec_;
  // The step timeout in force (a --step-timeout overrides the RunSpec's): workers wait for a
  // step's decision that long.
  response.mutable_spec()->mutable_failure()->set_step_timeout_s(
      absl::ToDoubleSeconds(options_.step_timeout));
  return response;
}

absl::Status RunController::OpenSession(const std::string& worker_id, absl::Time now,
                                        Actions* actions) {
  WorkerRecord* worker = membership_.Find(worker_id);
  if (worker == nullptr) {
    return absl::NotFoundError(absl::StrCat("unknown worker id '", Printable(worker_id),
                                            "': call Register first and open the session with "
                                            "the worker_id it returned"));
  }
  if (!worker->alive) {
    return absl::FailedPreconditionError(absl::StrCat("worker ", worker_id,
                                                      " is no longer in the run (",
                                                      worker->dead_reason, "); register again"));
  }
  if (worker->session_open) {
    return absl::FailedPreconditionError(
        absl::StrCat("worker ", worker_id, " already has an open session"));
  }
  worker->session_open = true;
  worker->last_heartbeat = now;
  if (state_ == v1::RUN_STATE_STOPPING || state_ == v1::RUN_STATE_DONE) {
    // Registered before the stop, its session opened after it (a stop with no session open ends
    // the run at once): it hears the stop, or it would wait for a start that never comes.
    actions->messages.emplace_back(worker_id, StopMessage(state_message_, generation_));
    return absl::OkStatus();
  }
  if (state_ == v1::RUN_STATE_FAILED) {
    v1::CoordinatorMessage stop = StopMessage(state_message_, generation_);
    stop.mutable_stop()->set_run_failed(true);
    actions->messages.emplace_back(worker_id, std::move(stop));
    actions->end_sessions.emplace_back(worker_id,
                                       absl::AbortedError("run failed: " + state_message_));
    return absl::OkStatus();
  }
  if (state_ == v1::RUN_STATE_RUNNING && membership_.Complete() && !worker->joining) {
    v1::CoordinatorMessage message;
    *message.mutable_assignment() = AssignmentOf(*worker, /*with_peers=*/true);
    actions->messages.emplace_back(worker_id, std::move(message));
  }
  MaybeStartStep(now, actions);
  return absl::OkStatus();
}

absl::Status RunController::HandleMessage(const std::string& worker_id,
                                          const v1::WorkerMessage& message, absl::Time now,
                                          Actions* actions) {
  WorkerRecord* worker = membership_.Find(worker_id);
  if (worker != nullptr && !worker->alive && message.has_failure()) {
    // Ended with its replica (a peer's loss came first) before its own word arrived: an error
    // every replica would meet still fails the run.
    if (message.failure().ends_run()) WorkerFailed(worker, message.failure(), now, actions);
    return absl::OkStatus();
  }
  if (worker == nullptr || !worker->alive) {
    return absl::FailedPreconditionError(absl::StrCat(
        "worker ", worker_id, " is no longer in the run",
        worker == nullptr ? "" : " (" + worker->dead_reason + ")", "; register again"));
  }
  // Any message proves the worker alive.
  worker->last_heartbeat = now;
  switch (message.kind_case()) {
    case v1::WorkerMessage::kHeartbeat: {
      // The next attempt may have been waiting for this worker to be heard from.
      if (!unheard_since_abort_.empty()) MaybeStartStep(now, actions);
      if (!message.heartbeat().ack_requested()) return absl::OkStatus();
      v1::CoordinatorMessage ack;
      v1::HeartbeatAck* a = ack.mutable_heartbeat_ack();
      a->set_seq(message.heartbeat().seq());
      a->set_client_time_ns(message.heartbeat().client_time_ns());
      a->set_generation(generation_);
      actions->messages.emplace_back(worker_id, std::move(ack));
      return absl::OkStatus();
    }
    case v1::WorkerMessage::kProgress:
      if (!message.progress().ended()) worker->progress = message.progress();
      if (state_ == v1::RUN_STATE_STOPPING && !message.progress().ended() &&
          message.progress().phase() == kOutputsPhase) {
        // A worker writing its outputs (waiting for its last checkpoint, at most half of
        // failure.step_timeout_s; gathering the model; sending it) gets as long as a step.
        stop_deadline_ = std::max(stop_deadline_, now + options_.step_timeout);
      }
      if (message.progress().ended()) {
        worker->ended_generation =
            std::max(worker->ended_generation, message.progress().generation());
        // The next attempt may have been waiting for this worker to give the last one up.
        if (!not_ended_since_abort_.empty()) MaybeStartStep(now, actions);
      }
      return absl::OkStatus();
    case v1::WorkerMessage::kGradNormPartial:
      HandleOutcome(orchestrator_.OnGradNormPartial(*worker, message.grad_norm_partial(), now,
                                                    &actions->messages),
                    now, actions);
      return absl::OkStatus();
    case v1::WorkerMessage::kReport:
      // A rank that reports its attempt failed has given it up (its driver waits for the next).
      if (!message.report().ok()) {
        worker->ended_generation =
            std::max(worker->ended_generation, message.report().generation());
        if (message.report().ends_run() && state_ == v1::RUN_STATE_RUNNING) {
          // Planned again, the step would fail the same way (this worker's data set is not the
          // plan's): the run fails now, with the worker's words, not after every attempt.
          Fail(absl::StrCat("worker ", worker->Describe(), " failed step ", message.report().step(),
                            ": ", Printable(message.report().error(), kMaxErrorBytes),
                            "; every attempt of the step would fail the same way, so the run "
                            "stops; ",
                            FixThenResume()),
               now, actions);
          return absl::OkStatus();
        }
      }
      HandleOutcome(orchestrator_.OnReport(*worker, message.report(), now, &actions->messages), now,
                    actions);
      return absl::OkStatus();
    case v1::WorkerMessage::kLeave:
      Leave(worker, Printable(message.leave().reason()), now, actions);
      return absl::OkStatus();
    case v1::WorkerMessage::kFailure:
      WorkerFailed(worker, message.failure(), now, actions);
      return absl::OkStatus();
    case v1::WorkerMessage::kOpen:
      return absl::InvalidArgumentError(
          absl::StrCat("worker ", worker_id, " sent a second SessionOpen on its session"));
    case v1::WorkerMessage::KIND_NOT_SET:
      break;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("worker ", worker_id, " sent an empty WorkerMessage"));
}

void RunController::SessionEnded(const std::string& worker_id, const std::string& why,
                                 absl::Time now, Actions* actions) {
  WorkerRecord* worker = membership_.Find(worker_id);
  if (worker == nullptr) return;
  worker->session_open = false;
  if (worker->alive) {
    const bool removed =
        worker->role == v1::WORKER_ROLE_ENCODER && !worker->joining &&
        membership_.placement() != v1::PLACEMENT_COLOCATED && [&] {
          const std::vector<int64_t> active = membership_.Replicas(v1::MODULE_ENCODER);
          return std::find(active.begin(), active.end(),
                           Membership::ReplicaOf(*worker, v1::MODULE_ENCODER)) == active.end();
        }();
    if (state_ == v1::RUN_STATE_STOPPING || state_ == v1::RUN_STATE_DONE ||
        state_ == v1::RUN_STATE_FAILED) {
      membership_.MarkDead(worker_id, "left after stop");
    } else if (removed && state_ == v1::RUN_STATE_RUNNING) {
      // A worker of a replica that left the pool (Scale, Leave) closing its session.
      membership_.MarkDead(worker_id, "left the encoder pool");
      HETPAR_LOG(INFO) << "worker " << worker->Describe() << " left the encoder pool";
    } else {
      LoseWorker(worker, absl::StrCat("session ended: ", why), /*end_session=*/false, now, actions);
    }
  }
  MaybeFinishStopping(now, actions);
}

std::string RunController::WhyALossEndsTheRun(const WorkerRecord& worker) const {
  // A DP replica's state (parameters, AdamW moments) is the same on every replica of its module:
  // the run goes on without the lost worker's replica, as long as enough replicas remain. A
  // colocated rank's state, or that of an LLM without DP, exists nowhere else.
  const v1::Module module = ModuleOf(worker.role);
  const std::string name = module == v1::MODULE_ENCODER ? "encoder" : "llm";
  if (module == v1::MODULE_UNSPECIFIED) {
    return "its colocated shard (parameters and optimizer state) is held by no other worker";
  }
  const int64_t replica = Membership::ReplicaOf(worker, module);
  const std::vector<int64_t> replicas = membership_.Replicas(module);
  const bool in_run = std::find(replicas.begin(), replicas.end(), replica) != replicas.end();
  const int64_t left_after = static_cast<int64_t>(replicas.size()) - (in_run ? 1 : 0);
  const int64_t minimum =
      std::max<int64_t>(1, module == v1::MODULE_ENCODER ? spec_.failure().min_encoder_replicas()
                                                        : spec_.failure().min_llm_replicas());
  if (HoldersWithout(module, replica) < 1) {
    return absl::StrCat("its ", name,
                        " shard (parameters and optimizer state) is held by no other worker");
  }
  if (left_after < minimum) {
    return absl::StrCat("the ", name, " pool would shrink to ", left_after,
                        " replicas, below failure.min_", name, "_replicas=", minimum);
  }
  if (module == v1::MODULE_LLM) {
    // Each LLM replica left must take at least one of the batch's microbatches.
    if (absl::Status splits = plan::LlmWaves(spec_, left_after).status(); !splits.ok()) {
      return std::string(splits.message());
    }
  }
  return "";
}

absl::Duration RunController::StuckAfter() const {
  const double peer_s = spec_.failure().peer_timeout_s();
  // At most the step timeout: a worker waits for its next plan coordinator_timeout +
  // step_timeout (StepDriverOptions::step_timeout), which must outlast this wait.
  return std::min(peer_s > 0 ? absl::Seconds(peer_s) : absl::Seconds(300),
                  options_.step_timeout);
}

void RunController::DropStuckWorkers(absl::Time now, Actions* actions) {
  std::vector<std::string> stuck;
  stuck.swap(not_ended_since_abort_);
  // Every loss first, then one attempt: started after the first loss, an attempt would include
  // the other stuck workers and be aborted by the next loss.
  dropping_stuck_ = true;
  for (const std::string& id : stuck) {
    WorkerRecord* worker = membership_.Find(id);
    // Lost with an earlier one (its replica's other ranks), or the run ended.
    if (worker == nullptr || !worker->alive || state_ != v1::RUN_STATE_RUNNING) continue;
    const std::string reason = absl::StrCat(
        "stuck: it did not give up the aborted attempt of step ", orchestrator_.step(), " within ",
        absl::FormatDuration(StuckAfter()),
        " (failure.peer_timeout_s, at most the step timeout), though it still sends heartbeats");
    if (const std::string cannot = WhyALossEndsTheRun(*worker); !cannot.empty()) {
      HETPAR_LOG(WARNING) << "worker " << worker->Describe() << " is " << reason
                          << "; it is kept, since " << cannot << ", and the step is tried again";
      continue;
    }
    // Its replica's other ranks are ended as declared dead too: a hang in a TP, CP or pipeline
    // collective holds them all, and only that end makes a hung process restart or exit.
    LoseWorker(worker, reason, /*end_session=*/true, now, actions, /*replica_may_hang=*/true);
  }
  dropping_stuck_ = false;
  MaybeStartStep(now, actions);
}

void RunController::LoseWorker(WorkerRecord* worker, const std::string& reason, bool end_session,
                               absl::Time now, Actions* actions, bool replica_may_hang) {
  const bool had_session = worker->session_open;
  membership_.MarkDead(worker->worker_id, reason);
  HETPAR_LOG(WARNING) << "worker " << worker->Describe() << " is dead: " << reason;
  if (end_session && had_session) {
    actions->end_sessions.emplace_back(
        worker->worker_id,
        // Not UNAVAILABLE, which a worker reads as its coordinator lost: it restarts to register
        // again either way, but says why.
        absl::AbortedError(absl::StrCat(kDeclaredDeadPrefix, reason)));
  }
  if (state_ != v1::RUN_STATE_RUNNING) return;
  if (worker->joining) {
    // It held nothing yet: its replica stays open for another worker.
    HETPAR_LOG(WARNING) << "joining worker " << worker->Describe() << " lost before its replica "
                        << "joined; the replica still admits a worker";
    return;
  }
  const std::string cause = absl::StrCat("worker ", worker->Describe(), " lost: ", reason);
  const v1::Module module = ModuleOf(worker->role);
  const std::string name = module == v1::MODULE_ENCODER ? "encoder" : "llm";
  const int64_t replica = Membership::ReplicaOf(*worker, module);
  if (module != v1::MODULE_UNSPECIFIED) {
    const std::vector<int64_t> replicas = membership_.Replicas(module);
    if (std::find(replicas.begin(), replicas.end(), replica) == replicas.end()) {
      return;  // its replica had already left the run
    }
  }
  const std::string cannot = WhyALossEndsTheRun(*worker);
  if (!cannot.empty()) {
    Fail(absl::StrCat(cause, "; the run cannot go on: ", cannot, "; ", HowToResume()), now,
         actions);
    return;
  }
  membership_.RetireReplica(module, replica);
  ++generation_;
  v1::CoordinatorMessage change;
  v1::MembershipChange* c = change.mutable_membership_change();
  c->set_generation(generation_);
  *c->add_lost() = membership_.PeerInfoOf(*worker);
  // The other ranks of the replica (its TP, CP and pipeline peers) have nothing left to do.
  for (const v1::PeerInfo& ended :
       EndReplicaWorkers(module, replica, cause, actions, replica_may_hang)) {
    *c->add_lost() = ended;
  }
  c->set_reason(cause);
  const std::vector<int64_t> left = membership_.Replicas(module);
  if (module == v1::MODULE_ENCODER) {
    EraseValue(encoder_joining_, replica);
    EraseValue(leave_requested_, replica);
  } else {
    EraseValue(llm_joining_, replica);
  }
  RecordPoolChange(module, replica, v1::POOL_CHANGE_LOST, cause, now);
  HETPAR_LOG(WARNING) << "generation " << generation_ << ": " << name << " replica " << replica
                      << " left the run; training on " << left.size() << " of "
                      << (module == v1::MODULE_ENCODER ? membership_.encoder_grid().dp
                                                       : membership_.llm_grid().dp)
                      << " " << name << " replicas [" << absl::StrJoin(left, ", ") << "] from step "
                      << committed_steps_;
  // Abort first, so the workers see the abort of the old attempt before the change; then the
  // step is planned again over the replicas that are left.
  const StepOrchestrator::Outcome outcome =
      orchestrator_.OnWorkerLost(*worker, now, &actions->messages);
  for (WorkerRecord* live : membership_.TrainingWorkers()) {
    if (live->session_open) actions->messages.emplace_back(live->worker_id, change);
  }
  // A replacement may register into the replica (an encoder pool below its target, an LLM
  // replica).
  RebalanceOpen(actions);
  HandleOutcome(outcome, now, actions);
  MaybeStartStep(now, actions);
}

std::string RunController::HowToResume() const {
  return spec_.checkpoint().dir().empty()
             ? "the run writes no checkpoints (checkpoint.dir), so it must start over"
             : absl::StrCat("resume it from its newest checkpoint under ", spec_.checkpoint().dir(),
                            " (start `hetpar coordinator` again on the run directory, pass it to "
                            "`hetpar run --resume`, or set checkpoint.resume_from)");
}

std::string RunController::FixThenResume() const {
  return spec_.checkpoint().dir().empty()
             ? "fix the cause and start the run again (it writes no checkpoints: checkpoint.dir)"
             : absl::StrCat("fix the cause, then ", HowToResume());
}

void RunController::WorkerFailed(WorkerRecord* worker, const v1::WorkerFailure& failure,
                                 absl::Time now, Actions* actions) {
  const std::string error = Printable(failure.error(), kMaxErrorBytes);
  if (state_ == v1::RUN_STATE_STOPPING) {
    // Training is over: the others finish their outputs, and the run ends as it would, its
    // message saying what failed (most often the last checkpoint).
    if (worker->alive) membership_.MarkDead(worker->worker_id, absl::StrCat("failed: ", error));
    HETPAR_LOG(WARNING) << "worker " << worker->Describe()
                        << " failed as the run stopped: " << error;
    if (stop_failure_.empty()) {
      stop_failure_ = absl::StrCat("worker ", worker->Describe(), " failed: ", error);
    }
    MaybeFinishStopping(now, actions);
    return;
  }
  const bool ended = state_ == v1::RUN_STATE_DONE || state_ == v1::RUN_STATE_FAILED;
  if (!failure.ends_run() || ended) {
    // Its session's end follows; the loss is taken now, with the worker's own words.
    if (worker->alive) {
      LoseWorker(worker, absl::StrCat("failed: ", error), /*end_session=*/false, now, actions);
    }
    return;
  }
  if (worker->alive) membership_.MarkDead(worker->worker_id, absl::StrCat("failed: ", error));
  HETPAR_LOG(WARNING) << "worker " << worker->Describe() << " failed: " << error;
  // Another replica would take over the failed one's part and meet the same error: the run
  // stops with it, its checkpoints (but the failed one) as they were.
  Fail(absl::StrCat("worker ", worker->Describe(), " failed: ", error,
                    "; every replica would meet this error in turn, so the run stops; ",
                    FixThenResume()),
       now, actions);
}

std::vector<v1::PeerInfo> RunController::EndReplicaWorkers(v1::Module module, int64_t replica,
                                                           const std::string& cause,
                                                           Actions* actions,
                                                           bool replica_may_hang) {
  const std::string name = module == v1::MODULE_ENCODER ? "encoder" : "llm";
  const v1::WorkerRole role =
      module == v1::MODULE_ENCODER ? v1::WORKER_ROLE_ENCODER : v1::WORKER_ROLE_LLM;
  std::vector<v1::PeerInfo> ended;
  for (WorkerRecord* live : membership_.LiveWorkers()) {
    if (live->role != role || Membership::ReplicaOf(*live, module) != replica) continue;
    const bool open = live->session_open;
    ended.push_back(membership_.PeerInfoOf(*live));
    membership_.MarkDead(live->worker_id,
                         absl::StrCat(name, " replica ", replica, " left the run"));
    if (open) {
      const std::string reason = absl::StrCat(name, " replica ", replica, " left the run: ", cause);
      v1::CoordinatorMessage stop;
      stop.mutable_stop()->set_reason(reason);
      stop.mutable_stop()->set_replica_left(true);
      actions->messages.emplace_back(live->worker_id, std::move(stop));
      actions->end_sessions.emplace_back(
          live->worker_id, absl::AbortedError(replica_may_hang
                                                  ? absl::StrCat(kDeclaredDeadPrefix, reason)
                                                  : reason));
    }
  }
  return ended;
}

bool RunController::StartWithoutMissingReplicas(absl::Time now, Actions* actions) {
  if (membership_.placement() == v1::PLACEMENT_COLOCATED) return false;
  // Per module, the replicas with a missing rank; every one must be able to go.
  std::map<v1::Module, std::vector<int64_t>> missing;
  for (v1::Module module : {v1::MODULE_ENCODER, v1::MODULE_LLM}) {
    const std::vector<int64_t> replicas = membership_.Replicas(module);
    for (int64_t d : replicas) {
      if (!membership_.ReplicaComplete(module, d)) missing[module].push_back(d);
    }
    if (missing[module].empty()) continue;
    const int64_t left = static_cast<int64_t>(replicas.size() - missing[module].size());
    const bool encoder = module == v1::MODULE_ENCODER;
    if (left < std::max<int64_t>(1, encoder ? spec_.failure().min_encoder_replicas()
                                            : spec_.failure().min_llm_replicas())) {
      return false;
    }
    // As for a loss mid-run: each LLM replica left takes at least one microbatch.
    if (!encoder && !plan::LlmWaves(spec_, left).ok()) {
      return false;
    }
  }
  if (missing[v1::MODULE_ENCODER].empty() && missing[v1::MODULE_LLM].empty()) return false;
  for (const auto& [module, replicas] : missing) {
    for (int64_t d : replicas) {
      const std::string cause = absl::StrCat(
          module == v1::MODULE_ENCODER ? "encoder" : "llm", " replica ", d,
          " did not register within register_timeout ",
          absl::FormatDuration(options_.register_timeout), " of the coordinator's restart");
      // Its ranks that did register have nothing to do in this run.
      EndReplicaWorkers(module, d, cause, actions);
      membership_.RetireReplica(module, d);
      RecordPoolChange(module, d, v1::POOL_CHANGE_LOST, cause, now);
      HETPAR_LOG(WARNING) << cause << ": it leaves the run";
    }
  }
  const std::vector<int64_t> encoders = membership_.Replicas(v1::MODULE_ENCODER);
  const std::vector<int64_t> llms = membership_.Replicas(v1::MODULE_LLM);
  incomplete_since_ = absl::InfiniteFuture();
  state_ = v1::RUN_STATE_RUNNING;
  HETPAR_LOG(INFO) << "run " << spec_.run().name() << " is running, generation " << generation_
                   << ", on " << encoders.size() << " of " << membership_.encoder_grid().dp
                   << " encoder replicas [" << absl::StrJoin(encoders, ", ") << "] and "
                   << llms.size() << " of " << membership_.llm_grid().dp << " llm replicas ["
                   << absl::StrJoin(llms, ", ") << "]";
  SendAssignments(actions);
  // A replacement may register into the replicas that left (the encoder pool up to its target).
  RebalanceOpen(actions);
  MaybeStartStep(now, actions);
  return true;
}

int64_t RunController::HoldersWithout(v1::Module module, int64_t replica) const {
  // Replicas that joined but have not trained a committed step may not hold the state yet.
  const std::vector<int64_t>& joining =
      module == v1::MODULE_ENCODER ? encoder_joining_ : llm_joining_;
  int64_t n = 0;
  for (int64_t r : membership_.Replicas(module)) {
    if (r != replica && std::find(joining.begin(), joining.end(), r) == joining.end()) ++n;
  }
  return n;
}

void RunController::RecordPoolChange(v1::Module module, int64_t replica, v1::PoolChangeKind kind,
                                     const std::string& cause, absl::Time now) {
  v1::PoolChange record;
  record.set_step(committed_steps_);
  record.set_generation(generation_);
  record.set_module(module);
  record.set_replica(replica);
  record.set_cause(cause);
  record.set_replicas_after(static_cast<int64_t>(membership_.Replicas(module).size()));
  record.set_unix_time(UnixSeconds(now));
  record.set_recovery_s(-1);
  record.set_kind(kind);
  pool_changes_.push_back(record);
}

void RunController::Leave(WorkerRecord* worker, const std::string& reason, absl::Time now,
                          Actions* actions) {
  const std::string why = absl::StrCat("worker ", worker->Describe(), " asked to leave",
                                       reason.empty() ? "" : " (" + reason + ")");
  if (state_ != v1::RUN_STATE_RUNNING && state_ != v1::RUN_STATE_WAITING) return;
  v1::CoordinatorMessage stop = StopMessage(why, generation_);
  stop.mutable_stop()->set_leave_run(true);
  if (worker->joining) {
    // It has not joined yet (it waits for its assignment): its session ends at once; its replica
    // still admits another worker.
    HETPAR_LOG(INFO) << why << " before its replica joined the run";
    actions->end_sessions.emplace_back(
        worker->worker_id, absl::AbortedError(absl::StrCat(why, " before its replica joined")));
    return;
  }
  if (state_ == v1::RUN_STATE_RUNNING && worker->role == v1::WORKER_ROLE_ENCODER &&
      membership_.placement() != v1::PLACEMENT_COLOCATED) {
    const int64_t replica = Membership::ReplicaOf(*worker, v1::MODULE_ENCODER);
    const std::vector<int64_t> active = membership_.Replicas(v1::MODULE_ENCODER);
    const int64_t minimum = std::max<int64_t>(1, spec_.failure().min_encoder_replicas());
    const bool in_run = std::find(active.begin(), active.end(), replica) != active.end();
    if (!in_run) return;  // its replica already left
    if (static_cast<int64_t>(active.size()) - 1 >= minimum &&
        HoldersWithout(v1::MODULE_ENCODER, replica) >= 1) {
      if (std::find(leave_requested_.begin(), leave_requested_.end(), replica) ==
          leave_requested_.end()) {
        leave_requested_.push_back(replica);
        // A pod removed from the pool: the target follows (a pod started again in its place
        // grows it back when it registers).
        encoder_target_ = std::max(minimum, encoder_target_ - 1);
        HETPAR_LOG(INFO) << why << ": encoder replica " << replica
                         << " leaves the run at the next step boundary";
      }
      MaybeStartStep(now, actions);
      return;
    }
  }
  // Its state is held by no other worker, or the pool may not shrink: the whole run stops, with
  // a checkpoint of the step in flight when it writes checkpoints.
  HETPAR_LOG(WARNING) << why << "; the run cannot go on without it: stopping the run";
  Stop(absl::StrCat(why, "; the run cannot go on without it"), /*checkpoint=*/true, now, actions);
}

void RunController::RebalanceOpen(Actions* actions) {
  if (membership_.placement() == v1::PLACEMENT_COLOCATED) return;
  const std::vector<int64_t> active = membership_.Replicas(v1::MODULE_ENCODER);
  std::vector<int64_t> open = membership_.OpenReplicas(v1::MODULE_ENCODER);
  const int64_t want_open =
      std::max<int64_t>(0, encoder_target_ - static_cast<int64_t>(active.size()));
  while (static_cast<int64_t>(open.size()) > want_open) {
    const int64_t d = open.back();
    open.pop_back();
    membership_.SetOpen(v1::MODULE_ENCODER, d, false);
    HETPAR_LOG(INFO) << "encoder replica " << d << " no longer admits workers (target "
                     << encoder_target_ << " replicas)";
    for (WorkerRecord* worker : membership_.LiveWorkers()) {
      if (!worker->joining || worker->role != v1::WORKER_ROLE_ENCODER ||
          Membership::ReplicaOf(*worker, v1::MODULE_ENCODER) != d) {
        continue;
      }
      // It waits for its assignment, not for steps: its session ends with the reason. One whose
      // session is not open yet is out of the run now (its later OpenSession is refused with
      // the reason), not left holding the closed replica's slot.
      const std::string why =
          absl::StrCat("encoder replica ", d, " is no longer wanted: the pool's target is ",
                       encoder_target_, " replicas");
      if (worker->session_open) {
        actions->end_sessions.emplace_back(worker->worker_id, absl::AbortedError(why));
      } else {
        membership_.MarkDead(worker->worker_id, why);
      }
    }
  }
  for (int64_t d = 0;
       d < membership_.encoder_grid().dp && static_cast<int64_t>(open.size()) < want_open; ++d) {
    if (std::find(active.begin(), active.end(), d) != active.end() ||
        std::find(open.begin(), open.end(), d) != open.end()) {
      continue;
    }
    membership_.SetOpen(v1::MODULE_ENCODER, d, true);
    open.push_back(d);
    HETPAR_LOG(INFO) << "encoder replica " << d << " admits workers (target " << encoder_target_
                     << " replicas, " << active.size() << " training)";
  }
  // The LLM's replicas are not resized: one that left admits a replacement.
  {
    const std::vector<int64_t> llm_active = membership_.Replicas(v1::MODULE_LLM);
    const std::vector<int64_t> llm_open = membership_.OpenReplicas(v1::MODULE_LLM);
    for (int64_t d = 0; d < membership_.llm_grid().dp; ++d) {
      if (std::find(llm_active.begin(), llm_active.end(), d) != llm_active.end() ||
          std::find(llm_open.begin(), llm_open.end(), d) != llm_open.end()) {
        continue;
      }
      membership_.SetOpen(v1::MODULE_LLM, d, true);
      HETPAR_LOG(INFO) << "llm replica " << d << " admits workers (a replacement)";
    }
  }
}

void RunController::RemoveEncoderReplica(int64_t dp, const std::string& cause, absl::Time now,
                                         Actions* actions) {
  membership_.RetireReplica(v1::MODULE_ENCODER, dp);
  EraseValue(encoder_joining_, dp);
  ++generation_;
  v1::CoordinatorMessage change;
  v1::MembershipChange* c = change.mutable_membership_change();
  c->set_generation(generation_);
  c->set_reason(cause);
  for (WorkerRecord* live : membership_.LiveWorkers()) {
    if (live->role != v1::WORKER_ROLE_ENCODER || live->joining ||
        Membership::ReplicaOf(*live, v1::MODULE_ENCODER) != dp) {
      continue;
    }
    *c->add_lost() = membership_.PeerInfoOf(*live);
    v1::CoordinatorMessage stop = StopMessage(cause, generation_);
    stop.mutable_stop()->set_leave_run(true);
    actions->messages.emplace_back(live->worker_id, std::move(stop));
  }
  for (WorkerRecord* live : membership_.TrainingWorkers()) {
    if (live->session_open) actions->messages.emplace_back(live->worker_id, change);
  }
  RecordPoolChange(v1::MODULE_ENCODER, dp, v1::POOL_CHANGE_REMOVED, cause, now);
  HETPAR_LOG(INFO) << "generation " << generation_ << ": encoder replica " << dp
                   << " left the run (" << cause << "); training on "
                   << membership_.Replicas(v1::MODULE_ENCODER).size()
                   << " encoder replicas from step " << committed_steps_;
}

void RunController::ChangePoolAtBoundary(absl::Time now, Actions* actions) {
  if (membership_.placement() == v1::PLACEMENT_COLOCATED || state_ != v1::RUN_STATE_RUNNING) {
    return;
  }
  const int64_t minimum = std::max<int64_t>(1, spec_.failure().min_encoder_replicas());
  // Leaves first: replicas whose worker asked to leave, then the highest replicas beyond the
  // target.
  std::vector<int64_t> leaving;
  leaving.swap(leave_requested_);
  for (int64_t r : leaving) {
    const std::vector<int64_t> active = membership_.Replicas(v1::MODULE_ENCODER);
    if (std::find(active.begin(), active.end(), r) == active.end()) continue;
    if (static_cast<int64_t>(active.size()) - 1 < minimum ||
        HoldersWithout(v1::MODULE_ENCODER, r) < 1) {
      // Granted when asked, but a loss since leaves the run unable to let the replica go: as
      // Leave does then, the run stops, with a checkpoint of the step that begins now (its worker
      // is in its grace period meanwhile), and without one where the run writes none.
      const std::string why = absl::StrCat(
          "a worker of encoder replica ", r,
          " asked to leave, and a loss since leaves the run unable to go on without it (",
          active.size(), " encoder replicas, failure.min_encoder_replicas ", minimum, ")");
      HETPAR_LOG(WARNING) << why << ": stopping the run";
      if (spec_.checkpoint().dir().empty()) {
        BeginStopping(why, now, actions);
        return;
      }
      if (stop_after_step_.empty()) stop_after_step_ = why;
      continue;
    }
    RemoveEncoderReplica(r, absl::StrCat("a worker of encoder replica ", r, " asked to leave"), now,
                         actions);
  }
  while (true) {
    const std::vector<int64_t> active = membership_.Replicas(v1::MODULE_ENCODER);
    if (static_cast<int64_t>(active.size()) <= std::max(encoder_target_, minimum) ||
        HoldersWithout(v1::MODULE_ENCODER, active.back()) < 1) {
      break;
    }
    RemoveEncoderReplica(
        active.back(),
        absl::StrCat("the encoder pool shrinks to ", encoder_target_, " replicas (hetpar scale)"),
        now, actions);
  }
  RebalanceOpen(actions);
  // Then joins: every open encoder replica whose ranks are all registered, up to the target, and
  // every LLM replica whose ranks are.
  std::vector<WorkerRecord*> joined;
  std::vector<std::pair<v1::Module, int64_t>> joined_replicas;
  for (int64_t d : membership_.OpenReplicas(v1::MODULE_ENCODER)) {
    if (static_cast<int64_t>(membership_.Replicas(v1::MODULE_ENCODER).size()) >= encoder_target_) {
      break;
    }
    if (!membership_.ReadyToJoin(v1::MODULE_ENCODER, d)) continue;
    for (WorkerRecord* w : membership_.Activate(v1::MODULE_ENCODER, d)) joined.push_back(w);
    joined_replicas.emplace_back(v1::MODULE_ENCODER, d);
    encoder_joining_.push_back(d);
  }
  for (int64_t d : membership_.OpenReplicas(v1::MODULE_LLM)) {
    const int64_t after = static_cast<int64_t>(membership_.Replicas(v1::MODULE_LLM).size()) + 1;
    if (!membership_.ReadyToJoin(v1::MODULE_LLM, d) || !plan::LlmWaves(spec_, after).ok()) {
      continue;
    }
    for (WorkerRecord* w : membership_.Activate(v1::MODULE_LLM, d)) joined.push_back(w);
    joined_replicas.emplace_back(v1::MODULE_LLM, d);
    llm_joining_.push_back(d);
  }
  if (joined.empty()) return;
  std::sort(encoder_joining_.begin(), encoder_joining_.end());
  std::sort(llm_joining_.begin(), llm_joining_.end());
  ++generation_;
  std::vector<std::string> names;
  for (const auto& [module, d] : joined_replicas) {
    names.push_back(absl::StrCat(ModuleName(module), " replica ", d));
  }
  const std::string cause = absl::StrCat(absl::StrJoin(names, ", "), " joined the run");
  for (const auto& [module, d] : joined_replicas) {
    RecordPoolChange(module, d, v1::POOL_CHANGE_JOINED, cause, now);
  }
  HETPAR_LOG(INFO) << "generation " << generation_ << ": " << cause << "; training on "
                   << membership_.Replicas(v1::MODULE_ENCODER).size() << " encoder and "
                   << membership_.Replicas(v1::MODULE_LLM).size() << " llm replicas from step "
                   << committed_steps_ << " (their state comes from a live replica first)";
  for (WorkerRecord* w : joined) {
    v1::CoordinatorMessage message;
    *message.mutable_assignment() = AssignmentOf(*w, /*with_peers=*/true);
    message.mutable_assignment()->set_joining(true);
    actions->messages.emplace_back(w->worker_id, std::move(message));
  }
  for (WorkerRecord* live : membership_.TrainingWorkers()) {
    if (!live->session_open || std::find(joined.begin(), joined.end(), live) != joined.end()) {
      continue;
    }
    v1::CoordinatorMessage change;
    v1::MembershipChange* c = change.mutable_membership_change();
    c->set_generation(generation_);
    c->set_reason(cause);
    for (const WorkerRecord* peer : membership_.PeersOf(*live)) {
      if (std::find(joined.begin(), joined.end(), peer) != joined.end()) {
        *c->add_joined() = membership_.PeerInfoOf(*peer);
      }
    }
    actions->messages.emplace_back(live->worker_id, std::move(change));
  }
}

void RunController::HandleOutcome(StepOrchestrator::Outcome outcome, absl::Time now,
                                  Actions* actions) {
  switch (outcome) {
    case StepOrchestrator::Outcome::kPending:
      // The next attempt may be waiting for a worker to be heard from (or lost).
      if (!unheard_since_abort_.empty() || !not_ended_since_abort_.empty()) {
        MaybeStartStep(now, actions);
      }
      return;
    case StepOrchestrator::Outcome::kCommitted:
      if (planner_ != nullptr) planner_->Committed(orchestrator_.step());
      ++committed_steps_;
      // Replicas that joined trained this step from the state they received: they hold it now.
      encoder_joining_.clear();
      llm_joining_.clear();
      for (v1::PoolChange& change : pool_changes_) {
        if (change.recovery_s() < 0) {
          change.set_recovery_s(UnixSeconds(now) - change.unix_time());
        }
      }
      step_attempts_ = 0;
      if (committed_steps_ >= spec_.run().steps()) {
        BeginStopping(absl::StrCat("completed ", committed_steps_, " steps"), now, actions);
        return;
      }
      if (!stop_after_step_.empty()) {
        BeginStopping(
            absl::StrCat(stop_after_step_, " (checkpointed after ", committed_steps_, " steps)"),
            now, actions);
        return;
      }
      MaybeStartStep(now, actions);
      return;
    case StepOrchestrator::Outcome::kAborted:
      ++step_attempts_;
      // Every attempt runs in a generation of its own: the workers form their process groups
      // anew for it, so nothing half done in the aborted one (a collective a peer left) lingers.
      ++generation_;
      HETPAR_LOG(WARNING) << "step " << orchestrator_.step() << " aborted (attempt "
                          << step_attempts_ << " of " << options_.max_step_attempts
                          << "): " << orchestrator_.last_abort_reason();
      if (step_attempts_ >= options_.max_step_attempts) {
        Fail(absl::StrCat("step ", orchestrator_.step(), " aborted ", step_attempts_,
                          " times in a row; last: ", orchestrator_.last_abort_reason()),
             now, actions);
        return;
      }
      if (!stop_after_step_.empty()) {
        if (stop_retry_taken_) {
          BeginStopping(absl::StrCat(stop_after_step_,
                                     " (the step to checkpoint was aborted twice: no "
                                     "checkpoint)"),
                        now, actions);
          return;
        }
        // Stopping now would lose every step since the last checkpoint: the next attempt
        // commits with the checkpoint instead (once; MaybeStartStep asks for it).
        stop_retry_taken_ = true;
        HETPAR_LOG(INFO) << stop_after_step_ << ": step " << orchestrator_.step()
                         << " was aborted; its next attempt commits with the checkpoint";
      }
      // A worker's death often reaches the coordinator after its peers' reports of the failures
      // it caused (a collective's connection reset): planned at once, the next attempt would
      // include the dead worker and be aborted again when its session ends, and its groups'
      // rendezvous would be cut short mid-way. So it waits until every worker of the aborted
      // attempt has been heard from since the abort, or found lost (Tick ends the wait for a
      // silent one: heartbeat_timeout).
      unheard_since_abort_ = orchestrator_.participants();
      // And until each has given the attempt up (its step driver took the abort): a worker whose
      // driver hangs while its session thread heartbeats would be planned into every retry and
      // hold it up (see DropStuckWorkers).
      not_ended_since_abort_ = orchestrator_.participants();
      aborted_generation_ = orchestrator_.generation();
      aborted_at_ = now;
      MaybeStartStep(now, actions);
      return;
  }
}

void RunController::PlannerPrepared(const absl::Status& status, absl::Time now, Actions* actions) {
  if (absl::IsCancelled(status)) {
    // Only a shutdown cancels it (StepPlanner::CancelPreparation): the run does not fail.
    HETPAR_LOG(WARNING) << "preparing the step planner: " << status.message();
    return;
  }
  if (!status.ok()) {
    if (state_ != v1::RUN_STATE_WAITING && state_ != v1::RUN_STATE_RUNNING) {
      // Stopped meanwhile: no step would have been planned.
      HETPAR_LOG(WARNING) << "preparing the step planner failed after the run "
                          << RunStateName(state_) << ": " << status.message();
      return;
    }
    Fail(absl::StrCat("preparing the step planner failed: ", status.message()), now, actions);
    return;
  }
  planner_prepared_ = true;
  MaybeStartStep(now, actions);
}

bool RunController::EverySessionOpen() const {
  for (const WorkerRecord* worker : membership_.TrainingWorkers()) {
    if (!worker->session_open) return false;
  }
  return true;
}

void RunController::MaybeStartStep(absl::Time now, Actions* actions) {
  if (dropping_stuck_ || state_ != v1::RUN_STATE_RUNNING || planner_ == nullptr ||
      !planner_prepared_ || orchestrator_.in_flight() || !membership_.Complete()) {
    return;
  }
  if (committed_steps_ >= spec_.run().steps()) {
    // Continued from the checkpoint of the run's last step (its coordinator was lost as it
    // gathered the outputs): nothing is left to train, and the workers write the outputs from
    // it, once each has its session open (its assignment with its peers went out on it). They
    // load the checkpoint first, which a step's timeout allows for as before a first step.
    if (!EverySessionOpen()) return;
    BeginStopping(absl::StrCat("completed ", committed_steps_, " steps"), now, actions);
    stop_deadline_ = std::max(stop_deadline_, now + options_.step_timeout);
    return;
  }
  while (!unheard_since_abort_.empty()) {
    const WorkerRecord* worker = membership_.Find(unheard_since_abort_.back());
    if (worker != nullptr && worker->alive && worker->last_heartbeat < aborted_at_) return;
    unheard_since_abort_.pop_back();
  }
  if (!not_ended_since_abort_.empty()) {
    std::vector<std::string> waiting;
    for (const std::string& id : not_ended_since_abort_) {
      const WorkerRecord* worker = membership_.Find(id);
      if (worker != nullptr && worker->alive && worker->ended_generation < aborted_generation_) {
        waiting.push_back(id);
      }
    }
    not_ended_since_abort_ = std::move(waiting);
    if (!not_ended_since_abort_.empty()) {
      if (now - aborted_at_ < StuckAfter()) return;
      // DropStuckWorkers loses them (each loss may start the next attempt itself).
      DropStuckWorkers(now, actions);
      return;
    }
  }
  if (!EverySessionOpen()) return;
  std::vector<WorkerRecord*> live = membership_.TrainingWorkers();
  // A step boundary: the encoder pool changes here (and only here).
  ChangePoolAtBoundary(now, actions);
  if (state_ != v1::RUN_STATE_RUNNING) return;  // a leave the run could no longer grant
  live = membership_.TrainingWorkers();
  absl::StatusOr<PlannedStep> plan = planner_->Plan(committed_steps_, generation_, membership_);
  if (!plan.ok()) {
    Fail(absl::StrCat("planning step ", committed_steps_, " failed: ", plan.status().message()),
         now, actions);
    return;
  }
  plan->encoder_joining = encoder_joining_;
  plan->llm_joining = llm_joining_;
  std::vector<const WorkerRecord*> participants(live.begin(), live.end());
  orchestrator_.Begin(committed_steps_, generation_, *std::move(plan), participants, now,
                      &actions->messages);
  // A stop with a checkpoint that came between attempts, or whose step was aborted.
  if (!stop_after_step_.empty()) orchestrator_.CheckpointAtCommit();
}

void RunController::OutputProgress(absl::Time now) {
  if (state_ == v1::RUN_STATE_STOPPING) {
    stop_deadline_ = std::max(stop_deadline_, now + options_.stop_timeout);
  }
}

void RunController::Tick(absl::Time now, Actions* actions) {
  if (state_ == v1::RUN_STATE_DONE || state_ == v1::RUN_STATE_FAILED) return;
  for (WorkerRecord* worker : membership_.LiveWorkers()) {
    // An earlier loss in this loop may have ended this worker's replica with it.
    if (!worker->alive) continue;
    const absl::Duration silent = now - worker->last_heartbeat;
    if (silent > options_.heartbeat_timeout) {
      LoseWorker(worker,
                 absl::StrCat("no heartbeat for ",
                              absl::FormatDuration(absl::Trunc(silent, absl::Milliseconds(100))),
                              " (heartbeat_timeout ",
                              absl::FormatDuration(options_.heartbeat_timeout), ")"),
                 /*end_session=*/true, now, actions);
    }
  }
  if (state_ == v1::RUN_STATE_STOPPING) {
    // A worker the heartbeats above took out may have been the last with a session open.
    MaybeFinishStopping(now, actions);
    if (state_ == v1::RUN_STATE_STOPPING && now >= stop_deadline_) {
      std::vector<std::string> open;
      for (WorkerRecord* worker : membership_.LiveWorkers()) {
        if (!worker->session_open) continue;
        open.push_back(worker->worker_id);
        actions->end_sessions.emplace_back(
            worker->worker_id, absl::AbortedError(absl::StrCat("run stopped: ", state_message_)));
        membership_.MarkDead(worker->worker_id, "did not close its session after stop");
      }
      HETPAR_LOG(WARNING) << open.size()
                          << " worker(s) did not close their session by the stop's deadline ("
                          << absl::FormatDuration(options_.stop_timeout)
                          << " after the stop, its last checkpoint or its last output): "
                          << absl::StrJoin(open, ", ");
      cut_at_stop_ = open;
      EndStopping();
    }
    return;
  }
  if ((state_ == v1::RUN_STATE_WAITING || state_ == v1::RUN_STATE_RUNNING) &&
      !membership_.Complete() && now - incomplete_since_ > options_.register_timeout) {
    if (state_ == v1::RUN_STATE_WAITING && options_.continues_lost_run &&
        StartWithoutMissingReplicas(now, actions)) {
      return;
    }
    const std::vector<std::string> missing = membership_.Missing();
    Fail(absl::StrCat(missing.size(), " of ", membership_.expected_workers(),
                      " ranks not registered within register_timeout ",
                      absl::FormatDuration(options_.register_timeout),
                      "; missing: ", absl::StrJoin(missing, "; ")),
         now, actions);
    return;
  }
  HandleOutcome(orchestrator_.CheckDeadline(now, &actions->messages), now, actions);
}

void RunController::BeginStopping(const std::string& reason, absl::Time now, Actions* actions) {
  if (orchestrator_.in_flight()) {
    (void)orchestrator_.Abort(absl::StrCat("run stopping: ", reason), now, &actions->messages);
    // The final outputs are gathered in a generation of their own, like the next attempt of an
    // aborted step: a collective the abort left half done on one rank of a group would otherwise
    // meet its peers' gathers (StopRun.generation).
    ++generation_;
  }
  state_ = v1::RUN_STATE_STOPPING;
  state_message_ = reason;
  // Moved on by a worker that begins its outputs, and by their chunks (HandleMessage,
  // OutputProgress).
  stop_deadline_ = now + options_.stop_timeout;
  HETPAR_LOG(INFO) << "stopping run " << spec_.run().name() << ": " << reason;
  // A replica that joined at the last boundary and has committed no step since may not hold the
  // run's state yet (the stop can abort its first step before the transfer ends): its workers
  // leave without outputs, and the outputs come from the replicas that hold it (the first of
  // them writes the model).
  const auto untrained = [this](v1::Module module, int64_t replica) {
    const std::vector<int64_t>& joining =
        module == v1::MODULE_ENCODER ? encoder_joining_ : llm_joining_;
    return std::find(joining.begin(), joining.end(), replica) != joining.end();
  };
  for (WorkerRecord* worker : membership_.LiveWorkers()) {
    if (!worker->session_open) continue;
    v1::CoordinatorMessage stop = StopMessage(reason, generation_);
    // The replicas the outputs' groups span: a replica lost during the step this stop aborted
    // is no longer among them, though the workers' last plan had it.
    if (membership_.placement() != v1::PLACEMENT_COLOCATED && !worker->joining) {
      const v1::Module module = ModuleOf(worker->role);
      if (module != v1::MODULE_UNSPECIFIED &&
          untrained(module, Membership::ReplicaOf(*worker, module))) {
        stop.mutable_stop()->set_leave_run(true);
      } else {
        for (int64_t r : membership_.Replicas(v1::MODULE_ENCODER)) {
          if (!untrained(v1::MODULE_ENCODER, r)) stop.mutable_stop()->add_encoder_replicas(r);
        }
        for (int64_t r : membership_.Replicas(v1::MODULE_LLM)) {
          if (!untrained(v1::MODULE_LLM, r)) stop.mutable_stop()->add_llm_replicas(r);
        }
      }
    }
    actions->messages.emplace_back(worker->worker_id, std::move(stop));
  }
  MaybeFinishStopping(now, actions);
}

void RunController::MaybeFinishStopping(absl::Time now, Actions* actions) {
  (void)now;
  (void)actions;
  if (state_ != v1::RUN_STATE_STOPPING) return;
  for (WorkerRecord* worker : membership_.LiveWorkers()) {
    if (worker->session_open) return;
  }
  EndStopping();
}

void RunController::EndStopping() {
  state_ = v1::RUN_STATE_DONE;
  if (!stop_failure_.empty()) {
    // The outputs decide whether the run is usable (the CLIs check them); the message keeps
    // what failed, since a continued run then resumes from an older checkpoint.
    absl::StrAppend(&state_message_, "; but ", stop_failure_, " as the run stopped");
    HETPAR_LOG(WARNING) << "run " << spec_.run().name() << ": " << stop_failure_
                        << " as the run stopped; its last checkpoint may be missing";
  }
  if (committed_steps_ < spec_.run().steps()) {
    HETPAR_LOG(INFO) << "run " << spec_.run().name() << " stopped after " << committed_steps_
                     << " of " << spec_.run().steps() << " steps: " << state_message_;
  } else {
    HETPAR_LOG(INFO) << "run " << spec_.run().name() << " done: " << state_message_;
  }
}

void RunController::Fail(const std::string& reason, absl::Time now, Actions* actions) {
  if (orchestrator_.in_flight()) {
    (void)orchestrator_.Abort(absl::StrCat("run failed: ", reason), now, &actions->messages);
  }
  state_ = v1::RUN_STATE_FAILED;
  state_message_ = reason;
  HETPAR_LOG(ERROR) << "run " << spec_.run().name() << " failed: " << reason;
  for (WorkerRecord* worker : membership_.LiveWorkers()) {
    if (!worker->session_open) continue;
    v1::CoordinatorMessage stop = StopMessage("run failed: " + reason, generation_);
    stop.mutable_stop()->set_run_failed(true);
    actions->messages.emplace_back(worker->worker_id, std::move(stop));
    actions->end_sessions.emplace_back(worker->worker_id,
                                       absl::AbortedError("run failed: " + reason));
  }
}

v1::StopResponse RunController::Stop(const std::string& reason, bool checkpoint, absl::Time now,
                                     Actions* actions) {
  const std::string why = reason.empty() ? "stop requested" : "stop requested: " + reason;
  // Between an abort and the next attempt (waiting for the workers to give the aborted one up),
  // the step to checkpoint is the next attempt.
  const bool retry_pending = !unheard_since_abort_.empty() || !not_ended_since_abort_.empty();
  v1::StopResponse response;
  if (checkpoint && state_ == v1::RUN_STATE_RUNNING &&
      (orchestrator_.in_flight() || retry_pending) && !spec_.checkpoint().dir().empty()) {
    if (stop_after_step_.empty()) {
      stop_after_step_ = why;
      if (orchestrator_.in_flight()) {
        orchestrator_.CheckpointAtCommit();
      } else {
        stop_retry_taken_ = true;  // the next attempt is the one retry a stop waits for
      }
      HETPAR_LOG(INFO) << why << ": stopping once step " << committed_steps_
                       << " commits, with a checkpoint"
                       << (orchestrator_.in_flight() ? "" : " (its next attempt)");
    }
    response.set_checkpoint(absl::StrCat("the run stops once step ", committed_steps_,
                                         " commits, with a checkpoint of it in ",
                                         spec_.checkpoint().dir()));
  } else if (state_ == v1::RUN_STATE_WAITING || state_ == v1::RUN_STATE_RUNNING) {
    if (checkpoint) {
      const std::string none = absl::StrCat(
          "no checkpoint: ",
          spec_.checkpoint().dir().empty()
              ? std::string("checkpoint.dir is not set")
              : absl::StrCat(
                    state_ == v1::RUN_STATE_WAITING ? "the run is waiting for its workers (" : "",
                    "no step was in flight; ", committed_steps_, " steps committed",
                    state_ == v1::RUN_STATE_WAITING ? ")" : ""));
      HETPAR_LOG(WARNING) << why << ": " << none;
      response.set_checkpoint(none);
    }
    BeginStopping(why, now, actions);
  }
  response.set_state(state_);
  return response;
}

absl::StatusOr<v1::ScaleResponse> RunController::Scale(const v1::ScaleRequest& request,
                                                       absl::Time now, Actions* actions) {
  if (membership_.placement() == v1::PLACEMENT_COLOCATED) {
    return absl::FailedPreconditionError(
        "a colocated run has no encoder pool to resize (every rank holds both modules)");
  }
  if (state_ != v1::RUN_STATE_WAITING && state_ != v1::RUN_STATE_RUNNING) {
    return absl::FailedPreconditionError(
        absl::StrCat("the run is ", RunStateName(state_), "; its encoder pool cannot change"));
  }
  const int64_t minimum = std::max<int64_t>(1, spec_.failure().min_encoder_replicas());
  const int64_t most = membership_.encoder_grid().dp;
  if (request.encoder_replicas() < minimum || request.encoder_replicas() > most) {
    return absl::InvalidArgumentError(absl::StrCat(
        "encoder_replicas=", request.encoder_replicas(), " is out of range: the pool holds ",
        minimum, " (failure.min_encoder_replicas) to ", most, " (encoder.layout.dp) replicas"));
  }
  const int64_t before = encoder_target_;
  encoder_target_ = request.encoder_replicas();
  if (state_ == v1::RUN_STATE_WAITING) {
    // Before the start no replica holds anything: the highest beyond the target leave now (their
    // registered ranks told so), and the run starts once the ranks of those left are all here.
    while (true) {
      const std::vector<int64_t> active = membership_.Replicas(v1::MODULE_ENCODER);
      if (static_cast<int64_t>(active.size()) <= encoder_target_) break;
      const int64_t d = active.back();
      const std::string cause =
          absl::StrCat("the encoder pool shrinks to ", encoder_target_, " replicas (hetpar scale)");
      EndReplicaWorkers(v1::MODULE_ENCODER, d, cause, actions);
      membership_.RetireReplica(v1::MODULE_ENCODER, d);
      RecordPoolChange(v1::MODULE_ENCODER, d, v1::POOL_CHANGE_REMOVED, cause, now);
      HETPAR_LOG(INFO) << "encoder replica " << d << " leaves the run before it starts: " << cause;
    }
    if (membership_.Complete()) {
      incomplete_since_ = absl::InfiniteFuture();
      state_ = v1::RUN_STATE_RUNNING;
      HETPAR_LOG(INFO) << "every rank of the " << encoder_target_
                       << " encoder replicas registered: run " << spec_.run().name()
                       << " is running, generation " << generation_;
      SendAssignments(actions);
    }
  }
  RebalanceOpen(actions);
  // Without a step in flight the pool changes now; otherwise after its commit.
  MaybeStartStep(now, actions);
  const int64_t training = static_cast<int64_t>(membership_.Replicas(v1::MODULE_ENCODER).size());
  const std::vector<int64_t> open = membership_.OpenReplicas(v1::MODULE_ENCODER);
  v1::ScaleResponse response;
  response.set_current_encoder_replicas(training);
  response.set_requested_encoder_replicas(encoder_target_);
  std::string message = absl::StrCat("encoder pool: target ", encoder_target_, " replicas (was ",
                                     before, "), ", training, " training");
  if (training > encoder_target_) {
    absl::StrAppend(&message, "; the pool shrinks when the step in flight commits");
  }
  if (state_ == v1::RUN_STATE_WAITING) {
    absl::StrAppend(&message, "; the run starts once their ranks are registered");
  }
  if (!open.empty()) {
    absl::StrAppend(&message, "; encoder replica(s) ", absl::StrJoin(open, ", "),
                    " admit workers (", open.size() * membership_.encoder_grid().tp,
                    " encoder ranks to start), each joining at a step boundary");
  }
  HETPAR_LOG(INFO) << "scale: " << message;
  response.set_message(message);
  return response;
}

v1::StatusResponse RunController::Status(absl::Time now) const {
  v1::StatusResponse status;
  status.set_run_name(spec_.run().name());
  status.set_state(state_);
  status.set_state_message(state_message_);
  status.set_generation(generation_);
  status.set_committed_steps(committed_steps_);
  status.set_first_step(first_step_);
  status.set_total_steps(spec_.run().steps());
  status.set_step_in_flight(orchestrator_.in_flight() ? orchestrator_.step() : -1);
  status.set_expected_workers(membership_.expected_workers());
  status.set_placement(membership_.placement());
  status.set_listen_address(options_.listen_address);
  status.set_uptime_s(absl::ToDoubleSeconds(now - created_));
  auto add_worker = [&](const WorkerRecord& worker) {
    v1::WorkerStatus* w = status.add_workers();
    w->set_worker_id(worker.worker_id);
    w->set_role(worker.role);
    for (const auto& rank : worker.ranks) *w->add_ranks() = rank;
    w->set_host(worker.host);
    w->set_data_address(worker.data_address);
    for (const auto& capability : worker.capabilities) w->add_capabilities(capability);
    w->set_alive(worker.alive);
    w->set_session_open(worker.session_open);
    w->set_last_heartbeat_age_s(absl::ToDoubleSeconds(now - worker.last_heartbeat));
    w->set_dead_reason(worker.dead_reason);
    *w->mutable_progress() = worker.progress;
    w->set_generation(worker.generation);
  };
  for (const WorkerRecord* worker : membership_.LiveWorkers()) add_worker(*worker);
  std::vector<const WorkerRecord*> dead;
  for (const auto& worker : membership_.workers()) {
    if (!worker->alive) dead.push_back(worker.get());
  }
  const size_t first = dead.size() > kDeadWorkersShown ? dead.size() - kDeadWorkersShown : 0;
  for (size_t i = first; i < dead.size(); ++i) add_worker(*dead[i]);
  // Once the run ends, the ranks that closed their sessions are no longer missed.
  if (state_ == v1::RUN_STATE_WAITING || state_ == v1::RUN_STATE_RUNNING) {
    for (const auto& line : membership_.Missing()) status.add_missing(line);
  }
  if ((state_ == v1::RUN_STATE_WAITING || state_ == v1::RUN_STATE_RUNNING) &&
      incomplete_since_ != absl::InfiniteFuture()) {
    status.set_missing_deadline_s(
        std::max(0.0, absl::ToDoubleSeconds(incomplete_since_ + options_.register_timeout - now)));
  }
  for (const auto& timing : orchestrator_.recent()) *status.add_recent_steps() = timing;
  // Not while Prepare runs: it moves the data position and fills the ledger on the server's
  // preparing thread, outside the lock.
  if (planner_ != nullptr && planner_prepared_) {
    status.set_data_position(planner_->DataPosition());
    const LedgerCounts ledger = planner_->Ledger();
    status.set_samples_trained(ledger.trained);
    status.set_samples_repeated(ledger.repeated);
    status.set_samples_lost(ledger.lost);
  }
  status.set_skipped_steps(orchestrator_.skipped_steps());
  status.set_peak_tflops(spec_.run().peak_tflops());
  status.set_aborted_steps(orchestrator_.aborted_steps());
  status.set_tokens_total(orchestrator_.tokens_total());
  status.set_images_total(orchestrator_.images_total());
  if (membership_.placement() != v1::PLACEMENT_COLOCATED) {
    status.set_encoder_replicas(
        static_cast<int64_t>(membership_.Replicas(v1::MODULE_ENCODER).size()));
    status.set_encoder_replicas_configured(membership_.encoder_grid().dp);
    status.set_llm_replicas(static_cast<int64_t>(membership_.Replicas(v1::MODULE_LLM).size()));
    status.set_llm_replicas_configured(membership_.llm_grid().dp);
    status.set_encoder_replicas_target(encoder_target_);
    for (int64_t d : membership_.OpenReplicas(v1::MODULE_ENCODER)) {
      status.add_encoder_replicas_open(d);
    }
    for (int64_t d : membership_.OpenReplicas(v1::MODULE_LLM)) status.add_llm_replicas_open(d);
    status.set_encoder_workers_joining(membership_.joining_workers());
  }
  for (const v1::PoolChange& change : pool_changes_) *status.add_pool_changes() = change;
  return status;
}

}  // namespace hetpar::coordinator
