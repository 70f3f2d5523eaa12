// The step protocol against a scripted coordinator: what the driver sends, in which order, and
// what the module sees (RunStep, Apply or Discard), for committed, aborted (before and after the
// report), stopped and failed steps.
#include "common/worker/step_driver.h"

#include <algorithm>
#include <deque>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/control/plan_codec.h"
#include "common/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hetpar::worker {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// Hands out the scripted messages in order; records what the worker sends.
class ScriptedChannel : public ControlChannel {
 public:
  void Push(v1::CoordinatorMessage message) { script_.push_back(std::move(message)); }
  absl::StatusOr<v1::CoordinatorMessage> Next(absl::Duration timeout) override {
    waits.push_back(timeout);
    if (script_.empty()) return end;
    v1::CoordinatorMessage m = std::move(script_.front());
    script_.pop_front();
    if (on_next) on_next(m);
    return m;
  }
  absl::Status SendGradNormPartial(const v1::GradNormPartial& partial) override {
    partials.push_back(partial);
    sent.push_back(absl::StrCat("partial ", partial.step()));
    return send_error;
  }
  absl::Status SendProgress(const v1::Progress& progress) override {
    progress_sent.push_back(absl::StrCat(progress.step(), "/", progress.generation(),
                                         progress.ended() ? " ended" : ""));
    return send_error;
  }
  absl::Status SendReport(const v1::StepReport& report) override {
    reports.push_back(report);
    sent.push_back(absl::StrCat("report ", report.step(), report.ok() ? " ok" : " failed"));
    if (log != nullptr) log->push_back(absl::StrCat("report ", report.step()));
    return send_error;
  }

  // What every send returns (a session that has ended fails them).
  absl::Status send_error;
  // What Next returns once the script is used up (a session's final status).
  absl::Status end = absl::DeadlineExceededError("script ended");

  std::vector<absl::Duration> waits;         // each Next's timeout, in order
  std::vector<std::string> progress_sent;     // each progress sent, in order
  std::vector<v1::GradNormPartial> partials;
  std::vector<v1::StepReport> reports;
  std::vector<std::string> sent;            // in order
  std::vector<std::string>* log = nullptr;  // reports are also appended here when set
  // Sees each message as it is handed out (what the session's on_arrival does with an abort).
  std::function<void(const v1::CoordinatorMessage&)> on_next;

 private:
  std::deque<v1::CoordinatorMessage> script_;
};

// A module whose gradient is known: each step's RunStep "computes" grad_sum_squares, Apply
// records the clip coefficient, Discard drops the pending gradient.
class RecordingModule : public ModuleRuntime {
 public:
  absl::StatusOr<StepOutcome> RunStep(const plan::RankStepPlan& plan) override {
    calls.push_back(absl::StrCat("run ", plan.step));
    if (plan.step == fail_at_step) return fail_with;
    // A step's waits on its peers end at once when the interrupt is raised.
    if (interrupt != nullptr && interrupt->raised()) return InterruptedError();
    pending = true;
    StepOutcome outcome;
    outcome.reports_loss = true;
    outcome.loss_sum = 12.5;
    outcome.loss_tokens = 5;
    outcome.modules.push_back({"encoder", {{"compute_s", 0.0}, {"images", 3}}});
    return outcome;
  }
  std::vector<GradNormShare> GradNormShares() const override { return {{v1::MODULE_ENCODER, 4.0}}; }
  absl::Status Apply(int64_t step, double clip, const v1::StepCommit& commit) override {
    calls.push_back(
        absl::StrCat("apply ", step, " clip ", clip, commit.checkpoint() ? " checkpoint" : ""));
    if (!pending) return absl::InternalError("apply without gradients");
    pending = false;
    ++updates;
    return absl::OkStatus();
  }
  void Discard() override {
    calls.push_back("discard");
    pending = false;
  }
  absl::Status Skip(int64_t step, const v1::StepCommit& commit) override {
    calls.push_back(absl::StrCat("skip ", step, commit.checkpoint() ? " checkpoint" : ""));
    pending = false;
    return absl::OkStatus();
  }
  void StepNotRun(const plan::RankStepPlan& plan) override {
    calls.push_back(absl::StrCat("not run ", plan.step));
  }
  absl::Status Regroup(int64_t generation, const StepReplicas& replicas) override {
    if (interrupt != nullptr && interrupt->raised()) ++regroups_with_interrupt_raised;
    calls.push_back(absl::StrCat("regroup ", generation, " [", absl::StrJoin(replicas.encoder, ","),
                                 "]", replicas.llm.empty() ? "" : " llm [",
                                 absl::StrJoin(replicas.llm, ","),
                                 replicas.llm.empty() ? "" : "]"));
    return regroup_error;
  }
  absl::Status WriteOutputs(const OutputSender&, int64_t) override { return absl::OkStatus(); }
  absl::Status ReceiveJoinedState(const StepReplicas& replicas,
                                  const StepReplicas& joining) override {
    calls.push_back(absl::StrCat("state of [", absl::StrJoin(replicas.encoder, ","), "] to [",
                                 absl::StrJoin(joining.encoder, ","), "]",
                                 joining.llm.empty() ? "" : " llm [",
                                 absl::StrJoin(joining.llm, ","), joining.llm.empty() ? "" : "]"));
    return absl::OkStatus();
  }

  std::vector<std::string> calls;
  bool pending = false;
  int updates = 0;
  int64_t fail_at_step = -1;
  absl::Status fail_with = absl::UnavailableError("peer llm-1 died");  // RunStep at fail_at_step
  absl::Status regroup_error;
  // When set, RunStep fails as an interrupted wait would while it is raised, and Regroup counts
  // calls while it is raised.
  const StepInterrupt* interrupt = nullptr;
  int regroups_with_interrupt_raised = 0;
};

