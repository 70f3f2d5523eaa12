#include "common/worker/step_driver.h"

#include <algorithm>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/control/plan_codec.h"
#include "common/logging.h"
#include "common/status.h"
#include "common/trace/recorder.h"

namespace hetpar::worker {
namespace {

std::string LostPeers(const v1::MembershipChange& change) {
  std::string lost;
  for (const auto& peer : change.lost()) {
    absl::StrAppend(&lost, lost.empty() ? "" : ", ", peer.worker_id(), " (", peer.host(), ")");
  }
  return lost.empty() ? "a peer" : lost;
}

std::string Describe(const v1::CoordinatorMessage& message) {
  if (message.has_grad_norm()) return absl::StrCat("the norm of step ", message.grad_norm().step());
  if (message.has_commit()) return absl::StrCat("the commit of step ", message.commit().step());
  if (message.has_step_plan()) return absl::StrCat("the plan of step ", message.step_plan().step());
  if (message.has_membership_change()) {
    return absl::StrCat("a membership change (the run lost ",
                        LostPeers(message.membership_change()), ")");
  }
  return "another message";
}

}  // namespace

const char* StateName(StepDriver::State state) {
  switch (state) {
    case StepDriver::State::kAwaitingPlan:
      return "awaiting plan";
    case StepDriver::State::kComputing:
      return "computing";
    case StepDriver::State::kAwaitingNorm:
      return "awaiting the gradient norm";
    case StepDriver::State::kAwaitingCommit:
      return "awaiting the commit";
    case StepDriver::State::kApplying:
      return "applying";
    case StepDriver::State::kStopped:
      return "stopped";
    case StepDriver::State::kFailed:
      return "failed";
  }
  return "unknown";
}

absl::StatusOr<v1::CoordinatorMessage> SessionChannel::Next(absl::Duration timeout) {
  return session_->Next(timeout);
}

absl::Status SessionChannel::SendGradNormPartial(const v1::GradNormPartial& partial) {
  return session_->SendGradNormPartial(partial);
}

absl::Status SessionChannel::SendReport(const v1::StepReport& report) {
  return session_->SendReport(report);
}

absl::Status SessionChannel::SendProgress(const v1::Progress& progress) {
  return session_->SendProgress(progress);
}

absl::StatusOr<v1::CoordinatorMessage> StepDriver::NextRelevant() {
  // The coordinator may rightly say nothing for up to its step timeout: while it decides a step
  // in flight, and after an abort while it waits for a stuck worker (at most the step timeout).
  const absl::Duration bound = options_.timeout + options_.step_timeout;
  const absl::Time deadline = absl::Now() + bound;
  while (true) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      return absl::DeadlineExceededError(absl::StrCat("no message from the coordinator within ",
                                                      absl::FormatDuration(bound), " (",
                                                      StateName(state_), ")"));
    }
    HETPAR_ASSIGN_OR_RETURN(v1::CoordinatorMessage message, channel_->Next(left));
    if (message.has_heartbeat_ack() || message.has_assignment()) continue;
    if (message.has_membership_change()) {
      const v1::MembershipChange& change = message.membership_change();
      if (change.lost_size() > 0) {
        HETPAR_LOG(WARNING) << "generation " << change.generation() << ": the run lost "
                            << LostPeers(change) << " (" << change.reason()
                            << "); going on with the coordinator's next plan";
      } else {
        HETPAR_LOG(INFO) << "generation " << change.generation() << ": " << change.reason();
      }
      if (options_.on_membership_change) {
        if (absl::Status s = options_.on_membership_change(change); !s.ok()) {
          HETPAR_LOG(WARNING) << "membership change of generation " << change.generation()
                              << " not followed: " << StatusText(s);
        }
      }
      continue;
    }
    return message;
  }
}

absl::Status StepDriver::Fail(absl::Status status) {
  state_ = State::kFailed;
  return status;
}

