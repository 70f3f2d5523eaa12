#include "coordinator/step_planner.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "common/control/plan_codec.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hetpar::coordinator {
namespace {

using ::testing::HasSubstr;

v1::RunSpec Spec() {
  v1::RunSpec spec;
  spec.mutable_run()->set_name("plan");
  spec.mutable_run()->set_steps(3);
  spec.mutable_run()->set_global_batch(8);
  spec.mutable_run()->set_micro_batch(2);
  spec.mutable_run()->set_seed(5);
  spec.mutable_run()->set_dtype(v1::DTYPE_FLOAT32);
  spec.set_placement(v1::PLACEMENT_NON_COLOCATED);
  auto* em = spec.mutable_encoder()->mutable_model();
  em->set_image_size(32);
  em->set_patch(8);
  em->set_hidden(64);
  em->set_layers(2);
  em->set_heads(4);
  em->set_mlp(128);
  em->set_out_hidden(64);
  em->set_channels(3);
  auto* el = spec.mutable_encoder()->mutable_layout();
  el->set_dp(2);
  el->set_tp(1);
  el->set_cp(1);
  el->set_pp(1);
  auto* lm = spec.mutable_llm()->mutable_model();
  lm->set_hidden(64);
  lm->set_layers(2);
  lm->set_heads(4);
  lm->set_kv_heads(2);
  lm->set_ffn(128);
  lm->set_vocab(256);
  lm->set_seq_len(128);
  auto* ll = spec.mutable_llm()->mutable_layout();
  ll->set_dp(1);
  ll->set_tp(2);
  ll->set_cp(1);
  ll->set_pp(1);
  return spec;
}

Membership FullMembership(const v1::RunSpec& spec) {
  Membership m = *Membership::Create(spec);
  v1::RegisterRequest enc;
  enc.set_role(v1::WORKER_ROLE_ENCODER);
  v1::RegisterRequest llm;
  llm.set_role(v1::WORKER_ROLE_LLM);
  for (int i = 0; i < 2; ++i) EXPECT_TRUE(m.Admit(enc, 1, absl::UnixEpoch()).ok());
  for (int i = 0; i < 2; ++i) EXPECT_TRUE(m.Admit(llm, 1, absl::UnixEpoch()).ok());
  return m;
}

std::set<int64_t> SampleIds(const PlannedStep& step) {
  std::set<int64_t> ids;
  for (const auto& [id, plan] : step.worker_plans) {
    for (const auto& sample : plan.samples()) ids.insert(sample.id());
  }
  return ids;
}

TEST(StepPlannerTest, EachWorkerGetsItsWorldRanksPlan) {
  const v1::RunSpec spec = Spec();
  auto planner = MakeStepPlanner(spec, /*synthetic_batches=*/true);
  ASSERT_TRUE(planner.ok()) << planner.status();
  const Membership membership = FullMembership(spec);
  auto step = (*planner)->Plan(0, 1, membership);
  ASSERT_TRUE(step.ok()) << step.status();
  ASSERT_EQ(step->worker_plans.size(), 4u);
  int64_t loss_tokens = 0;
  std::set<int64_t> microbatch_samples;
  for (const WorkerRecord* w : membership.LiveWorkers()) {
    const v1::RankStepPlan& p = step->worker_plans.at(w->worker_id);
    EXPECT_EQ(p.rank(), w->world_rank);
    EXPECT_EQ(p.step(), 0);
    EXPECT_EQ(p.generation(), 1);
    EXPECT_EQ(p.waves(), 4);  // 8 / (2 x llm dp 1)
    EXPECT_EQ(p.n_global(), step->global_loss_tokens);
    EXPECT_EQ(p.encoder_role(), w->role == v1::WORKER_ROLE_ENCODER);
    EXPECT_EQ(p.llm_role(), w->role == v1::WORKER_ROLE_LLM);
    ASSERT_TRUE(RankStepPlanFromProto(p).ok());
    if (w->world_rank == 2) {  // llm tp 0: sums the loss tokens of its microbatches
      for (const auto& mb : p.microbatches()) {
        loss_tokens += mb.loss_tokens();
        for (int64_t s : mb.samples()) microbatch_samples.insert(s);
      }
    }
  }
  // The LLM replica trains the whole batch; N_global counts its loss tokens.
  EXPECT_EQ(microbatch_samples.size(), 8u);
  EXPECT_EQ(loss_tokens, step->global_loss_tokens);
  EXPECT_EQ(SampleIds(*step), (std::set<int64_t>{0, 1, 2, 3, 4, 5, 6, 7}));
}

TEST(StepPlannerTest, AbortedStepsRetrainTheSameSamplesCommittedOnesMoveOn) {
  const v1::RunSpec spec = Spec();
  auto planner = MakeStepPlanner(spec, true);
  ASSERT_TRUE(planner.ok());
  const Membership membership = FullMembership(spec);
  EXPECT_EQ((*planner)->DataPosition(), "synthetic sample 0");
  auto first = (*planner)->Plan(0, 1, membership);
  auto again = (*planner)->Plan(0, 2, membership);
  ASSERT_TRUE(first.ok() && again.ok());
  EXPECT_EQ(SampleIds(*first), SampleIds(*again));
  EXPECT_EQ(first->global_loss_tokens, again->global_loss_tokens);
  (*planner)->Committed(0);
  EXPECT_EQ((*planner)->DataPosition(), "synthetic sample 8");
  auto next = (*planner)->Plan(1, 2, membership);
  ASSERT_TRUE(next.ok());
  EXPECT_EQ(SampleIds(*next), (std::set<int64_t>{8, 9, 10, 11, 12, 13, 14, 15}));
}

TEST(StepPlannerTest, LedgerCountsAnAbortedStepOnceWhenItCommits) {
  const v1::RunSpec spec = Spec();
  auto planner = MakeStepPlanner(spec, /*synthetic_batches=*/true);
  ASSERT_TRUE(planner.ok()) << planner.status();
  const Membership membership = FullMembership(spec);
  ASSERT_TRUE((*planner)->Plan(0, 1, membership).ok());
  ASSERT_TRUE((*planner)->Plan(0, 2, membership).ok());  // step 0 aborted and planned again
  (*planner)->Committed(0);
  ASSERT_TRUE((*planner)->Plan(1, 2, membership).ok());
  (*planner)->Committed(1);
  const LedgerCounts ledger = (*planner)->Ledger();
  EXPECT_EQ(ledger.trained, 16);  // 2 committed steps x global_batch 8
  EXPECT_EQ(ledger.repeated, 0);
  EXPECT_EQ(ledger.lost, 0);
}

// A run resumed at step 3: its ledger records the skipped steps from `ledger_from_step` on (a
// coordinator restarted on its journal continues one run), none by default (a run of its own).
TEST(StepPlannerTest, ASkippedStepIsInTheLedgerFromTheStepItIsAskedTo) {
  const std::string checkpoint =
      (std::filesystem::temp_directory_path() / ("hetpar_planner_" + std::to_string(::getpid())))
          .string();
  std::filesystem::create_directories(checkpoint);
  std::ofstream(checkpoint + "/manifest.json") << R"({"format": 1, "step": 3, "shards": []})";
  v1::RunSpec spec = Spec();
  spec.mutable_run()->set_steps(5);
  spec.mutable_checkpoint()->set_resume_from(checkpoint);
  const Membership membership = FullMembership(spec);
  // global_batch 8: step s trains synthetic samples [8s, 8s + 8).
  for (const auto& [from_step, trained] :
       std::vector<std::pair<int64_t, int64_t>>{{-1, 8}, {0, 32}, {1, 24}, {3, 8}}) {
    auto planner = MakeStepPlanner(spec, /*synthetic_batches=*/true, nullptr, from_step);
    ASSERT_TRUE(planner.ok()) << planner.status();
    ASSERT_TRUE((*planner)->NeedsPreparation());
    ASSERT_TRUE((*planner)->Prepare().ok());
    EXPECT_EQ((*planner)->DataPosition(), "synthetic sample 24") << from_step;
    auto step = (*planner)->Plan(3, 1, membership);
    ASSERT_TRUE(step.ok()) << step.status();
    EXPECT_EQ(SampleIds(*step), (std::set<int64_t>{24, 25, 26, 27, 28, 29, 30, 31}));
    (*planner)->Committed(3);
    const LedgerCounts ledger = (*planner)->Ledger();
    EXPECT_EQ(ledger.trained, trained) << from_step;
    EXPECT_EQ(ledger.repeated, 0) << from_step;
    EXPECT_EQ(ledger.lost, 0) << from_step;  // the ledger starts at the first step it records
  }
  std::filesystem::remove_all(checkpoint);
}

// The samples of a planned step, in the plan's order of ids.
std::set<int64_t> Expected(const std::vector<int64_t>& order, size_t from, size_t count) {
  return std::set<int64_t>(order.begin() + from, order.begin() + from + count);
}

// A resume over a data index of another size than its checkpoint's manifest records: refused
// mid-epoch (the rest of the epoch would follow another order), and at an epoch boundary the run
// goes on with the next epoch's order over the new index, instead of replaying the checkpoint's
// steps over the new index (which lands mid-epoch elsewhere).
TEST(StepPlannerTest, AResumeOverAnIndexOfAnotherSizeGoesOnOnlyFromAnEpochBoundary) {
  namespace fs = std::filesystem;
  const fs::path dir =
      fs::temp_directory_path() / ("hetpar_planner_data_" + std::to_string(::getpid()));
  fs::create_directories(dir / "ckpt");
  // Two generated data sets: 40 samples, and 24.
  auto over = [&](const std::string& name, int64_t samples) {
    v1::RunSpec spec = Spec();
    spec.mutable_run()->set_steps(10);
    const std::string data = (dir / name).string();
    fs::create_directories(data);
    spec.mutable_data()->set_manifest(data + "/train.jsonl");
    spec.mutable_data()->set_tokenizer(data + "/tokenizer.model");
    spec.mutable_data()->set_index(data + "/train.jsonl.index");
    spec.mutable_data()->set_image_token("<image>");
    spec.mutable_data()->set_chat_template("plain");
    spec.mutable_data()->mutable_synth()->set_samples(samples);
    spec.mutable_data()->mutable_synth()->set_seed(3);
    spec.mutable_checkpoint()->set_resume_from((dir / "ckpt").string());
    return spec;
  };
  auto checkpoint = [&](int64_t step, const std::string& data) {
    std::ofstream(dir / "ckpt" / "manifest.json")
        << R"({"format": 1, "step": )" << step << R"(, "extra": {"samples_trained": )" << step * 8
        << R"(, "data": )" << data << "}}";
  };
  const v1::RunSpec forty = over("forty", 40);
  const v1::RunSpec twenty_four = over("twenty-four", 24);
  const Membership membership = FullMembership(forty);

  // Step 3 of the 40 (24 samples into epoch 0).
  checkpoint(3, R"({"index_samples": 40, "epoch": 0, "offset": 24})");
  {
    auto same = MakeStepPlanner(forty, /*synthetic_batches=*/false);
    ASSERT_TRUE(same.ok()) << same.status();
    ASSERT_TRUE((*same)->Prepare().ok());
    EXPECT_EQ((*same)->DataPosition(), "epoch=0,offset=24");
    auto step = (*same)->Plan(3, 1, membership);
    ASSERT_TRUE(step.ok()) << step.status();
    // The plan says where the data stands once the step commits.
    EXPECT_EQ(step->data_after.index_samples(), 40);
    EXPECT_EQ(step->data_after.epoch(), 0);
    EXPECT_EQ(step->data_after.offset(), 32);
  }
  // The same size over other samples (the 40's ids digest otherwise): refused as well; with the
  // 40's own digest it goes on.
  {
    auto opened = data::BatchSource::Create(forty);
    ASSERT_TRUE(opened.ok()) << opened.status();
    const uint32_t digest = (*opened)->index().IdDigest();
    checkpoint(3, absl::StrCat(R"({"index_samples": 40, "epoch": 0, "offset": 24, )",
                               R"("index_digest": )", digest + 1, "}"));
    auto other = MakeStepPlanner(forty, false);
    ASSERT_TRUE(other.ok()) << other.status();
    const absl::Status refused = (*other)->Prepare();
    EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(std::string(refused.message()),
                HasSubstr("now indexes 40 other samples (their ids differ)"));
    checkpoint(3, absl::StrCat(R"({"index_samples": 40, "epoch": 0, "offset": 24, )",
                               R"("index_digest": )", digest, "}"));
    auto same = MakeStepPlanner(forty, false);
    ASSERT_TRUE(same.ok()) << same.status();
    ASSERT_TRUE((*same)->Prepare().ok());
    auto step = (*same)->Plan(3, 1, membership);
    ASSERT_TRUE(step.ok()) << step.status();
    EXPECT_EQ(step->data_after.index_digest(), digest);
    checkpoint(3, R"({"index_samples": 40, "epoch": 0, "offset": 24})");
  }
  {
    auto changed = MakeStepPlanner(twenty_four, false);
    ASSERT_TRUE(changed.ok()) << changed.status();
    const absl::Status prepared = (*changed)->Prepare();
    EXPECT_EQ(prepared.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(std::string(prepared.message()),
                HasSubstr("stopped 24 samples into epoch 0 of a data index of 40 samples, and "
                          "data.manifest='" +
                          twenty_four.data().manifest() + "' now indexes 24"));
  }

  // Step 5 of the 40: the end of epoch 0. Over the 24, the run goes on with epoch 1's order.
  checkpoint(5, R"({"index_samples": 40, "epoch": 0, "offset": 40})");
  auto planner = MakeStepPlanner(twenty_four, false);
  ASSERT_TRUE(planner.ok()) << planner.status();
  ASSERT_TRUE((*planner)->Prepare().ok());
  EXPECT_EQ((*planner)->DataPosition(), "epoch=1,offset=0");
  auto sampler = data::EpochSampler::Create(24, /*seed=*/5);
  ASSERT_TRUE(sampler.ok()) << sampler.status();
  const std::vector<int64_t> epoch1 = (*sampler)->EpochOrder(1);
  for (int64_t step = 5; step < 8; ++step) {
    auto planned = (*planner)->Plan(step, 1, membership);
    ASSERT_TRUE(planned.ok()) << planned.status();
    EXPECT_EQ(SampleIds(*planned), Expected(epoch1, 8 * (step - 5), 8)) << step;
    EXPECT_EQ(planned->data_after.index_samples(), 24);
    EXPECT_EQ(planned->data_after.epoch(), 1);
    EXPECT_EQ(planned->data_after.offset(), 8 * (step - 4));
    (*planner)->Committed(step);
  }
  // That run's later checkpoint (step 8, at {1, 24} of the 24): its position no longer follows
  // from its steps (64 samples from the start would be {2, 16}); a resume continues from the
  // recorded one, with epoch 2.
  checkpoint(8, R"({"index_samples": 24, "epoch": 1, "offset": 24})");
  auto later = MakeStepPlanner(twenty_four, false);
  ASSERT_TRUE(later.ok()) << later.status();
  ASSERT_TRUE((*later)->Prepare().ok());
  EXPECT_EQ((*later)->DataPosition(), "epoch=1,offset=24");
  auto next = (*later)->Plan(8, 1, membership);
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(SampleIds(*next), Expected((*sampler)->EpochOrder(2), 0, 8));
  // The same at the start of an epoch (offset 0).
  checkpoint(5, R"({"index_samples": 40, "epoch": 1, "offset": 0})");
  auto started = MakeStepPlanner(twenty_four, false);
  ASSERT_TRUE(started.ok()) << started.status();
  ASSERT_TRUE((*started)->Prepare().ok());
  EXPECT_EQ((*started)->DataPosition(), "epoch=1,offset=0");
  fs::remove_all(dir);
}

TEST(StepPlannerTest, BatchThatDoesNotDivideFailsAtCreation) {
  v1::RunSpec spec = Spec();
  spec.mutable_run()->set_global_batch(7);
  auto planner = MakeStepPlanner(spec, true);
  EXPECT_EQ(planner.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(StepPlannerTest, IndexSourceNeedsAManifest) {
  v1::RunSpec spec = Spec();
  auto planner = MakeStepPlanner(spec, /*synthetic_batches=*/false);
  EXPECT_FALSE(planner.ok());
  spec.mutable_data()->set_manifest("/nonexistent/train.jsonl");
  spec.mutable_data()->set_tokenizer("/nonexistent/tokenizer.model");
  spec.mutable_data()->set_index("/nonexistent/train.jsonl.index");
  spec.mutable_data()->set_image_token("<image>");
  auto lazy = MakeStepPlanner(spec, false);
  ASSERT_TRUE(lazy.ok()) << lazy.status();
  // The index is opened by Prepare (the coordinator runs it off its lock before the first step),
  // with a message that says what to do; planning before it is refused.
  EXPECT_TRUE((*lazy)->NeedsPreparation());
  const Membership membership = FullMembership(spec);
  EXPECT_THAT(std::string((*lazy)->Plan(0, 1, membership).status().message()),
              HasSubstr("not opened before planning"));
  const absl::Status prepared = (*lazy)->Prepare();
  EXPECT_EQ(prepared.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(prepared.message()), HasSubstr("hetpar data synth"));
  EXPECT_THAT(std::string(prepared.message()), HasSubstr("/nonexistent/"));
  // Synthetic batches need no preparation.
  auto synthetic = MakeStepPlanner(spec, true);
  ASSERT_TRUE(synthetic.ok()) << synthetic.status();
  EXPECT_FALSE((*synthetic)->NeedsPreparation());
}

// A coordinator shutting down does not wait out another process's generation of the data set (up
// to two hours): CancelPreparation ends Prepare's wait for the data set's lock with Cancelled.
TEST(StepPlannerTest, CancelPreparationEndsTheWaitForAnotherProcessesDataSet) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / absl::StrCat("hetpar_planner_cancel_", ::getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  v1::RunSpec spec = Spec();
  spec.mutable_data()->set_manifest((dir / "train.jsonl").string());
  spec.mutable_data()->set_tokenizer((dir / "tokenizer.model").string());
  spec.mutable_data()->set_index((dir / "train.jsonl.index").string());
  spec.mutable_data()->set_image_token("<image>");
  spec.mutable_data()->mutable_synth()->set_samples(64);
  auto planner = MakeStepPlanner(spec, /*synthetic_batches=*/false);
  ASSERT_TRUE(planner.ok()) << planner.status();
  // This test is the other process: it holds the data set's lock throughout.
  const int fd = ::open((dir / ".hetpar-synth.lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX | LOCK_NB), 0);
  absl::Status prepared = absl::UnknownError("not run");
  absl::Notification done;
  std::thread preparing([&] {
    prepared = (*planner)->Prepare();
    done.Notify();
  });
  (*planner)->CancelPreparation();
  const bool ended = done.WaitForNotificationWithTimeout(absl::Seconds(60));
  ::close(fd);  // if it still waits, it generates the data set now and returns
  preparing.join();
  EXPECT_TRUE(ended) << "Prepare still waited 60 s after CancelPreparation";
  EXPECT_EQ(prepared.code(), absl::StatusCode::kCancelled) << prepared;
  EXPECT_THAT(std::string(prepared.message()),
              HasSubstr("stopped waiting for another process generating the synthetic data set"));
  EXPECT_FALSE(std::filesystem::exists(dir / "train.jsonl"));
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace hetpar::coordinator