// Options of a driver whose groups were formed in generation 1.
StepDriverOptions Gen1() {
  StepDriverOptions options;
  options.initial_generation = 1;
  return options;
}

// Options whose on_applied records each applied step in `steps`.
StepDriverOptions RecordingApplied(std::vector<int64_t>* steps) {
  StepDriverOptions options = Gen1();
  options.on_applied = [steps](int64_t step, const std::vector<ModuleTimings>&) {
    steps->push_back(step);
  };
  return options;
}

// A plan of generation 1 (the one the drivers below start in) unless given another.
v1::CoordinatorMessage Plan(int64_t step, int64_t generation = 1,
                            std::vector<int64_t> encoder_replicas = {}) {
  plan::RankStepPlan rank_plan;
  rank_plan.step = step;
  v1::CoordinatorMessage m;
  m.mutable_step_plan()->set_step(step);
  m.mutable_step_plan()->set_generation(generation);
  for (int64_t r : encoder_replicas) m.mutable_step_plan()->add_encoder_replicas(r);
  *m.mutable_step_plan()->mutable_rank_plan() = coordinator::RankStepPlanToProto(rank_plan);
  return m;
}

v1::CoordinatorMessage Norm(int64_t step, double clip, int64_t generation = 1) {
  v1::CoordinatorMessage m;
  m.mutable_grad_norm()->set_step(step);
  m.mutable_grad_norm()->set_generation(generation);
  m.mutable_grad_norm()->set_clip_coefficient(clip);
  return m;
}

v1::CoordinatorMessage Commit(int64_t step, bool checkpoint = false) {
  v1::CoordinatorMessage m;
  m.mutable_commit()->set_step(step);
  m.mutable_commit()->set_checkpoint(checkpoint);
  return m;
}

v1::CoordinatorMessage Abort(int64_t step, int64_t generation = 1) {
  v1::CoordinatorMessage m;
  m.mutable_abort()->set_step(step);
  m.mutable_abort()->set_generation(generation);
  m.mutable_abort()->set_reason("encoder-1 missed its deadline");
  return m;
}

v1::CoordinatorMessage Stop(int64_t generation = 0) {
  v1::CoordinatorMessage m;
  m.mutable_stop()->set_reason("run complete");
  m.mutable_stop()->set_generation(generation);
  return m;
}

// The stop of a run that failed (RunController::Fail).
v1::CoordinatorMessage FailedStop(int64_t generation) {
  v1::CoordinatorMessage m = Stop(generation);
  m.mutable_stop()->set_reason("run failed: llm rank 1 lost; the run cannot go on");
  m.mutable_stop()->set_run_failed(true);
  return m;
}

// Step 0 committed in generation 3 over encoder replicas 0 and 1; step 1's attempt then aborted,
// after its report or (`failed_here`: the module fails step 1) after it failed on this rank; then
// `stop`.
std::vector<v1::CoordinatorMessage> AbortedAfterACommit(bool failed_here,
                                                        v1::CoordinatorMessage stop) {
  std::vector<v1::CoordinatorMessage> script = {Plan(0, 3, {0, 1}), Norm(0, 1.0), Commit(0),
                                                Plan(1, 3, {0, 1})};
  if (!failed_here) script.push_back(Norm(1, 1.0));
  script.push_back(Abort(1, 3));
  script.push_back(std::move(stop));
  return script;
}

v1::CoordinatorMessage Ack() {
  v1::CoordinatorMessage m;
  m.mutable_heartbeat_ack();
  return m;
}

TEST(StepDriverTest, CommittedStepsApplyTheCoordinatorsClipOnlyAtTheCommit) {
  ScriptedChannel channel;
  RecordingModule module;
  for (auto m :
       {Plan(0), Ack(), Norm(0, 0.5), Commit(0), Plan(1), Norm(1, 1.0), Commit(1, true), Stop()}) {
    channel.Push(m);
  }
  std::vector<int64_t> applied_steps;
  StepDriverOptions options = Gen1();
  options.on_applied = [&](int64_t step, const std::vector<ModuleTimings>& t) {
    applied_steps.push_back(step);
    ASSERT_EQ(t.size(), 1u);
    EXPECT_EQ(t[0].module, "encoder");
  };
  channel.log = &module.calls;
  StepDriver driver(&channel, &module, options);
  ASSERT_TRUE(driver.Run().ok());
  EXPECT_EQ(driver.state(), StepDriver::State::kStopped);
  EXPECT_EQ(driver.steps_applied(), 2);
  // Each step is reported before anything changes, and applied at its commit, which may ask for
  // a checkpoint.
  EXPECT_THAT(module.calls, ElementsAre("run 0", "report 0", "apply 0 clip 0.5", "run 1",
                                        "report 1", "apply 1 clip 1 checkpoint"));
  EXPECT_THAT(channel.sent, ElementsAre("partial 0", "report 0 ok", "partial 1", "report 1 ok"));
  EXPECT_THAT(applied_steps, ElementsAre(0, 1));
  ASSERT_EQ(channel.partials.size(), 2u);
  EXPECT_EQ(channel.partials[0].module(), v1::MODULE_ENCODER);
  EXPECT_EQ(channel.partials[0].sum_squares(), 4.0);
  EXPECT_EQ(channel.partials[0].generation(), 1);
  const v1::StepReport& report = channel.reports[0];
  EXPECT_EQ(report.loss_sum(), 12.5);
  EXPECT_EQ(report.loss_tokens(), 5);
  EXPECT_EQ(report.timings_s().at("encoder.images"), 3);
  EXPECT_TRUE(report.timings_s().contains("encoder.grad_norm_wait_s"));
  EXPECT_TRUE(report.timings_s().contains("encoder.optimizer_s"));
  EXPECT_TRUE(report.timings_s().contains("encoder.idle_s"));
}

