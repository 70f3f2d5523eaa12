#include "llm_trainer/language_model.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <cmath>

#include "common/nn/test_ranks.h"
#include "common/plan/estimate.h"
#include "common/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/util/tiny_llm.h"

namespace hetpar::llm {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kVocab = 40;
constexpr int64_t kPlaceholder = 39;

hetpar::v1::LlmModel TinyModel() { return testing::TinyLlm(kVocab); }

std::unique_ptr<LanguageModel> Make(at::ScalarType dtype = at::kDouble,
                                    nn::InitStyle style = nn::InitStyle::kAllRandom) {
  static auto single = nn::Communicator::CreateSingle();
  LlmOptions options;
  options.dtype = dtype;
  options.seed = 11;
  options.init_style = style;
  auto lm = LanguageModel::Create(TinyModel(), options, *single);
  EXPECT_TRUE(lm.ok()) << lm.status();
  return lm.ok() ? *std::move(lm) : nullptr;
}

// A sample whose labels are the next tokens; every position but the last and the image
// placeholders counts in the loss.
LlmSample MakeSample(std::string id, std::vector<int64_t> tokens,
                     std::vector<int64_t> image_positions = {}) {
  return testing::LabeledSample(std::move(id), std::move(tokens), std::move(image_positions));
}

std::vector<int64_t> Tokens(int64_t n, int64_t salt) {
  std::vector<int64_t> t;
  for (int64_t i = 0; i < n; ++i) t.push_back((i * 7 + salt * 13 + 3) % (kVocab - 1));
  return t;
}

// Samples with 0, 1 (3 rows) and 2 (2 + 3 rows) images.
std::vector<LlmSample> MixedBatch() {
  return {MakeSample("text", Tokens(9, 1)), MakeSample("one-image", Tokens(12, 2), {2, 3, 4}),
          MakeSample("two-images", Tokens(15, 3), {1, 2, 8, 9, 10})};
}

at::Tensor Random(std::vector<int64_t> shape, uint64_t seed) {
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::normal(0.0, 1.0, shape, generator, at::TensorOptions().dtype(at::kDouble));
}

double Loss(LanguageModel& lm, const std::vector<LlmSample>& samples, const at::Tensor& rows,
            int64_t n_global = 20) {
  auto out = lm.Forward(samples, rows, n_global);
  EXPECT_TRUE(out.ok()) << out.status();
  return out.ok() ? out->loss.item<double>() : NAN;
}

// The layout planner sizes gradients, optimizer state and DP all-reduces from a count of the
// parameters by formula (common/plan/estimate.h); it must match what the model registers.
TEST(LanguageModelTest, PlannerCountsEveryParameter) {
  auto lm = Make();
  EXPECT_EQ(lm->parameters().FullNumel(), static_cast<int64_t>(plan::LlmParameters(TinyModel())));
}

TEST(LanguageModelTest, SplicedRowsLandExactlyOnTheirPlaceholders) {
  auto lm = Make();
  ASSERT_NE(lm, nullptr);
  // Text-only: the original tokens everywhere.
  std::vector<LlmSample> text = MixedBatch();
  for (auto& s : text) {
    for (int64_t p : s.image_positions) s.loss_mask[p] = 0;
    s.image_positions.clear();
    s.image_rows = 0;
  }
  // With images: placeholders at the image positions, and as image rows the embeddings of the
  // tokens they replaced, in sample order. Only a splice that puts row k exactly on placeholder
  // k gives back the text-only loss.
  std::vector<LlmSample> spliced = MixedBatch();
  const at::Tensor embed = lm->parameters().Find("llm.embed.weight")->tensor.detach();
  std::vector<int64_t> replaced;
  for (auto& s : spliced) {
    for (int64_t p : s.image_positions) {
      replaced.push_back(s.tokens[p]);
      s.tokens[p] = kPlaceholder;
    }
  }
  const at::Tensor rows = embed.index_select(0, at::tensor(replaced, at::kLong));
  const double text_loss = Loss(*lm, text, at::Tensor());
  const double spliced_loss = Loss(*lm, spliced, rows);
  EXPECT_NEAR(spliced_loss, text_loss, 1e-13 * std::abs(text_loss));
  // Swapping two rows of different images changes the loss.
  at::Tensor swapped = rows.clone();
  swapped[0].copy_(rows[4]);
  swapped[4].copy_(rows[0]);
  EXPECT_GT(std::abs(Loss(*lm, spliced, swapped) - text_loss), 1e-6);
  // Placeholders without the splice give another loss.
  std::vector<LlmSample> unspliced = spliced;
  for (auto& s : unspliced) {
    s.image_positions.clear();
    s.image_rows = 0;
  }
  EXPECT_GT(std::abs(Loss(*lm, unspliced, at::Tensor()) - text_loss), 1e-6);
}

TEST(LanguageModelTest, ImageRowsReadByRankFollowTheSequenceShards) {
  // 9 + 12 + 15 = 36 packed rows; placeholders at rows 11, 12, 13 and 22, 23, 29, 30, 31.
  const std::vector<LlmSample> batch = MixedBatch();
  const std::vector<int64_t> all = {0, 1, 2, 3, 4, 5, 6, 7};
  EXPECT_EQ(ImageRowsReadByRank(batch, 0, 1, true), all);
  EXPECT_EQ(ImageRowsReadByRank(batch, 1, 4, false), all);
  // SP over 4 ranks: shards of 9 rows.
  EXPECT_EQ(ImageRowsReadByRank(batch, 0, 4, true), std::vector<int64_t>{});
  EXPECT_EQ(ImageRowsReadByRank(batch, 1, 4, true), (std::vector<int64_t>{0, 1, 2}));
  EXPECT_EQ(ImageRowsReadByRank(batch, 2, 4, true), (std::vector<int64_t>{3, 4}));
  EXPECT_EQ(ImageRowsReadByRank(batch, 3, 4, true), (std::vector<int64_t>{5, 6, 7}));
  // SP over 2 ranks: shards of 18 rows.
  EXPECT_EQ(ImageRowsReadByRank(batch, 0, 2, true), (std::vector<int64_t>{0, 1, 2}));
  EXPECT_EQ(ImageRowsReadByRank(batch, 1, 2, true), (std::vector<int64_t>{3, 4, 5, 6, 7}));
}

TEST(LanguageModelTest, GradientsMatchFiniteDifferences) {
  auto lm = Make();
  const std::vector<LlmSample> batch = MixedBatch();
  at::Tensor rows = Random({8, 32}, 3).mul(0.5).requires_grad_(true);
  auto out = lm->Forward(batch, rows, 20);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->loss_tokens, 8 + 11 - 3 + 14 - 5);
  ASSERT_TRUE(lm->Backward(out->loss).ok());
  ASSERT_TRUE(lm->FinishGradients().ok());
  ASSERT_TRUE(rows.grad().defined());
  auto check = [&](const std::string& what, at::Tensor values, const at::Tensor& grad) {
    at::Tensor flat = values.view({-1});
    for (int64_t index : {int64_t{0}, flat.numel() / 3, flat.numel() - 1}) {
      const double original = flat[index].item<double>();
      const double eps = 1e-6;
      flat[index] = original + eps;
      const double plus = Loss(*lm, batch, rows.detach());
      flat[index] = original - eps;
      const double minus = Loss(*lm, batch, rows.detach());
      flat[index] = original;
      const double numeric = (plus - minus) / (2 * eps);
      EXPECT_NEAR(grad.view({-1})[index].item<double>(), numeric,
                  1e-7 * std::max(1.0, std::abs(numeric)))
          << what << "[" << index << "]";
    }
  };
  check("image rows", rows.detach(), rows.grad());
  for (const char* name :
       {"llm.embed.weight", "llm.layers.0.attn.qkv.weight", "llm.layers.1.attn.proj.weight",
        "llm.layers.0.attn_norm.weight", "llm.layers.1.mlp.gate.weight",
        "llm.layers.0.mlp.down.weight", "llm.norm.weight", "llm.output.weight"}) {
    const nn::NamedParameter* p = lm->parameters().Find(name);
    ASSERT_NE(p, nullptr) << name;
    ASSERT_TRUE(p->tensor.grad().defined()) << name;
    check(name, p->tensor.detach(), p->tensor.grad());
  }
}