absl::Status StepDriver::Run() {
  state_ = State::kAwaitingPlan;
  while (state_ == State::kAwaitingPlan) {
    absl::StatusOr<v1::CoordinatorMessage> message = NextRelevant();
    if (!message.ok()) return Fail(message.status());
    if (message->has_stop()) {
      Stopped(message->stop());
    } else if (message->has_abort()) {
      // Between steps there is nothing to undo; the coordinator sends the step again, a stop,
      // or a membership change next.
      HETPAR_LOG(WARNING) << "step " << message->abort().step()
                          << " aborted by the coordinator: " << message->abort().reason();
      modules_->Discard();
      SendEnded(message->abort().step(), message->abort().generation());
    } else if (message->has_step_plan()) {
      if (absl::Status s = RunOneStep(message->step_plan()); !s.ok()) return Fail(std::move(s));
    } else if (message->has_grad_norm() && message->grad_norm().step() == failed_step_ &&
               message->grad_norm().generation() == failed_generation_) {
      // The ranks that send the norm's partials finished the attempt before it failed here: its
      // norm may pass this rank's failed report on the way. The abort follows.
      HETPAR_LOG(INFO) << "ignoring the norm of step " << failed_step_ << " (generation "
                       << failed_generation_ << "), which failed on this rank";
    } else if (message->has_grad_norm() || message->has_commit()) {
      return Fail(absl::FailedPreconditionError(absl::StrCat(
          "the coordinator sent ", Describe(*message), " while no step was in flight")));
    }
  }
  if (!run_failed_.ok()) return Fail(run_failed_);
  if (state_ == State::kStopped && !left_run_) {
    if (absl::Status s = RegroupForOutputs(); !s.ok()) return Fail(std::move(s));
  }
  return absl::OkStatus();
}

void StepDriver::Stopped(const v1::StopRun& stop) {
  HETPAR_LOG(INFO) << (stop.leave_run() ? "leaving the run: " : "stop: ") << stop.reason();
  left_run_ = stop.leave_run();
  stop_generation_ = stop.generation();
  // No groups and no outputs after a failed run, or for a replica that left the run: the peers
  // they would wait on may be gone.
  if (stop.run_failed() || stop.replica_left()) run_failed_ = absl::AbortedError(stop.reason());
  replica_left_ = stop.replica_left();
  if (stop.encoder_replicas_size() > 0 || stop.llm_replicas_size() > 0) {
    // The run's replicas as it stopped: the outputs' groups span these.
    replicas_.encoder.assign(stop.encoder_replicas().begin(), stop.encoder_replicas().end());
    replicas_.llm.assign(stop.llm_replicas().begin(), stop.llm_replicas().end());
  }
  state_ = State::kStopped;
}

absl::Status StepDriver::Sent(absl::Status sent) {
  if (sent.ok()) return sent;
  // The session's queue still holds what came before its end; the end itself follows at once.
  const absl::Time deadline = absl::Now() + std::min(options_.timeout, absl::Seconds(10));
  while (true) {
    absl::StatusOr<v1::CoordinatorMessage> message = channel_->Next(deadline - absl::Now());
    if (!message.ok()) return absl::IsDeadlineExceeded(message.status()) ? sent : message.status();
    if (message->has_stop() && (message->stop().run_failed() || message->stop().replica_left())) {
      Stopped(message->stop());
      return run_failed_;
    }
  }
}

absl::Status StepDriver::RegroupForOutputs() {
  if (stop_generation_ <= formed_generation_) return absl::OkStatus();
  // The stop's arrival raised the interrupt (and the abort's before it); nothing follows it.
  if (options_.interrupt != nullptr) options_.interrupt->Clear();
  HETPAR_LOG(INFO) << "the stop aborted a step in flight: forming the groups anew in generation "
                   << stop_generation_ << " for the final outputs";
  HETPAR_RETURN_IF_ERROR(Annotate(
      modules_->Regroup(stop_generation_, replicas_),
      absl::StrCat("forming the groups of generation ", stop_generation_, " for the outputs")));
  formed_generation_ = stop_generation_;
  return absl::OkStatus();
}

void StepDriver::SendEnded(int64_t step, int64_t generation) {
  v1::Progress ended;
  ended.set_step(step);
  ended.set_generation(generation);
  ended.set_ended(true);
  // A session that ended shows up at the driver's next wait.
  if (absl::Status s = channel_->SendProgress(ended); !s.ok()) {
    HETPAR_LOG(WARNING) << "cannot tell the coordinator this rank gave step " << step
                        << " (generation " << generation << ") up: " << StatusText(s);
  }
}