// The update of a step that every rank reported is still not applied when the coordinator aborts
// it before its commit (a lost worker, a loss-token mismatch): the retry starts from the same
// parameters and applies once.
TEST(StepDriverTest, AnAbortAfterTheReportDiscardsTheStepSoTheRetryAppliesOnce) {
  ScriptedChannel channel;
  RecordingModule module;
  for (auto m : {Plan(5), Norm(5, 1.0), Abort(5), Plan(5), Norm(5, 0.25), Commit(5), Stop()}) {
    channel.Push(m);
  }
  std::vector<int64_t> applied_steps;
  StepDriver driver(&channel, &module, RecordingApplied(&applied_steps));
  ASSERT_TRUE(driver.Run().ok());
  EXPECT_THAT(module.calls, ElementsAre("run 5", "discard", "run 5", "apply 5 clip 0.25"));
  EXPECT_EQ(module.updates, 1);
  EXPECT_EQ(driver.steps_discarded(), 1);
  EXPECT_THAT(applied_steps, ElementsAre(5));
  EXPECT_THAT(channel.sent, ElementsAre("partial 5", "report 5 ok", "partial 5", "report 5 ok"));
}

TEST(StepDriverTest, AStopAfterTheReportButBeforeTheCommitAppliesNothing) {
  ScriptedChannel channel;
  RecordingModule module;
  for (auto m : {Plan(0), Norm(0, 1.0), Stop()}) channel.Push(m);
  StepDriver driver(&channel, &module, Gen1());
  ASSERT_TRUE(driver.Run().ok());
  EXPECT_EQ(driver.state(), StepDriver::State::kStopped);
  EXPECT_THAT(module.calls, ElementsAre("run 0", "discard"));
  EXPECT_EQ(module.updates, 0);
}

TEST(StepDriverTest, ACommittedStepWithANonFiniteNormIsDiscardedNotApplied) {
  ScriptedChannel channel;
  RecordingModule module;
  v1::CoordinatorMessage skip = Norm(2, 1.0);
  skip.mutable_grad_norm()->set_skip(true);
  // The commit asks for a checkpoint (a stop with one): the skipped step still writes it.
  for (auto m : {Plan(2), skip, Commit(2, /*checkpoint=*/true), Plan(3), Norm(3, 1.0), Commit(3),
                 Stop()}) {
    channel.Push(m);
  }
  std::vector<int64_t> applied_steps;
  std::vector<int64_t> committed_steps;
  StepDriverOptions options = RecordingApplied(&applied_steps);
  options.on_committed = [&committed_steps](int64_t step) { committed_steps.push_back(step); };
  StepDriver driver(&channel, &module, options);
  ASSERT_TRUE(driver.Run().ok());
  EXPECT_THAT(module.calls, ElementsAre("run 2", "skip 2 checkpoint", "run 3", "apply 3 clip 1"));
  EXPECT_EQ(driver.steps_skipped(), 1);
  EXPECT_EQ(driver.steps_applied(), 1);
  EXPECT_THAT(applied_steps, ElementsAre(3));
  // Both were committed: the worker trains with the run from the skipped one on (--ready-file).
  EXPECT_THAT(committed_steps, ElementsAre(2, 3));
  // The skipped step was still reported: the coordinator commits it.
  EXPECT_THAT(channel.sent, ElementsAre("partial 2", "report 2 ok", "partial 3", "report 3 ok"));
}

TEST(StepDriverTest, ACommitOfAnotherStepIsRefusedInsteadOfApplied) {
  ScriptedChannel channel;
  RecordingModule module;
  for (auto m : {Plan(4), Norm(4, 1.0), Commit(3)}) channel.Push(m);
  StepDriver driver(&channel, &module, Gen1());
  const absl::Status status = driver.Run();
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(status.message()), HasSubstr("the commit of step 3"));
  EXPECT_EQ(module.updates, 0);
}

TEST(StepDriverTest, AnAbortAfterThePartialsDiscardsTheStepAndTheRetryApplies) {
  ScriptedChannel channel;
  RecordingModule module;
  for (auto m : {Plan(3), Abort(3), Plan(3), Norm(3, 1.0), Commit(3), Stop()}) channel.Push(m);
  StepDriver driver(&channel, &module, Gen1());
  ASSERT_TRUE(driver.Run().ok());
  EXPECT_THAT(module.calls, ElementsAre("run 3", "discard", "run 3", "apply 3 clip 1"));
  EXPECT_EQ(module.updates, 1);
  EXPECT_EQ(driver.steps_applied(), 1);
  EXPECT_EQ(driver.steps_discarded(), 1);
  // No report for the aborted attempt.
  EXPECT_THAT(channel.sent, ElementsAre("partial 3", "partial 3", "report 3 ok"));
}

TEST(StepDriverTest, AStopWhileAwaitingTheDecisionDiscardsWithoutApplying) {
  ScriptedChannel channel;
  RecordingModule module;
  for (auto m : {Plan(0), Stop()}) channel.Push(m);
  StepDriver driver(&channel, &module, Gen1());
  ASSERT_TRUE(driver.Run().ok());
  EXPECT_EQ(driver.state(), StepDriver::State::kStopped);
  EXPECT_THAT(module.calls, ElementsAre("run 0", "discard"));
  EXPECT_EQ(module.updates, 0);
}