TEST(LanguageModelTest, LossIsTheTokenSumOverNGlobal) {
  auto lm = Make();
  const std::vector<LlmSample> batch = MixedBatch();
  const at::Tensor rows = Random({8, 32}, 3);
  const double at_20 = Loss(*lm, batch, rows, 20);
  const double at_40 = Loss(*lm, batch, rows, 40);
  EXPECT_NEAR(at_40 * 2, at_20, 1e-15 * std::abs(at_20));
  // Microbatches add up: two halves over the same N_global give the whole.
  const std::vector<LlmSample> first = {batch[0]};
  const std::vector<LlmSample> rest = {batch[1], batch[2]};
  const double whole = Loss(*lm, batch, rows, 33);
  const double parts = Loss(*lm, first, at::Tensor(), 33) + Loss(*lm, rest, rows, 33);
  EXPECT_NEAR(whole, parts, 1e-13 * std::abs(whole));
  // With the training initialisation the logits are near zero: the mean token loss is near
  // log(vocab).
  auto fresh = Make(at::kDouble, nn::InitStyle::kTraining);
  auto out = fresh->Forward(batch, rows, 1);
  ASSERT_TRUE(out.ok());
  EXPECT_NEAR(out->loss.item<double>() / out->loss_tokens, std::log(double{kVocab}), 0.05);
}

