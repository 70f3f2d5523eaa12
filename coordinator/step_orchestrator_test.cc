#include "coordinator/step_orchestrator.h"

#include <cmath>
#include <limits>
#include <map>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hetpar::coordinator {
namespace {

using ::testing::HasSubstr;
using Outcome = StepOrchestrator::Outcome;

const absl::Time kT0 = absl::FromUnixSeconds(1000);

// Encoder dp 2 (ranks e0, e1), LLM dp 1 x tp 2 (ranks l0, l1).
class StepOrchestratorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    v1::RunSpec spec;
    spec.mutable_encoder()->mutable_layout()->set_dp(2);
    spec.mutable_encoder()->mutable_layout()->set_tp(1);
    spec.mutable_llm()->mutable_layout()->set_dp(1);
    spec.mutable_llm()->mutable_layout()->set_tp(2);
    membership_.emplace(*Membership::Create(spec));
    v1::RegisterRequest enc;
    enc.set_role(v1::WORKER_ROLE_ENCODER);
    v1::RegisterRequest llm;
    llm.set_role(v1::WORKER_ROLE_LLM);
    e0_ = *membership_->Admit(enc, 1, kT0);
    e1_ = *membership_->Admit(enc, 1, kT0);
    l0_ = *membership_->Admit(llm, 1, kT0);
    l1_ = *membership_->Admit(llm, 1, kT0);
    orchestrator_.emplace(*membership_,
                          StepOrchestrator::Options{/*grad_clip=*/1.0, absl::Seconds(30), 4});
  }

  void Begin(int64_t step, int64_t global_tokens = 100) {
    PlannedStep plan;
    plan.global_loss_tokens = global_tokens;
    plan.worker_plans[e0_->worker_id].set_rank(e0_->world_rank);
    plan.worker_plans[l1_->worker_id].set_rank(l1_->world_rank);
    plan.data_after.set_index_samples(40);
    plan.data_after.set_epoch(1);
    plan.data_after.set_offset(8 + step);
    out_.clear();
    orchestrator_->Begin(step, 1, plan, {e0_, e1_, l0_, l1_}, kT0, &out_);
  }

  Outcome Partial(const WorkerRecord* w, v1::Module module, double sum_squares, int64_t step = 0) {
    v1::GradNormPartial p;
    p.set_step(step);
    p.set_generation(1);
    p.set_module(module);
    p.set_sum_squares(sum_squares);
    return orchestrator_->OnGradNormPartial(*w, p, kT0 + absl::Seconds(1), &out_);
  }

  Outcome Report(const WorkerRecord* w, bool ok, double loss_sum = 0, int64_t tokens = 0,
                 int64_t step = 0, const std::map<std::string, double>& timings = {}) {
    v1::StepReport r;
    for (const auto& [key, value] : timings) (*r.mutable_timings_s())[key] = value;
    r.set_step(step);
    r.set_generation(1);
    r.set_ok(ok);
    r.set_error(ok ? "" : "out of memory in wave 2");
    r.set_loss_sum(loss_sum);
    r.set_loss_tokens(tokens);
    return orchestrator_->OnReport(*w, r, kT0 + absl::Seconds(2), &out_);
  }

  // The messages of one kind sent since the last clear, by worker id.
  std::vector<std::pair<std::string, v1::CoordinatorMessage>> Sent(
      v1::CoordinatorMessage::KindCase kind) const {
    std::vector<std::pair<std::string, v1::CoordinatorMessage>> result;
    for (const auto& [id, m] : out_) {
      if (m.kind_case() == kind) result.emplace_back(id, m);
    }
    return result;
  }

  std::optional<Membership> membership_;
  WorkerRecord* e0_ = nullptr;
  WorkerRecord* e1_ = nullptr;
  WorkerRecord* l0_ = nullptr;
  WorkerRecord* l1_ = nullptr;
  std::optional<StepOrchestrator> orchestrator_;
  Outbox out_;
};