TEST(StepDriverTest, AFailedStepIsReportedDiscardedAndTheCoordinatorsRetryRuns) {
  ScriptedChannel channel;
  RecordingModule module;
  module.fail_at_step = 2;
  // The coordinator aborts the failed attempt and plans the step again in a new generation.
  for (auto m : {Plan(2), Abort(2), Plan(3, 2), Norm(3, 1.0), Commit(3), Stop()}) {
    channel.Push(m);
  }
  StepDriver driver(&channel, &module, Gen1());
  ASSERT_TRUE(driver.Run().ok());
  EXPECT_EQ(driver.steps_failed(), 1);
  EXPECT_THAT(channel.sent, ElementsAre("report 2 failed", "partial 3", "report 3 ok"));
  EXPECT_THAT(channel.reports[0].error(), HasSubstr("peer llm-1 died"));
  EXPECT_FALSE(channel.reports[0].ends_run());  // a peer's death: the retry may go otherwise
  EXPECT_THAT(module.calls, ElementsAre("run 2", "discard", "discard", "regroup 2 []", "run 3",
                                        "apply 3 clip 1"));
  EXPECT_EQ(module.updates, 1);
}

// A failure that every attempt of the step would meet (BatchSource::RecordFor: this worker's data
// index is not the coordinator's) is reported so: the coordinator fails the run instead of
// planning the step again. The driver waits for its word as after any failure.
TEST(StepDriverTest, AFailureEveryAttemptWouldMeetIsReportedAsEndingTheRun) {
  ScriptedChannel channel;
  RecordingModule module;
  module.fail_at_step = 2;
  module.fail_with = EndsRun(absl::FailedPreconditionError(
      "data index position 7 (sample 'a', train.jsonl:8) has other tokens here"));
  for (auto m : {Plan(2), FailedStop(2)}) channel.Push(m);
  StepDriver driver(&channel, &module, Gen1());
  const absl::Status status = driver.Run();
  EXPECT_EQ(status.code(), absl::StatusCode::kAborted);
  ASSERT_EQ(channel.reports.size(), 1u);
  EXPECT_FALSE(channel.reports[0].ok());
  EXPECT_TRUE(channel.reports[0].ends_run());
  // The words, without the mark's payload.
  EXPECT_EQ(channel.reports[0].error(),
            "data index position 7 (sample 'a', train.jsonl:8) has other tokens here");
  EXPECT_THAT(module.calls, ElementsAre("run 2", "discard"));
}

// A collective group that failed without the coordinator's abort (an NCCL communicator aborted
// by its watchdog) fails the step after its compute, before any partial goes out.
TEST(StepDriverTest, AFailedCollectiveGroupFailsTheStepBeforeItsPartials) {
  ScriptedChannel channel;
  RecordingModule module;
  for (auto m : {Plan(0), Norm(0, 1.0), Commit(0), Plan(1), Abort(1), Plan(2, 2), Norm(2, 1.0),
                 Commit(2), Stop()}) {
    channel.Push(m);
  }
  std::vector<int64_t> checked;
  StepDriverOptions options = Gen1();
  options.check_collectives = [&](int64_t generation) -> absl::Status {
    checked.push_back(generation);
    if (checked.size() == 2) {
      return absl::UnavailableError(
          "the nccl group of rank 0 of 2 (generation 1): a collective "
          "timed out");
    }
    return absl::OkStatus();
  };
  StepDriver driver(&channel, &module, options);
  ASSERT_TRUE(driver.Run().ok());
  EXPECT_THAT(checked, ElementsAre(1, 1, 2));
  EXPECT_EQ(driver.steps_failed(), 1);
  EXPECT_THAT(channel.sent, ElementsAre("partial 0", "report 0 ok", "report 1 failed", "partial 2",
                                        "report 2 ok"));
  EXPECT_THAT(channel.reports[1].error(), HasSubstr("a collective timed out"));
  EXPECT_THAT(module.calls, ElementsAre("run 0", "apply 0 clip 1", "run 1", "discard", "discard",
                                        "regroup 2 []", "run 2", "apply 2 clip 1"));
  EXPECT_EQ(module.updates, 2);
}

TEST(StepDriverTest, ANewGenerationFormsTheGroupsOverThePlansEncoderReplicasOnce) {
  ScriptedChannel channel;
  RecordingModule module;
  for (auto m : {Plan(0, 4, {0, 2}), Norm(0, 1.0), Commit(0), Plan(1, 4, {0, 2}), Norm(1, 1.0),
                 Commit(1), Stop()}) {
    channel.Push(m);
  }
  StepDriver driver(&channel, &module, Gen1());
  ASSERT_TRUE(driver.Run().ok());
  EXPECT_THAT(module.calls,
              ElementsAre("regroup 4 [0,2]", "run 0", "apply 0 clip 1", "run 1", "apply 1 clip 1"));
}

TEST(StepDriverTest, GroupsThatCannotBeFormedFailTheStepAndAreTriedAgainNextAttempt) {
  ScriptedChannel channel;
  RecordingModule module;
  module.regroup_error = absl::DeadlineExceededError("rendezvous of generation 2 timed out");
  for (auto m : {Plan(0, 2), Abort(0), Stop()}) channel.Push(m);
  StepDriver driver(&channel, &module, Gen1());
  ASSERT_TRUE(driver.Run().ok());
  EXPECT_THAT(channel.sent, ElementsAre("report 0 failed"));
  EXPECT_THAT(channel.reports[0].error(), HasSubstr("rendezvous of generation 2"));
  // The step never ran on groups that were not formed.
  EXPECT_THAT(module.calls, ElementsAre("regroup 2 []", "not run 0", "discard", "discard"));
}