TEST(LanguageModelTest, AttentionIsCausalAndStaysInsideItsSample) {
  auto lm = Make();
  LlmSample a = MakeSample("a", Tokens(10, 4));
  LlmSample b = MakeSample("b", Tokens(10, 5));
  LlmSample b_changed = b;
  b_changed.tokens = Tokens(10, 6);
  b.loss_mask.assign(10, 0);
  b_changed.loss_mask.assign(10, 0);
  // Loss on `a` only: whatever follows it in the microbatch does not matter.
  EXPECT_EQ(Loss(*lm, {a, b}, at::Tensor()), Loss(*lm, {a, b_changed}, at::Tensor()));
  // Loss on positions 0..4 only: tokens after position 4 do not matter.
  LlmSample early = a;
  for (int i = 5; i < 10; ++i) early.loss_mask[i] = 0;
  LlmSample early_changed = early;
  for (int i = 5; i < 10; ++i) early_changed.tokens[i] = (early.tokens[i] + 1) % kVocab;
  EXPECT_EQ(Loss(*lm, {early}, at::Tensor()), Loss(*lm, {early_changed}, at::Tensor()));
  // ...but token 4 does.
  early_changed.tokens[4] = (early.tokens[4] + 1) % kVocab;
  EXPECT_NE(Loss(*lm, {early}, at::Tensor()), Loss(*lm, {early_changed}, at::Tensor()));
}

// Consecutive samples of one length run as one attention call over a batch dimension: the
// microbatch's loss is still the sum of each sample's loss alone (float64, where reordering the
// same operations moves the result by rounding only).
TEST(LanguageModelTest, RunsOfEqualLengthSamplesAttendAsIfAlone) {
  auto lm = Make();
  const std::vector<LlmSample> batch = {
      MakeSample("a", Tokens(10, 4)), MakeSample("b", Tokens(10, 5)),
      MakeSample("c", Tokens(10, 6)), MakeSample("short", Tokens(7, 7)),
      MakeSample("d", Tokens(10, 8))};
  double alone = 0;
  for (const LlmSample& sample : batch) alone += Loss(*lm, {sample}, at::Tensor());
  EXPECT_NEAR(Loss(*lm, batch, at::Tensor()), alone, 1e-12 * std::abs(alone));
}