TEST_F(StepOrchestratorTest, BeginSendsEachWorkerItsPlan) {
  Begin(7);
  ASSERT_EQ(out_.size(), 4u);
  const std::vector<std::string> order = {e0_->worker_id, e1_->worker_id, l0_->worker_id,
                                          l1_->worker_id};
  for (size_t i = 0; i < out_.size(); ++i) {
    EXPECT_EQ(out_[i].first, order[i]);
    const v1::StepPlan& plan = out_[i].second.step_plan();
    EXPECT_EQ(plan.step(), 7);
    EXPECT_EQ(plan.generation(), 1);
    EXPECT_EQ(plan.global_loss_tokens(), 100);
    // dp-0 ranks: encoder rank 0, llm ranks 0 and 1.
    EXPECT_EQ(plan.grad_norm_contributors(), 3);
  }
  EXPECT_TRUE(out_[0].second.step_plan().has_rank_plan());
  EXPECT_EQ(out_[0].second.step_plan().rank_plan().rank(), 0);
  EXPECT_FALSE(out_[1].second.step_plan().has_rank_plan());
  EXPECT_EQ(out_[3].second.step_plan().rank_plan().rank(), 3);  // llm rank 1 = world rank 2 + 1
  EXPECT_TRUE(orchestrator_->in_flight());
}

TEST_F(StepOrchestratorTest, CombinesGradNormThenCommits) {
  Begin(0);
  out_.clear();
  EXPECT_EQ(Partial(e0_, v1::MODULE_ENCODER, 1.0), Outcome::kPending);
  EXPECT_EQ(Partial(l0_, v1::MODULE_LLM, 4.0), Outcome::kPending);
  EXPECT_TRUE(out_.empty());
  EXPECT_EQ(Partial(l1_, v1::MODULE_LLM, 11.0), Outcome::kPending);
  auto norms = Sent(v1::CoordinatorMessage::kGradNorm);
  ASSERT_EQ(norms.size(), 4u);
  for (const auto& [id, m] : norms) {
    EXPECT_DOUBLE_EQ(m.grad_norm().norm(), 4.0);  // sqrt(1 + 4 + 11)
    EXPECT_DOUBLE_EQ(m.grad_norm().clip_coefficient(), 1.0 / (4.0 + 1e-6));
    EXPECT_EQ(m.grad_norm().step(), 0);
  }
  out_.clear();
  EXPECT_EQ(Report(e0_, true), Outcome::kPending);
  EXPECT_EQ(Report(e1_, true), Outcome::kPending);
  // l0 is the loss rank (tp 0, last stage); l1's loss is the same and must not count twice.
  EXPECT_EQ(Report(l1_, true, 999.0, 100), Outcome::kPending);
  EXPECT_EQ(Report(l0_, true, 250.0, 100), Outcome::kCommitted);
  auto commits = Sent(v1::CoordinatorMessage::kCommit);
  ASSERT_EQ(commits.size(), 4u);
  for (const auto& [id, m] : commits) {
    EXPECT_DOUBLE_EQ(m.commit().loss(), 2.5);
    // Where the plan said the data stands after the step, for the checkpoint's manifest.
    EXPECT_EQ(m.commit().data().index_samples(), 40);
    EXPECT_EQ(m.commit().data().epoch(), 1);
    EXPECT_EQ(m.commit().data().offset(), 8);
  }
  EXPECT_FALSE(orchestrator_->in_flight());
  ASSERT_EQ(orchestrator_->recent().size(), 1u);
  const v1::StepTiming& timing = orchestrator_->recent().front();
  EXPECT_TRUE(timing.committed());
  EXPECT_DOUBLE_EQ(timing.duration_s(), 2.0);
  EXPECT_DOUBLE_EQ(timing.loss(), 2.5);
  EXPECT_DOUBLE_EQ(timing.grad_norm(), 4.0);
}