TEST(StepDriverTest, AnAbortOfAnEarlierAttemptDoesNotInterruptTheNextOne) {
  ScriptedChannel channel;
  RecordingModule module;
  StepInterrupt interrupt;
  interrupt.Raise(1);  // the abort of the attempt in generation 1
  module.interrupt = &interrupt;
  for (auto m : {Plan(0, 2), Norm(0, 1.0), Commit(0), Stop()}) channel.Push(m);
  StepDriverOptions options = Gen1();
  options.interrupt = &interrupt;
  StepDriver driver(&channel, &module, options);
  ASSERT_TRUE(driver.Run().ok());
  EXPECT_FALSE(interrupt.raised());
  EXPECT_THAT(module.calls, ElementsAre("regroup 2 []", "run 0", "apply 0 clip 1"));
  EXPECT_EQ(module.updates, 1);
}

// The rank was still finishing the step before when the coordinator planned the next one and
// then aborted it (a peer died): the abort raised the interrupt while the plan waited in the
// queue. That attempt ends as soon as it starts instead of waiting on the dead peer for its whole
// deadline; the next attempt, in the next generation, runs.
TEST(StepDriverTest, AnAbortThatArrivedBeforeItsPlanWasTakenEndsThatAttempt) {
  ScriptedChannel channel;
  RecordingModule module;
  StepInterrupt interrupt;
  module.interrupt = &interrupt;
  for (auto m : {Plan(0), Norm(0, 1.0), Commit(0), Plan(1), Abort(1), Plan(1, 2), Norm(1, 1.0),
                 Commit(1), Stop()}) {
    channel.Push(m);
  }
  // The abort of step 1's first attempt (generation 1, the groups' own) arrives with step 0's
  // commit, before the driver takes step 1's plan.
  channel.on_next = [&interrupt](const v1::CoordinatorMessage& m) {
    if (m.has_commit() && m.commit().step() == 0) interrupt.Raise(1);
  };
  StepDriverOptions options = Gen1();
  options.interrupt = &interrupt;
  StepDriver driver(&channel, &module, options);
  ASSERT_TRUE(driver.Run().ok());
  EXPECT_THAT(channel.sent, ElementsAre("partial 0", "report 0 ok", "report 1 failed", "partial 1",
                                        "report 1 ok"));
  EXPECT_THAT(channel.reports[1].error(), HasSubstr("interrupted"));
  EXPECT_THAT(module.calls, ElementsAre("run 0", "apply 0 clip 1", "not run 1", "discard",
                                        "discard", "regroup 2 []", "run 1", "apply 1 clip 1"));
  EXPECT_EQ(driver.steps_failed(), 1);
  EXPECT_EQ(module.updates, 2);
}

// A stop ends what is in flight whatever its generation; Clear lets the outputs' gathers run.
TEST(StepInterruptTest, AStopRaisesEveryGenerationUntilCleared) {
  StepInterrupt interrupt;
  EXPECT_FALSE(interrupt.raised());
  interrupt.Raise(3);  // before any Arm, an abort interrupts
  EXPECT_TRUE(interrupt.raised());
  interrupt.Arm(4);
  EXPECT_FALSE(interrupt.raised());
  interrupt.Raise(2);  // a late abort of an older attempt
  EXPECT_FALSE(interrupt.raised());
  interrupt.Raise(4);
  EXPECT_TRUE(interrupt.raised());
  interrupt.Arm(5);
  EXPECT_FALSE(interrupt.raised());
  interrupt.RaiseAll();
  EXPECT_TRUE(interrupt.raised());
  interrupt.Arm(9);
  EXPECT_TRUE(interrupt.raised());
  interrupt.Clear();
  EXPECT_FALSE(interrupt.raised());
}

// The norm goes out once the partials' ranks have sent them; a rank outside them may fail the
// same attempt after that. The norm then reaches it after its failed report: it is ignored, and
// the abort and the next attempt follow. A norm of any other attempt there ends the worker.
TEST(StepDriverTest, TheNormOfAnAttemptThatFailedHereIsIgnored) {
  ScriptedChannel channel;
  RecordingModule module;
  module.fail_at_step = 0;
  for (auto m : {Plan(0), Norm(0, 1.0), Abort(0), Plan(1, 2), Norm(1, 1.0, 2), Commit(1), Stop()}) {
    channel.Push(m);
  }
  StepDriver driver(&channel, &module, Gen1());
  ASSERT_TRUE(driver.Run().ok());
  EXPECT_THAT(channel.sent, ElementsAre("report 0 failed", "partial 1", "report 1 ok"));
  EXPECT_EQ(module.updates, 1);

  ScriptedChannel other;
  RecordingModule failing;
  failing.fail_at_step = 0;
  for (auto m : {Plan(0), Norm(0, 1.0, 3)}) other.Push(m);
  StepDriver refusing(&other, &failing, Gen1());
  const absl::Status status = refusing.Run();
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(status.message()), HasSubstr("while no step was in flight"));
}

TEST(StepDriverTest, ANormOfAnotherStepIsRefusedInsteadOfApplied) {
  ScriptedChannel channel;
  RecordingModule module;
  for (auto m : {Plan(4), Norm(3, 1.0)}) channel.Push(m);
  StepDriver driver(&channel, &module, Gen1());
  const absl::Status status = driver.Run();
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(status.message()), HasSubstr("the norm of step 3"));
  EXPECT_EQ(module.updates, 0);
}

