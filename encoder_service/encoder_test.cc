#include "encoder_service/encoder.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include "common/nn/test_ranks.h"
#include "common/plan/estimate.h"
#include "common/train/optimizer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hetpar::encoder {
namespace {

using ::testing::HasSubstr;

hetpar::v1::EncoderModel TinyModel() {
  hetpar::v1::EncoderModel m;
  m.set_image_size(6);
  m.set_patch(2);  // 9 tokens per image
  m.set_hidden(16);
  m.set_layers(2);
  m.set_heads(4);
  m.set_mlp(32);
  m.set_out_hidden(12);
  m.set_channels(3);
  return m;
}

at::Tensor Images(int64_t n, uint64_t seed) {
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::normal(0.0, 1.0, {n, 3, 6, 6}, generator, at::TensorOptions().dtype(at::kDouble));
}

std::unique_ptr<VisionEncoder> Make(at::ScalarType dtype = at::kDouble, int64_t seed = 5,
                                    bool frozen = false, bool train_projector = false) {
  static auto single = nn::Communicator::CreateSingle();
  EncoderOptions options;
  options.dtype = dtype;
  options.seed = seed;
  options.init_style = nn::InitStyle::kAllRandom;
  options.frozen = frozen;
  options.train_projector = train_projector;
  auto encoder = VisionEncoder::Create(TinyModel(), options, *single);
  EXPECT_TRUE(encoder.ok()) << encoder.status();
  return encoder.ok() ? *std::move(encoder) : nullptr;
}

double RelativeError(const at::Tensor& a, const at::Tensor& b) {
  const double scale = b.abs().max().item<double>();
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>() / scale;
}

TEST(EncoderTest, OutputHasOneBlockPerImageInJobOrder) {
  auto encoder = Make();
  ASSERT_NE(encoder, nullptr);
  EXPECT_EQ(encoder->tokens_per_image(), 9);
  const at::Tensor images = Images(3, 1);
  auto job = encoder->Forward(images);
  ASSERT_TRUE(job.ok()) << job.status();
  ASSERT_EQ(job->sizes(), at::IntArrayRef({27, 12}));
  EXPECT_EQ(job->scalar_type(), at::kDouble);
  // Each image encoded alone gives exactly its block of the job: images never attend to each
  // other and blocks keep the input order.
  for (int64_t i = 0; i < 3; ++i) {
    auto alone = encoder->Forward(images.narrow(0, i, 1));
    ASSERT_TRUE(alone.ok()) << alone.status();
    EXPECT_LE(RelativeError(job->narrow(0, 9 * i, 9), *alone), 1e-13) << "image " << i;
  }
  // Different images give different blocks.
  EXPECT_GT((job->narrow(0, 0, 9) - job->narrow(0, 9, 9)).abs().max().item<double>(), 1e-3);
}

TEST(EncoderTest, SameSeedSameModelOtherSeedOtherModel) {
  auto a = Make(at::kDouble, 5);
  auto b = Make(at::kDouble, 5);
  auto c = Make(at::kDouble, 6);
  const at::Tensor images = Images(2, 2);
  auto ya = a->Forward(images);
  auto yb = b->Forward(images);
  auto yc = c->Forward(images);
  ASSERT_TRUE(ya.ok() && yb.ok() && yc.ok());
  EXPECT_TRUE(at::equal(*ya, *yb));
  EXPECT_FALSE(at::equal(*ya, *yc));
}

TEST(EncoderTest, ParameterNamesAndShapes) {
  auto encoder = Make();
  const auto& params = encoder->parameters().parameters();
  ASSERT_EQ(params.size(), 3u + 2 * 12 + 2 + 4);
  EXPECT_EQ(params[0].name, "encoder.patch_embed.weight");
  EXPECT_EQ(params[0].full_shape, (std::vector<int64_t>{16, 12}));
  EXPECT_EQ(params[2].name, "encoder.pos_embed");
  EXPECT_EQ(params[2].full_shape, (std::vector<int64_t>{9, 16}));
  const nn::NamedParameter* qkv = encoder->parameters().Find("encoder.layers.1.attn.qkv.weight");
  ASSERT_NE(qkv, nullptr);
  EXPECT_EQ(qkv->full_shape, (std::vector<int64_t>{48, 16}));
  EXPECT_EQ(qkv->slice.split_dim, 0);
  const nn::NamedParameter* fc2 = encoder->parameters().Find("encoder.projector.fc2.weight");
  ASSERT_NE(fc2, nullptr);
  EXPECT_EQ(fc2->slice.split_dim, 1);
  EXPECT_EQ(encoder->parameters().Find("encoder.norm.bias")->slice.split_dim, -1);
}

// The layout planner sizes gradients, optimizer state and DP all-reduces from a count of the
// parameters by formula (common/plan/estimate.h); it must match what the model registers.
TEST(EncoderTest, PlannerCountsEveryParameter) {
  auto encoder = Make();
  EXPECT_EQ(encoder->parameters().FullNumel(),
            static_cast<int64_t>(plan::EncoderParameters(TinyModel())));
}

// encoder.model.no_final_norm: the same tower without its final LayerNorm, which is not built
// (nor counted by the planner); its features, normalised by the other's final norm, are the
// other's.
TEST(EncoderTest, WithoutTheFinalNormTheTowerGivesTheLastLayersStates) {
  static auto single = nn::Communicator::CreateSingle();
  EncoderOptions options;
  options.dtype = at::kDouble;
  options.seed = 5;
  options.init_style = nn::InitStyle::kAllRandom;
  hetpar::v1::EncoderModel model = TinyModel();
  model.set_no_final_norm(true);
  auto without = VisionEncoder::Create(model, options, *single);
  ASSERT_TRUE(without.ok()) << without.status();
  auto with = Make();
  EXPECT_EQ((*without)->parameters().Find("encoder.norm.weight"), nullptr);
  EXPECT_EQ((*without)->parameters().Find("encoder.norm.bias"), nullptr);
  EXPECT_EQ((*without)->parameters().FullNumel(),
            static_cast<int64_t>(plan::EncoderParameters(model)));
  EXPECT_EQ((*without)->parameters().FullNumel() + 2 * 16, with->parameters().FullNumel());
  const at::Tensor images = Images(2, 4);
  auto raw = (*without)->TowerFeatures(images);
  auto normed = with->TowerFeatures(images);
  ASSERT_TRUE(raw.ok() && normed.ok());
  const at::Tensor expected =
      at::layer_norm(*raw, {16}, with->parameters().Find("encoder.norm.weight")->tensor,
                     with->parameters().Find("encoder.norm.bias")->tensor, 1e-6);
  EXPECT_LE(RelativeError(*normed, expected), 1e-13);
  EXPECT_GT((*raw - *normed).abs().max().item<double>(), 1e-3);
  auto rows = (*without)->Forward(images);
  ASSERT_TRUE(rows.ok()) << rows.status();
  EXPECT_EQ(rows->sizes(), at::IntArrayRef({18, 12}));
}

// Finite differences of a weighted sum of the output against the autograd gradient, for a few
// elements of several parameters.
TEST(EncoderTest, BackwardMatchesFiniteDifferences) {
  auto encoder = Make();
  const at::Tensor images = Images(2, 3);
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(4);
  const at::Tensor weights =
      at::normal(0.0, 1.0, {18, 12}, generator, at::TensorOptions().dtype(at::kDouble));
  auto out = encoder->Forward(images);
  ASSERT_TRUE(out.ok());
  ASSERT_TRUE(encoder->Backward(*out, weights).ok());
  ASSERT_TRUE(encoder->FinishGradients().ok());
  for (const char* name :
       {"encoder.patch_embed.weight", "encoder.pos_embed", "encoder.layers.0.attn.qkv.weight",
        "encoder.layers.1.norm1.weight", "encoder.layers.1.mlp.fc2.bias", "encoder.norm.weight",
        "encoder.projector.fc1.bias"}) {
    const nn::NamedParameter* p = encoder->parameters().Find(name);
    ASSERT_NE(p, nullptr) << name;
    ASSERT_TRUE(p->tensor.grad().defined()) << name;
    at::Tensor flat = p->tensor.detach().view({-1});
    for (int64_t index : {int64_t{0}, flat.numel() / 2, flat.numel() - 1}) {
      const double original = flat[index].item<double>();
      const double eps = 1e-6;
      flat[index] = original + eps;
      const double plus = ((*encoder->Forward(images)).detach() * weights).sum().item<double>();
      flat[index] = original - eps;
      const double minus = ((*encoder->Forward(images)).detach() * weights).sum().item<double>();
      flat[index] = original;
      const double numeric = (plus - minus) / (2 * eps);
      const double analytic = p->tensor.grad().view({-1})[index].item<double>();
      EXPECT_NEAR(analytic, numeric, 1e-6 * std::max(1.0, std::abs(numeric)))
          << name << "[" << index << "]";
    }
  }
}

TEST(EncoderTest, Bfloat16AndFloat32StayCloseToFloat64) {
  const at::Tensor images = Images(2, 5);
  auto reference = Make(at::kDouble)->Forward(images);
  ASSERT_TRUE(reference.ok());
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    auto encoder = Make(dtype);
    auto out = encoder->Forward(images);
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_EQ(out->scalar_type(), dtype);
    EXPECT_LE(RelativeError(*out, *reference), dtype == at::kFloat ? 1e-5 : 5e-2) << dtype;
    ASSERT_TRUE(encoder->Backward(*out, at::ones_like(*out)).ok());
  }
}

