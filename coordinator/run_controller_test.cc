#include "coordinator/run_controller.h"

#include <algorithm>
#include <filesystem>
#include <fstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/control/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hetpar::coordinator {
namespace {

using ::testing::HasSubstr;

const absl::Time kT0 = absl::FromUnixSeconds(1000);

// Plans every step with 10 loss tokens and a plan naming the step and the worker.
class CountingPlanner : public StepPlanner {
 public:
  absl::StatusOr<PlannedStep> Plan(int64_t step, int64_t generation,
                                   const Membership& membership) override {
    ++calls;
    if (fail) return absl::InternalError("no samples left");
    PlannedStep plan;
    plan.global_loss_tokens = 10;
    for (const WorkerRecord* w : membership.LiveWorkers()) {
      v1::RankStepPlan& rank_plan = plan.worker_plans[w->worker_id];
      rank_plan.set_rank(w->world_rank);
      rank_plan.set_step(step);
      rank_plan.set_generation(generation);
    }
    plan.encoder_replicas = membership.Replicas(v1::MODULE_ENCODER);
    plan.llm_replicas = membership.Replicas(v1::MODULE_LLM);
    return plan;
  }
  absl::Status Prepare() override {
    ++prepares;
    return prepare_status;
  }
  bool NeedsPreparation() const override { return needs_preparation; }

  int calls = 0;
  bool fail = false;
  bool needs_preparation = false;
  int prepares = 0;
  absl::Status prepare_status;
};

v1::RunSpec TinySpec(int64_t steps = 2, const std::string& checkpoint_dir = "",
                     int64_t min_encoder_replicas = 1) {
  v1::RunSpec spec;
  spec.mutable_failure()->set_min_encoder_replicas(min_encoder_replicas);
  spec.mutable_checkpoint()->set_dir(checkpoint_dir);
  spec.mutable_run()->set_name("tiny");
  spec.mutable_run()->set_steps(steps);
  spec.mutable_run()->set_grad_clip(1.0);
  spec.set_placement(v1::PLACEMENT_NON_COLOCATED);
  spec.mutable_encoder()->mutable_layout()->set_dp(2);
  spec.mutable_encoder()->mutable_layout()->set_tp(1);
  spec.mutable_llm()->mutable_layout()->set_dp(1);
  spec.mutable_llm()->mutable_layout()->set_tp(2);
  spec.mutable_coordinator()->set_heartbeat_timeout_s(10);
  spec.mutable_coordinator()->set_register_timeout_s(60);
  spec.mutable_failure()->set_peer_timeout_s(30);  // how long a stuck worker is waited for
  return spec;
}

class RunControllerTest : public ::testing::Test {
 protected:
  void Create(int64_t steps = 2, bool with_planner = true, bool needs_preparation = false,
              const std::string& checkpoint_dir = "", int64_t min_encoder_replicas = 1) {
    auto planner = std::make_unique<CountingPlanner>();
    planner->needs_preparation = needs_preparation;
    planner_ = planner.get();
    ControllerOptions options;
    options.step_timeout = absl::Seconds(100);
    options.keep_committed_steps = keep_committed_steps_;
    options.continues_lost_run = continues_lost_run_;
    auto c = RunController::Create(TinySpec(steps, checkpoint_dir, min_encoder_replicas), options,
                                   with_planner ? std::move(planner) : nullptr, kT0);
    ASSERT_TRUE(c.ok()) << c.status();
    controller_ = *std::move(c);
  }

  void CreateWith(const v1::RunSpec& spec) {
    auto planner = std::make_unique<CountingPlanner>();
    planner_ = planner.get();
    ControllerOptions options;
    options.step_timeout = absl::Seconds(100);
    options.keep_committed_steps = keep_committed_steps_;
    options.continues_lost_run = continues_lost_run_;
    auto c = RunController::Create(spec, options, std::move(planner), kT0);
    ASSERT_TRUE(c.ok()) << c.status();
    controller_ = *std::move(c);
  }

  std::string Register(v1::WorkerRole role, absl::Time now = kT0) {
    v1::RegisterRequest request;
    request.set_role(role);
    request.set_host("host");
    request.set_data_address("host:1");
    auto response = controller_->Register(request, now, &actions_);
    EXPECT_TRUE(response.ok()) << response.status();
    return response.ok() ? response->assignment().worker_id() : "";
  }

  // An encoder worker from another host registering at `now` (into a vacant replica, if any).
  absl::StatusOr<v1::RegisterResponse> RegisterReplacement(absl::Time now) {
    v1::RegisterRequest request;
    request.set_role(v1::WORKER_ROLE_ENCODER);
    request.set_host("new-host");
    request.set_data_address("new-host:1");
    return controller_->Register(request, now, &actions_);
  }

  // A run of two steps with two LLM replicas at tp 1, started: ids_ are encoder 0, encoder 1, LLM
  // replica 0 and LLM replica 1; actions_ is empty.
  // TinySpec of 2 steps with two LLM replicas at tp 1, in `pp` stages each.
  static v1::RunSpec TwoLlmReplicasSpec(int64_t pp = 1) {
    v1::RunSpec spec = TinySpec(/*steps=*/2);
    spec.mutable_llm()->mutable_layout()->set_dp(2);
    spec.mutable_llm()->mutable_layout()->set_tp(1);
    spec.mutable_llm()->mutable_layout()->set_pp(pp);
    spec.mutable_run()->set_global_batch(8);
    spec.mutable_run()->set_micro_batch(2);
    return spec;
  }

  void StartWithTwoLlmReplicas() {
    CreateWith(TwoLlmReplicasSpec());
    StartAll();
    actions_ = {};
  }

  // Registers workers of `roles` (no sessions), keeps them alive and ticks past TinySpec's
  // register_timeout of 60 s.
  void RegisterAndPassTheRegisterTimeout(const std::vector<v1::WorkerRole>& roles) {
    for (v1::WorkerRole role : roles) Register(role);
    for (auto* w : controller_->membership().LiveWorkers()) {
      w->last_heartbeat = kT0 + absl::Seconds(61);
    }
    controller_->Tick(kT0 + absl::Seconds(61), &actions_);
  }

  // Registers all four workers and opens their sessions.
  // Registers workers of `roles` (by default tiny's two encoder and two LLM ranks) and opens
  // their sessions.
  void StartAll(const std::vector<v1::WorkerRole>& roles = {
                    v1::WORKER_ROLE_ENCODER, v1::WORKER_ROLE_ENCODER, v1::WORKER_ROLE_LLM,
                    v1::WORKER_ROLE_LLM}) {
    for (v1::WorkerRole role : roles) ids_.push_back(Register(role));
    for (const auto& id : ids_) ASSERT_TRUE(controller_->OpenSession(id, kT0, &actions_).ok());
  }

  std::vector<v1::CoordinatorMessage> SentTo(const std::string& id,
                                             v1::CoordinatorMessage::KindCase kind) const {
    std::vector<v1::CoordinatorMessage> result;
    for (const auto& [to, m] : actions_.messages) {
      if (to == id && m.kind_case() == kind) result.push_back(m);
    }
    return result;
  }

  void Send(const std::string& id, const v1::WorkerMessage& m, absl::Time now = kT0) {
    ASSERT_TRUE(controller_->HandleMessage(id, m, now, &actions_).ok());
  }

  // What each worker `workers` indexes sends as an abort reaches it: a heartbeat from its
  // session, then its step driver's Progress that it gave the attempt up.
  void HearFrom(std::vector<size_t> workers, absl::Time now) {
    for (size_t i : workers) {
      v1::WorkerMessage m;
      m.mutable_heartbeat()->set_seq(1);
      Send(ids_[i], m, now);
      GiveUp(i, now);
    }
  }

  // Worker `i`'s step driver took the last abort sent to it (if any), naming its generation.
  void GiveUp(size_t i, absl::Time now) {
    const auto aborts = SentTo(ids_[i], v1::CoordinatorMessage::kAbort);
    if (aborts.empty() || !controller_->membership().Find(ids_[i])->alive) return;
    v1::WorkerMessage m;
    m.mutable_progress()->set_step(aborts.back().abort().step());
    m.mutable_progress()->set_generation(aborts.back().abort().generation());
    m.mutable_progress()->set_ended(true);
    Send(ids_[i], m, now);
  }

  // Every worker completes step `step`: the ranks of the first replica taking part send
  // partials (encoder rank `encoder_contributor`), every worker in `reporting` (default: all)
  // reports.
  void CompleteStep(int64_t step, size_t encoder_contributor = 0,
                    std::vector<size_t> reporting = {0, 1, 2, 3}, absl::Time now = kT0) {
    const int64_t generation = controller_->generation();
    for (size_t i : {encoder_contributor, size_t{2}, size_t{3}}) {  // llm ranks 0 and 1
      v1::WorkerMessage m;
      auto* p = m.mutable_grad_norm_partial();
      p->set_step(step);
      p->set_generation(generation);
      p->set_module(i < 2 ? v1::MODULE_ENCODER : v1::MODULE_LLM);
      p->set_sum_squares(1.0);
      Send(ids_[i], m, now);
    }
    for (size_t i : reporting) {
      v1::WorkerMessage m;
      auto* r = m.mutable_report();
      r->set_step(step);
      r->set_generation(generation);
      r->set_ok(true);
      if (i == 2) {
        r->set_loss_sum(30.0);
        r->set_loss_tokens(10);
      }
      Send(ids_[i], m, now);
    }
  }

  // A 5-step run with checkpoint.dir whose step 0 is aborted (encoder replica 1 lost) around a
  // stop with a checkpoint (before the loss when `stop_first`, else after it); the retry has
  // begun when it returns.
  void StopWithACheckpointAroundAnAbort(bool stop_first) {
    ids_.clear();
    actions_ = {};
    Create(5, true, false, "/ckpt");
    StartAll();
    if (stop_first) controller_->Stop("preempted", true, kT0, &actions_);
    controller_->SessionEnded(ids_[1], "connection reset", kT0 + absl::Seconds(1), &actions_);
    if (!stop_first) {
      EXPECT_EQ(controller_->Stop("preempted", true, kT0, &actions_).state(),
                v1::RUN_STATE_RUNNING);
    }
    EXPECT_EQ(controller_->state(), v1::RUN_STATE_RUNNING);
    EXPECT_TRUE(SentTo(ids_[0], v1::CoordinatorMessage::kStop).empty());
    // The retry waits for the others to give the aborted attempt up.
    HearFrom({0, 2, 3}, kT0 + absl::Seconds(2));
    ASSERT_EQ(SentTo(ids_[0], v1::CoordinatorMessage::kStepPlan).size(), 2u);
  }