TEST(StepDriverTest, AMembershipChangeIsLoggedAndTheWorkerGoesOnWithTheNextPlan) {
  ScriptedChannel channel;
  RecordingModule module;
  v1::CoordinatorMessage change;
  auto* lost = change.mutable_membership_change()->add_lost();
  lost->set_worker_id("encoder-1");
  lost->set_host("10.0.0.7");
  change.mutable_membership_change()->set_reason("heartbeat timeout");
  for (auto m : {change, Plan(0, 3, {1}), Norm(0, 1.0), Commit(0), Stop()}) channel.Push(m);
  StepDriver driver(&channel, &module, Gen1());
  ASSERT_TRUE(driver.Run().ok());
  EXPECT_THAT(module.calls, ElementsAre("regroup 3 [1]", "run 0", "apply 0 clip 1"));
}

// A plan naming replicas that joined: the state broadcast comes after the groups of its
// generation and before the step, in every attempt until one commits. A membership change naming
// joined workers reaches the worker's hook (it connects to them) before the plan after it.
TEST(StepDriverTest, JoinedReplicasGetTheStateBeforeTheirFirstStepInEveryAttempt) {
  ScriptedChannel channel;
  RecordingModule module;
  v1::CoordinatorMessage change;
  change.mutable_membership_change()->set_generation(2);
  change.mutable_membership_change()->set_reason("encoder replica(s) 1 joined the run");
  change.mutable_membership_change()->add_joined()->set_world_rank(1);
  v1::CoordinatorMessage joined = Plan(0, 2, {0, 1});
  joined.mutable_step_plan()->add_encoder_joining(1);
  v1::CoordinatorMessage retry = Plan(0, 3, {0, 1});
  retry.mutable_step_plan()->add_encoder_joining(1);
  for (auto m : {change, joined, Norm(0, 1.0), Abort(0), retry, Norm(0, 1.0), Commit(0), Plan(1, 3),
                 Norm(1, 1.0), Commit(1), Stop()}) {
    channel.Push(m);
  }
  StepDriverOptions options = Gen1();
  std::vector<int64_t> connected;
  options.on_membership_change = [&](const v1::MembershipChange& c) {
    for (const auto& peer : c.joined()) connected.push_back(peer.world_rank());
    module.calls.push_back("membership change");
    return absl::OkStatus();
  };
  StepDriver driver(&channel, &module, options);
  ASSERT_TRUE(driver.Run().ok());
  EXPECT_THAT(connected, ElementsAre(1));
  EXPECT_THAT(module.calls,
              ElementsAre("membership change", "regroup 2 [0,1]", "state of [0,1] to [1]", "run 0",
                          "discard", "regroup 3 [0,1]", "state of [0,1] to [1]", "run 0",
                          "apply 0 clip 1", "run 1", "apply 1 clip 1"));
  EXPECT_FALSE(driver.left_run());
}

// A stop for this worker alone (its replica left a run that goes on).
TEST(StepDriverTest, AStopThatLeavesTheRunIsToldApartFromTheRunsStop) {
  ScriptedChannel channel;
  RecordingModule module;
  v1::CoordinatorMessage leave = Stop();
  leave.mutable_stop()->set_leave_run(true);
  for (auto m : {Plan(0), Norm(0, 1.0), Commit(0), leave}) channel.Push(m);
  StepDriver driver(&channel, &module, Gen1());
  ASSERT_TRUE(driver.Run().ok());
  EXPECT_EQ(driver.state(), StepDriver::State::kStopped);
  EXPECT_TRUE(driver.left_run());
  EXPECT_EQ(driver.steps_applied(), 1);
}

// A stop that aborted a step in flight comes in a generation of its own: the groups are formed
// anew in it, over the last plan's replicas and with the interrupt armed, before Run returns and
// the outputs are gathered. Whether the step failed on this rank or was aborted after its report.
TEST(StepDriverTest, AStopOfANewerGenerationFormsTheGroupsAnewForTheOutputs) {
  for (const bool failed_here : {false, true}) {
    SCOPED_TRACE(failed_here ? "the step failed on this rank" : "aborted after the report");
    ScriptedChannel channel;
    RecordingModule module;
    if (failed_here) module.fail_at_step = 1;
    for (const auto& m : AbortedAfterACommit(failed_here, Stop(4))) channel.Push(m);
    StepInterrupt interrupt;
    StepDriverOptions options = Gen1();
    options.interrupt = &interrupt;
    options.initial_replicas.encoder = {0};
    module.interrupt = &interrupt;
    StepDriver driver(&channel, &module, options);
    // The stop's arrival raised the interrupt; it must not fail the new groups' rendezvous.
    channel.on_next = [&interrupt](const v1::CoordinatorMessage& m) {
      if (m.has_abort()) interrupt.Raise(m.abort().generation());
      if (m.has_stop()) interrupt.RaiseAll();
    };
    ASSERT_TRUE(driver.Run().ok());
    EXPECT_EQ(driver.state(), StepDriver::State::kStopped);
    EXPECT_EQ(module.calls.front(), "regroup 3 [0,1]");
    EXPECT_EQ(module.calls.back(), "regroup 4 [0,1]");
    EXPECT_EQ(module.regroups_with_interrupt_raised, 0);
    EXPECT_EQ(driver.steps_applied(), 1);
  }
}