TEST(EncoderTest, BadInputsAreRejectedWithTheExpectedShape) {
  auto encoder = Make();
  auto wrong = encoder->Forward(at::zeros({2, 3, 8, 8}));
  ASSERT_FALSE(wrong.ok());
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(wrong.status().message()),
              HasSubstr("images have shape [2, 3, 8, 8], expected [n >= 1, 3, 6, 6]"));
  auto ints = encoder->Forward(at::zeros({1, 3, 6, 6}, at::kLong));
  EXPECT_FALSE(ints.ok());
  auto out = encoder->Forward(Images(1, 1));
  ASSERT_TRUE(out.ok());
  absl::Status bad_grad = encoder->Backward(*out, at::ones({3, 12}));
  EXPECT_THAT(std::string(bad_grad.message()), HasSubstr("expected the output's [9, 12]"));
  ASSERT_TRUE(encoder->Backward(*out, at::ones({9, 12}, at::kDouble)).ok());
  // A second backward through the same (freed) graph is an error, not a crash.
  EXPECT_FALSE(encoder->Backward(*out, at::ones({9, 12}, at::kDouble)).ok());
}

TEST(EncoderTest, TpThatDoesNotSplitTheHeadsIsRejected) {
  absl::Status status = nn::testing::RunRanks(3, [](int, nn::Communicator& comm) {
    auto encoder = VisionEncoder::Create(TinyModel(), EncoderOptions(), comm);
    EXPECT_FALSE(encoder.ok());
    EXPECT_THAT(std::string(encoder.status().message()),
                HasSubstr("encoder.layout.tp=3 does not divide encoder.model.heads=4 (attention "
                          "is split by heads)"));
    return absl::OkStatus();
  });
  ASSERT_TRUE(status.ok()) << status;
}