TEST(LanguageModelTest, MismatchesAreErrorsNamingTheSample) {
  auto lm = Make();
  std::vector<LlmSample> batch = MixedBatch();
  const at::Tensor rows = Random({8, 32}, 3);
  batch[2].image_rows = 4;
  auto out = lm->Forward(batch, rows, 20);
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(out.status().message()),
              HasSubstr("sample 'two-images' (#2 of the microbatch) has 5 image placeholder "
                        "tokens but 4 image rows were assigned to it"));

  batch = MixedBatch();
  out = lm->Forward(batch, Random({7, 32}, 3), 20);
  EXPECT_THAT(std::string(out.status().message()),
              HasSubstr("the image-rows tensor has 7 rows but the microbatch's 3 samples have 8 "
                        "image placeholder tokens"));
  out = lm->Forward(batch, at::Tensor(), 20);
  EXPECT_THAT(std::string(out.status().message()), HasSubstr("has 0 rows"));
  out = lm->Forward(batch, Random({8, 31}, 3), 20);
  EXPECT_THAT(std::string(out.status().message()),
              HasSubstr("expected [rows, llm.model.hidden=32]"));
  out = lm->Forward(batch, Random({8, 32}, 3).to(at::kFloat), 20);
  EXPECT_THAT(std::string(out.status().message()),
              HasSubstr("image rows have dtype float32, expected the model dtype float64"));
  out = lm->Forward(batch, rows, 0);
  EXPECT_THAT(std::string(out.status().message()), HasSubstr("N_global=0"));

  batch[0].tokens[3] = kVocab;
  out = lm->Forward(batch, rows, 20);
  EXPECT_THAT(std::string(out.status().message()),
              HasSubstr("sample 'text' (#0 of the microbatch): token 40 at position 3 is outside "
                        "the vocabulary [0, 40)"));
  batch = MixedBatch();
  batch[1] = MakeSample("long", Tokens(25, 1));
  batch[2].image_rows = 8;
  batch[2].image_positions = {0, 1, 2, 3, 4, 5, 6, 7};
  out = lm->Forward(batch, rows, 20);
  EXPECT_THAT(std::string(out.status().message()),
              HasSubstr("sample 'long' (#1 of the microbatch) has 25 tokens, expected "
                        "1..llm.model.seq_len=24"));
  batch = MixedBatch();
  batch[1].image_positions = {4, 3, 2};
  out = lm->Forward(batch, rows, 20);
  EXPECT_THAT(std::string(out.status().message()), HasSubstr("image position 3 is not increasing"));
}

TEST(LanguageModelTest, Float32AndBfloat16StayCloseToFloat64) {
  const std::vector<LlmSample> batch = MixedBatch();
  const at::Tensor rows = Random({8, 32}, 3).mul(0.1);
  auto reference = Make(at::kDouble);
  const double expected = Loss(*reference, batch, rows);
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    auto lm = Make(dtype);
    at::Tensor typed_rows = rows.to(dtype).requires_grad_(true);
    auto out = lm->Forward(batch, typed_rows, 20);
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_EQ(out->loss.scalar_type(), at::kFloat);
    EXPECT_NEAR(out->loss.item<double>(), expected,
                (dtype == at::kFloat ? 1e-5 : 2e-2) * std::abs(expected))
        << dtype;
    ASSERT_TRUE(lm->Backward(out->loss).ok());
    EXPECT_EQ(typed_rows.grad().scalar_type(), dtype);
    EXPECT_TRUE(at::isfinite(typed_rows.grad()).all().item<bool>());
  }
}

TEST(LanguageModelTest, TpThatDoesNotSplitKvHeadsIsRejected) {
  hetpar::v1::LlmModel model = TinyModel();
  model.set_kv_heads(2);
  absl::Status status = nn::testing::RunRanks(4, [&](int, nn::Communicator& comm) {
    auto lm = LanguageModel::Create(model, LlmOptions(), comm);
    EXPECT_FALSE(lm.ok());
    EXPECT_THAT(std::string(lm.status().message()),
                HasSubstr("llm.layout.tp=4 does not divide llm.model.kv_heads=2"));
    return absl::OkStatus();
  });
  ASSERT_TRUE(status.ok()) << status;
  model = TinyModel();
  model.set_hidden(24);  // head size 3
  auto single = nn::Communicator::CreateSingle();
  auto lm = LanguageModel::Create(model, LlmOptions(), *single);
  EXPECT_THAT(std::string(lm.status().message()), HasSubstr("odd head size 3"));
}

TEST(LanguageModelTest, CpLocalPositionsAreTheLoadBalancedChunks) {
  // seq_len 24 over cp 2: chunks of 6; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
  EXPECT_EQ(CpLocalPositions(20, 24, 2, 0), (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 18, 19}));
  EXPECT_EQ(CpLocalPositions(20, 24, 2, 1),
            (std::vector<int64_t>{6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17}));
  EXPECT_EQ(CpLocalPositions(4, 24, 2, 1), std::vector<int64_t>{});
  EXPECT_EQ(CpLocalPositions(3, 24, 1, 0), (std::vector<int64_t>{0, 1, 2}));
}

