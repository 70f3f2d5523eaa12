// One training step of a non-colocated layout, ranks as threads: encoder ranks encode their
// jobs and send blocks over the in-process transport, LLM ranks receive, train and send the
// gradients back, both modules sum over DP. Every rank's parameter gradient must equal the
// matching slice of the single-process reference gradient (float64, relative 1e-10), for DP
// ratios that divide and that do not, TP on either side, and batches mixing 0 to 3 images.
#include <ATen/ATen.h>
#include <unistd.h>

#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/config/config.h"
#include "common/data/batch_source.h"
#include "common/nn/communicator.h"
#include "common/plan/layout.h"
#include "common/plan/step_plan.h"
#include "common/train/boundary.h"
#include "common/transport/faulty_transport.h"
#include "common/transport/inproc/inproc_transport.h"
#include "common/transport/ucx/ucx_transport.h"
#include "encoder_service/encoder_runtime.h"
#include "gtest/gtest.h"
#include "llm_trainer/llm_runtime.h"
#include "llm_trainer/reference/reference_trainer.h"

namespace hetpar {
namespace {

namespace fs = std::filesystem;

struct Case {
  std::string name;
  int64_t enc_dp, enc_tp, llm_dp, llm_tp;
  bool sequence_parallel = false;
  bool colocated = false;  // both modules on the same ranks, three-phase schedule
};

std::string DataDir() {
  static const std::string dir =
      (fs::temp_directory_path() / ("hetpar_boundary_step_" + std::to_string(::getpid()))).string();
  return dir;
}

hetpar::v1::RunSpec MakeSpec(const Case& c) {
  const std::string yaml =
      absl::StrCat(R"(
run: {name: t, steps: 1, global_batch: 12, micro_batch: )",
                   12 % (c.llm_dp * 3) == 0 ? 12 / (c.llm_dp * 3) : 1,
                   R"(, dtype: float64, seed: 5}
placement: )",
                   c.colocated ? "colocated" : "non_colocated", R"(
encoder:
  model: {image_size: 16, patch: 8, hidden: 16, layers: 1, heads: 2, mlp: 32, out_hidden: 32}
  layout: {dp: )",
                   c.enc_dp, ", tp: ", c.enc_tp, R"(}
llm:
  model: {hidden: 32, layers: 1, heads: 4, kv_heads: )",
                   c.llm_tp == 4 ? 4 : 2, R"(, ffn: 64, vocab: 256, seq_len: 128}
  layout: {dp: )",
                   c.llm_dp, ", tp: ", c.llm_tp,
                   ", sequence_parallel: ", c.sequence_parallel ? "true" : "false", R"(}
data:
  manifest: )",
                   DataDir(), R"(/train.jsonl
  val_manifest: )",
                   DataDir(), R"(/val.jsonl
  tokenizer: )",
                   DataDir(), R"(/tokenizer.model
  synth: {samples: 48, val_samples: 4, seed: 3}
)");
  auto loaded = config::LoadRunSpecFromString(yaml, "boundary_step_test.yaml", {});
  EXPECT_TRUE(loaded.ok()) << loaded.status();
  return loaded->spec;
}

// The largest relative difference of `local` against its slice of `full`.
double SliceError(const nn::NamedParameter& p, const at::Tensor& full) {
  at::Tensor expected =
      p.slice.split_dim < 0 ? full : full.narrow(p.slice.split_dim, p.slice.offset, p.slice.length);
  at::Tensor got = p.tensor.grad().defined() ? p.tensor.grad() : at::zeros_like(p.tensor);
  const double scale = std::max(expected.abs().max().item<double>(), 1e-30);
  return (got - expected).abs().max().item<double>() / scale;
}

class BoundaryStepTest : public ::testing::TestWithParam<Case> {};