// A frozen encoder computes what the trainable one computes, keeps no graph and takes no
// gradient; AdamW (with weight decay) leaves it bit for bit as it was.
TEST(EncoderTest, FrozenEncoderKeepsNoGraphAndNeverChanges) {
  auto trainable = Make();
  auto frozen = Make(at::kDouble, 5, /*frozen=*/true);
  const at::Tensor images = Images(2, 8);
  auto a = trainable->Forward(images);
  auto b = frozen->Forward(images);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_TRUE(at::equal(a->detach(), *b));
  EXPECT_TRUE(a->requires_grad());
  EXPECT_FALSE(b->requires_grad());
  EXPECT_FALSE(frozen->TakesGradients());
  EXPECT_EQ(frozen->parameters().TrainableLocalNumel(), 0);
  const absl::Status backward = frozen->Backward(*b, at::ones_like(*b));
  EXPECT_EQ(backward.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(backward.message()), HasSubstr("frozen"));

  std::vector<at::Tensor> before;
  for (const auto& p : frozen->parameters().parameters()) before.push_back(p.tensor.clone());
  hetpar::v1::Optimizer adamw;
  adamw.set_lr(0.1);
  adamw.set_weight_decay(0.5);
  auto optimizer = train::ModuleOptimizer::Create(&frozen->parameters(), adamw);
  ASSERT_TRUE(optimizer.ok()) << optimizer.status();
  ASSERT_TRUE((*optimizer)->Step(0, 1.0).ok());
  for (size_t i = 0; i < before.size(); ++i) {
    EXPECT_TRUE(at::equal(frozen->parameters().parameters()[i].tensor, before[i]))
        << frozen->parameters().parameters()[i].name;
  }
}