// Context parallelism over 2 ranks (threads) against the model in one piece: the sum of the
// ranks' losses, of their parameter gradients and of their image-row gradients equal the whole
// model's, for a batch where every rank holds rows and for one that lies on rank 0 alone (rank 1
// then holds no row and still takes part in every collective).
TEST(LanguageModelTest, ContextParallelEqualsTheWholeModel) {
  std::vector<LlmSample> mixed = MixedBatch();
  mixed.push_back(MakeSample("short", Tokens(4, 4)));
  mixed.push_back(MakeSample("long", Tokens(23, 5), {5, 6, 7, 17, 18}));
  const std::vector<std::vector<LlmSample>> batches = {
      mixed, {MakeSample("a", Tokens(5, 6), {1, 2}), MakeSample("b", Tokens(6, 7))}};
  for (const auto& batch : batches) {
    SCOPED_TRACE(batch.size());
    int64_t image_rows = 0;
    for (const auto& sample : batch) image_rows += sample.image_rows;
    const at::Tensor rows = Random({image_rows, 32}, 21);
    auto whole = Make();
    at::Tensor whole_rows = rows.clone().requires_grad_(true);
    auto out = whole->Forward(batch, whole_rows, 50);
    ASSERT_TRUE(out.ok()) << out.status();
    ASSERT_TRUE(whole->Backward(out->loss).ok());
    const double whole_loss = out->loss.item<double>();
    const absl::Status status = nn::testing::RunRanks(2, [&](int rank, nn::Communicator& cp) {
      auto single = nn::Communicator::CreateSingle();
      LlmOptions options;
      options.dtype = at::kDouble;
      options.seed = 11;
      options.init_style = nn::InitStyle::kAllRandom;
      auto lm = LanguageModel::Create(TinyModel(), options, *single);
      if (!lm.ok()) return lm.status();
      HETPAR_RETURN_IF_ERROR((*lm)->SetContextParallel(cp.group()));
      EXPECT_EQ((*lm)->cp_rank(), rank);
      at::Tensor my_rows = rows.clone().requires_grad_(true);
      auto part = (*lm)->Forward(batch, my_rows, 50);
      if (!part.ok()) return part.status();
      HETPAR_RETURN_IF_ERROR((*lm)->Backward(part->loss));
      at::Tensor loss = part->loss.detach().reshape({1}).clone();
      HETPAR_RETURN_IF_ERROR(cp.AllReduce(loss));
      EXPECT_NEAR(loss.item<double>(), whole_loss, 1e-12 * std::abs(whole_loss)) << rank;
      for (const auto& p : (*lm)->parameters().parameters()) {
        at::Tensor grad =
            p.tensor.grad().defined() ? p.tensor.grad().clone() : at::zeros_like(p.tensor);
        HETPAR_RETURN_IF_ERROR(cp.AllReduce(grad));
        const at::Tensor expected = whole->parameters().Find(p.name)->tensor.grad();
        EXPECT_LE((grad - expected).abs().max().item<double>(),
                  1e-12 * std::max(1.0, expected.abs().max().item<double>()))
            << p.name << " on rank " << rank;
      }
      if (image_rows > 0) {
        at::Tensor grad =
            my_rows.grad().defined() ? my_rows.grad().clone() : at::zeros_like(my_rows);
        HETPAR_RETURN_IF_ERROR(cp.AllReduce(grad));
        EXPECT_LE((grad - whole_rows.grad()).abs().max().item<double>(), 1e-12) << rank;
      }
      return absl::OkStatus();
    });
    ASSERT_TRUE(status.ok()) << status;
  }
}