// The rank says it gave an aborted attempt up, whether the abort came after its failure
// (between steps) or while it waited for the decision: the coordinator's next attempt waits for
// that. A committed step sends nothing of the kind.
TEST(StepDriverTest, EachAbortedAttemptIsSaidToBeGivenUp) {
  ScriptedChannel channel;
  RecordingModule module;
  module.fail_at_step = 1;
  for (auto m : {Plan(0), Norm(0, 1.0), Commit(0), Plan(1), Abort(1, 1), Plan(2), Abort(2, 1)}) {
    channel.Push(m);
  }
  StepDriver driver(&channel, &module, Gen1());
  EXPECT_EQ(driver.Run().code(), absl::StatusCode::kDeadlineExceeded);  // the script ends
  EXPECT_THAT(channel.progress_sent, ElementsAre("1/1 ended", "2/1 ended"));
}

// A replica lost during the step the stop aborted: the outputs' groups span the replicas the
// stop names, not the last plan's.
TEST(StepDriverTest, TheOutputsGroupsSpanTheReplicasTheStopNames) {
  ScriptedChannel channel;
  RecordingModule module;
  v1::CoordinatorMessage stop = Stop(4);
  stop.mutable_stop()->add_encoder_replicas(0);
  stop.mutable_stop()->add_llm_replicas(0);
  for (const auto& m : AbortedAfterACommit(/*failed_here=*/false, stop)) channel.Push(m);
  StepDriverOptions options = Gen1();
  options.initial_replicas.encoder = {0};
  StepDriver driver(&channel, &module, options);
  ASSERT_TRUE(driver.Run().ok());
  EXPECT_EQ(module.calls.front(), "regroup 3 [0,1]");  // the plans' replicas
  EXPECT_EQ(module.calls.back(), "regroup 4 [0] llm [0]");
}

TEST(StepDriverTest, AStopOfTheGroupsOwnGenerationOrOfNoneKeepsThem) {
  for (const int64_t generation : {int64_t{0}, int64_t{1}}) {
    ScriptedChannel channel;
    RecordingModule module;
    for (auto m : {Plan(0), Norm(0, 1.0), Commit(0), Stop(generation)}) channel.Push(m);
    StepDriver driver(&channel, &module, Gen1());
    ASSERT_TRUE(driver.Run().ok());
    EXPECT_THAT(module.calls, ElementsAre("run 0", "apply 0 clip 1")) << generation;
  }
}

TEST(StepDriverTest, AStopBeforeAnyPlanFormsTheGroupsOverTheAssignedReplicas) {
  ScriptedChannel channel;
  RecordingModule module;
  channel.Push(Stop(2));
  StepDriverOptions options = Gen1();
  options.initial_replicas.encoder = {0, 1};
  options.initial_replicas.llm = {0};
  StepDriver driver(&channel, &module, options);
  ASSERT_TRUE(driver.Run().ok());
  EXPECT_THAT(module.calls, ElementsAre("regroup 2 [0,1] llm [0]"));
}

TEST(StepDriverTest, AStopThatLeavesTheRunFormsNoGroups) {
  ScriptedChannel channel;
  RecordingModule module;
  v1::CoordinatorMessage leave = Stop(2);
  leave.mutable_stop()->set_leave_run(true);
  channel.Push(leave);
  StepDriver driver(&channel, &module, Gen1());
  ASSERT_TRUE(driver.Run().ok());
  EXPECT_TRUE(driver.left_run());
  EXPECT_TRUE(module.calls.empty());
}

TEST(StepDriverTest, GroupsForTheOutputsThatCannotBeFormedFailTheRun) {
  ScriptedChannel channel;
  RecordingModule module;
  module.regroup_error = absl::DeadlineExceededError("rendezvous of generation 2 timed out");
  channel.Push(Stop(2));
  StepDriver driver(&channel, &module, Gen1());
  const absl::Status status = driver.Run();
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(status.message(), HasSubstr("forming the groups of generation 2 for the outputs"));
  EXPECT_EQ(driver.state(), StepDriver::State::kFailed);
}

// A failed run's stop (the coordinator also aborted the step in flight and moved the generation
// on) forms no groups: the peers they would wait on may be the ones lost. Run ends with its reason.
TEST(StepDriverTest, AFailedRunsStopFormsNoGroupsAndEndsTheRunWithItsReason) {
  for (const bool failed_here : {false, true}) {
    SCOPED_TRACE(failed_here ? "the step failed on this rank" : "aborted after the report");
    ScriptedChannel channel;
    RecordingModule module;
    if (failed_here) module.fail_at_step = 1;
    for (const auto& m : AbortedAfterACommit(failed_here, FailedStop(4))) channel.Push(m);
    StepDriver driver(&channel, &module, Gen1());
    const absl::Status status = driver.Run();
    EXPECT_EQ(status.code(), absl::StatusCode::kAborted);
    EXPECT_EQ(status.message(), "run failed: llm rank 1 lost; the run cannot go on");
    EXPECT_EQ(driver.state(), StepDriver::State::kFailed);
    EXPECT_EQ(module.calls.front(), "regroup 3 [0,1]");
    for (const std::string& call : module.calls) EXPECT_NE(call, "regroup 4 [0,1]");
    EXPECT_EQ(driver.steps_applied(), 1);
  }
}