TEST_F(StepOrchestratorTest, CombinesTheModulesTimeSplitsAtCommit) {
  Begin(0);
  Partial(e0_, v1::MODULE_ENCODER, 1.0);
  Partial(l0_, v1::MODULE_LLM, 1.0);
  Partial(l1_, v1::MODULE_LLM, 1.0);
  // The slowest rank's split per module (most compute + bridge wait + collective); bridge
  // traffic added up; peak live jobs the largest.
  Report(e0_, true, 0, 0, 0,
         {{"encoder.compute_s", 0.3},
          {"encoder.bridge_wait_s", 1.0},
          {"encoder.collective_s", 0.1},
          {"encoder.bridge_bytes", 100},
          {"encoder.bridge_messages", 2},
          {"encoder.bridge_transfer_s", 0.01},
          {"encoder.peak_live_jobs", 2},
          {"not_a_module_key", 5}});
  Report(e1_, true, 0, 0, 0,
         {{"encoder.compute_s", 0.5},
          {"encoder.bridge_wait_s", 0.2},
          {"encoder.collective_s", 0.1},
          {"encoder.bridge_bytes", 50},
          {"encoder.bridge_messages", 1},
          {"encoder.bridge_transfer_s", 0.02},
          {"encoder.peak_live_jobs", 3}});
  Report(l1_, true, 0, 0, 0,
         {{"llm.compute_s", 1.2},
          {"llm.bridge_wait_s", 0.1},
          {"llm.collective_s", 0.2},
          {"llm.grad_norm_wait_s", 0.05}});
  ASSERT_EQ(Report(l0_, true, 250.0, 100, 0,
                   {{"llm.compute_s", 1.0}, {"llm.bridge_wait_s", 0.1}, {"llm.collective_s", 0.2}}),
            Outcome::kCommitted);
  const v1::StepTiming& timing = orchestrator_->recent().front();  // 2 s long
  ASSERT_EQ(timing.modules_size(), 2);
  const v1::ModuleStepSplit& enc = timing.modules().at("encoder");
  EXPECT_EQ(enc.ranks(), 2);
  EXPECT_DOUBLE_EQ(enc.compute_s(), 0.3);  // e0: 1.4 s busy against e1's 0.8 s
  EXPECT_DOUBLE_EQ(enc.bridge_wait_s(), 1.0);
  EXPECT_NEAR(enc.idle_s(), 0.6, 1e-12);
  EXPECT_EQ(enc.bridge_bytes(), 150);
  EXPECT_EQ(enc.bridge_messages(), 3);
  EXPECT_NEAR(enc.bridge_transfer_s(), 0.03, 1e-12);
  EXPECT_EQ(enc.peak_live_jobs(), 3);
  const v1::ModuleStepSplit& llm = timing.modules().at("llm");
  EXPECT_EQ(llm.ranks(), 2);
  EXPECT_DOUBLE_EQ(llm.compute_s(), 1.2);
  EXPECT_DOUBLE_EQ(llm.grad_norm_wait_s(), 0.05);
  EXPECT_NEAR(llm.idle_s(), 0.5, 1e-12);
  // An aborted step carries no split, and the next step starts from nothing.
  Begin(1);
  Report(e0_, true, 0, 0, 1, {{"encoder.compute_s", 9.0}});
  Report(e1_, false, 0, 0, 1);
  EXPECT_EQ(orchestrator_->recent().front().modules_size(), 0);
}

TEST_F(StepOrchestratorTest, NoClippingWhenGradClipIsOff) {
  orchestrator_.emplace(*membership_, StepOrchestrator::Options{0.0, absl::Seconds(30), 4});
  Begin(0);
  Partial(e0_, v1::MODULE_ENCODER, 100.0);
  Partial(l0_, v1::MODULE_LLM, 0.0);
  Partial(l1_, v1::MODULE_LLM, 0.0);
  auto norms = Sent(v1::CoordinatorMessage::kGradNorm);
  ASSERT_FALSE(norms.empty());
  EXPECT_DOUBLE_EQ(norms[0].second.grad_norm().norm(), 10.0);
  EXPECT_DOUBLE_EQ(norms[0].second.grad_norm().clip_coefficient(), 1.0);
}

TEST_F(StepOrchestratorTest, FailureReportAbortsEverywhere) {
  Begin(3);
  out_.clear();
  EXPECT_EQ(Report(e1_, false, 0, 0, 3), Outcome::kAborted);
  auto aborts = Sent(v1::CoordinatorMessage::kAbort);
  ASSERT_EQ(aborts.size(), 4u);
  EXPECT_EQ(aborts[0].second.abort().step(), 3);
  EXPECT_THAT(aborts[0].second.abort().reason(), HasSubstr("out of memory in wave 2"));
  EXPECT_THAT(aborts[0].second.abort().reason(), HasSubstr(e1_->worker_id));
  EXPECT_FALSE(orchestrator_->in_flight());
  EXPECT_FALSE(orchestrator_->recent().front().committed());
  // Late messages of the aborted step are ignored.
  out_.clear();
  EXPECT_EQ(Report(e0_, true, 0, 0, 3), Outcome::kPending);
  EXPECT_TRUE(out_.empty());
}