// With train_projector only the projector gets gradients, and they equal the trainable model's.
TEST(EncoderTest, FrozenTowerWithTrainableProjector) {
  auto trainable = Make();
  auto partial = Make(at::kDouble, 5, /*frozen=*/true, /*train_projector=*/true);
  ASSERT_TRUE(partial->TakesGradients());
  const at::Tensor images = Images(2, 9);
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(10);
  const at::Tensor weights =
      at::normal(0.0, 1.0, {18, 12}, generator, at::TensorOptions().dtype(at::kDouble));
  auto a = trainable->Forward(images);
  auto b = partial->Forward(images);
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE(b->requires_grad());
  ASSERT_TRUE(trainable->Backward(*a, weights).ok());
  ASSERT_TRUE(partial->Backward(*b, weights).ok());
  int64_t projector = 0;
  for (const auto& p : partial->parameters().parameters()) {
    const bool is_projector = p.name.rfind("encoder.projector.", 0) == 0;
    EXPECT_EQ(p.trainable, is_projector) << p.name;
    if (!is_projector) {
      EXPECT_FALSE(p.tensor.grad().defined()) << p.name;
      continue;
    }
    ++projector;
    ASSERT_TRUE(p.tensor.grad().defined()) << p.name;
    const at::Tensor expected = trainable->parameters().Find(p.name)->tensor.grad();
    EXPECT_LE(RelativeError(p.tensor.grad(), expected), 1e-13) << p.name;
  }
  EXPECT_EQ(projector, 4);
}

TEST(EncoderTest, OptionsComeFromTheRunSpec) {
  hetpar::v1::RunSpec spec;
  spec.mutable_run()->set_dtype(hetpar::v1::DTYPE_BFLOAT16);
  spec.mutable_run()->set_seed(77);
  spec.mutable_encoder()->mutable_layout()->set_sequence_parallel(true);
  auto options = EncoderOptionsFromSpec(spec);
  ASSERT_TRUE(options.ok());
  EXPECT_EQ(options->dtype, at::kBFloat16);
  EXPECT_EQ(options->seed, 77);
  EXPECT_TRUE(options->sequence_parallel);
  EXPECT_FALSE(options->frozen);
  spec.mutable_encoder()->set_train_projector(true);  // meaningless without frozen
  EXPECT_FALSE(EncoderOptionsFromSpec(spec)->train_projector);
  spec.mutable_encoder()->set_frozen(true);
  EXPECT_TRUE(EncoderOptionsFromSpec(spec)->frozen);
  EXPECT_TRUE(EncoderOptionsFromSpec(spec)->train_projector);
  spec.mutable_run()->set_dtype(hetpar::v1::DTYPE_UNSPECIFIED);
  EXPECT_FALSE(EncoderOptionsFromSpec(spec).ok());
}

}  // namespace
}  // namespace hetpar::encoder