// Two pipeline stages (the tiny model's two layers, one each) against the whole model: stage 1
// takes stage 0's output as a leaf, and the gradient of that leaf goes back into stage 0. The
// loss, every parameter's gradient (each parameter on exactly one stage) and the image rows'
// gradient equal the whole model's.
TEST(LanguageModelTest, PipelineStagesComposeToTheWholeModel) {
  const std::vector<LlmSample> batch = MixedBatch();
  const at::Tensor rows = Random({8, 32}, 31);
  auto whole = Make();
  at::Tensor whole_rows = rows.clone().requires_grad_(true);
  auto out = whole->Forward(batch, whole_rows, 30);
  ASSERT_TRUE(out.ok()) << out.status();
  ASSERT_TRUE(whole->Backward(out->loss).ok());

  static auto single = nn::Communicator::CreateSingle();
  std::vector<std::unique_ptr<LanguageModel>> stages;
  for (int64_t stage = 0; stage < 2; ++stage) {
    LlmOptions options;
    options.dtype = at::kDouble;
    options.seed = 11;
    options.init_style = nn::InitStyle::kAllRandom;
    options.pp_stage = stage;
    options.pp_stages = 2;
    auto lm = LanguageModel::Create(TinyModel(), options, *single);
    ASSERT_TRUE(lm.ok()) << lm.status();
    stages.push_back(*std::move(lm));
  }
  EXPECT_TRUE(stages[0]->first_stage() && !stages[0]->last_stage());
  EXPECT_TRUE(stages[1]->last_stage() && !stages[1]->first_stage());
  EXPECT_EQ(stages[0]->Forward(batch, rows, 30).status().code(),
            absl::StatusCode::kFailedPrecondition);

  at::Tensor stage_rows = rows.clone().requires_grad_(true);
  auto first = stages[0]->ForwardStage(batch, stage_rows, at::Tensor(), 30);
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE(first->output.defined());
  EXPECT_FALSE(first->loss.defined());
  at::Tensor input = first->output.detach().clone().requires_grad_(true);
  auto bad = stages[1]->ForwardStage(batch, at::Tensor(), input.narrow(0, 0, 5), 30);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("input from the previous stage"));
  auto last = stages[1]->ForwardStage(batch, at::Tensor(), input, 30);
  ASSERT_TRUE(last.ok()) << last.status();
  EXPECT_EQ(last->loss_tokens, out->loss_tokens);
  EXPECT_NEAR(last->loss.item<double>(), out->loss.item<double>(),
              1e-13 * std::abs(out->loss.item<double>()));
  last->loss.backward();
  first->output.backward(input.grad());

  int64_t seen = 0;
  for (const auto& stage : stages) {
    for (const auto& p : stage->parameters().parameters()) {
      ++seen;
      const at::Tensor expected = whole->parameters().Find(p.name)->tensor.grad();
      ASSERT_TRUE(p.tensor.grad().defined()) << p.name;
      EXPECT_LE((p.tensor.grad() - expected).abs().max().item<double>(),
                1e-12 * std::max(1.0, expected.abs().max().item<double>()))
          << p.name;
    }
  }
  EXPECT_EQ(seen, static_cast<int64_t>(whole->parameters().parameters().size()));
  EXPECT_EQ(stages[0]->parameters().FullNumel() + stages[1]->parameters().FullNumel(),
            whole->parameters().FullNumel());
  EXPECT_LE((stage_rows.grad() - whole_rows.grad()).abs().max().item<double>(), 1e-12);

  // Each stage knows the whole model's names (what it may skip in the whole model's file) and
  // nothing more: not a third layer, not a name written otherwise.
  for (const auto& stage : stages) {
    for (const auto& p : whole->parameters().parameters()) {
      EXPECT_TRUE(stage->WholeModelHas(p.name)) << p.name;
    }
    for (const char* name :
         {"llm.layers.2.mlp.up.weight", "llm.layers.01.mlp.up.weight",
          "llm.layers.-1.mlp.up.weight", "llm.layers.0.mlp.up.bias", "llm.layers.0",
          "llm.layers..mlp.up.weight", "llm.lm_head.weight", "vision.embed.weight"}) {
      EXPECT_FALSE(stage->WholeModelHas(name)) << name;
    }
  }

  // More stages than layers is refused.
  LlmOptions options;
  options.pp_stages = 3;
  auto three = LanguageModel::Create(TinyModel(), options, *single);
  EXPECT_THAT(std::string(three.status().message()), HasSubstr("llm.layout.pp=3"));
}

TEST(LanguageModelTest, OptionsComeFromTheRunSpec) {
  hetpar::v1::RunSpec spec;
  spec.mutable_run()->set_dtype(hetpar::v1::DTYPE_FLOAT64);
  spec.mutable_run()->set_seed(9);
  spec.mutable_llm()->mutable_layout()->set_sequence_parallel(true);
  auto options = LlmOptionsFromSpec(spec);
  ASSERT_TRUE(options.ok());
  EXPECT_EQ(options->dtype, at::kDouble);
  EXPECT_EQ(options->seed, 9);
  EXPECT_TRUE(options->sequence_parallel);
}

}  // namespace
}  // namespace hetpar::llm