// A worker of this worker's replica was lost and the run goes on without the replica
// (RunController::EndReplicaWorkers): no groups, no outputs, and a failure naming why, which
// tells worker_main not to linger.
TEST(StepDriverTest, AStopForAReplicaThatLeftEndsTheRunHereWithItsReason) {
  for (const bool failed_here : {false, true}) {
    SCOPED_TRACE(failed_here ? "the step failed on this rank" : "aborted after the report");
    ScriptedChannel channel;
    RecordingModule module;
    if (failed_here) module.fail_at_step = 1;
    v1::CoordinatorMessage stop;
    stop.mutable_stop()->set_reason("llm replica 1 left the run: worker llm3 lost");
    stop.mutable_stop()->set_replica_left(true);
    for (const auto& m : AbortedAfterACommit(failed_here, stop)) channel.Push(m);
    StepDriver driver(&channel, &module, Gen1());
    const absl::Status status = driver.Run();
    EXPECT_EQ(status.code(), absl::StatusCode::kAborted);
    EXPECT_EQ(status.message(), "llm replica 1 left the run: worker llm3 lost");
    EXPECT_TRUE(driver.replica_left());
    EXPECT_FALSE(driver.left_run());
    EXPECT_EQ(driver.state(), StepDriver::State::kFailed);
    EXPECT_EQ(driver.steps_applied(), 1);
    EXPECT_EQ(std::count(module.calls.begin(), module.calls.end(), "regroup 3 [0,1]"), 1);
  }
  // A run's own stop is not one.
  ScriptedChannel channel;
  RecordingModule module;
  for (const auto& m : AbortedAfterACommit(false, FailedStop(4))) channel.Push(m);
  StepDriver driver(&channel, &module, Gen1());
  EXPECT_FALSE(driver.Run().ok());
  EXPECT_FALSE(driver.replica_left());
}

// The coordinator ends the sessions right after a failed run's stop: a report sent in between
// fails. The run's reason is what the worker ends with, else the session's final status, else
// the send's own error.
TEST(StepDriverTest, ASendThatFailsAfterTheSessionEndedEndsWithTheCoordinatorsLastWord) {
  const absl::Status ended =
      absl::FailedPreconditionError("the session has ended; no more messages can be sent");
  {
    SCOPED_TRACE("a failed run's stop queued");
    ScriptedChannel channel;
    RecordingModule module;
    module.fail_at_step = 0;
    channel.send_error = ended;
    for (auto m : {Plan(0), Abort(0), FailedStop(2)}) channel.Push(m);
    StepDriver driver(&channel, &module, Gen1());
    const absl::Status status = driver.Run();
    EXPECT_EQ(status.code(), absl::StatusCode::kAborted);
    EXPECT_EQ(status.message(), "run failed: llm rank 1 lost; the run cannot go on");
    EXPECT_THAT(channel.sent, ElementsAre("report 0 failed"));
    EXPECT_THAT(module.calls, ElementsAre("run 0", "discard"));
  }
  {
    SCOPED_TRACE("the stop of a replica that left queued");
    ScriptedChannel channel;
    RecordingModule module;
    module.fail_at_step = 0;
    channel.send_error = ended;
    v1::CoordinatorMessage stop;
    stop.mutable_stop()->set_reason("encoder replica 1 left the run: worker enc1 lost");
    stop.mutable_stop()->set_replica_left(true);
    for (auto m : {Plan(0), Abort(0), stop}) channel.Push(m);
    StepDriver driver(&channel, &module, Gen1());
    const absl::Status status = driver.Run();
    EXPECT_EQ(status.code(), absl::StatusCode::kAborted);
    EXPECT_EQ(status.message(), "encoder replica 1 left the run: worker enc1 lost");
    EXPECT_TRUE(driver.replica_left());
  }
  {
    SCOPED_TRACE("only the session's final status");
    ScriptedChannel channel;
    RecordingModule module;
    channel.send_error = ended;
    channel.end = absl::AbortedError("Session: run failed: encoder rank 0 lost");
    channel.Push(Plan(0));
    StepDriver driver(&channel, &module, Gen1());
    const absl::Status status = driver.Run();
    EXPECT_EQ(status.code(), absl::StatusCode::kAborted);
    EXPECT_EQ(status.message(), "Session: run failed: encoder rank 0 lost");
    EXPECT_THAT(channel.sent, ElementsAre("partial 0"));
  }
  {
    SCOPED_TRACE("nothing more from the coordinator");
    ScriptedChannel channel;
    RecordingModule module;
    channel.send_error = ended;
    channel.Push(Plan(0));
    StepDriver driver(&channel, &module, Gen1());
    EXPECT_EQ(driver.Run(), ended);
  }
}

TEST(StepDriverTest, SilenceFromTheCoordinatorEndsTheWaitWithADeadline) {
  ScriptedChannel channel;  // empty: Next fails with DeadlineExceeded
  RecordingModule module;
  StepDriver driver(&channel, &module, Gen1());
  EXPECT_EQ(driver.Run().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(module.calls.empty());
}

// The coordinator decides a step up to its step timeout after the plan, and after an abort holds
// the next plan up to that long for a stuck worker: every wait lasts that much longer than the
// coordinator timeout.
TEST(StepDriverTest, TheWaitsOutlastTheCoordinatorsStepTimeout) {
  ScriptedChannel channel;
  channel.Push(Plan(0));
  channel.Push(Norm(0, 1.0));
  channel.Push(Commit(0));
  RecordingModule module;
  StepDriverOptions options = Gen1();
  options.timeout = absl::Seconds(300);
  options.step_timeout = absl::Seconds(600);
  StepDriver driver(&channel, &module, options);
  EXPECT_EQ(driver.Run().code(), absl::StatusCode::kDeadlineExceeded);  // the script ends
  ASSERT_EQ(channel.waits.size(), 4u);
  const auto within = [](absl::Duration wait, absl::Duration bound) {
    return wait <= bound && wait > bound - absl::Seconds(60);
  };
  for (size_t i = 0; i < 4; ++i) {  // the plan, the norm, the commit, the next plan
    EXPECT_TRUE(within(channel.waits[i], absl::Seconds(900))) << i << ": " << channel.waits[i];
  }
}

}  // namespace
}  // namespace hetpar::worker