TEST_F(StepOrchestratorTest, EveryAttemptOfAStepHasItsOwnAttemptIdInTheRankPlans) {
  Begin(3);
  const auto first = Sent(v1::CoordinatorMessage::kStepPlan);
  ASSERT_EQ(first.size(), 4u);
  const int64_t attempt = first[0].second.step_plan().rank_plan().attempt();
  EXPECT_GT(attempt, 0);
  EXPECT_EQ(first[3].second.step_plan().rank_plan().attempt(), attempt);
  out_.clear();
  EXPECT_EQ(Report(e1_, false, 0, 0, 3), Outcome::kAborted);
  // The same step, the same generation, planned again: a new attempt.
  out_.clear();
  Begin(3);
  const auto retry = Sent(v1::CoordinatorMessage::kStepPlan);
  ASSERT_EQ(retry.size(), 4u);
  EXPECT_EQ(retry[0].second.step_plan().step(), 3);
  EXPECT_EQ(retry[0].second.step_plan().generation(), first[0].second.step_plan().generation());
  EXPECT_EQ(retry[0].second.step_plan().rank_plan().attempt(), attempt + 1);
  EXPECT_EQ(retry[3].second.step_plan().rank_plan().attempt(), attempt + 1);
}

TEST_F(StepOrchestratorTest, LostWorkerAbortsAndIsNotMessaged) {
  Begin(0);
  out_.clear();
  membership_->MarkDead(l1_->worker_id, "no heartbeat for 10s");
  EXPECT_EQ(orchestrator_->OnWorkerLost(*l1_, kT0, &out_), Outcome::kAborted);
  auto aborts = Sent(v1::CoordinatorMessage::kAbort);
  ASSERT_EQ(aborts.size(), 3u);
  for (const auto& [id, m] : aborts) EXPECT_NE(id, l1_->worker_id);
  EXPECT_THAT(aborts[0].second.abort().reason(), HasSubstr("no heartbeat for 10s"));
}

TEST_F(StepOrchestratorTest, MalformedPartialsAbort) {
  Begin(0);
  EXPECT_EQ(Partial(e1_, v1::MODULE_ENCODER, 1.0), Outcome::kAborted);  // dp replica 1
  EXPECT_THAT(orchestrator_->last_abort_reason(), HasSubstr("dp replica 1"));
  Begin(0);
  EXPECT_EQ(Partial(e0_, v1::MODULE_LLM, 1.0), Outcome::kAborted);  // no llm rank
  Begin(0);
  EXPECT_EQ(Partial(l0_, v1::MODULE_LLM, 1.0), Outcome::kPending);
  EXPECT_EQ(Partial(l0_, v1::MODULE_LLM, 1.0), Outcome::kAborted);  // twice
  EXPECT_THAT(orchestrator_->last_abort_reason(), HasSubstr("second grad-norm partial"));
  Begin(0);
  EXPECT_EQ(Partial(l0_, v1::MODULE_LLM, -1.0), Outcome::kAborted);
  EXPECT_THAT(orchestrator_->last_abort_reason(), HasSubstr("expected a sum of squares >= 0"));
}