  bool keep_committed_steps_ = false;  // ControllerOptions::keep_committed_steps
  bool continues_lost_run_ = false;    // ControllerOptions::continues_lost_run
  CountingPlanner* planner_ = nullptr;
  std::unique_ptr<RunController> controller_;
  Actions actions_;
  std::vector<std::string> ids_;
};

TEST(RunControllerOptionsTest, StepDeadlineAndAttemptsComeFromTheFailureSectionUnlessGiven) {
  v1::RunSpec spec = TinySpec();
  spec.mutable_failure()->set_step_timeout_s(42);
  spec.mutable_failure()->set_max_step_attempts(5);
  auto from_spec = RunController::Create(spec, ControllerOptions{}, nullptr, kT0);
  ASSERT_TRUE(from_spec.ok()) << from_spec.status();
  EXPECT_EQ((*from_spec)->options().step_timeout, absl::Seconds(42));
  EXPECT_EQ((*from_spec)->options().max_step_attempts, 5);
  // A flag (`--step-timeout`) wins over the spec.
  ControllerOptions given;
  given.step_timeout = absl::Seconds(7);
  given.max_step_attempts = 2;
  auto overridden = RunController::Create(spec, given, nullptr, kT0);
  ASSERT_TRUE(overridden.ok()) << overridden.status();
  EXPECT_EQ((*overridden)->options().step_timeout, absl::Seconds(7));
  EXPECT_EQ((*overridden)->options().max_step_attempts, 2);
  // Workers learn the one in force from their registration's RunSpec (they wait that long for
  // a step's decision).
  v1::RegisterRequest request;
  request.set_role(v1::WORKER_ROLE_ENCODER);
  request.set_host("host");
  request.set_data_address("host:1");
  Actions actions;
  auto registered = (*overridden)->Register(request, kT0, &actions);
  ASSERT_TRUE(registered.ok()) << registered.status();
  EXPECT_EQ(registered->spec().failure().step_timeout_s(), 7);
  // A spec without the section (not normalised): 10 minutes, 3 attempts.
  auto bare = RunController::Create(TinySpec(), ControllerOptions{}, nullptr, kT0);
  ASSERT_TRUE(bare.ok()) << bare.status();
  EXPECT_EQ((*bare)->options().step_timeout, absl::Minutes(10));
  EXPECT_EQ((*bare)->options().max_step_attempts, 3);
}

// A run continued from the checkpoint of its last step (its coordinator lost as it gathered the
// outputs) has nothing to train: it stops once every worker's session is open, so that each has
// had its assignment with its peers first, and no step is planned.
TEST_F(RunControllerTest, ARunContinuedFromItsLastStepsCheckpointStopsOnceEverySessionIsOpen) {
  const std::string checkpoint = (std::filesystem::temp_directory_path() /
                                  absl::StrCat("hetpar_rc_", ::getpid(), "/step-000002"))
                                     .string();
  std::filesystem::create_directories(checkpoint);
  std::ofstream(checkpoint + "/manifest.json") << "{\"step\": 2}\n";
  v1::RunSpec spec = TinySpec(/*steps=*/2);
  spec.mutable_checkpoint()->set_resume_from(checkpoint);
  CreateWith(spec);
  std::filesystem::remove_all(std::filesystem::path(checkpoint).parent_path());
  // It starts at the checkpoint's step, having committed none itself (hetpar_step and
  // hetpar_steps_committed_total).
  EXPECT_EQ(controller_->Status(kT0).committed_steps(), 2);
  EXPECT_EQ(controller_->Status(kT0).first_step(), 2);
  for (v1::WorkerRole role : {v1::WORKER_ROLE_ENCODER, v1::WORKER_ROLE_ENCODER, v1::WORKER_ROLE_LLM,
                              v1::WORKER_ROLE_LLM}) {
    ids_.push_back(Register(role));
  }
  // Every rank registered: the run is running, but not stopping while a session is not open.
  for (size_t i = 0; i + 1 < ids_.size(); ++i) {
    ASSERT_TRUE(controller_->OpenSession(ids_[i], kT0, &actions_).ok());
    EXPECT_EQ(controller_->state(), v1::RUN_STATE_RUNNING) << i;
  }
  ASSERT_TRUE(controller_->OpenSession(ids_.back(), kT0, &actions_).ok());
  EXPECT_EQ(controller_->state(), v1::RUN_STATE_STOPPING);
  EXPECT_EQ(planner_->calls, 0);
  for (const std::string& id : ids_) {
    // Its assignment (with its peers), then the stop.
    EXPECT_EQ(SentTo(id, v1::CoordinatorMessage::kAssignment).size(), 1u) << id;
    const auto stops = SentTo(id, v1::CoordinatorMessage::kStop);
    ASSERT_EQ(stops.size(), 1u) << id;
    EXPECT_THAT(stops[0].stop().reason(), ::testing::HasSubstr("completed 2 steps"));
  }
}

TEST_F(RunControllerTest, RunStartsWhenEveryRankHasRegistered) {
  Create();
  EXPECT_EQ(controller_->state(), v1::RUN_STATE_WAITING);
  const std::string e0 = Register(v1::WORKER_ROLE_ENCODER);
  ASSERT_TRUE(controller_->OpenSession(e0, kT0, &actions_).ok());
  Register(v1::WORKER_ROLE_LLM);
  Register(v1::WORKER_ROLE_ENCODER);
  EXPECT_EQ(controller_->state(), v1::RUN_STATE_WAITING);
  EXPECT_TRUE(actions_.messages.empty());
  v1::StatusResponse status = controller_->Status(kT0 + absl::Seconds(5));
  ASSERT_EQ(status.missing_size(), 1);
  EXPECT_EQ(status.missing(0), "llm rank 1 (dp 0, tp 1, cp 0, pp 0)");
  EXPECT_DOUBLE_EQ(status.missing_deadline_s(), 55.0);

  v1::RegisterRequest last;
  last.set_role(v1::WORKER_ROLE_LLM);
  auto response = controller_->Register(last, kT0, &actions_);
  ASSERT_TRUE(response.ok());
  EXPECT_EQ(controller_->state(), v1::RUN_STATE_RUNNING);
  // The last one learns its peers at once (both encoders); earlier ones on their session.
  EXPECT_TRUE(response->assignment().peers_complete());
  EXPECT_EQ(response->assignment().peers_size(), 2);
  EXPECT_EQ(response->assignment().generation(), 1);
  EXPECT_EQ(response->spec().run().name(), "tiny");
  auto assignments = SentTo(e0, v1::CoordinatorMessage::kAssignment);
  ASSERT_EQ(assignments.size(), 1u);
  EXPECT_TRUE(assignments[0].assignment().peers_complete());
  EXPECT_EQ(assignments[0].assignment().peers_size(), 2);  // both llm ranks
  EXPECT_EQ(assignments[0].assignment().peers(1).ranks(0).tp(), 1);
  EXPECT_DOUBLE_EQ(assignments[0].assignment().heartbeat_interval_s(), 1.0);
}

TEST_F(RunControllerTest, MissingRanksFailTheRunAfterTheRegisterTimeout) {
  Create();
  Register(v1::WORKER_ROLE_ENCODER);
  Register(v1::WORKER_ROLE_LLM);
  // Heartbeats keep these two alive; the run still fails for the missing ones.
  for (auto* w : controller_->membership().LiveWorkers())
    w->last_heartbeat = kT0 + absl::Seconds(59);
  controller_->Tick(kT0 + absl::Seconds(59), &actions_);
  EXPECT_EQ(controller_->state(), v1::RUN_STATE_WAITING);
  controller_->Tick(kT0 + absl::Seconds(61), &actions_);
  EXPECT_EQ(controller_->state(), v1::RUN_STATE_FAILED);
  EXPECT_THAT(controller_->state_message(), HasSubstr("2 of 4 ranks not registered"));
  EXPECT_THAT(controller_->state_message(), HasSubstr("encoder rank 1 (dp 1, tp 0)"));
  EXPECT_THAT(controller_->state_message(), HasSubstr("llm rank 1 (dp 0, tp 1, cp 0, pp 0)"));
  v1::RegisterRequest late;
  late.set_role(v1::WORKER_ROLE_LLM);
  EXPECT_EQ(controller_->Register(late, kT0 + absl::Seconds(62), &actions_).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST_F(RunControllerTest, SilentWorkerIsDeclaredDeadAndOthersAreTold) {
  Create(/*steps=*/5, /*with_planner=*/false);
  StartAll();
  EXPECT_EQ(controller_->state(), v1::RUN_STATE_RUNNING);
  actions_ = {};
  // Everyone but ids_[1] keeps heartbeating.
  v1::WorkerMessage heartbeat;
  heartbeat.mutable_heartbeat()->set_seq(1);
  heartbeat.mutable_heartbeat()->set_client_time_ns(77);
  for (int t = 1; t <= 10; ++t) {
    // Acks only when asked for.
    heartbeat.mutable_heartbeat()->set_ack_requested(t % 2 == 1);
    for (size_t i : {0u, 2u, 3u}) Send(ids_[i], heartbeat, kT0 + absl::Seconds(t));
  }
  auto acks = SentTo(ids_[0], v1::CoordinatorMessage::kHeartbeatAck);
  ASSERT_EQ(acks.size(), 5u);
  EXPECT_EQ(acks[0].heartbeat_ack().client_time_ns(), 77);
  EXPECT_EQ(acks[0].heartbeat_ack().generation(), 1);
  controller_->Tick(kT0 + absl::Seconds(10), &actions_);
  EXPECT_EQ(controller_->generation(), 1);
  controller_->Tick(kT0 + absl::Milliseconds(10100), &actions_);
  EXPECT_EQ(controller_->generation(), 2);
  EXPECT_EQ(controller_->state(), v1::RUN_STATE_RUNNING);
  auto changes = SentTo(ids_[3], v1::CoordinatorMessage::kMembershipChange);
  ASSERT_EQ(changes.size(), 1u);
  EXPECT_EQ(changes[0].membership_change().generation(), 2);
  EXPECT_EQ(changes[0].membership_change().lost(0).worker_id(), ids_[1]);
  EXPECT_THAT(changes[0].membership_change().reason(), HasSubstr("no heartbeat for 10.1s"));
  EXPECT_TRUE(SentTo(ids_[1], v1::CoordinatorMessage::kMembershipChange).empty());
  ASSERT_EQ(actions_.end_sessions.size(), 1u);
  EXPECT_EQ(actions_.end_sessions[0].first, ids_[1]);
  // Its messages are refused from now on.
  EXPECT_EQ(controller_->HandleMessage(ids_[1], heartbeat, kT0, &actions_).code(),
            absl::StatusCode::kFailedPrecondition);
  // Encoder replica 1 left the run: nothing is missing, the pool has one replica.
  v1::StatusResponse status = controller_->Status(kT0 + absl::Seconds(11));
  EXPECT_EQ(status.missing_size(), 0);
  EXPECT_EQ(status.encoder_replicas(), 1);
  EXPECT_EQ(status.encoder_replicas_configured(), 2);
  ASSERT_EQ(status.pool_changes_size(), 1);
  EXPECT_EQ(status.pool_changes(0).replica(), 1);
  EXPECT_EQ(status.pool_changes(0).generation(), 2);
  EXPECT_THAT(status.pool_changes(0).cause(), HasSubstr("no heartbeat"));
  ASSERT_EQ(status.workers_size(), 4);
  EXPECT_FALSE(status.workers(3).alive());
  EXPECT_THAT(status.workers(3).dead_reason(), HasSubstr("no heartbeat"));

  // Its rank takes a replacement, which joins later (the pool's target is still 2); an LLM rank
  // takes no one.
  v1::RegisterRequest request;
  request.set_role(v1::WORKER_ROLE_ENCODER);
  request.set_host("host");
  auto replacement = controller_->Register(request, kT0 + absl::Seconds(11), &actions_);
  ASSERT_TRUE(replacement.ok()) << replacement.status();
  EXPECT_EQ(replacement->assignment().world_rank(), 1);
  EXPECT_FALSE(replacement->assignment().peers_complete());
  request.set_role(v1::WORKER_ROLE_LLM);
  auto refused = controller_->Register(request, kT0 + absl::Seconds(11), &actions_);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(controller_->state(), v1::RUN_STATE_RUNNING);
}

TEST_F(RunControllerTest, ALostEncoderReplicaLeavesAndTheStepIsPlannedAgainOverTheOthers) {
  Create(/*steps=*/2);
  StartAll();
  ASSERT_EQ(SentTo(ids_[1], v1::CoordinatorMessage::kStepPlan).size(), 1u);
  actions_ = {};
  // Encoder replica 0 dies in step 0.
  controller_->SessionEnded(ids_[0], "connection reset", kT0 + absl::Seconds(1), &actions_);
  EXPECT_EQ(controller_->state(), v1::RUN_STATE_RUNNING);
  // The next attempt waits until every other worker of the aborted one has been heard from.
  HearFrom({1, 2}, kT0 + absl::Seconds(1));
  EXPECT_TRUE(SentTo(ids_[1], v1::CoordinatorMessage::kStepPlan).empty());
  HearFrom({3}, kT0 + absl::Seconds(1));
  // The abort of the old attempt, the change, then the new plan, in that order.
  std::vector<v1::CoordinatorMessage::KindCase> kinds;
  for (const auto& [to, m] : actions_.messages) {
    if (to == ids_[2]) kinds.push_back(m.kind_case());
  }
  EXPECT_THAT(kinds, ::testing::ElementsAre(v1::CoordinatorMessage::kAbort,
                                            v1::CoordinatorMessage::kMembershipChange,
                                            v1::CoordinatorMessage::kStepPlan));
  // One generation for the loss, one for the new attempt.
  EXPECT_EQ(controller_->generation(), 3);
  auto plans = SentTo(ids_[1], v1::CoordinatorMessage::kStepPlan);
  ASSERT_EQ(plans.size(), 1u);
  EXPECT_EQ(plans[0].step_plan().step(), 0);
  EXPECT_EQ(plans[0].step_plan().generation(), 3);
  EXPECT_THAT(plans[0].step_plan().encoder_replicas(), ::testing::ElementsAre(1));
  // Replica 1 now sends the encoder's partial: 3 contributors, as before.
  EXPECT_EQ(plans[0].step_plan().grad_norm_contributors(), 3);
  EXPECT_TRUE(SentTo(ids_[0], v1::CoordinatorMessage::kStepPlan).empty());
  CompleteStep(0, /*encoder_contributor=*/1, /*reporting=*/{1, 2, 3}, kT0 + absl::Seconds(3));
  EXPECT_EQ(controller_->committed_steps(), 1);
  v1::StatusResponse status = controller_->Status(kT0 + absl::Seconds(2));
  ASSERT_EQ(status.pool_changes_size(), 1);
  EXPECT_EQ(status.pool_changes(0).replica(), 0);
  EXPECT_EQ(status.pool_changes(0).step(), 0);
  EXPECT_EQ(status.pool_changes(0).replicas_after(), 1);
  EXPECT_DOUBLE_EQ(status.pool_changes(0).recovery_s(), 2.0);  // lost at 1 s, committed at 3 s
  CompleteStep(1, 1, {1, 2, 3});
  EXPECT_EQ(controller_->state(), v1::RUN_STATE_STOPPING);
  // The stop names the replicas left in the run: the outputs' groups span those.
  auto stops = SentTo(ids_[2], v1::CoordinatorMessage::kStop);
  ASSERT_EQ(stops.size(), 1u);
  EXPECT_THAT(stops[0].stop().encoder_replicas(), ::testing::ElementsAre(1));
  EXPECT_THAT(stops[0].stop().llm_replicas(), ::testing::ElementsAre(0));
}

// Step 0's attempt is aborted (worker `failing`, by default LLM rank 1, reports a failure, which
// is giving it up); every worker keeps heartbeating, and those in `giving_up` take the abort.
// Ticks until `until` after the abort.
void AbortAndWait(RunController* controller, const std::vector<std::string>& ids,
                  const std::vector<size_t>& giving_up, absl::Duration until, Actions* actions,
                  size_t failing = 3) {
  const int64_t attempt = controller->generation();
  v1::WorkerMessage failed;
  failed.mutable_report()->set_step(0);
  failed.mutable_report()->set_generation(attempt);
  failed.mutable_report()->set_ok(false);
  failed.mutable_report()->set_error("collective timed out");
  EXPECT_TRUE(controller->HandleMessage(ids[failing], failed, kT0, actions).ok());
  for (size_t i : giving_up) {
    v1::WorkerMessage m;
    m.mutable_progress()->set_step(0);
    m.mutable_progress()->set_generation(attempt);
    m.mutable_progress()->set_ended(true);
    EXPECT_TRUE(controller->HandleMessage(ids[i], m, kT0, actions).ok());
  }
  for (absl::Time t = kT0 + absl::Seconds(1); t <= kT0 + until; t += absl::Seconds(1)) {
    for (const std::string& id : ids) {
      if (!controller->membership().Find(id)->alive) continue;
      v1::WorkerMessage m;
      m.mutable_heartbeat()->set_seq(1);
      EXPECT_TRUE(controller->HandleMessage(id, m, t, actions).ok());
    }
    controller->Tick(t, actions);
  }
}

// TinySpec's failure.peer_timeout_s, after which a worker that has not given an aborted attempt
// up is stuck.
constexpr absl::Duration kStuckAfter = absl::Seconds(30);

TEST_F(RunControllerTest, TheNextAttemptWaitsForEveryWorkerToGiveTheAbortedOneUp) {
  Create(/*steps=*/2);
  StartAll();
  actions_ = {};
  // LLM rank 1 failed the attempt (which counts as giving it up); LLM rank 0's driver has not
  // taken the abort yet (a long kernel, a checkpoint write).
  AbortAndWait(controller_.get(), ids_, {0, 1}, absl::Seconds(2), &actions_);
  EXPECT_TRUE(SentTo(ids_[1], v1::CoordinatorMessage::kStepPlan).empty());
  GiveUp(2, kT0 + absl::Seconds(3));
  auto plans = SentTo(ids_[1], v1::CoordinatorMessage::kStepPlan);
  ASSERT_EQ(plans.size(), 1u);
  EXPECT_EQ(plans[0].step_plan().step(), 0);
  EXPECT_THAT(plans[0].step_plan().encoder_replicas(), ::testing::ElementsAre(0, 1));
}

TEST_F(RunControllerTest, AWorkerStuckInAnAbortedAttemptLeavesWhenTheRunCanGoOn) {
  Create(/*steps=*/2);
  StartAll();
  actions_ = {};
  // Encoder 0 heartbeats but its driver never takes the abort.
  AbortAndWait(controller_.get(), ids_, {1, 2}, kStuckAfter - absl::Seconds(1), &actions_);
  EXPECT_TRUE(SentTo(ids_[1], v1::CoordinatorMessage::kStepPlan).empty());
  EXPECT_TRUE(controller_->membership().Find(ids_[0])->alive);
  actions_ = {};
  controller_->Tick(kT0 + kStuckAfter + absl::Seconds(1), &actions_);
  EXPECT_EQ(controller_->state(), v1::RUN_STATE_RUNNING);
  const WorkerRecord* stuck = controller_->membership().Find(ids_[0]);
  EXPECT_FALSE(stuck->alive);
  EXPECT_THAT(stuck->dead_reason, HasSubstr("stuck: it did not give up the aborted attempt of "
                                            "step 0 within 30s (failure.peer_timeout_s, at most "
                                            "the step timeout), though it still sends "
                                            "heartbeats"));
  ASSERT_FALSE(actions_.end_sessions.empty());
  EXPECT_EQ(actions_.end_sessions[0].first, ids_[0]);
  // The step is planned again over encoder replica 1.
  auto plans = SentTo(ids_[1], v1::CoordinatorMessage::kStepPlan);
  ASSERT_EQ(plans.size(), 1u);
  EXPECT_EQ(plans[0].step_plan().step(), 0);
  EXPECT_THAT(plans[0].step_plan().encoder_replicas(), ::testing::ElementsAre(1));
}

// Stuck workers in two replicas (an encoder, and both stages of an LLM replica): every loss is
// decided before the next attempt starts, so one attempt follows, over the replicas left, and
// the stuck replica's other rank is ended as declared dead too (a hung process restarts on it).
TEST_F(RunControllerTest, StuckWorkersOfSeveralReplicasAreAllDroppedBeforeOneNextAttempt) {
  CreateWith(TwoLlmReplicasSpec(/*pp=*/2));
  // LLM ranks 0 to 3 (ids 2 to 5): (dp 0, pp 0), (dp 1, pp 0), (dp 0, pp 1), (dp 1, pp 1).
  StartAll({v1::WORKER_ROLE_ENCODER, v1::WORKER_ROLE_ENCODER, v1::WORKER_ROLE_LLM,
            v1::WORKER_ROLE_LLM, v1::WORKER_ROLE_LLM, v1::WORKER_ROLE_LLM});
  actions_ = {};
  // Encoder 0 and LLM replica 1 (ids 3 and 5) hang; LLM rank 0 (id 2) reports the failure.
  AbortAndWait(controller_.get(), ids_, {1, 4}, kStuckAfter + absl::Seconds(1), &actions_,
               /*failing=*/2);
  EXPECT_EQ(controller_->state(), v1::RUN_STATE_RUNNING) << controller_->state_message();
  for (size_t i : {size_t{0}, size_t{3}, size_t{5}}) {
    EXPECT_FALSE(controller_->membership().Find(ids_[i])->alive) << i;
  }
  auto plans = SentTo(ids_[1], v1::CoordinatorMessage::kStepPlan);
  ASSERT_EQ(plans.size(), 1u);
  EXPECT_THAT(plans[0].step_plan().encoder_replicas(), ::testing::ElementsAre(1));
  EXPECT_THAT(plans[0].step_plan().llm_replicas(), ::testing::ElementsAre(0));
  EXPECT_EQ(controller_->Status(kT0 + kStuckAfter).aborted_steps(), 1);
  int declared_dead = 0;
  for (const auto& [id, status] : actions_.end_sessions) {
    if (absl::StrContains(status.message(), "declared dead by the coordinator: ")) ++declared_dead;
  }
  EXPECT_EQ(declared_dead, 3);
}

TEST_F(RunControllerTest, AStuckWorkerWhoseLossWouldEndTheRunIsKeptAndTheStepRetried) {
  Create(/*steps=*/2);
  StartAll();
  actions_ = {};
  // LLM rank 0 (of the LLM's only replica) never takes the abort.
  AbortAndWait(controller_.get(), ids_, {0, 1}, kStuckAfter + absl::Seconds(1), &actions_);
  EXPECT_EQ(controller_->state(), v1::RUN_STATE_RUNNING);
  for (const std::string& id : ids_) EXPECT_TRUE(controller_->membership().Find(id)->alive) << id;
  // The retry goes out to every worker, as before.
  auto plans = SentTo(ids_[2], v1::CoordinatorMessage::kStepPlan);
  ASSERT_EQ(plans.size(), 1u);
  EXPECT_EQ(plans[0].step_plan().step(), 0);
}

TEST_F(RunControllerTest, AnEncoderLossBelowTheMinimumPoolFailsTheRunSayingHowToResume) {
  Create(/*steps=*/5, /*with_planner=*/true, false, "/runs/ckpt", /*min_encoder_replicas=*/2);
  StartAll();
  controller_->SessionEnded(ids_[1], "connection reset", kT0 + absl::Seconds(1), &actions_);
  EXPECT_EQ(controller_->state(), v1::RUN_STATE_FAILED);
  EXPECT_THAT(controller_->state_message(), HasSubstr("below failure.min_encoder_replicas=2"));
  EXPECT_THAT(controller_->state_message(), HasSubstr("resume it from its newest checkpoint under "
                                                      "/runs/ckpt"));
}

TEST_F(RunControllerTest, ALostLlmReplicaLeavesWhenAnotherHoldsItsState) {
  StartWithTwoLlmReplicas();
  controller_->SessionEnded(ids_[3], "connection reset", kT0 + absl::Seconds(1), &actions_);
  EXPECT_EQ(controller_->state(), v1::RUN_STATE_RUNNING);
  HearFrom({0, 1, 2}, kT0 + absl::Seconds(1));
  auto plans = SentTo(ids_[2], v1::CoordinatorMessage::kStepPlan);
  ASSERT_EQ(plans.size(), 1u);
  EXPECT_THAT(plans[0].step_plan().llm_replicas(), ::testing::ElementsAre(0));
  EXPECT_THAT(plans[0].step_plan().encoder_replicas(), ::testing::ElementsAre(0, 1));
  // The encoder's replica 0 and the LLM's replica 0 send partials.
  EXPECT_EQ(plans[0].step_plan().grad_norm_contributors(), 2);
  v1::StatusResponse status = controller_->Status(kT0 + absl::Seconds(1));
  EXPECT_EQ(status.llm_replicas(), 1);
  EXPECT_EQ(status.llm_replicas_configured(), 2);
  ASSERT_EQ(status.pool_changes_size(), 1);
  EXPECT_EQ(status.pool_changes(0).module(), v1::MODULE_LLM);
  EXPECT_EQ(status.pool_changes(0).replica(), 1);

  // The lost replica admits a replacement, which joins at the next step boundary and takes the
  // LLM's state from replica 0; the encoder ranks connect to it.
  EXPECT_THAT(status.llm_replicas_open(), ::testing::ElementsAre(1));
  const std::string joiner = Register(v1::WORKER_ROLE_LLM);
  ASSERT_TRUE(controller_->OpenSession(joiner, kT0, &actions_).ok());
  actions_ = {};
  // Step 0 on LLM replica 0 alone: its partial and the encoder's, every training worker's report.
  const int64_t generation = controller_->generation();
  for (size_t i : {size_t{0}, size_t{2}}) {
    v1::WorkerMessage m;
    auto* p = m.mutable_grad_norm_partial();
    p->set_step(0);
    p->set_generation(generation);
    p->set_module(i == 0 ? v1::MODULE_ENCODER : v1::MODULE_LLM);
    p->set_sum_squares(1.0);
    Send(ids_[i], m, kT0 + absl::Seconds(2));
  }
  for (size_t i : {size_t{0}, size_t{1}, size_t{2}}) {
    v1::WorkerMessage m;
    auto* r = m.mutable_report();
    r->set_step(0);
    r->set_generation(generation);
    r->set_ok(true);
    if (i == 2) {
      r->set_loss_sum(30.0);
      r->set_loss_tokens(10);
    }
    Send(ids_[i], m, kT0 + absl::Seconds(2));
  }
  ASSERT_EQ(controller_->committed_steps(), 1);
  auto assignment = SentTo(joiner, v1::CoordinatorMessage::kAssignment);
  ASSERT_EQ(assignment.size(), 1u);
  EXPECT_TRUE(assignment[0].assignment().joining());
  EXPECT_EQ(assignment[0].assignment().peers_size(), 2);  // both encoder ranks
  EXPECT_THAT(assignment[0].assignment().llm_replicas(), ::testing::ElementsAre(0, 1));
  auto changes = SentTo(ids_[0], v1::CoordinatorMessage::kMembershipChange);
  ASSERT_EQ(changes.size(), 1u);
  ASSERT_EQ(changes[0].membership_change().joined_size(), 1);
  EXPECT_EQ(changes[0].membership_change().joined(0).worker_id(), joiner);
  plans = SentTo(joiner, v1::CoordinatorMessage::kStepPlan);
  ASSERT_EQ(plans.size(), 1u);
  EXPECT_THAT(plans[0].step_plan().llm_joining(), ::testing::ElementsAre(1));
  EXPECT_EQ(plans[0].step_plan().encoder_joining_size(), 0);
  EXPECT_THAT(plans[0].step_plan().llm_replicas(), ::testing::ElementsAre(0, 1));
  status = controller_->Status(kT0 + absl::Seconds(2));
  EXPECT_EQ(status.llm_replicas(), 2);
  ASSERT_EQ(status.pool_changes_size(), 2);
  EXPECT_EQ(status.pool_changes(1).kind(), v1::POOL_CHANGE_JOINED);
  EXPECT_EQ(status.pool_changes(1).module(), v1::MODULE_LLM);
}

// A killed worker's peers often report the failures it caused (a collective's connection reset)
// before its own session's end reaches the coordinator. The next attempt waits until every worker
// of the aborted one has been heard from since the abort, so it leaves the dead worker out
// instead of including it and being aborted again.
TEST_F(RunControllerTest, TheNextAttemptWaitsToHearFromEveryWorkerOfTheAbortedOne) {
  StartWithTwoLlmReplicas();
  const absl::Time t1 = kT0 + absl::Seconds(1);
  v1::WorkerMessage failed;
  failed.mutable_report()->set_step(0);
  failed.mutable_report()->set_generation(controller_->generation());
  failed.mutable_report()->set_ok(false);
  failed.mutable_report()->set_error("gradient all-reduce: Connection reset by peer");
  Send(ids_[2], failed, t1);
  ASSERT_EQ(SentTo(ids_[0], v1::CoordinatorMessage::kAbort).size(), 1u);
  // Heard from before the abort does not count.
  HearFrom({3}, kT0);
  HearFrom({0, 1}, t1);
  EXPECT_TRUE(SentTo(ids_[0], v1::CoordinatorMessage::kStepPlan).empty());
  // LLM replica 1's worker was the one that died.
  controller_->SessionEnded(ids_[3], "connection reset", t1 + absl::Milliseconds(5), &actions_);
  EXPECT_EQ(controller_->state(), v1::RUN_STATE_RUNNING);
  auto plans = SentTo(ids_[0], v1::CoordinatorMessage::kStepPlan);
  ASSERT_EQ(plans.size(), 1u);
  EXPECT_EQ(plans[0].step_plan().step(), 0);
  EXPECT_THAT(plans[0].step_plan().llm_replicas(), ::testing::ElementsAre(0));
  EXPECT_EQ(SentTo(ids_[2], v1::CoordinatorMessage::kStepPlan).size(), 1u);
  EXPECT_TRUE(SentTo(ids_[3], v1::CoordinatorMessage::kStepPlan).empty());
  // One abort: the loss found no attempt in flight.
  EXPECT_EQ(SentTo(ids_[0], v1::CoordinatorMessage::kAbort).size(), 1u);
  EXPECT_EQ(controller_->Status(t1).aborted_steps(), 1);
}

// The batch's three microbatches do not divide over the two LLM replicas left: the run goes on,
// one replica taking a wave fewer (plan::AssignLlm).
TEST_F(RunControllerTest, ALostLlmReplicaLeavesTheRunThoughTheBatchNoLongerDividesEvenly) {
  v1::RunSpec spec = TinySpec(/*steps=*/2, "/runs/ckpt");
  spec.mutable_llm()->mutable_layout()->set_dp(3);
  spec.mutable_llm()->mutable_layout()->set_tp(1);
  spec.mutable_run()->set_global_batch(3);
  spec.mutable_run()->set_micro_batch(1);
  CreateWith(spec);
  StartAll({v1::WORKER_ROLE_ENCODER, v1::WORKER_ROLE_ENCODER, v1::WORKER_ROLE_LLM,
            v1::WORKER_ROLE_LLM, v1::WORKER_ROLE_LLM});
  actions_ = {};
  controller_->SessionEnded(ids_[4], "connection reset", kT0 + absl::Seconds(1), &actions_);
  EXPECT_EQ(controller_->state(), v1::RUN_STATE_RUNNING) << controller_->state_message();
  HearFrom({0, 1, 2, 3}, kT0 + absl::Seconds(1));
  auto plans = SentTo(ids_[2], v1::CoordinatorMessage::kStepPlan);
  ASSERT_EQ(plans.size(), 1u);
  EXPECT_THAT(plans[0].step_plan().llm_replicas(), ::testing::ElementsAre(0, 1));
  EXPECT_TRUE(SentTo(ids_[4], v1::CoordinatorMessage::kStepPlan).empty());
  const v1::StatusResponse status = controller_->Status(kT0 + absl::Seconds(1));
  EXPECT_EQ(status.llm_replicas(), 2);
  ASSERT_EQ(status.pool_changes_size(), 1);
  EXPECT_EQ(status.pool_changes(0).replica(), 2);
}

TEST_F(RunControllerTest, WithPipelineStagesALostEncoderReplicaLeavesAndTheRunGoesOn) {
  v1::RunSpec spec = TinySpec(/*steps=*/2);
  spec.mutable_llm()->mutable_layout()->set_tp(1);
  spec.mutable_llm()->mutable_layout()->set_pp(2);
  CreateWith(spec);
  StartAll();  // enc 0, enc 1, llm stage 0, llm stage 1
  controller_->SessionEnded(ids_[1], "connection reset", kT0 + absl::Seconds(1), &actions_);
  EXPECT_EQ(controller_->state(), v1::RUN_STATE_RUNNING) << controller_->state_message();
  const v1::StatusResponse status = controller_->Status(kT0 + absl::Seconds(1));
  EXPECT_EQ(status.encoder_replicas(), 1);
  ASSERT_EQ(status.pool_changes_size(), 1);
  EXPECT_EQ(status.pool_changes(0).module(), v1::MODULE_ENCODER);
}

TEST_F(RunControllerTest, WithPipelineStagesALostLlmStageTakesItsWholeReplicaOut) {
  CreateWith(TwoLlmReplicasSpec(/*pp=*/2));
  // LLM ranks 0 to 3: (dp 0, pp 0), (dp 1, pp 0), (dp 0, pp 1), (dp 1, pp 1).
  StartAll({v1::WORKER_ROLE_ENCODER, v1::WORKER_ROLE_ENCODER, v1::WORKER_ROLE_LLM,
            v1::WORKER_ROLE_LLM, v1::WORKER_ROLE_LLM, v1::WORKER_ROLE_LLM});
  actions_ = {};
  controller_->SessionEnded(ids_[5], "connection reset", kT0 + absl::Seconds(1), &actions_);
  EXPECT_EQ(controller_->state(), v1::RUN_STATE_RUNNING) << controller_->state_message();
  // Stage 0 of replica 1 has nothing left to do; replica 0's stages go on.
  std::vector<std::string> ended;
  for (const auto& [id, status] : actions_.end_sessions) ended.push_back(id);
  EXPECT_THAT(ended, ::testing::ElementsAre(ids_[3]));
  // Told first, so that it exits instead of lingering: started again it registers into the
  // vacant replica.
  const auto stops = SentTo(ids_[3], v1::CoordinatorMessage::kStop);
  ASSERT_EQ(stops.size(), 1u);
  EXPECT_TRUE(stops[0].stop().replica_left());
  EXPECT_THAT(stops[0].stop().reason(), HasSubstr("llm replica 1 left the run"));
  const v1::StatusResponse status = controller_->Status(kT0 + absl::Seconds(1));
  EXPECT_EQ(status.llm_replicas(), 1);
  EXPECT_THAT(status.llm_replicas_open(), ::testing::ElementsAre(1));
  ASSERT_EQ(status.pool_changes_size(), 1);
  EXPECT_EQ(status.pool_changes(0).module(), v1::MODULE_LLM);
  EXPECT_EQ(status.pool_changes(0).replica(), 1);
}

// A coordinator restarted on its journal: encoder replica 1's worker did not come back. At
// register_timeout the run starts on the replicas that did, as after a loss mid-run.
TEST_F(RunControllerTest, ARestartedRunStartsWithoutAnEncoderReplicaThatDidNotComeBack) {
  continues_lost_run_ = true;
  Create(/*steps=*/3);
  StartAll({v1::WORKER_ROLE_ENCODER, v1::WORKER_ROLE_LLM, v1::WORKER_ROLE_LLM});
  EXPECT_TRUE(SentTo(ids_[0], v1::CoordinatorMessage::kStepPlan).empty());
  HearFrom({0, 1, 2}, kT0 + absl::Seconds(59));
  controller_->Tick(kT0 + absl::Seconds(59), &actions_);
  EXPECT_EQ(controller_->state(), v1::RUN_STATE_WAITING);
  HearFrom({0, 1, 2}, kT0 + absl::Seconds(61));
  controller_->Tick(kT0 + absl::Seconds(61), &actions_);
  ASSERT_EQ(controller_->state(), v1::RUN_STATE_RUNNING) << controller_->state_message();
  for (size_t i = 0; i < ids_.size(); ++i) {
    const auto plans = SentTo(ids_[i], v1::CoordinatorMessage::kStepPlan);
    ASSERT_EQ(plans.size(), 1u) << i;
    EXPECT_EQ(plans[0].step_plan().step(), 0);
    EXPECT_THAT(plans[0].step_plan().encoder_replicas(), ::testing::ElementsAre(0));
    // Its assignment with the peers, now that the run starts.
    const auto assignments = SentTo(ids_[i], v1::CoordinatorMessage::kAssignment);
    ASSERT_EQ(assignments.size(), 1u) << i;
  }
  const v1::StatusResponse status = controller_->Status(kT0 + absl::Seconds(61));
  ASSERT_EQ(status.pool_changes_size(), 1);
  EXPECT_EQ(status.pool_changes(0).module(), v1::MODULE_ENCODER);
  EXPECT_EQ(status.pool_changes(0).replica(), 1);
  EXPECT_EQ(status.pool_changes(0).kind(), v1::POOL_CHANGE_LOST);
  EXPECT_EQ(status.pool_changes(0).replicas_after(), 1);
  EXPECT_THAT(status.pool_changes(0).cause(),
              HasSubstr("did not register within register_timeout"));
  // The replica admits a replacement, which joins at a step boundary.
  v1::RegisterRequest late;
  late.set_role(v1::WORKER_ROLE_ENCODER);
  late.set_host("host");
  late.set_data_address("host:1");
  auto joined = controller_->Register(late, kT0 + absl::Seconds(62), &actions_);
  ASSERT_TRUE(joined.ok()) << joined.status();
  EXPECT_TRUE(controller_->membership().Find(joined->assignment().worker_id())->joining);
}

TEST_F(RunControllerTest, ARestartedRunStartsWithoutAnLlmReplicaThatDidNotComeBack) {
  continues_lost_run_ = true;
  v1::RunSpec spec = TinySpec(/*steps=*/2);
  spec.mutable_llm()->mutable_layout()->set_dp(2);
  spec.mutable_llm()->mutable_layout()->set_tp(1);
  spec.mutable_run()->set_global_batch(8);
  spec.mutable_run()->set_micro_batch(2);
  CreateWith(spec);
  StartAll({v1::WORKER_ROLE_ENCODER, v1::WORKER_ROLE_ENCODER, v1::WORKER_ROLE_LLM});
  HearFrom({0, 1, 2}, kT0 + absl::Seconds(61));
  controller_->Tick(kT0 + absl::Seconds(61), &actions_);
  ASSERT_EQ(controller_->state(), v1::RUN_STATE_RUNNING) << controller_->state_message();
  const auto plans = SentTo(ids_[2], v1::CoordinatorMessage::kStepPlan);
  ASSERT_EQ(plans.size(), 1u);
  EXPECT_THAT(plans[0].step_plan().llm_replicas(), ::testing::ElementsAre(0));
  EXPECT_THAT(plans[0].step_plan().encoder_replicas(), ::testing::ElementsAre(0, 1));
  const v1::StatusResponse status = controller_->Status(kT0 + absl::Seconds(61));
  ASSERT_EQ(status.pool_changes_size(), 1);
  EXPECT_EQ(status.pool_changes(0).module(), v1::MODULE_LLM);
  EXPECT_EQ(status.pool_changes(0).replica(), 1);
}

// With pipeline stages, a replica whose stage 1 did not come back leaves with its stage 0, which
// registered: told so (StopRun.replica_left), it exits and may register again.
TEST_F(RunControllerTest, ARestartedPipelinedRunStartsWithoutAPartlyRegisteredLlmReplica) {
  continues_lost_run_ = true;
  CreateWith(TwoLlmReplicasSpec(/*pp=*/2));
  // LLM ranks 0 (dp 0, pp 0), 1 (dp 1, pp 0) and 2 (dp 0, pp 1); rank 3 (dp 1, pp 1) is missing.
  StartAll({v1::WORKER_ROLE_ENCODER, v1::WORKER_ROLE_ENCODER, v1::WORKER_ROLE_LLM,
            v1::WORKER_ROLE_LLM, v1::WORKER_ROLE_LLM});
  HearFrom({0, 1, 2, 3, 4}, kT0 + absl::Seconds(61));
  controller_->Tick(kT0 + absl::Seconds(61), &actions_);
  ASSERT_EQ(controller_->state(), v1::RUN_STATE_RUNNING) << controller_->state_message();
  for (size_t i : {size_t{2}, size_t{4}}) {
    const auto plans = SentTo(ids_[i], v1::CoordinatorMessage::kStepPlan);
    ASSERT_EQ(plans.size(), 1u) << "llm worker " << i;
    EXPECT_THAT(plans[0].step_plan().llm_replicas(), ::testing::ElementsAre(0));
  }
  EXPECT_TRUE(SentTo(ids_[3], v1::CoordinatorMessage::kStepPlan).empty());
  const auto stops = SentTo(ids_[3], v1::CoordinatorMessage::kStop);
  ASSERT_EQ(stops.size(), 1u);
  EXPECT_TRUE(stops[0].stop().replica_left());
  EXPECT_THAT(stops[0].stop().reason(), HasSubstr("llm replica 1 did not register"));
}

TEST_F(RunControllerTest, ARestartedRunStillFailsWhenItCannotStartWithoutTheMissingRanks) {
  // An LLM rank missing at tp 2 without LLM DP: its replica is the only one.
  continues_lost_run_ = true;
  Create();
  RegisterAndPassTheRegisterTimeout(
      {v1::WORKER_ROLE_ENCODER, v1::WORKER_ROLE_ENCODER, v1::WORKER_ROLE_LLM});
  EXPECT_EQ(controller_->state(), v1::RUN_STATE_FAILED);
  EXPECT_THAT(controller_->state_message(), HasSubstr("llm rank 1 (dp 0, tp 1, cp 0, pp 0)"));
  // An encoder replica missing, with failure.min_encoder_replicas 2.
  controller_.reset();
  Create(/*steps=*/2, true, false, "", /*min_encoder_replicas=*/2);
  RegisterAndPassTheRegisterTimeout(
      {v1::WORKER_ROLE_ENCODER, v1::WORKER_ROLE_LLM, v1::WORKER_ROLE_LLM});
  EXPECT_EQ(controller_->state(), v1::RUN_STATE_FAILED);
  EXPECT_THAT(controller_->state_message(), HasSubstr("encoder rank 1 (dp 1, tp 0)"));
}

TEST_F(RunControllerTest, ALostLlmRankFailsTheRunAtOnceSayingItMustStartOver) {
  Create(5, false);
  StartAll();
  actions_ = {};
  controller_->SessionEnded(ids_[2], "cancelled", kT0 + absl::Seconds(1), &actions_);
  // Its shard is held by no other worker: a replacement would start from nothing.
  EXPECT_EQ(controller_->state(), v1::RUN_STATE_FAILED);
  EXPECT_THAT(controller_->state_message(), HasSubstr("llm rank 0"));
  EXPECT_THAT(controller_->state_message(), HasSubstr("held by no other worker"));
  EXPECT_THAT(controller_->state_message(), HasSubstr("no checkpoints (checkpoint.dir)"));
  const auto stops = SentTo(ids_[0], v1::CoordinatorMessage::kStop);
  ASSERT_EQ(stops.size(), 1u);
  // The workers left are told the run failed: they write no outputs and exit with its reason.
  EXPECT_TRUE(stops[0].stop().run_failed());
  EXPECT_THAT(stops[0].stop().reason(), HasSubstr("held by no other worker"));
}

TEST_F(RunControllerTest, StepsRunToCommitAndTheRunStopsAfterTheLast) {
  Create(/*steps=*/2);
  StartAll();
  ASSERT_EQ(planner_->calls, 1);
  auto plans = SentTo(ids_[1], v1::CoordinatorMessage::kStepPlan);
  ASSERT_EQ(plans.size(), 1u);
  EXPECT_EQ(plans[0].step_plan().rank_plan().step(), 0);
  EXPECT_EQ(plans[0].step_plan().rank_plan().generation(), 1);
  EXPECT_EQ(plans[0].step_plan().rank_plan().rank(), 1);  // encoder rank 1
  EXPECT_EQ(plans[0].step_plan().global_loss_tokens(), 10);
  actions_ = {};
  CompleteStep(0);
  auto commits = SentTo(ids_[0], v1::CoordinatorMessage::kCommit);
  ASSERT_EQ(commits.size(), 1u);
  EXPECT_DOUBLE_EQ(commits[0].commit().loss(), 3.0);
  EXPECT_EQ(controller_->committed_steps(), 1);
  EXPECT_EQ(planner_->calls, 2);
  ASSERT_EQ(SentTo(ids_[0], v1::CoordinatorMessage::kStepPlan).size(), 1u);
  CompleteStep(1);
  EXPECT_EQ(controller_->committed_steps(), 2);
  EXPECT_EQ(controller_->state(), v1::RUN_STATE_STOPPING);
  const auto stops = SentTo(ids_[3], v1::CoordinatorMessage::kStop);
  ASSERT_EQ(stops.size(), 1u);
  // Nothing was in flight: the outputs are gathered on the groups of the steps' generation.
  EXPECT_EQ(stops[0].stop().generation(), 1);
  EXPECT_EQ(controller_->generation(), 1);
  EXPECT_EQ(controller_->state_message(), "completed 2 steps");
  for (const auto& id : ids_) controller_->SessionEnded(id, "closed by the worker", kT0, &actions_);
  EXPECT_EQ(controller_->state(), v1::RUN_STATE_DONE);
  v1::StatusResponse status = controller_->Status(kT0);
  EXPECT_EQ(status.committed_steps(), 2);
  ASSERT_EQ(status.recent_steps_size(), 2);
  EXPECT_EQ(status.recent_steps(0).step(), 1);
  EXPECT_DOUBLE_EQ(status.recent_steps(0).grad_norm(), std::sqrt(3.0));
  // Workers that left after stop are not "dead" failures.
  EXPECT_EQ(status.workers(0).dead_reason(), "left after stop");
}

// metrics.jsonl's writer takes the committed steps: all of them, in order, however many committed
// since it last took them (more than Status's 32), and no aborted attempt.
TEST_F(RunControllerTest, EveryCommittedStepIsKeptUntilTaken) {
  keep_committed_steps_ = true;
  Create(/*steps=*/45);
  StartAll();
  for (int64_t step = 0; step < 5; ++step) CompleteStep(step);
  std::vector<v1::StepTiming> taken = controller_->TakeCommittedSteps();
  ASSERT_EQ(taken.size(), 5u);
  EXPECT_TRUE(controller_->TakeCommittedSteps().empty());  // taken once
  // Step 5's first attempt fails on a rank and is tried again in the next generation.
  v1::WorkerMessage failed;
  failed.mutable_report()->set_step(5);
  failed.mutable_report()->set_generation(controller_->generation());
  failed.mutable_report()->set_ok(false);
  failed.mutable_report()->set_error("nan loss");
  Send(ids_[0], failed);
  HearFrom({1, 2, 3}, kT0);
  ASSERT_EQ(controller_->generation(), 2);
  for (int64_t step = 5; step < 45; ++step) CompleteStep(step);
  EXPECT_EQ(controller_->committed_steps(), 45);
  const std::vector<v1::StepTiming> rest = controller_->TakeCommittedSteps();
  taken.insert(taken.end(), rest.begin(), rest.end());
  ASSERT_EQ(taken.size(), 45u);
  for (int64_t step = 0; step < 45; ++step) {
    const v1::StepTiming& t = taken[step];
    EXPECT_EQ(t.step(), step);
    EXPECT_TRUE(t.committed()) << step;
    EXPECT_DOUBLE_EQ(t.loss(), 3.0) << step;  // 30 over 10 tokens, from LLM rank 0's report
    EXPECT_EQ(t.generation(), step < 5 ? 1 : 2) << step;
  }
  // Status shows only the latest 32 attempts.
  EXPECT_EQ(controller_->Status(kT0).recent_steps_size(), 32);
}

TEST_F(RunControllerTest, CommittedStepsAreNotKeptWithoutAReader) {
  Create(/*steps=*/3);
  StartAll();
  for (int64_t step = 0; step < 3; ++step) CompleteStep(step);
  EXPECT_EQ(controller_->committed_steps(), 3);
  EXPECT_TRUE(controller_->TakeCommittedSteps().empty());
}

TEST_F(RunControllerTest, StepsWaitForEverySession) {
  Create(2);
  for (auto role : {v1::WORKER_ROLE_ENCODER, v1::WORKER_ROLE_ENCODER, v1::WORKER_ROLE_LLM,
                    v1::WORKER_ROLE_LLM}) {
    ids_.push_back(Register(role));
  }
  for (size_t i = 0; i < 3; ++i)
    ASSERT_TRUE(controller_->OpenSession(ids_[i], kT0, &actions_).ok());
  EXPECT_EQ(planner_->calls, 0);
  ASSERT_TRUE(controller_->OpenSession(ids_[3], kT0, &actions_).ok());
  EXPECT_EQ(planner_->calls, 1);
  EXPECT_EQ(controller_->OpenSession(ids_[3], kT0, &actions_).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(controller_->OpenSession("enc9-99", kT0, &actions_).code(),
            absl::StatusCode::kNotFound);
}

TEST_F(RunControllerTest, RepeatedAbortsFailTheRun) {
  Create(5);
  StartAll();
  for (int attempt = 0; attempt < 3; ++attempt) {
    v1::WorkerMessage m;
    m.mutable_report()->set_step(0);
    // Every attempt has a generation of its own.
    EXPECT_EQ(controller_->generation(), 1 + attempt);
    m.mutable_report()->set_generation(controller_->generation());
    m.mutable_report()->set_ok(false);
    m.mutable_report()->set_error("nan loss");
    Send(ids_[0], m);
    if (attempt < 2) HearFrom({1, 2, 3}, kT0);
  }
  EXPECT_EQ(planner_->calls, 3);
  EXPECT_EQ(controller_->state(), v1::RUN_STATE_FAILED);
  EXPECT_THAT(controller_->state_message(), HasSubstr("step 0 aborted 3 times in a row"));
  EXPECT_THAT(controller_->state_message(), HasSubstr("nan loss"));
  ASSERT_FALSE(actions_.end_sessions.empty());
}

TEST_F(RunControllerTest, PlannerErrorFailsTheRun) {
  Create(5);
  planner_->fail = true;
  StartAll();
  EXPECT_EQ(controller_->state(), v1::RUN_STATE_FAILED);
  EXPECT_THAT(controller_->state_message(), HasSubstr("planning step 0 failed: no samples left"));
}

// A planner that opens its data set first (StepPlanner::Prepare, run by the server off its lock):
// no step starts until it has prepared, however complete the membership.
TEST_F(RunControllerTest, NoStepStartsBeforeThePlannerIsPrepared) {
  Create(5, true, /*needs_preparation=*/true);
  ASSERT_EQ(controller_->planner_to_prepare(), planner_);
  StartAll();
  EXPECT_EQ(controller_->state(), v1::RUN_STATE_RUNNING);
  EXPECT_EQ(planner_->calls, 0);
  EXPECT_TRUE(SentTo(ids_[0], v1::CoordinatorMessage::kStepPlan).empty());
  controller_->Tick(kT0 + absl::Seconds(1), &actions_);
  EXPECT_EQ(planner_->calls, 0);
  controller_->PlannerPrepared(absl::OkStatus(), kT0 + absl::Seconds(2), &actions_);
  EXPECT_EQ(controller_->planner_to_prepare(), nullptr);
  EXPECT_EQ(planner_->calls, 1);
  EXPECT_EQ(SentTo(ids_[0], v1::CoordinatorMessage::kStepPlan).size(), 1u);
}

TEST_F(RunControllerTest, APreparationErrorFailsTheRunWithIt) {
  Create(5, true, /*needs_preparation=*/true);
  StartAll();
  controller_->PlannerPrepared(absl::FailedPreconditionError("cannot open the training data: x"),
                               kT0, &actions_);
  EXPECT_EQ(controller_->state(), v1::RUN_STATE_FAILED);
  EXPECT_THAT(controller_->state_message(),
              HasSubstr("preparing the step planner failed: cannot open the training data: x"));
  EXPECT_EQ(planner_->calls, 0);
}

TEST_F(RunControllerTest, StopWaitsForSessionsThenTimesOut) {
  Create(5, false);
  StartAll();
  auto response = controller_->Stop("maintenance", false, kT0, &actions_);
  EXPECT_EQ(response.state(), v1::RUN_STATE_STOPPING);
  EXPECT_EQ(SentTo(ids_[0], v1::CoordinatorMessage::kStop)[0].stop().reason(),
            "stop requested: maintenance");
  controller_->SessionEnded(ids_[0], "closed by the worker", kT0, &actions_);
  EXPECT_EQ(controller_->state(), v1::RUN_STATE_STOPPING);
  for (auto* w : controller_->membership().LiveWorkers())
    w->last_heartbeat = kT0 + absl::Seconds(10);
  actions_ = {};
  controller_->Tick(kT0 + absl::Seconds(10), &actions_);
  EXPECT_EQ(controller_->state(), v1::RUN_STATE_DONE);
  EXPECT_EQ(actions_.end_sessions.size(), 3u);
  // Stop is idempotent.
  EXPECT_EQ(controller_->Stop("again", false, kT0, &actions_).state(), v1::RUN_STATE_DONE);
}

// A worker that says it has begun its outputs gets as long as a step (100 s here) from then,
// and each chunk of outputs that arrives moves the stop's deadline to at least --stop-timeout
// (10 s) later; the sessions the deadline ends are named.
TEST_F(RunControllerTest, TheStopsDeadlineFollowsOutputsUnderWay) {
  Create(5);
  StartAll();
  controller_->Stop("maintenance", false, kT0, &actions_);
  ASSERT_EQ(controller_->state(), v1::RUN_STATE_STOPPING);
  auto tick = [&](absl::Duration after) {
    for (auto* w : controller_->membership().LiveWorkers()) w->last_heartbeat = kT0 + after;
    controller_->Tick(kT0 + after, &actions_);
    return controller_->state();
  };
  v1::WorkerMessage outputs;
  outputs.mutable_progress()->set_phase(kOutputsPhase);
  Send(ids_[2], outputs, kT0 + absl::Seconds(5));
  EXPECT_EQ(tick(absl::Seconds(104)), v1::RUN_STATE_STOPPING);  // 10 s alone would have ended it
  controller_->OutputProgress(kT0 + absl::Seconds(104));
  EXPECT_EQ(tick(absl::Seconds(113)), v1::RUN_STATE_STOPPING);
  EXPECT_TRUE(controller_->cut_at_stop().empty());
  controller_->SessionEnded(ids_[0], "closed by the worker", kT0 + absl::Seconds(113), &actions_);
  EXPECT_EQ(tick(absl::Seconds(114)), v1::RUN_STATE_DONE);
  std::vector<std::string> open(ids_.begin() + 1, ids_.end());
  EXPECT_THAT(controller_->cut_at_stop(), ::testing::UnorderedElementsAreArray(open));
}

// A worker silent past the heartbeat timeout while the run stops (here the last with a session
// open, its outputs under way) is lost, and with it the stop is over: no wait for the stop's
// deadline, and nobody is reported cut off by it. Once stopped, no rank is listed as missing.
TEST_F(RunControllerTest, AStopEndsWhenTheLastWorkerWithASessionIsLostToItsHeartbeats) {
  Create(5);
  StartAll();
  controller_->Stop("maintenance", false, kT0, &actions_);
  v1::WorkerMessage outputs;
  outputs.mutable_progress()->set_phase(kOutputsPhase);
  Send(ids_[0], outputs, kT0 + absl::Seconds(1));  // the deadline is a step's timeout away now
  for (size_t i : {size_t{1}, size_t{2}, size_t{3}}) {
    controller_->SessionEnded(ids_[i], "closed by the worker", kT0 + absl::Seconds(2), &actions_);
  }
  controller_->Tick(kT0 + absl::Seconds(5), &actions_);
  ASSERT_EQ(controller_->state(), v1::RUN_STATE_STOPPING);
  controller_->Tick(kT0 + absl::Seconds(12), &actions_);  // 11 s silent, heartbeat_timeout 10 s
  EXPECT_EQ(controller_->state(), v1::RUN_STATE_DONE);
  EXPECT_TRUE(controller_->cut_at_stop().empty());
  EXPECT_EQ(controller_->Status(kT0 + absl::Seconds(12)).missing_size(), 0);
}

// A worker that registered before a stop and opens its session after the run ended (a stop with
// no session open ends it at once) hears the stop, instead of waiting for a start that never
// comes; after a failed run, the failure, and its session ends.
TEST_F(RunControllerTest, ASessionOpenedAfterTheRunEndedHearsHowItEnded) {
  Create();
  const std::string early = Register(v1::WORKER_ROLE_ENCODER);
  controller_->Stop("not today", false, kT0, &actions_);
  ASSERT_EQ(controller_->state(), v1::RUN_STATE_DONE);
  ASSERT_TRUE(controller_->OpenSession(early, kT0 + absl::Seconds(1), &actions_).ok());
  auto stops = SentTo(early, v1::CoordinatorMessage::kStop);
  ASSERT_EQ(stops.size(), 1u);
  EXPECT_FALSE(stops[0].stop().run_failed());
  EXPECT_EQ(stops[0].stop().reason(), "stop requested: not today");

  ids_.clear();
  actions_ = {};
  Create();
  RegisterAndPassTheRegisterTimeout({v1::WORKER_ROLE_ENCODER});
  ASSERT_EQ(controller_->state(), v1::RUN_STATE_FAILED);
  const std::string late = controller_->membership().LiveWorkers().at(0)->worker_id;
  actions_ = {};
  ASSERT_TRUE(controller_->OpenSession(late, kT0 + absl::Seconds(62), &actions_).ok());
  stops = SentTo(late, v1::CoordinatorMessage::kStop);
  ASSERT_EQ(stops.size(), 1u);
  EXPECT_TRUE(stops[0].stop().run_failed());
  ASSERT_EQ(actions_.end_sessions.size(), 1u);
  EXPECT_EQ(actions_.end_sessions[0].first, late);
}

// A planner whose preparation fails after the run was stopped leaves the stopped run as it is.
TEST_F(RunControllerTest, APreparationErrorAfterAStopLeavesTheRunStopped) {
  Create(5, true, /*needs_preparation=*/true);
  controller_->Stop("not today", false, kT0, &actions_);
  ASSERT_EQ(controller_->state(), v1::RUN_STATE_DONE);
  controller_->PlannerPrepared(absl::InternalError("interrupted"), kT0, &actions_);
  EXPECT_EQ(controller_->state(), v1::RUN_STATE_DONE);
  EXPECT_EQ(controller_->state_message(), "stop requested: not today");
}

// The messages of `kind` sent to `id` since `actions` was last cleared, in order.
std::vector<v1::CoordinatorMessage::KindCase> KindsTo(const Actions& actions,
                                                      const std::string& id) {
  std::vector<v1::CoordinatorMessage::KindCase> kinds;
  for (const auto& [to, m] : actions.messages) {
    if (to == id) kinds.push_back(m.kind_case());
  }
  return kinds;
}

// A stop that aborts the step in flight moves the run to a generation of its own, as the next
// attempt of an aborted step would be: every worker is told it with the stop (after the abort),
// so that the final outputs are not gathered on groups the abort left half done.
TEST_F(RunControllerTest, AStopThatAbortsTheStepInFlightComesInANewGeneration) {
  Create(5);
  StartAll();
  const auto plans = SentTo(ids_[0], v1::CoordinatorMessage::kStepPlan);
  ASSERT_EQ(plans.size(), 1u);
  const int64_t planned = plans[0].step_plan().generation();
  actions_ = {};
  controller_->Stop("maintenance", false, kT0, &actions_);
  for (const auto& id : ids_) {
    EXPECT_THAT(KindsTo(actions_, id), ::testing::ElementsAre(v1::CoordinatorMessage::kAbort,
                                                              v1::CoordinatorMessage::kStop))
        << id;
    const auto stops = SentTo(id, v1::CoordinatorMessage::kStop);
    ASSERT_EQ(stops.size(), 1u);
    EXPECT_EQ(stops[0].stop().generation(), planned + 1) << id;
    EXPECT_FALSE(stops[0].stop().leave_run());
    EXPECT_FALSE(stops[0].stop().run_failed());
  }
  EXPECT_EQ(controller_->generation(), planned + 1);
}

TEST_F(RunControllerTest, StopWhileWaitingIsDoneAtOnce) {
  Create();
  const v1::StopResponse response = controller_->Stop("", false, kT0, &actions_);
  EXPECT_EQ(response.state(), v1::RUN_STATE_DONE);
  EXPECT_EQ(response.checkpoint(), "");  // none asked for
  EXPECT_EQ(controller_->state_message(), "stop requested");
}

// A stop that asks for a checkpoint which cannot be written says so, and why, to the one who
// asked (`hetpar stop --checkpoint` prints it).
TEST_F(RunControllerTest, AStopWithACheckpointThatCannotBeWrittenSaysWhy) {
  Create(5, true, false, "/ckpt");
  const v1::StopResponse waiting = controller_->Stop("preempted", true, kT0, &actions_);
  EXPECT_EQ(waiting.state(), v1::RUN_STATE_DONE);
  EXPECT_EQ(waiting.checkpoint(),
            "no checkpoint: the run is waiting for its workers (no step was in flight; 0 steps "
            "committed)");
}

TEST_F(RunControllerTest, AStopWithACheckpointLetsTheStepInFlightCommitWithOne) {
  Create(5, true, false, "/ckpt");
  StartAll();
  ASSERT_EQ(SentTo(ids_[0], v1::CoordinatorMessage::kStepPlan).size(), 1u);
  auto response = controller_->Stop("preempted", true, kT0, &actions_);
  // Step 0 goes on: nothing stops yet.
  EXPECT_EQ(response.state(), v1::RUN_STATE_RUNNING);
  EXPECT_EQ(response.checkpoint(),
            "the run stops once step 0 commits, with a checkpoint of it in /ckpt");
  EXPECT_TRUE(SentTo(ids_[0], v1::CoordinatorMessage::kStop).empty());
  CompleteStep(0);
  const auto commits = SentTo(ids_[0], v1::CoordinatorMessage::kCommit);
  ASSERT_EQ(commits.size(), 1u);
  EXPECT_TRUE(commits[0].commit().checkpoint());
  // Then the run stops instead of planning step 1.
  EXPECT_EQ(controller_->state(), v1::RUN_STATE_STOPPING);
  EXPECT_EQ(controller_->committed_steps(), 1);
  EXPECT_EQ(planner_->calls, 1);
  const auto stops = SentTo(ids_[0], v1::CoordinatorMessage::kStop);
  ASSERT_EQ(stops.size(), 1u);
  EXPECT_EQ(stops[0].stop().reason(), "stop requested: preempted (checkpointed after 1 steps)");
}

// A stop with a checkpoint whose step is aborted (a replica lost), or that comes while the
// coordinator waits for the workers to give an aborted attempt up, checkpoints the next attempt
// instead of stopping without one (which would lose every step since the last checkpoint).
TEST_F(RunControllerTest, AStopWithACheckpointAroundAnAbortCheckpointsTheNextAttempt) {
  for (const bool stop_first : {true, false}) {
    SCOPED_TRACE(stop_first ? "stop, then the abort" : "the abort, then the stop");
    ASSERT_NO_FATAL_FAILURE(StopWithACheckpointAroundAnAbort(stop_first));
    CompleteStep(0, 0, {0, 2, 3});
    const auto commits = SentTo(ids_[0], v1::CoordinatorMessage::kCommit);
    ASSERT_EQ(commits.size(), 1u);
    EXPECT_TRUE(commits[0].commit().checkpoint());
    EXPECT_EQ(controller_->state(), v1::RUN_STATE_STOPPING);
    const auto stops = SentTo(ids_[0], v1::CoordinatorMessage::kStop);
    ASSERT_EQ(stops.size(), 1u);
    EXPECT_EQ(stops[0].stop().reason(), "stop requested: preempted (checkpointed after 1 steps)");
  }
}

// Only one attempt is waited for: a stop whose retry is aborted too stops without a checkpoint.
TEST_F(RunControllerTest, AStopWithACheckpointWhoseRetryIsAbortedTooStopsWithoutOne) {
  for (const bool stop_first : {true, false}) {
    SCOPED_TRACE(stop_first ? "stop, then the abort" : "the abort, then the stop");
    ASSERT_NO_FATAL_FAILURE(StopWithACheckpointAroundAnAbort(stop_first));
    v1::WorkerMessage failed;
    failed.mutable_report()->set_step(0);
    failed.mutable_report()->set_generation(controller_->generation());
    failed.mutable_report()->set_ok(false);
    failed.mutable_report()->set_error("connection reset by peer");
    Send(ids_[2], failed, kT0 + absl::Seconds(3));
    EXPECT_EQ(controller_->state(), v1::RUN_STATE_STOPPING);
    EXPECT_EQ(controller_->committed_steps(), 0);
    EXPECT_THAT(controller_->state_message(),
                HasSubstr("stop requested: preempted (the step to checkpoint was aborted twice: no "
                          "checkpoint)"));
  }
}

TEST_F(RunControllerTest, AStopWithACheckpointStopsAtOnceWithoutACheckpointDirectory) {
  Create(5);
  StartAll();
  EXPECT_EQ(controller_->Stop("preempted", true, kT0, &actions_).state(), v1::RUN_STATE_STOPPING);
  EXPECT_EQ(SentTo(ids_[0], v1::CoordinatorMessage::kStop).size(), 1u);
}

TEST_F(RunControllerTest, AReplacementJoinsAtTheNextStepBoundaryAndTakesALiveReplicasState) {
  Create(/*steps=*/3);
  StartAll();
  // Encoder replica 1 dies in step 0: the step goes on over replica 0, and replica 1 admits a
  // replacement (the pool's target is still 2).
  controller_->SessionEnded(ids_[1], "connection reset", kT0 + absl::Seconds(1), &actions_);
  ASSERT_EQ(controller_->state(), v1::RUN_STATE_RUNNING);
  HearFrom({0, 2, 3}, kT0 + absl::Seconds(1));  // the retry starts
  v1::StatusResponse status = controller_->Status(kT0);
  EXPECT_EQ(status.encoder_replicas(), 1);
  EXPECT_EQ(status.encoder_replicas_target(), 2);
  EXPECT_THAT(status.encoder_replicas_open(), ::testing::ElementsAre(1));

  absl::StatusOr<v1::RegisterResponse> joined = RegisterReplacement(kT0 + absl::Seconds(2));
  ASSERT_TRUE(joined.ok()) << joined.status();
  const std::string joiner = joined->assignment().worker_id();
  EXPECT_EQ(joined->assignment().world_rank(), 1);  // the lost worker's rank
  EXPECT_FALSE(joined->assignment().peers_complete());
  EXPECT_EQ(controller_->Status(kT0).encoder_workers_joining(), 1);
  actions_ = {};
  ASSERT_TRUE(controller_->OpenSession(joiner, kT0 + absl::Seconds(2), &actions_).ok());
  // Step 0 is in flight: the joiner waits for its commit.
  EXPECT_TRUE(KindsTo(actions_, joiner).empty());
  const int64_t before = controller_->generation();

  CompleteStep(0, /*encoder_contributor=*/0, /*reporting=*/{0, 2, 3}, kT0 + absl::Seconds(3));
  ASSERT_EQ(controller_->committed_steps(), 1);
  // The boundary: a generation for the join; the joiner's assignment (peers: both LLM ranks),
  // the LLM ranks' change naming it, then step 1 over both replicas, replica 1 joining.
  EXPECT_EQ(controller_->generation(), before + 1);
  EXPECT_THAT(KindsTo(actions_, joiner), ::testing::ElementsAre(v1::CoordinatorMessage::kAssignment,
                                                                v1::CoordinatorMessage::kStepPlan));
  const v1::Assignment assignment =
      SentTo(joiner, v1::CoordinatorMessage::kAssignment)[0].assignment();
  EXPECT_TRUE(assignment.joining());
  EXPECT_TRUE(assignment.peers_complete());
  EXPECT_EQ(assignment.peers_size(), 2);
  EXPECT_EQ(assignment.generation(), before + 1);
  EXPECT_THAT(assignment.encoder_replicas(), ::testing::ElementsAre(0, 1));
  auto changes = SentTo(ids_[2], v1::CoordinatorMessage::kMembershipChange);
  ASSERT_EQ(changes.size(), 1u);
  ASSERT_EQ(changes[0].membership_change().joined_size(), 1);
  EXPECT_EQ(changes[0].membership_change().joined(0).worker_id(), joiner);
  EXPECT_EQ(changes[0].membership_change().joined(0).data_address(), "new-host:1");
  EXPECT_EQ(changes[0].membership_change().lost_size(), 0);
  // The other encoder rank talks to no encoder: its change names no peer.
  changes = SentTo(ids_[0], v1::CoordinatorMessage::kMembershipChange);
  ASSERT_EQ(changes.size(), 1u);
  EXPECT_EQ(changes[0].membership_change().joined_size(), 0);
  for (const std::string& id : {ids_[0], joiner, ids_[2]}) {
    auto plans = SentTo(id, v1::CoordinatorMessage::kStepPlan);
    ASSERT_EQ(plans.size(), 1u) << id;
    EXPECT_EQ(plans[0].step_plan().step(), 1);
    EXPECT_EQ(plans[0].step_plan().generation(), before + 1);
    EXPECT_THAT(plans[0].step_plan().encoder_replicas(), ::testing::ElementsAre(0, 1));
    EXPECT_THAT(plans[0].step_plan().encoder_joining(), ::testing::ElementsAre(1));
  }
  // Once a step with it commits, it holds the state: the next plan has no one joining.
  ids_[1] = joiner;
  actions_ = {};
  CompleteStep(1);
  ASSERT_EQ(controller_->committed_steps(), 2);
  auto plans = SentTo(joiner, v1::CoordinatorMessage::kStepPlan);
  ASSERT_EQ(plans.size(), 1u);
  EXPECT_EQ(plans[0].step_plan().encoder_joining_size(), 0);
  status = controller_->Status(kT0 + absl::Seconds(4));
  ASSERT_EQ(status.pool_changes_size(), 2);
  EXPECT_EQ(status.pool_changes(0).kind(), v1::POOL_CHANGE_LOST);
  EXPECT_EQ(status.pool_changes(1).kind(), v1::POOL_CHANGE_JOINED);
  EXPECT_EQ(status.pool_changes(1).replica(), 1);
  EXPECT_EQ(status.pool_changes(1).step(), 1);
  EXPECT_EQ(status.pool_changes(1).replicas_after(), 2);
  EXPECT_EQ(status.encoder_replicas(), 2);
  EXPECT_EQ(status.encoder_replicas_open_size(), 0);
}

// A stop that aborts the first step of a replica that joined at the boundary: the joiner may not
// have received the run's state yet, so its workers leave without outputs, and the outputs'
// groups span the replicas that hold the state (the first of them writes the model). Otherwise
// the joiner, replica 0, would write its untrained weights as the run's final model.
TEST_F(RunControllerTest, AStopBeforeAJoinedReplicasFirstCommitTakesTheOutputsFromTheOthers) {
  Create(/*steps=*/4);
  StartAll();
  controller_->SessionEnded(ids_[0], "connection reset", kT0 + absl::Seconds(1), &actions_);
  HearFrom({1, 2, 3}, kT0 + absl::Seconds(1));
  absl::StatusOr<v1::RegisterResponse> joined = RegisterReplacement(kT0 + absl::Seconds(2));
  ASSERT_TRUE(joined.ok()) << joined.status();
  const std::string joiner = joined->assignment().worker_id();
  ASSERT_TRUE(controller_->OpenSession(joiner, kT0 + absl::Seconds(2), &actions_).ok());
  CompleteStep(0, /*encoder_contributor=*/1, /*reporting=*/{1, 2, 3}, kT0 + absl::Seconds(3));
  ASSERT_EQ(controller_->committed_steps(), 1);
  const auto plans = SentTo(joiner, v1::CoordinatorMessage::kStepPlan);
  ASSERT_EQ(plans.size(), 1u);
  ASSERT_THAT(plans[0].step_plan().encoder_joining(), ::testing::ElementsAre(0));
  controller_->Stop("preempted", false, kT0 + absl::Seconds(4), &actions_);
  ASSERT_EQ(controller_->state(), v1::RUN_STATE_STOPPING);
  const auto joiner_stops = SentTo(joiner, v1::CoordinatorMessage::kStop);
  ASSERT_EQ(joiner_stops.size(), 1u);
  EXPECT_TRUE(joiner_stops[0].stop().leave_run());
  for (size_t i : {size_t{1}, size_t{2}, size_t{3}}) {
    const auto stops = SentTo(ids_[i], v1::CoordinatorMessage::kStop);
    ASSERT_EQ(stops.size(), 1u);
    EXPECT_FALSE(stops[0].stop().leave_run());
    EXPECT_THAT(stops[0].stop().encoder_replicas(), ::testing::ElementsAre(1)) << i;
    EXPECT_THAT(stops[0].stop().llm_replicas(), ::testing::ElementsAre(0)) << i;
  }
}

TEST_F(RunControllerTest, ScaleShrinksThePoolAtTheStepBoundaryAndGrowsItByAdmittingWorkers) {
  Create(/*steps=*/4);
  StartAll();
  ASSERT_GE(controller_->Status(kT0).step_in_flight(), 0);
  v1::ScaleRequest request;
  request.set_encoder_replicas(1);
  actions_ = {};
  auto scaled = controller_->Scale(request, kT0, &actions_);
  ASSERT_TRUE(scaled.ok()) << scaled.status();
  EXPECT_EQ(scaled->requested_encoder_replicas(), 1);
  EXPECT_EQ(scaled->current_encoder_replicas(), 2);
  EXPECT_THAT(scaled->message(), HasSubstr("shrinks when the step in flight commits"));
  EXPECT_TRUE(actions_.messages.empty());  // nothing changes mid-step

  CompleteStep(0);
  // Replica 1 (the highest) leaves: its worker alone is stopped, told it leaves a run that goes
  // on; the others learn of it; step 1 runs on replica 0.
  auto stops = SentTo(ids_[1], v1::CoordinatorMessage::kStop);
  ASSERT_EQ(stops.size(), 1u);
  EXPECT_TRUE(stops[0].stop().leave_run());
  EXPECT_THAT(stops[0].stop().reason(), HasSubstr("shrinks to 1 replicas"));
  EXPECT_TRUE(SentTo(ids_[1], v1::CoordinatorMessage::kStepPlan).empty());
  EXPECT_TRUE(SentTo(ids_[0], v1::CoordinatorMessage::kStop).empty());
  auto changes = SentTo(ids_[2], v1::CoordinatorMessage::kMembershipChange);
  ASSERT_EQ(changes.size(), 1u);
  EXPECT_EQ(changes[0].membership_change().lost(0).worker_id(), ids_[1]);
  auto plans = SentTo(ids_[0], v1::CoordinatorMessage::kStepPlan);
  ASSERT_EQ(plans.size(), 1u);
  EXPECT_EQ(plans[0].step_plan().step(), 1);
  EXPECT_THAT(plans[0].step_plan().encoder_replicas(), ::testing::ElementsAre(0));
  // It closes its session: no loss, the run goes on.
  controller_->SessionEnded(ids_[1], "closed", kT0, &actions_);
  EXPECT_EQ(controller_->state(), v1::RUN_STATE_RUNNING);
  v1::StatusResponse status = controller_->Status(kT0);
  EXPECT_EQ(status.encoder_replicas(), 1);
  ASSERT_EQ(status.pool_changes_size(), 1);
  EXPECT_EQ(status.pool_changes(0).kind(), v1::POOL_CHANGE_REMOVED);
  EXPECT_EQ(status.workers(status.workers_size() - 1).dead_reason(), "left the encoder pool");

  // Out of range: failure.min_encoder_replicas (1) to encoder.layout.dp (2).
  for (int64_t n : {0, 3}) {
    request.set_encoder_replicas(n);
    auto refused = controller_->Scale(request, kT0, &actions_);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(refused.status().message()),
                HasSubstr(absl::StrCat("encoder_replicas=", n, " is out of range")));
  }
  EXPECT_EQ(controller_->Status(kT0).encoder_replicas_target(), 1);

  // Back to 2: replica 1 admits a worker, which joins at the next boundary.
  request.set_encoder_replicas(2);
  scaled = controller_->Scale(request, kT0, &actions_);
  ASSERT_TRUE(scaled.ok()) << scaled.status();
  EXPECT_THAT(scaled->message(), HasSubstr("encoder replica(s) 1 admit workers"));
  const std::string joiner = Register(v1::WORKER_ROLE_ENCODER);
  ASSERT_TRUE(controller_->OpenSession(joiner, kT0, &actions_).ok());
  actions_ = {};
  CompleteStep(1, 0, {0, 2, 3});
  plans = SentTo(joiner, v1::CoordinatorMessage::kStepPlan);
  ASSERT_EQ(plans.size(), 1u);
  EXPECT_EQ(plans[0].step_plan().step(), 2);
  EXPECT_THAT(plans[0].step_plan().encoder_joining(), ::testing::ElementsAre(1));
  EXPECT_EQ(controller_->Status(kT0).encoder_replicas(), 2);
}

TEST_F(RunControllerTest, ALeavingEncoderWorkerTakesItsReplicaOutAndALeavingLlmWorkerStopsTheRun) {
  Create(/*steps=*/4, true, false, "/runs/ckpt");
  StartAll();
  v1::WorkerMessage leave;
  leave.mutable_leave()->set_reason("SIGTERM");
  Send(ids_[0], leave);
  EXPECT_TRUE(SentTo(ids_[0], v1::CoordinatorMessage::kStop).empty());
  CompleteStep(0);
  auto stops = SentTo(ids_[0], v1::CoordinatorMessage::kStop);
  ASSERT_EQ(stops.size(), 1u);
  EXPECT_TRUE(stops[0].stop().leave_run());
  EXPECT_THAT(stops[0].stop().reason(), HasSubstr("asked to leave"));
  auto plans = SentTo(ids_[1], v1::CoordinatorMessage::kStepPlan);
  ASSERT_EQ(plans.size(), 2u);
  EXPECT_THAT(plans[1].step_plan().encoder_replicas(), ::testing::ElementsAre(1));
  // An LLM worker's shard is held by no other worker: the run stops after a checkpoint of the
  // step in flight.
  Send(ids_[2], leave);
  EXPECT_EQ(controller_->state(), v1::RUN_STATE_RUNNING);  // the step in flight commits first
  CompleteStep(1, 1, {1, 2, 3});
  EXPECT_EQ(controller_->state(), v1::RUN_STATE_STOPPING);
  EXPECT_THAT(controller_->state_message(), HasSubstr("asked to leave (SIGTERM)"));
  auto llm_stops = SentTo(ids_[3], v1::CoordinatorMessage::kStop);
  ASSERT_EQ(llm_stops.size(), 1u);
  EXPECT_FALSE(llm_stops[0].stop().leave_run());
}

// A leave granted while a step was in flight, for encoder replica 2 of 3 with a minimum of 2:
// replica 0 is lost before the step boundary, so the pool can no longer let replica 2 go. The
// run stops as a leave that cannot be granted stops it, with a checkpoint of the step that
// begins then, instead of dropping the request and losing every step since the last checkpoint
// when the leaving worker's grace period ends.
TEST_F(RunControllerTest, ALeaveALossMadeImpossibleBeforeTheBoundaryStopsTheRunWithACheckpoint) {
  v1::RunSpec spec = TinySpec(/*steps=*/4, "/ckpt", /*min_encoder_replicas=*/2);
  spec.mutable_encoder()->mutable_layout()->set_dp(3);
  CreateWith(spec);
  StartAll({v1::WORKER_ROLE_ENCODER, v1::WORKER_ROLE_ENCODER, v1::WORKER_ROLE_ENCODER,
            v1::WORKER_ROLE_LLM, v1::WORKER_ROLE_LLM});
  ASSERT_EQ(SentTo(ids_[2], v1::CoordinatorMessage::kStepPlan).size(), 1u);
  v1::WorkerMessage leave;
  leave.mutable_leave()->set_reason("SIGTERM");
  Send(ids_[2], leave);
  EXPECT_TRUE(SentTo(ids_[2], v1::CoordinatorMessage::kStop).empty());  // granted, at the boundary
  controller_->SessionEnded(ids_[0], "connection reset", kT0 + absl::Seconds(1), &actions_);
  EXPECT_EQ(controller_->state(), v1::RUN_STATE_RUNNING);  // 2 replicas left: the run goes on
  HearFrom({1, 2, 3, 4}, kT0 + absl::Seconds(2));
  auto plans = SentTo(ids_[1], v1::CoordinatorMessage::kStepPlan);
  ASSERT_EQ(plans.size(), 2u);
  EXPECT_EQ(plans[1].step_plan().step(), 0);
  EXPECT_THAT(plans[1].step_plan().encoder_replicas(), ::testing::ElementsAre(1, 2));
  // Step 0's new attempt commits, with a checkpoint, and the run stops.
  const int64_t generation = controller_->generation();
  for (size_t i : {size_t{1}, size_t{3}, size_t{4}}) {
    v1::WorkerMessage m;
    auto* p = m.mutable_grad_norm_partial();
    p->set_step(0);
    p->set_generation(generation);
    p->set_module(i < 3 ? v1::MODULE_ENCODER : v1::MODULE_LLM);
    p->set_sum_squares(1.0);
    Send(ids_[i], m, kT0 + absl::Seconds(3));
  }
  for (size_t i : {size_t{1}, size_t{2}, size_t{3}, size_t{4}}) {
    v1::WorkerMessage m;
    m.mutable_report()->set_step(0);
    m.mutable_report()->set_generation(generation);
    m.mutable_report()->set_ok(true);
    Send(ids_[i], m, kT0 + absl::Seconds(3));
  }
  const auto commits = SentTo(ids_[1], v1::CoordinatorMessage::kCommit);
  ASSERT_EQ(commits.size(), 1u);
  EXPECT_TRUE(commits[0].commit().checkpoint());
  EXPECT_EQ(controller_->state(), v1::RUN_STATE_STOPPING);
  EXPECT_EQ(controller_->committed_steps(), 1);
  const auto stops = SentTo(ids_[2], v1::CoordinatorMessage::kStop);
  ASSERT_EQ(stops.size(), 1u);
  EXPECT_FALSE(stops[0].stop().leave_run());
  EXPECT_THAT(stops[0].stop().reason(),
              HasSubstr("a worker of encoder replica 2 asked to leave, and a loss since leaves the "
                        "run unable to go on without it (2 encoder replicas, "
                        "failure.min_encoder_replicas 2) (checkpointed after 1 steps)"));
}

// `hetpar scale` before the run starts (an encoder replica's pod never comes): the replicas
// beyond the new target leave at once, a rank of one already registered is told so, and the run
// starts on those left once their ranks are here, instead of failing at register_timeout.
TEST_F(RunControllerTest, ScalingDownBeforeTheStartLetsTheRunStartWithoutTheMissingReplica) {
  Create(/*steps=*/2);
  ids_.push_back(Register(v1::WORKER_ROLE_ENCODER));  // replica 0
  ids_.push_back(Register(v1::WORKER_ROLE_LLM));
  ids_.push_back(Register(v1::WORKER_ROLE_LLM));
  for (const auto& id : ids_) ASSERT_TRUE(controller_->OpenSession(id, kT0, &actions_).ok());
  ASSERT_EQ(controller_->state(), v1::RUN_STATE_WAITING);  // encoder replica 1 is missing
  v1::ScaleRequest request;
  request.set_encoder_replicas(1);
  auto scaled = controller_->Scale(request, kT0 + absl::Seconds(5), &actions_);
  ASSERT_TRUE(scaled.ok()) << scaled.status();
  EXPECT_EQ(controller_->state(), v1::RUN_STATE_RUNNING);
  const auto plans = SentTo(ids_[0], v1::CoordinatorMessage::kStepPlan);
  ASSERT_EQ(plans.size(), 1u);
  EXPECT_THAT(plans[0].step_plan().encoder_replicas(), ::testing::ElementsAre(0));
  for (auto* w : controller_->membership().LiveWorkers()) {
    w->last_heartbeat = kT0 + absl::Seconds(61);
  }
  controller_->Tick(kT0 + absl::Seconds(61), &actions_);
  EXPECT_EQ(controller_->state(), v1::RUN_STATE_RUNNING);
  EXPECT_EQ(controller_->Status(kT0 + absl::Seconds(61)).encoder_replicas(), 1);
}

// A worker registered into a vacant replica that the pool then no longer wants (hetpar scale
// down) before it opened its session is out of the run: its session is refused with the reason,
// and it is not counted as joining.
TEST_F(RunControllerTest, AJoinerWithoutASessionLeavesWithTheReplicaThatClosed) {
  Create(/*steps=*/4);
  StartAll();
  controller_->SessionEnded(ids_[1], "connection reset", kT0 + absl::Seconds(1), &actions_);
  HearFrom({0, 2, 3}, kT0 + absl::Seconds(1));
  ASSERT_THAT(controller_->Status(kT0).encoder_replicas_open(), ::testing::ElementsAre(1));
  absl::StatusOr<v1::RegisterResponse> joined = RegisterReplacement(kT0 + absl::Seconds(2));
  ASSERT_TRUE(joined.ok()) << joined.status();
  ASSERT_EQ(controller_->Status(kT0).encoder_workers_joining(), 1);
  v1::ScaleRequest scale;
  scale.set_encoder_replicas(1);
  ASSERT_TRUE(controller_->Scale(scale, kT0 + absl::Seconds(3), &actions_).ok());
  EXPECT_EQ(controller_->Status(kT0).encoder_workers_joining(), 0);
  const absl::Status opened =
      controller_->OpenSession(joined->assignment().worker_id(), kT0 + absl::Seconds(4), &actions_);
  EXPECT_EQ(opened.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(opened.message()),
              HasSubstr("encoder replica 1 is no longer wanted: the pool's target is 1 replicas"));
}

// A worker about to exit says why (WorkerFailure): its loss carries its error, and the run goes
// on without its replica as after any loss.
TEST_F(RunControllerTest, AWorkerThatFailsIsLostWithItsOwnError) {
  Create(/*steps=*/4, true, false, "/runs/ckpt");
  StartAll();
  v1::WorkerMessage failure;
  failure.mutable_failure()->set_error("step 0 optimizer: CUDA out of memory");
  Send(ids_[0], failure);
  EXPECT_EQ(controller_->state(), v1::RUN_STATE_RUNNING);
  auto changes = SentTo(ids_[1], v1::CoordinatorMessage::kMembershipChange);
  ASSERT_EQ(changes.size(), 1u);
  EXPECT_THAT(changes[0].membership_change().reason(),
              HasSubstr("lost: failed: step 0 optimizer: CUDA out of memory"));
  const v1::StatusResponse status = controller_->Status(kT0);
  const auto failed =
      std::find_if(status.workers().begin(), status.workers().end(),
                   [&](const v1::WorkerStatus& w) { return w.worker_id() == ids_[0]; });
  ASSERT_NE(failed, status.workers().end());
  EXPECT_EQ(failed->dead_reason(), "failed: step 0 optimizer: CUDA out of memory");
  // The worker's session then ends: nothing more is lost.
  actions_ = {};
  controller_->SessionEnded(ids_[0], "closed", kT0, &actions_);
  EXPECT_TRUE(SentTo(ids_[1], v1::CoordinatorMessage::kMembershipChange).empty());
  EXPECT_EQ(controller_->state(), v1::RUN_STATE_RUNNING);
}

// An error every replica would meet in turn (a checkpoint.dir that cannot be written) fails the
// run at once, though the run would survive the loss of the worker's replica, instead of taking
// the replicas out one after another.
TEST_F(RunControllerTest, AFailureEveryReplicaWouldMeetFailsTheRunWithTheWorkersError) {
  Create(/*steps=*/4, true, false, "/runs/ckpt");
  StartAll();
  v1::WorkerMessage failure;
  failure.mutable_failure()->set_error(
      "writing the encoder checkpoint of step 2 into /runs/ckpt: No space left on device");
  failure.mutable_failure()->set_ends_run(true);
  Send(ids_[0], failure);
  EXPECT_EQ(controller_->state(), v1::RUN_STATE_FAILED);
  EXPECT_THAT(controller_->state_message(),
              HasSubstr("failed: writing the encoder checkpoint of step 2 into /runs/ckpt: No "
                        "space left on device; every replica would meet this error in turn"));
  EXPECT_THAT(controller_->state_message(),
              HasSubstr("resume it from its newest checkpoint under /runs/ckpt"));
  EXPECT_TRUE(SentTo(ids_[1], v1::CoordinatorMessage::kMembershipChange).empty());
  for (size_t i : {1, 2, 3}) {
    auto stops = SentTo(ids_[i], v1::CoordinatorMessage::kStop);
    ASSERT_EQ(stops.size(), 1u) << i;
    EXPECT_TRUE(stops[0].stop().run_failed());
    EXPECT_THAT(stops[0].stop().reason(), HasSubstr("No space left on device"));
  }
}

// A step that failed for a cause every attempt would meet (a worker's data index that is not the
// coordinator's) fails the run at once, naming the worker and the step, instead of being planned
// again until max_step_attempts; a failed report without the mark is retried, as before.
TEST_F(RunControllerTest, AStepFailureEveryAttemptWouldMeetFailsTheRunAtOnce) {
  Create(/*steps=*/4, true, false, "/runs/ckpt");
  StartAll();
  const int64_t attempt = controller_->generation();
  v1::WorkerMessage failed;
  failed.mutable_report()->set_step(0);
  failed.mutable_report()->set_generation(attempt);
  failed.mutable_report()->set_ok(false);
  failed.mutable_report()->set_error(
      "data index position 5 (sample 'b', data/train.jsonl:6) has id checksum 0000abcd here");
  failed.mutable_report()->set_ends_run(true);
  actions_ = {};
  Send(ids_[3], failed);
  EXPECT_EQ(controller_->state(), v1::RUN_STATE_FAILED);
  EXPECT_THAT(controller_->state_message(),
              HasSubstr("worker " + ids_[3] +
                        " (llm rank 1 (dp 0, tp 1, cp 0, pp 0), host host) failed "
                        "step 0: data index position 5 (sample 'b', data/train.jsonl:6) has id "
                        "checksum 0000abcd here; every attempt of the step would fail the same "
                        "way, so the run stops"));
  EXPECT_THAT(controller_->state_message(),
              HasSubstr("resume it from its newest checkpoint under /runs/ckpt"));
  for (size_t i : {0, 1, 2, 3}) {
    auto stops = SentTo(ids_[i], v1::CoordinatorMessage::kStop);
    ASSERT_EQ(stops.size(), 1u) << i;
    EXPECT_TRUE(stops[0].stop().run_failed());
    EXPECT_THAT(stops[0].stop().reason(), HasSubstr("data index position 5"));
    EXPECT_TRUE(SentTo(ids_[i], v1::CoordinatorMessage::kStepPlan).empty()) << i;
  }

  // Without the mark, the same report aborts the attempt and the run goes on.
  ids_.clear();
  actions_ = {};
  Create(/*steps=*/4, true, false, "/runs/ckpt");
  StartAll();
  failed.mutable_report()->set_generation(controller_->generation());
  failed.mutable_report()->set_ends_run(false);
  Send(ids_[3], failed);
  EXPECT_EQ(controller_->state(), v1::RUN_STATE_RUNNING);
  EXPECT_GT(controller_->generation(), failed.report().generation());
}

// A worker that fails as the run stops (its last checkpoint: a full disk) cuts nobody off: the
// others finish their outputs, and the run ends as it would, its message naming the failure.
TEST_F(RunControllerTest, AWorkerFailingAsTheRunStopsLetsTheOthersFinishAndIsNamedAtTheEnd) {
  Create(/*steps=*/4, true, false, "/runs/ckpt");
  StartAll();
  controller_->Stop("maintenance", false, kT0, &actions_);
  ASSERT_EQ(controller_->state(), v1::RUN_STATE_STOPPING);
  actions_ = {};
  v1::WorkerMessage failure;
  failure.mutable_failure()->set_error(
      "writing the llm checkpoint of step 4 into /runs/ckpt: No space left on device");
  failure.mutable_failure()->set_ends_run(true);
  Send(ids_[2], failure);
  // Nobody else is stopped or cut off.
  EXPECT_EQ(controller_->state(), v1::RUN_STATE_STOPPING);
  EXPECT_TRUE(actions_.end_sessions.empty());
  for (size_t i : {0, 1, 3}) EXPECT_TRUE(SentTo(ids_[i], v1::CoordinatorMessage::kStop).empty());
  for (size_t i : {0, 1, 2}) controller_->SessionEnded(ids_[i], "closed", kT0, &actions_);
  EXPECT_EQ(controller_->state(), v1::RUN_STATE_STOPPING);  // llm rank 1 still writes its outputs
  controller_->SessionEnded(ids_[3], "closed", kT0, &actions_);
  EXPECT_EQ(controller_->state(), v1::RUN_STATE_DONE);
  EXPECT_THAT(controller_->state_message(),
              HasSubstr("stop requested: maintenance; but worker llm0-3 (llm rank 0 (dp 0, tp 0, "
                        "cp 0, pp 0), host host) failed: writing the llm checkpoint of step 4 "
                        "into /runs/ckpt: No space left on device as the run stopped"));

  // The same when the stop's deadline ends the others' sessions.
  ids_.clear();
  actions_ = {};
  Create(/*steps=*/4, true, false, "/runs/ckpt");
  StartAll();
  controller_->Stop("maintenance", false, kT0, &actions_);
  Send(ids_[2], failure);
  for (auto* w : controller_->membership().LiveWorkers()) {
    w->last_heartbeat = kT0 + absl::Seconds(60);
  }
  controller_->Tick(kT0 + absl::Seconds(60), &actions_);
  EXPECT_EQ(controller_->state(), v1::RUN_STATE_DONE);
  EXPECT_EQ(controller_->cut_at_stop().size(), 3u);
  EXPECT_THAT(controller_->state_message(),
              HasSubstr("; but worker llm0-3 (llm rank 0 (dp 0, tp 0, cp 0, pp 0), host host) "
                        "failed: writing the llm checkpoint of step 4"));
}

// A worker ended with its replica (a peer's loss came first) whose own error every replica
// would meet arrives after: the run still fails with it.
TEST_F(RunControllerTest, AFailureEveryReplicaWouldMeetFromAWorkerAlreadyEndedFailsTheRun) {
  Create(/*steps=*/4, true, false, "/runs/ckpt");
  StartAll();
  controller_->SessionEnded(ids_[0], "connection reset", kT0, &actions_);
  ASSERT_EQ(controller_->state(), v1::RUN_STATE_RUNNING);
  v1::WorkerMessage failure;
  failure.mutable_failure()->set_error("No space left on device");
  Send(ids_[0], failure);  // not every replica's: nothing more
  EXPECT_EQ(controller_->state(), v1::RUN_STATE_RUNNING);
  failure.mutable_failure()->set_ends_run(true);
  Send(ids_[0], failure);
  EXPECT_EQ(controller_->state(), v1::RUN_STATE_FAILED);
  EXPECT_THAT(controller_->state_message(), HasSubstr("No space left on device; every replica"));
}

TEST_F(RunControllerTest, ARunStartsWithItsInitialEncoderReplicas) {
  v1::RunSpec spec = TinySpec(/*steps=*/2);
  spec.mutable_encoder()->set_initial_replicas(1);
  CreateWith(spec);
  StartAll({v1::WORKER_ROLE_ENCODER, v1::WORKER_ROLE_LLM, v1::WORKER_ROLE_LLM});
  EXPECT_EQ(controller_->state(), v1::RUN_STATE_RUNNING);
  auto assignments = SentTo(ids_[1], v1::CoordinatorMessage::kAssignment);
  ASSERT_FALSE(assignments.empty());
  EXPECT_THAT(assignments[0].assignment().encoder_replicas(), ::testing::ElementsAre(0));
  EXPECT_EQ(assignments[0].assignment().peers_size(), 1);  // encoder rank 0 only
  auto plans = SentTo(ids_[0], v1::CoordinatorMessage::kStepPlan);
  ASSERT_EQ(plans.size(), 1u);
  EXPECT_THAT(plans[0].step_plan().encoder_replicas(), ::testing::ElementsAre(0));
  v1::StatusResponse status = controller_->Status(kT0);
  EXPECT_EQ(status.encoder_replicas(), 1);
  EXPECT_EQ(status.encoder_replicas_target(), 1);
  EXPECT_EQ(status.encoder_replicas_open_size(), 0);
  EXPECT_EQ(status.missing_size(), 0);
}

}  // namespace
}  // namespace hetpar::coordinator