TEST_P(BoundaryStepTest, GradientsMatchTheReference) {
  const Case c = GetParam();
  const hetpar::v1::RunSpec spec = MakeSpec(c);
  auto batches = data::BatchSource::Create(spec);
  ASSERT_TRUE(batches.ok()) << batches.status();
  auto placement = plan::PlacementFromRunSpec(spec);
  ASSERT_TRUE(placement.ok()) << placement.status();
  auto batch = (*batches)->Take({}, spec.run().global_batch());
  ASSERT_TRUE(batch.ok()) << batch.status();
  int images_per_count[4] = {0, 0, 0, 0};
  for (const auto& s : batch->samples) ++images_per_count[std::min<int64_t>(3, s.image_count())];
  auto options = plan::StepPlanOptionsFromRunSpec(spec, 0, 0);
  ASSERT_TRUE(options.ok());
  auto step_plan = plan::BuildStepPlan(*placement, batch->samples, *options);
  ASSERT_TRUE(step_plan.ok()) << step_plan.status();

  // The reference gradients (tp = 1, one process).
  auto single = nn::Communicator::CreateSingle();
  auto enc_options = encoder::EncoderOptionsFromSpec(spec);
  auto llm_options = llm::LlmOptionsFromSpec(spec);
  ASSERT_TRUE(enc_options.ok() && llm_options.ok());
  enc_options->sequence_parallel = false;
  llm_options->sequence_parallel = false;
  auto ref_enc = encoder::VisionEncoder::Create(spec.encoder().model(), *enc_options, *single);
  auto ref_llm = llm::LanguageModel::Create(spec.llm().model(), *llm_options, *single);
  ASSERT_TRUE(ref_enc.ok() && ref_llm.ok());
  auto ref = llm::RunReferenceStep(**batches, *step_plan, **ref_enc, **ref_llm);
  ASSERT_TRUE(ref.ok()) << ref.status();
  std::map<std::string, at::Tensor> ref_grads;
  for (const auto& p : (*ref_enc)->parameters().parameters()) ref_grads[p.name] = p.tensor.grad();
  for (const auto& p : (*ref_llm)->parameters().parameters()) ref_grads[p.name] = p.tensor.grad();

  // The distributed step, one thread per world rank.
  const plan::Placement& pl = *placement;
  const int64_t world = pl.world_size;
  auto store = nn::OpenHashStore();
  std::vector<std::unique_ptr<transport::Transport>> transports(world);
  for (int64_t r = 0; r < world; ++r) {
    auto t = transport::inproc::InprocTransport::Create({absl::StrCat("rank ", r)});
    ASSERT_TRUE(t.ok()) << t.status();
    transports[r] = std::move(t).value();
  }
  std::mutex mu;
  std::vector<std::string> failures;
  double worst_error = 0;
  double llm_loss = 0;
  std::vector<std::thread> threads;
  for (int64_t r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      auto fail = [&](const std::string& what) {
        std::lock_guard<std::mutex> lock(mu);
        failures.push_back(absl::StrCat("rank ", r, ": ", what));
      };
      auto rank_plan = plan::ExtractRankPlan(*step_plan, r);
      if (!rank_plan.ok()) return fail(std::string(rank_plan.status().message()));
      // One module's TP and DP groups for this rank.
      auto groups = [&](const std::string& module, const plan::Layout& layout,
                        const plan::RankCoords& coords, std::unique_ptr<nn::Communicator>* tp,
                        std::unique_ptr<nn::Communicator>* dp) -> bool {
        for (int which = 0; which < 2; ++which) {
          nn::CommunicatorOptions o;
          o.prefix = which == 0 ? absl::StrCat(module, "/dp", coords.dp, "/tp")
                                : absl::StrCat(module, "/tp", coords.tp, "/dp");
          o.rank = static_cast<int>(which == 0 ? coords.tp : coords.dp);
          o.size = static_cast<int>(which == 0 ? layout.tp : layout.dp);
          auto group = o.size > 1 ? nn::Communicator::Create(store, o)
                                  : absl::StatusOr<std::unique_ptr<nn::Communicator>>(
                                        nn::Communicator::CreateSingle());
          if (!group.ok()) return false;
          *(which == 0 ? tp : dp) = std::move(group).value();
        }
        return true;
      };
      // Connect to every rank on the other side of the boundary (every other rank, colocated).
      std::map<int64_t, transport::PeerId> peers;
      for (int64_t other = 0; other < world; ++other) {
        const bool same_side =
            !c.colocated && (other < pl.encoder.end_rank()) == rank_plan->encoder_role;
        if (other == r || same_side) continue;
        auto peer = transports[r]->Connect(transports[other]->LocalAddress(),
                                           absl::Now() + absl::Seconds(30));
        if (!peer.ok()) return fail(std::string(peer.status().message()));
        peers[other] = *peer;
      }
      train::BoundaryCommunicator boundary(transports[r].get(), peers, absl::Seconds(60));
      std::unique_ptr<nn::Communicator> enc_tp, enc_dp, llm_tp, llm_dp;
      std::unique_ptr<encoder::VisionEncoder> enc;
      std::unique_ptr<llm::LanguageModel> lm;
      if (rank_plan->encoder_role) {
        if (!groups("enc", pl.encoder, rank_plan->encoder_coords, &enc_tp, &enc_dp)) {
          return fail("encoder process groups");
        }
        auto model = encoder::VisionEncoder::Create(spec.encoder().model(), *enc_options, *enc_tp);
        if (!model.ok()) return fail(std::string(model.status().message()));
        enc = std::move(model).value();
      }
      if (rank_plan->llm_role) {
        if (!groups("llm", pl.llm, rank_plan->llm_coords, &llm_tp, &llm_dp)) {
          return fail("LLM process groups");
        }
        auto options = *llm_options;
        options.sequence_parallel = c.sequence_parallel;
        auto model = llm::LanguageModel::Create(spec.llm().model(), options, *llm_tp);
        if (!model.ok()) return fail(std::string(model.status().message()));
        lm = std::move(model).value();
      }
      std::optional<llm::LlmRuntime> llm_runtime;
      if (lm) {
        llm_runtime.emplace(lm.get(), llm_tp.get(), llm_dp.get(), batches->get(), &boundary,
                            llm::LlmRuntimeOptions{absl::Seconds(60), c.colocated,
                                                   c.colocated ? 0 : spec.run().max_inflight()});
      }
      double loss = 0;
      auto run_llm = [&]() -> absl::Status {
        auto stats = llm_runtime->RunStep(*rank_plan);
        if (!stats.ok()) return stats.status();
        loss = stats->loss.defined() ? stats->loss.item<double>() : 0.0;
        return absl::OkStatus();
      };
      absl::Status status;
      if (enc) {
        encoder::EncoderRuntime runtime(enc.get(), enc_tp.get(), enc_dp.get(), batches->get(),
                                        &boundary, {spec.run().max_inflight(), absl::Seconds(60)});
        auto stats =
            c.colocated ? runtime.RunStepAround(*rank_plan, run_llm) : runtime.RunStep(*rank_plan);
        status = stats.status();
      } else {
        status = run_llm();
      }
      if (status.ok() && c.colocated) status = llm_runtime->WaitForSends();
      if (!status.ok()) return fail(std::string(status.message()));
      // The bridge's transfer records: one per message that crossed the transport to this rank
      // (same-rank handovers excluded), with its exact size, and a union no longer than the sum.
      for (const auto& [direction, receives] :
           {std::pair{plan::Direction::kForward, &rank_plan->forward_receives},
            std::pair{plan::Direction::kBackward, &rank_plan->backward_receives}}) {
        int64_t messages = 0, payload = 0;
        for (const plan::Transfer& t : *receives) {
          if (t.src_rank == r) continue;
          ++messages;
          payload += t.rows * rank_plan->row_bytes;
        }
        const train::BridgeStats bridge = boundary.Stats(direction);
        const std::string name(plan::DirectionName(direction));
        if (bridge.messages != messages) {
          fail(absl::StrCat(name, " bridge messages ", bridge.messages, ", plan ", messages));
        }
        if (messages > 0 ? bridge.bytes <= payload : bridge.bytes != 0) {
          fail(absl::StrCat(name, " bridge bytes ", bridge.bytes, " for ", payload,
                            " payload bytes in ", messages, " messages"));
        }
        if (bridge.transfer_s < 0 || bridge.transfer_s > bridge.sum_transfer_s + 1e-9 ||
            (messages > 0 && bridge.sum_transfer_s <= 0)) {
          fail(absl::StrCat(name, " bridge transfer ", bridge.transfer_s, " s, sum ",
                            bridge.sum_transfer_s, " s"));
        }
      }
      if (lm && rank_plan->llm_coords.tp == 0) {
        std::lock_guard<std::mutex> lock(mu);
        llm_loss += loss;
      }
      std::vector<const nn::ParameterSet*> sets;
      if (enc) sets.push_back(&enc->parameters());
      if (lm) sets.push_back(&lm->parameters());
      for (const nn::ParameterSet* params : sets) {
        for (const auto& p : params->parameters()) {
          const double error = SliceError(p, ref_grads.at(p.name));
          std::lock_guard<std::mutex> lock(mu);
          worst_error = std::max(worst_error, error);
          if (error > 1e-10)
            failures.push_back(absl::StrCat("rank ", r, " ", p.name, " error ", error));
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_TRUE(failures.empty()) << absl::StrJoin(failures, "\n");
  EXPECT_NEAR(llm_loss, ref->loss, 1e-12 * std::abs(ref->loss));
  EXPECT_GT(images_per_count[0] + images_per_count[1], 0);
  RecordProperty("worst_relative_gradient_error", std::to_string(worst_error));
  std::printf("%s: worst relative gradient error %.3e over %lld ranks\n", c.name.c_str(),
              worst_error, static_cast<long long>(world));
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, BoundaryStepTest,
    ::testing::Values(Case{"enc_dp2_tp1_to_llm_dp1_tp2", 2, 1, 1, 2},
                      Case{"enc_dp3_tp1_to_llm_dp2_tp1", 3, 1, 2, 1},
                      Case{"enc_dp1_tp2_to_llm_dp2_tp2", 1, 2, 2, 2},
                      Case{"enc_dp2_tp1_to_llm_dp1_tp2_sp", 2, 1, 1, 2, true},
                      Case{"colocated_enc_dp4_tp1_llm_dp1_tp4", 4, 1, 1, 4, false, true},
                      Case{"colocated_enc_dp2_tp2_llm_dp4_tp1", 2, 2, 4, 1, false, true},
                      Case{"colocated_enc_dp3_llm_dp3_uneven", 3, 1, 3, 1, false, true}),
    [](const auto& info) { return info.param.name; });

// One step of the dp 1 -> dp 1 layout: encoder rank 0's plan and LLM rank 1's, the encoder's
// first job with image rows, and rows for it (1000 * job row + column).
struct OneToOnePlans {
  hetpar::v1::RunSpec spec;
  std::optional<plan::RankStepPlan> enc_plan, llm_plan;
  const plan::EncoderJob* job = nullptr;  // in enc_plan
  at::Tensor job_rows;

  // The LLM's row buffer of the job's wave once its forward message is placed: job_rows' pieces
  // at their dst_offset, `fill` elsewhere.
  at::Tensor ForwardRows(double fill) const {
    const int64_t wave = job->wave;
    at::Tensor rows = at::full({llm_plan->image_rows[wave], spec.llm().model().hidden()}, fill,
                               at::kDouble);
    for (const plan::Transfer& t : llm_plan->forward_receives) {
      if (t.wave != wave) continue;
      for (const plan::BlockPiece& piece : t.pieces) {
        rows.narrow(0, piece.dst_offset, piece.rows)
            .copy_(job_rows.narrow(0, piece.src_offset, piece.rows));
      }
    }
    return rows;
  }
};

// The plan of step 0 of `spec` over its data set.
void PlanFirstStep(const hetpar::v1::RunSpec& spec, std::optional<plan::StepPlan>* out) {
  auto batches = data::BatchSource::Create(spec);
  ASSERT_TRUE(batches.ok()) << batches.status();
  auto placement = plan::PlacementFromRunSpec(spec);
  ASSERT_TRUE(placement.ok()) << placement.status();
  auto batch = (*batches)->Take({}, spec.run().global_batch());
  ASSERT_TRUE(batch.ok()) << batch.status();
  auto options = plan::StepPlanOptionsFromRunSpec(spec, 0, 0);
  ASSERT_TRUE(options.ok());
  auto step_plan = plan::BuildStepPlan(*placement, batch->samples, *options);
  ASSERT_TRUE(step_plan.ok()) << step_plan.status();
  *out = *std::move(step_plan);
}

void MakeOneToOnePlans(OneToOnePlans* out) {
  const Case c{"enc_dp1_to_llm_dp1", 1, 1, 1, 1};
  out->spec = MakeSpec(c);
  const hetpar::v1::RunSpec& spec = out->spec;
  std::optional<plan::StepPlan> step_plan;
  ASSERT_NO_FATAL_FAILURE(PlanFirstStep(spec, &step_plan));
  auto enc_plan = plan::ExtractRankPlan(*step_plan, 0);
  auto llm_plan = plan::ExtractRankPlan(*step_plan, 1);
  ASSERT_TRUE(enc_plan.ok() && llm_plan.ok());
  out->enc_plan = *std::move(enc_plan);
  out->llm_plan = *std::move(llm_plan);
  for (const auto& j : out->enc_plan->encoder_jobs) {
    if (j.rows > 0) {
      out->job = &j;
      break;
    }
  }
  ASSERT_NE(out->job, nullptr);
  const int64_t hidden = spec.llm().model().hidden();
  out->job_rows = (at::arange(out->job->rows, at::kDouble).unsqueeze(1) * 1000 +
                   at::arange(hidden, at::kDouble).unsqueeze(0))
                      .contiguous();
}

// A forward message lands straight in the LLM's row buffer; its header is still checked on
// arrival: a message of another generation fails the receive naming both, and a matching one
// leaves exactly the sent rows at their places.
TEST(BoundaryReceiveTest, StraightReceivesCheckTheHeaderAndPlaceTheRows) {
  OneToOnePlans plans;
  ASSERT_NO_FATAL_FAILURE(MakeOneToOnePlans(&plans));
  const hetpar::v1::RunSpec& spec = plans.spec;
  const std::optional<plan::RankStepPlan>& enc_plan = plans.enc_plan;
  const std::optional<plan::RankStepPlan>& llm_plan = plans.llm_plan;
  ASSERT_TRUE(enc_plan->encoder_role && llm_plan->llm_role);

  auto enc_t = transport::inproc::InprocTransport::Create({"enc"});
  auto llm_t = transport::inproc::InprocTransport::Create({"llm"});
  ASSERT_TRUE(enc_t.ok() && llm_t.ok());
  auto to_llm = (*enc_t)->Connect((*llm_t)->LocalAddress(), absl::Now() + absl::Seconds(10));
  auto to_enc = (*llm_t)->Connect((*enc_t)->LocalAddress(), absl::Now() + absl::Seconds(10));
  ASSERT_TRUE(to_llm.ok() && to_enc.ok());
  train::BoundaryCommunicator enc(enc_t->get(), {{1, *to_llm}}, absl::Seconds(10));
  train::BoundaryCommunicator llm(llm_t->get(), {{0, *to_enc}}, absl::Seconds(10));

  // The first wave with images.
  const int64_t wave = plans.job->wave;
  const int64_t hidden = spec.llm().model().hidden();
  const at::Tensor& job_rows = plans.job_rows;
  const int64_t buffer_rows = llm_plan->image_rows[wave];

  // Another generation: rejected, naming the field.
  plan::RankStepPlan stale = *enc_plan;
  stale.generation = 7;
  at::Tensor buffer = at::full({buffer_rows, hidden}, -1.0, at::kDouble);
  ASSERT_TRUE(llm.PostForwardReceives(*llm_plan, wave, buffer).ok());
  auto sent = enc.SendForward(stale, wave, job_rows);
  ASSERT_TRUE(sent.ok()) << sent.status();
  absl::Status status = llm.ReceiveForward(*llm_plan, wave, buffer);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  EXPECT_NE(std::string(status.message()).find("generation"), std::string::npos) << status;
  ASSERT_TRUE(sent->Wait(absl::Now() + absl::Seconds(10)).ok());

  // The matching message: every piece's rows at its dst_offset, nothing else written.
  llm.BeginStep();
  at::Tensor fresh = at::full({buffer_rows, hidden}, -1.0, at::kDouble);
  ASSERT_TRUE(llm.PostForwardReceives(*llm_plan, wave, fresh).ok());
  auto sent2 = enc.SendForward(*enc_plan, wave, job_rows);
  ASSERT_TRUE(sent2.ok()) << sent2.status();
  ASSERT_TRUE(llm.ReceiveForward(*llm_plan, wave, fresh).ok());
  const at::Tensor expected = plans.ForwardRows(-1.0);
  EXPECT_TRUE(at::equal(fresh, expected));
  EXPECT_EQ(llm.Stats(plan::Direction::kForward).messages, 1);
  ASSERT_TRUE(sent2->Wait(absl::Now() + absl::Seconds(10)).ok());

  // A receive must use the buffer its wave was posted into.
  llm.BeginStep();
  ASSERT_TRUE(llm.PostForwardReceives(*llm_plan, wave, fresh).ok());
  at::Tensor other = at::zeros_like(fresh);
  EXPECT_EQ(llm.ReceiveForward(*llm_plan, wave, other).code(), absl::StatusCode::kInvalidArgument);

  // A step attempt the coordinator aborts after the encoder sent its rows, then the retry of the
  // same step and generation: the late message of the aborted attempt is already at the LLM rank
  // when the retry posts its receive, and must not be taken for the retry's.
  llm.BeginStep();
  enc.BeginStep();
  plan::RankStepPlan aborted_enc = *enc_plan;
  aborted_enc.attempt = 1;
  plan::RankStepPlan retry_enc = *enc_plan;
  retry_enc.attempt = 2;
  plan::RankStepPlan retry_llm = *llm_plan;
  retry_llm.attempt = 2;
  auto late = enc.SendForward(aborted_enc, wave, at::full_like(job_rows, 5.0));
  ASSERT_TRUE(late.ok()) << late.status();
  at::Tensor retried = at::full({buffer_rows, hidden}, -1.0, at::kDouble);
  ASSERT_TRUE(llm.PostForwardReceives(retry_llm, wave, retried).ok());
  auto sent3 = enc.SendForward(retry_enc, wave, job_rows);
  ASSERT_TRUE(sent3.ok()) << sent3.status();
  ASSERT_TRUE(llm.ReceiveForward(retry_llm, wave, retried).ok());
  EXPECT_TRUE(at::equal(retried, expected));
  ASSERT_TRUE(sent3->Wait(absl::Now() + absl::Seconds(10)).ok());

  // An attempt that never ran on the LLM rank (its groups could not be formed) while the encoder
  // ran it: the encoder's send stays pending (this transport is rendezvous at every size) until
  // AbandonUnrun posts the attempt's receives, which absorb it.
  enc.BeginStep();
  plan::RankStepPlan unrun_enc = *enc_plan;
  unrun_enc.attempt = 3;
  plan::RankStepPlan unrun_llm = *llm_plan;
  unrun_llm.attempt = 3;
  auto orphan = enc.SendForward(unrun_enc, wave, job_rows);
  ASSERT_TRUE(orphan.ok()) << orphan.status();
  EXPECT_EQ(orphan->Wait(absl::Now() + absl::Milliseconds(100)).code(),
            absl::StatusCode::kDeadlineExceeded);
  llm.AbandonUnrun(unrun_llm);
  EXPECT_TRUE(orphan->Wait(absl::Now() + absl::Seconds(10)).ok());
}

// Over UCX, whose sends cannot be withdrawn: the encoder's attempt fails with its rows sent and
// not yet taken, and it drops the sends; the LLM rank gives the same attempt up only later. The
// sends stay in flight until the LLM's abandoned receives absorb them, and the connection serves
// the retry. Destroying them unfinished instead tears the connection down after the transport's
// abandon timeout, and the retry between two live ranks fails.
TEST(BoundaryAbandonTest, SendsLeftByAFailedAttemptWaitForTheReceiverAndKeepTheConnection) {
  OneToOnePlans plans;
  ASSERT_NO_FATAL_FAILURE(MakeOneToOnePlans(&plans));
  const hetpar::v1::RunSpec& spec = plans.spec;
  const std::optional<plan::RankStepPlan>& enc_plan = plans.enc_plan;
  const std::optional<plan::RankStepPlan>& llm_plan = plans.llm_plan;

  // Every message waits for its receiver (same-host zero copy at any size), and an Operation
  // destroyed unfinished gives up after 100 ms.
  transport::ucx::UcxTransport::Options enc_options, llm_options;
  enc_options.name = "enc";
  llm_options.name = "llm";
  for (auto* o : {&enc_options, &llm_options}) {
    o->zero_copy_threshold = 1;
    o->abandon_timeout = absl::Milliseconds(100);
  }
  auto enc_t = transport::ucx::UcxTransport::Create(enc_options);
  auto llm_t = transport::ucx::UcxTransport::Create(llm_options);
  ASSERT_TRUE(enc_t.ok()) << enc_t.status();
  ASSERT_TRUE(llm_t.ok()) << llm_t.status();
  auto to_llm = (*enc_t)->Connect((*llm_t)->LocalAddress(), absl::Now() + absl::Seconds(20));
  auto to_enc = (*llm_t)->Connect((*enc_t)->LocalAddress(), absl::Now() + absl::Seconds(20));
  ASSERT_TRUE(to_llm.ok()) << to_llm.status();
  ASSERT_TRUE(to_enc.ok()) << to_enc.status();
  train::BoundaryCommunicator enc(enc_t->get(), {{1, *to_llm}}, absl::Seconds(20));
  train::BoundaryCommunicator llm(llm_t->get(), {{0, *to_enc}}, absl::Seconds(20));

  const int64_t wave = plans.job->wave;
  const int64_t hidden = spec.llm().model().hidden();
  const at::Tensor& job_rows = plans.job_rows;
  plan::RankStepPlan failed_enc = *enc_plan, failed_llm = *llm_plan;
  failed_enc.attempt = failed_llm.attempt = 1;
  plan::RankStepPlan retry_enc = *enc_plan, retry_llm = *llm_plan;
  retry_enc.attempt = retry_llm.attempt = 2;

  enc.BeginStep();
  llm.BeginStep();
  {
    auto sent = enc.SendForward(failed_enc, wave, at::full_like(job_rows, 5.0));
    ASSERT_TRUE(sent.ok()) << sent.status();
  }  // the encoder's attempt failed: its sends are dropped
  enc.BeginStep();
  EXPECT_EQ(enc.draining_sends(), 1);
  // The LLM rank gives attempt 1 up: its receives absorb the message.
  llm.Abandon(failed_llm);
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (enc.draining_sends() > 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(1));  // leaves the core to UCX's progress thread
    enc.BeginStep();
  }
  EXPECT_EQ(enc.draining_sends(), 0);

  // The retry: the same two ranks, over the same connection.
  llm.BeginStep();
  const int64_t buffer_rows = llm_plan->image_rows[wave];
  at::Tensor buffer = at::full({buffer_rows, hidden}, -1.0, at::kDouble);
  ASSERT_TRUE(llm.PostForwardReceives(retry_llm, wave, buffer).ok());
  auto sent = enc.SendForward(retry_enc, wave, job_rows);
  ASSERT_TRUE(sent.ok()) << sent.status();
  const absl::Status received = llm.ReceiveForward(retry_llm, wave, buffer);
  ASSERT_TRUE(received.ok()) << received;
  const at::Tensor expected = plans.ForwardRows(-1.0);
  EXPECT_TRUE(at::equal(buffer, expected));
  EXPECT_TRUE(sent->Wait(absl::Now() + absl::Seconds(20)).ok());
}

// An LLM rank takes a wave's rows from two encoder ranks, and one of them is dead before it
// sends. The live rank's message is still taken: by the wave's receive, which fails naming the
// dead rank, and, for a wave the step never reached, by Abandon. Its send completes either way;
// it would otherwise wait in its rank's drain for the rest of the run (holding its buffer), and
// its message in the LLM rank's transport.
TEST(BoundaryAbandonTest, ADeadSourceOfAWaveLeavesTheLiveSourcesMessagesTaken) {
  const hetpar::v1::RunSpec spec = MakeSpec(Case{"enc_dp2_to_llm_dp1", 2, 1, 1, 1});
  std::optional<plan::StepPlan> step_plan;
  ASSERT_NO_FATAL_FAILURE(PlanFirstStep(spec, &step_plan));
  // Ranks 0 and 1 are the encoders, 2 the LLM.
  auto live_plan = plan::ExtractRankPlan(*step_plan, 1);
  auto llm_plan = plan::ExtractRankPlan(*step_plan, 2);
  ASSERT_TRUE(live_plan.ok() && llm_plan.ok());
  // The waves whose rows come from both encoders.
  std::vector<int64_t> shared_waves;
  for (int64_t wave = 0; wave < static_cast<int64_t>(llm_plan->image_rows.size()); ++wave) {
    bool from[2] = {false, false};
    for (const plan::Transfer& t : llm_plan->forward_receives) {
      if (t.wave == wave && t.src_rank < 2) from[t.src_rank] = true;
    }
    if (from[0] && from[1]) shared_waves.push_back(wave);
  }
  ASSERT_GE(shared_waves.size(), 2u) << "the batch no longer mixes both encoders' rows in a wave";
  const int64_t received_wave = shared_waves[0], abandoned_wave = shared_waves[1];
  const int64_t hidden = spec.llm().model().hidden();
  auto job_rows = [&](int64_t wave) {
    for (const plan::EncoderJob& job : live_plan->encoder_jobs) {
      if (job.wave == wave) {
        return (at::arange(job.rows, at::kDouble).unsqueeze(1) * 1000 + wave * 100 +
                at::arange(hidden, at::kDouble).unsqueeze(0))
            .contiguous();
      }
    }
    return at::Tensor();
  };

  auto dead_t = transport::inproc::InprocTransport::Create({"enc 0"});
  auto live_t = transport::inproc::InprocTransport::Create({"enc 1"});
  auto llm_inner = transport::inproc::InprocTransport::Create({"llm"});
  ASSERT_TRUE(dead_t.ok() && live_t.ok() && llm_inner.ok());
  auto llm_t = transport::FaultyTransport::Create(std::move(llm_inner).value(), {});
  ASSERT_TRUE(llm_t.ok()) << llm_t.status();
  const absl::Time connect_by = absl::Now() + absl::Seconds(10);
  auto to_dead = (*llm_t)->Connect((*dead_t)->LocalAddress(), connect_by);
  auto to_live = (*llm_t)->Connect((*live_t)->LocalAddress(), connect_by);
  auto to_llm = (*live_t)->Connect((*llm_t)->LocalAddress(), connect_by);
  ASSERT_TRUE(to_dead.ok() && to_live.ok() && to_llm.ok());
  train::BoundaryCommunicator live(live_t->get(), {{2, *to_llm}}, absl::Seconds(10));
  train::BoundaryCommunicator llm(llm_t->get(), {{0, *to_dead}, {1, *to_live}}, absl::Seconds(10));
  (*llm_t)->FailPeer(*to_dead);  // encoder 0's process is gone

  // This transport is rendezvous at every size: a send completes once a receive takes it.
  const at::Tensor rows = job_rows(received_wave);
  ASSERT_TRUE(rows.defined());
  auto sent = live.SendForward(*live_plan, received_wave, rows);
  ASSERT_TRUE(sent.ok()) << sent.status();
  at::Tensor buffer = at::full({llm_plan->image_rows[received_wave], hidden}, -1.0, at::kDouble);
  const absl::Status received = llm.ReceiveForward(*llm_plan, received_wave, buffer);
  EXPECT_TRUE(absl::IsUnavailable(received)) << received;
  EXPECT_NE(std::string(received.message()).find("from rank 0"), std::string::npos) << received;
  EXPECT_TRUE(sent->Wait(absl::Now() + absl::Seconds(10)).ok());
  // Encoder 1's rows are where the plan puts them.
  for (const plan::Transfer& t : llm_plan->forward_receives) {
    if (t.wave != received_wave || t.src_rank != 1) continue;
    for (const plan::BlockPiece& piece : t.pieces) {
      EXPECT_TRUE(at::equal(buffer.narrow(0, piece.dst_offset, piece.rows),
                            rows.narrow(0, piece.src_offset, piece.rows)));
    }
  }

  // A later wave the LLM rank never reached: its step gives up, and Abandon takes the message.
  auto unreached = live.SendForward(*live_plan, abandoned_wave, job_rows(abandoned_wave));
  ASSERT_TRUE(unreached.ok()) << unreached.status();
  llm.Abandon(*llm_plan);
  EXPECT_TRUE(unreached->Wait(absl::Now() + absl::Seconds(10)).ok());
}

}  // namespace
}  // namespace hetpar