absl::Status StepDriver::RunOneStep(const v1::StepPlan& step_message) {
  state_ = State::kComputing;
  const int64_t step = step_message.step();
  trace::Recorder::Process().BeginStep(step);
  const trace::Clock::time_point step_start = trace::Clock::now();
  v1::StepReport report;
  report.set_step(step);
  report.set_generation(step_message.generation());
  // An abort of this attempt that arrived while its plan waited in the queue ends it at once.
  if (options_.interrupt != nullptr) options_.interrupt->Arm(step_message.generation());
  const absl::Time start = absl::Now();
  absl::Status grouped = absl::OkStatus();
  replicas_.encoder.assign(step_message.encoder_replicas().begin(),
                           step_message.encoder_replicas().end());
  replicas_.llm.assign(step_message.llm_replicas().begin(), step_message.llm_replicas().end());
  if (options_.interrupt != nullptr && options_.interrupt->raised()) {
    // Aborted before it started: no groups are formed for it (they would wait on peers that
    // will not come) and it is not run.
    grouped = InterruptedError();
  } else if (step_message.generation() != formed_generation_) {
    // A new generation (an attempt aborted, or replicas left): groups formed anew.
    grouped = modules_->Regroup(step_message.generation(), replicas_);
    if (grouped.ok()) formed_generation_ = step_message.generation();
  }
  if (grouped.ok() &&
      (step_message.encoder_joining_size() > 0 || step_message.llm_joining_size() > 0)) {
    // Replicas joined: their state comes from a live replica before the step (every attempt
    // until one commits; the broadcast leaves the others as they were).
    StepReplicas replicas;
    replicas.encoder.assign(step_message.encoder_replicas().begin(),
                            step_message.encoder_replicas().end());
    replicas.llm.assign(step_message.llm_replicas().begin(), step_message.llm_replicas().end());
    StepReplicas joining;
    joining.encoder.assign(step_message.encoder_joining().begin(),
                           step_message.encoder_joining().end());
    joining.llm.assign(step_message.llm_joining().begin(), step_message.llm_joining().end());
    grouped = modules_->ReceiveJoinedState(replicas, joining);
  }
  absl::StatusOr<plan::RankStepPlan> rank_plan =
      coordinator::RankStepPlanFromProto(step_message.rank_plan());
  absl::StatusOr<StepOutcome> outcome = !grouped.ok() ? absl::StatusOr<StepOutcome>(grouped)
                                        : rank_plan.ok()
                                            ? modules_->RunStep(*rank_plan)
                                            : absl::StatusOr<StepOutcome>(rank_plan.status());
  // Peers whose groups formed may run the step and send this rank its boundary messages.
  if (!grouped.ok() && rank_plan.ok()) modules_->StepNotRun(*rank_plan);
  // A collective that failed without the coordinator's abort (on NCCL its group was aborted and
  // the step's read returned what was left): the step fails here, before its partials go out.
  if (outcome.ok() && options_.check_collectives) {
    if (absl::Status s = options_.check_collectives(step_message.generation()); !s.ok()) {
      outcome = s;
    }
  }
  trace::Record(trace::kStepLane, "compute", "step", step_start);
  if (!outcome.ok()) {
    // The coordinator decides what follows (it aborts the step, and plans it again or stops).
    HETPAR_LOG(WARNING) << "step " << step << " (generation " << step_message.generation()
                        << ") failed on this rank: " << StatusText(outcome.status());
    report.set_ok(false);
    report.set_error(std::string(outcome.status().message()));
    report.set_ends_run(IsEndsRun(outcome.status()));
    modules_->Discard();
    ++steps_failed_;
    failed_step_ = step;
    failed_generation_ = step_message.generation();
    state_ = State::kAwaitingPlan;
    return Sent(channel_->SendReport(report));
  }
  for (const GradNormShare& share : modules_->GradNormShares()) {
    v1::GradNormPartial partial;
    partial.set_step(step);
    partial.set_generation(step_message.generation());
    partial.set_module(share.module);
    partial.set_sum_squares(share.sum_squares);
    HETPAR_RETURN_IF_ERROR(Sent(channel_->SendGradNormPartial(partial)));
  }

  state_ = State::kAwaitingNorm;
  const absl::Time norm_asked = absl::Now();
  const trace::Clock::time_point norm_start = trace::Clock::now();
  HETPAR_ASSIGN_OR_RETURN(v1::CoordinatorMessage norm, NextRelevant());
  const double grad_norm_wait_s = absl::ToDoubleSeconds(absl::Now() - norm_asked);
  trace::Record(trace::kStepLane, "gradient norm wait", "grad_norm_wait", norm_start);
  if (EndsStep(norm, step)) return absl::OkStatus();
  if (!norm.has_grad_norm() || norm.grad_norm().step() != step) {
    return absl::FailedPreconditionError(
        absl::StrCat("step ", step,
                     ": expected the global gradient norm of this step from the coordinator, got ",
                     Describe(norm)));
  }

  // The report goes out before any state changes: the coordinator may still abort the step.
  report.set_ok(true);
  report.set_compute_s(absl::ToDoubleSeconds(absl::Now() - start));
  if (outcome->reports_loss) {
    report.set_loss_sum(outcome->loss_sum);
    report.set_loss_tokens(outcome->loss_tokens);
  }
  for (ModuleTimings& m : outcome->modules) {
    auto& t = m.values;
    t["step_s"] = report.compute_s();
    t["idle_s"] =
        std::max(0.0, report.compute_s() - t["compute_s"] - t["bridge_wait_s"] - t["collective_s"]);
    t["grad_norm_wait_s"] = grad_norm_wait_s;
    // The optimizer step that applied the previous step, at the start of this one.
    t["optimizer_s"] = last_optimizer_s_;
    for (const auto& [key, value] : t) {
      (*report.mutable_timings_s())[absl::StrCat(m.module, ".", key)] = value;
    }
  }
  HETPAR_RETURN_IF_ERROR(Sent(channel_->SendReport(report)));

  state_ = State::kAwaitingCommit;
  const trace::Clock::time_point commit_start = trace::Clock::now();
  HETPAR_ASSIGN_OR_RETURN(v1::CoordinatorMessage commit, NextRelevant());
  trace::Record(trace::kStepLane, "commit wait", "commit_wait", commit_start);
  if (EndsStep(commit, step)) return absl::OkStatus();
  if (!commit.has_commit() || commit.commit().step() != step) {
    return absl::FailedPreconditionError(
        absl::StrCat("step ", step, ": expected the coordinator to commit or abort this step, got ",
                     Describe(commit)));
  }

  if (norm.grad_norm().skip()) {
    // A non-finite norm: the step is committed without an update.
    HETPAR_LOG(WARNING) << "step " << step << " skipped: its gradient norm is "
                        << norm.grad_norm().norm();
    // Committed all the same: its checkpoint, when one is due, holds the state it left.
    HETPAR_RETURN_IF_ERROR(Annotate(modules_->Skip(step, commit.commit()),
                                    absl::StrCat("committing step ", step, " (skipped)")));
    ++steps_skipped_;
    last_optimizer_s_ = 0;
    state_ = State::kAwaitingPlan;
    if (options_.on_committed) options_.on_committed(step);
    return absl::OkStatus();
  }
  state_ = State::kApplying;
  const absl::Time optimizer_start = absl::Now();
  const trace::Clock::time_point optimizer_trace_start = trace::Clock::now();
  HETPAR_RETURN_IF_ERROR(
      Annotate(modules_->Apply(step, norm.grad_norm().clip_coefficient(), commit.commit()),
               absl::StrCat("committing step ", step)));
  last_optimizer_s_ = absl::ToDoubleSeconds(absl::Now() - optimizer_start);
  trace::Record(trace::kStepLane, "optimizer", "optimizer", optimizer_trace_start);
  if (options_.on_applied) options_.on_applied(step, outcome->modules);
  ++steps_applied_;
  state_ = State::kAwaitingPlan;
  if (options_.on_committed) options_.on_committed(step);
  return absl::OkStatus();
}

bool StepDriver::EndsStep(const v1::CoordinatorMessage& message, int64_t step) {
  if (message.has_abort()) {
    HETPAR_LOG(WARNING) << "step " << step
                        << " aborted by the coordinator: " << message.abort().reason();
    modules_->Discard();
    ++steps_discarded_;
    state_ = State::kAwaitingPlan;
    SendEnded(step, message.abort().generation());
    return true;
  }
  if (message.has_stop()) {
    // A stop before the commit: the step never happened.
    Stopped(message.stop());
    modules_->Discard();
    return true;
  }
  return false;
}

}  // namespace hetpar::worker