// A diverged step is not retried (its NaN would come back): every worker is told to skip it,
// and it commits without an update, recorded as skipped.
TEST_F(StepOrchestratorTest, ANonFiniteNormSkipsTheStepInsteadOfAbortingIt) {
  Begin(0);
  out_.clear();
  EXPECT_EQ(Partial(e0_, v1::MODULE_ENCODER, 1.0), Outcome::kPending);
  EXPECT_EQ(Partial(l0_, v1::MODULE_LLM, std::nan("")), Outcome::kPending);
  EXPECT_EQ(Partial(l1_, v1::MODULE_LLM, 4.0), Outcome::kPending);
  auto norms = Sent(v1::CoordinatorMessage::kGradNorm);
  ASSERT_EQ(norms.size(), 4u);
  for (const auto& [id, m] : norms) {
    EXPECT_TRUE(m.grad_norm().skip());
    EXPECT_TRUE(std::isnan(m.grad_norm().norm()));
    EXPECT_EQ(m.grad_norm().clip_coefficient(), 1.0);
  }
  EXPECT_EQ(Report(e0_, true), Outcome::kPending);
  EXPECT_EQ(Report(e1_, true), Outcome::kPending);
  EXPECT_EQ(Report(l1_, true, 1.0, 100), Outcome::kPending);
  EXPECT_EQ(Report(l0_, true, 1.0, 100), Outcome::kCommitted);
  EXPECT_TRUE(orchestrator_->recent().front().committed());
  EXPECT_TRUE(orchestrator_->recent().front().skipped());
  EXPECT_EQ(orchestrator_->skipped_steps(), 1);
  // The next step is an ordinary one again.
  Begin(1);
  out_.clear();
  EXPECT_EQ(Partial(e0_, v1::MODULE_ENCODER, 1.0, 1), Outcome::kPending);
  EXPECT_EQ(Partial(l0_, v1::MODULE_LLM, 1.0, 1), Outcome::kPending);
  EXPECT_EQ(Partial(l1_, v1::MODULE_LLM, std::numeric_limits<double>::infinity(), 1),
            Outcome::kPending);
  EXPECT_TRUE(Sent(v1::CoordinatorMessage::kGradNorm).front().second.grad_norm().skip());
  Begin(2);
  out_.clear();
  for (auto* w : {e0_, l0_, l1_}) {
    Partial(w, w == e0_ ? v1::MODULE_ENCODER : v1::MODULE_LLM, 1.0, 2);
  }
  EXPECT_FALSE(Sent(v1::CoordinatorMessage::kGradNorm).front().second.grad_norm().skip());
}

TEST_F(StepOrchestratorTest, LossTokensMustMatchThePlan) {
  Begin(0, /*global_tokens=*/100);
  Partial(e0_, v1::MODULE_ENCODER, 1);
  Partial(l0_, v1::MODULE_LLM, 1);
  Partial(l1_, v1::MODULE_LLM, 1);
  Report(e0_, true);
  Report(e1_, true);
  Report(l1_, true, 10, 100);
  EXPECT_EQ(Report(l0_, true, 10, 99), Outcome::kAborted);
  EXPECT_THAT(orchestrator_->last_abort_reason(), HasSubstr("counted 99 loss tokens"));
}

TEST_F(StepOrchestratorTest, ReportsWithoutGradNormAbort) {
  Begin(0);
  Report(e0_, true);
  Report(e1_, true);
  Report(l0_, true);
  EXPECT_EQ(Report(l1_, true), Outcome::kAborted);
  EXPECT_THAT(orchestrator_->last_abort_reason(), HasSubstr("only 0 of 3 grad-norm partials"));
}

TEST_F(StepOrchestratorTest, DeadlineAbortsNamingTheSilentWorkers) {
  Begin(0);
  Report(e0_, true);
  out_.clear();
  EXPECT_EQ(orchestrator_->CheckDeadline(kT0 + absl::Seconds(29), &out_), Outcome::kPending);
  EXPECT_EQ(orchestrator_->CheckDeadline(kT0 + absl::Seconds(30), &out_), Outcome::kAborted);
  EXPECT_THAT(orchestrator_->last_abort_reason(), HasSubstr("no report from 3 worker(s)"));
  EXPECT_THAT(orchestrator_->last_abort_reason(), HasSubstr(l1_->worker_id));
  EXPECT_EQ(Sent(v1::CoordinatorMessage::kAbort).size(), 4u);
}

TEST_F(StepOrchestratorTest, RecentKeepsTheLastSteps) {
  for (int step = 0; step < 6; ++step) {
    Begin(step);
    orchestrator_->Abort("stop", kT0, &out_);
  }
  ASSERT_EQ(orchestrator_->recent().size(), 4u);
  EXPECT_EQ(orchestrator_->recent().front().step(), 5);
  EXPECT_EQ(orchestrator_->recent().back().step(), 2);
}

}  // namespace
}  // namespace hetpar::coordinator
