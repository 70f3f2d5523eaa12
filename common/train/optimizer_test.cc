#include "common/train/optimizer.h"

#include <ATen/ATen.h>

#include <cmath>
#include <optional>
#include <string>

#include "gtest/gtest.h"

namespace hetpar::train {
namespace {

hetpar::v1::Optimizer Adam(double lr, double weight_decay, int64_t warmup = 0) {
  hetpar::v1::Optimizer o;
  o.set_lr(lr);
  o.set_weight_decay(weight_decay);
  o.set_beta1(0.9);
  o.set_beta2(0.999);
  o.set_eps(1e-8);
  o.set_warmup_steps(warmup);
  return o;
}

// A parameter set with one TP-split matrix [4, 3] (split on dim 0) and one replicated vector [3].
std::unique_ptr<nn::ParameterSet> MakeSet(int tp_rank, int tp_size) {
  auto set = std::make_unique<nn::ParameterSet>(7, at::kDouble, tp_rank, tp_size,
                                                nn::InitStyle::kAllRandom);
  EXPECT_TRUE(set->Add("m.weight", {4, 3}, 0, nn::InitRule::Normal(0.5)).ok());
  EXPECT_TRUE(set->Add("m.bias", {3}, -1, nn::InitRule::Normal(0.5)).ok());
  return set;
}

// Deterministic "full" gradients for step `step`.
at::Tensor FullGrad(const std::string& name, int step) {
  const int64_t n = name == "m.weight" ? 12 : 3;
  at::Tensor g = at::arange(n, at::kDouble).mul(0.37).add(step * 0.11).sin();
  return name == "m.weight" ? g.reshape({4, 3}) : g;
}

void SetGrads(nn::ParameterSet& set, int step) {
  for (const auto& p : set.parameters()) {
    at::Tensor full = FullGrad(p.name, step);
    at::Tensor local = p.slice.split_dim < 0
                           ? full
                           : full.narrow(p.slice.split_dim, p.slice.offset, p.slice.length);
    p.tensor.mutable_grad() = local.clone();
  }
}

TEST(ClipCoefficientTest, Values) {
  EXPECT_EQ(ClipCoefficient(0.5, 1.0), 1.0);
  EXPECT_NEAR(ClipCoefficient(4.0, 1.0), 1.0 / (4.0 + 1e-6), 1e-15);
  EXPECT_EQ(ClipCoefficient(100.0, 0.0), 1.0);  // clipping off
}

TEST(OwnedSumsTest, SplitOnEveryRankReplicatedOnRankZeroOnly) {
  auto full = MakeSet(0, 1);
  auto r0 = MakeSet(0, 2);
  auto r1 = MakeSet(1, 2);
  SetGrads(*full, 0);
  SetGrads(*r0, 0);
  SetGrads(*r1, 0);
  const OwnedSums f = OwnedGradSums(*full);
  const OwnedSums a = OwnedGradSums(*r0);
  const OwnedSums b = OwnedGradSums(*r1);
  EXPECT_NEAR(a.square_sum + b.square_sum, f.square_sum, 1e-14);
  EXPECT_NEAR(a.sum + b.sum, f.sum, 1e-14);
  // Rank 1 holds only its half of the matrix.
  const double half = FullGrad("m.weight", 0).narrow(0, 2, 2).square().sum().item<double>();
  EXPECT_NEAR(b.square_sum, half, 1e-14);
  // Parameters: the same rule.
  const OwnedSums pf = OwnedParamSums(*full);
  const OwnedSums pa = OwnedParamSums(*r0);
  const OwnedSums pb = OwnedParamSums(*r1);
  EXPECT_NEAR(pa.square_sum + pb.square_sum, pf.square_sum, 1e-13);
}

TEST(ModuleOptimizerTest, OneAdamWStepMatchesTheFormula) {
  nn::ParameterSet set(1, at::kDouble, 0, 1, nn::InitStyle::kTraining);
  // A matrix: weight decay applies to parameters of two or more dimensions only.
  ASSERT_TRUE(set.Add("p", {1, 1}, -1, nn::InitRule::Constant(1.0)).ok());
  auto opt = ModuleOptimizer::Create(&set, Adam(0.1, 0.01));
  ASSERT_TRUE(opt.ok()) << opt.status();
  set.parameters()[0].tensor.mutable_grad() = at::full({1, 1}, 0.5, at::kDouble);
  ASSERT_TRUE((*opt)->Step(0, 1.0).ok());
  // Decoupled decay, then the bias-corrected Adam update: m_hat = g, v_hat = g^2.
  const double expected = 1.0 * (1 - 0.1 * 0.01) - 0.1 * 0.5 / (std::sqrt(0.25) + 1e-8);
  EXPECT_NEAR(set.parameters()[0].tensor.item<double>(), expected, 1e-15);
  EXPECT_FALSE(set.parameters()[0].tensor.grad().defined());  // gradients dropped
}

TEST(ModuleOptimizerTest, ClipCoefficientScalesTheGradient) {
  nn::ParameterSet a(1, at::kDouble, 0, 1, nn::InitStyle::kTraining);
  nn::ParameterSet b(1, at::kDouble, 0, 1, nn::InitStyle::kTraining);
  ASSERT_TRUE(a.Add("p", {1}, -1, nn::InitRule::Constant(1.0)).ok());
  ASSERT_TRUE(b.Add("p", {1}, -1, nn::InitRule::Constant(1.0)).ok());
  auto oa = ModuleOptimizer::Create(&a, Adam(0.1, 0.0));
  auto ob = ModuleOptimizer::Create(&b, Adam(0.1, 0.0));
  ASSERT_TRUE(oa.ok() && ob.ok());
  for (int step = 0; step < 3; ++step) {
    a.parameters()[0].tensor.mutable_grad() = at::full({1}, 0.8 + step, at::kDouble);
    b.parameters()[0].tensor.mutable_grad() = at::full({1}, (0.8 + step) * 0.25, at::kDouble);
    ASSERT_TRUE((*oa)->Step(step, 0.25).ok());
    ASSERT_TRUE((*ob)->Step(step, 1.0).ok());
  }
  EXPECT_NEAR(a.parameters()[0].tensor.item<double>(), b.parameters()[0].tensor.item<double>(),
              1e-15);
}

TEST(ModuleOptimizerTest, TpSlicesStepLikeTheFullParameter) {
  auto full = MakeSet(0, 1);
  auto r0 = MakeSet(0, 2);
  auto r1 = MakeSet(1, 2);
  auto of = ModuleOptimizer::Create(full.get(), Adam(0.05, 0.1));
  auto o0 = ModuleOptimizer::Create(r0.get(), Adam(0.05, 0.1));
  auto o1 = ModuleOptimizer::Create(r1.get(), Adam(0.05, 0.1));
  ASSERT_TRUE(of.ok() && o0.ok() && o1.ok());
  for (int step = 0; step < 4; ++step) {
    SetGrads(*full, step);
    SetGrads(*r0, step);
    SetGrads(*r1, step);
    ASSERT_TRUE((*of)->Step(step, 0.7).ok());
    ASSERT_TRUE((*o0)->Step(step, 0.7).ok());
    ASSERT_TRUE((*o1)->Step(step, 0.7).ok());
  }
  const at::Tensor w = full->Find("m.weight")->tensor;
  const at::Tensor joined = at::cat({r0->Find("m.weight")->tensor, r1->Find("m.weight")->tensor});
  EXPECT_EQ(at::max(at::abs(w - joined)).item<double>(), 0.0);
  EXPECT_EQ(
      at::max(at::abs(full->Find("m.bias")->tensor - r1->Find("m.bias")->tensor)).item<double>(),
      0.0);
}

TEST(ModuleOptimizerTest, ParameterWithoutGradientStepsWithZero) {
  nn::ParameterSet set(1, at::kDouble, 0, 1, nn::InitStyle::kTraining);
  ASSERT_TRUE(set.Add("p", {1, 1}, -1, nn::InitRule::Constant(2.0)).ok());
  auto opt = ModuleOptimizer::Create(&set, Adam(0.1, 0.5));
  ASSERT_TRUE(opt.ok());
  ASSERT_TRUE((*opt)->Step(0, 1.0).ok());
  // Only the decoupled weight decay acts: 2 * (1 - 0.1 * 0.5).
  EXPECT_NEAR(set.parameters()[0].tensor.item<double>(), 1.9, 1e-15);
}

// A frozen parameter has no AdamW state: weight decay and a stray gradient leave it as it was,
// while its trainable neighbour decays.
TEST(ModuleOptimizerTest, FrozenParameterNeverChanges) {
  nn::ParameterSet set(1, at::kDouble, 0, 1, nn::InitStyle::kTraining);
  ASSERT_TRUE(set.Add("tower.w", {1, 1}, -1, nn::InitRule::Constant(2.0)).ok());
  ASSERT_TRUE(set.Add("head.w", {1, 1}, -1, nn::InitRule::Constant(2.0)).ok());
  EXPECT_EQ(set.Freeze("tower."), 1);
  EXPECT_EQ(set.Freeze("tower."), 0);  // already frozen
  EXPECT_FALSE(set.parameters()[0].trainable);
  EXPECT_FALSE(set.parameters()[0].tensor.requires_grad());
  EXPECT_EQ(set.TrainableLocalNumel(), 1);
  auto opt = ModuleOptimizer::Create(&set, Adam(0.1, 0.5));
  ASSERT_TRUE(opt.ok());
  set.parameters()[0].tensor.mutable_grad() = at::ones_like(set.parameters()[0].tensor);
  ASSERT_TRUE((*opt)->Step(0, 1.0).ok());
  EXPECT_EQ(set.parameters()[0].tensor.item<double>(), 2.0);
  EXPECT_NEAR(set.parameters()[1].tensor.item<double>(), 1.9, 1e-15);
  // Everything frozen: the optimizer is a no-op.
  EXPECT_EQ(set.Freeze(""), 1);
  EXPECT_FALSE(set.AnyTrainable());
  auto none = ModuleOptimizer::Create(&set, Adam(0.1, 0.5));
  ASSERT_TRUE(none.ok()) << none.status();
  ASSERT_TRUE((*none)->Step(1, 1.0).ok());
  EXPECT_NEAR(set.parameters()[1].tensor.item<double>(), 1.9, 1e-15);
}

// A fresh optimizer given the parameters and the AdamW state of one after 3 steps takes the 4th
// step bit for bit as the original does: StateOf/SetState carry everything AdamW needs (the
// moments and the step count behind the bias correction).
TEST(ModuleOptimizerTest, SetStateContinuesExactlyLikeTheOriginal) {
  auto original = MakeSet(0, 1);
  auto original_opt = ModuleOptimizer::Create(original.get(), Adam(0.05, 0.1, 2));
  ASSERT_TRUE(original_opt.ok());
  EXPECT_FALSE((*original_opt)->StateOf("m.weight").has_value());  // before the first step
  for (int step = 0; step < 3; ++step) {
    SetGrads(*original, step);
    ASSERT_TRUE((*original_opt)->Step(step, 0.8).ok());
  }
  // Another seed: every value the copy ends with comes from the original.
  nn::ParameterSet copy(8, at::kDouble, 0, 1, nn::InitStyle::kAllRandom);
  ASSERT_TRUE(copy.Add("m.weight", {4, 3}, 0, nn::InitRule::Normal(0.5)).ok());
  ASSERT_TRUE(copy.Add("m.bias", {3}, -1, nn::InitRule::Normal(0.5)).ok());
  auto copy_opt = ModuleOptimizer::Create(&copy, Adam(0.05, 0.1, 2));
  ASSERT_TRUE(copy_opt.ok());
  for (const auto& p : original->parameters()) {
    std::optional<ModuleOptimizer::ParamState> state = (*original_opt)->StateOf(p.name);
    ASSERT_TRUE(state.has_value()) << p.name;
    EXPECT_EQ(state->step, 3) << p.name;
    {
      at::NoGradGuard no_grad;
      copy.Find(p.name)->tensor.copy_(p.tensor);
    }
    ASSERT_TRUE((*copy_opt)->SetState(p.name, *state).ok()) << p.name;
    // SetState copied the moments: they do not alias the original's.
    std::optional<ModuleOptimizer::ParamState> copied = (*copy_opt)->StateOf(p.name);
    ASSERT_TRUE(copied.has_value());
    EXPECT_FALSE(copied->exp_avg.is_same(state->exp_avg));
    EXPECT_TRUE(at::equal(copied->exp_avg, state->exp_avg)) << p.name;
    EXPECT_TRUE(at::equal(copied->exp_avg_sq, state->exp_avg_sq)) << p.name;
  }
  SetGrads(*original, 3);
  SetGrads(copy, 3);
  ASSERT_TRUE((*original_opt)->Step(3, 0.8).ok());
  ASSERT_TRUE((*copy_opt)->Step(3, 0.8).ok());
  for (const auto& p : original->parameters()) {
    const at::Tensor a = p.tensor.detach().reshape({-1});
    const at::Tensor b = copy.Find(p.name)->tensor.detach().reshape({-1});
    // The step moved the parameter, so matching it is not matching a copy made before it.
    ASSERT_EQ(a.numel(), b.numel());
    for (int64_t i = 0; i < a.numel(); ++i) {
      EXPECT_EQ(a[i].item<double>(), b[i].item<double>()) << p.name << " at index " << i;
    }
    EXPECT_EQ((*copy_opt)->StateOf(p.name)->step, 4);
  }
}

TEST(ModuleOptimizerTest, SetStateRejectsFrozenUnknownAndMisshapen) {
  nn::ParameterSet set(1, at::kDouble, 0, 1, nn::InitStyle::kTraining);
  ASSERT_TRUE(set.Add("tower.w", {2, 3}, -1, nn::InitRule::Constant(1.0)).ok());
  ASSERT_TRUE(set.Add("head.w", {2, 3}, -1, nn::InitRule::Constant(1.0)).ok());
  set.Freeze("tower.");
  auto opt = ModuleOptimizer::Create(&set, Adam(0.1, 0.0));
  ASSERT_TRUE(opt.ok());
  const ModuleOptimizer::ParamState good{at::ones({2, 3}, at::kFloat),
                                         at::full({2, 3}, 0.5, at::kFloat), 7, at::Tensor()};
  for (const std::string name : {"tower.w", "nope"}) {
    absl::Status status = (*opt)->SetState(name, good);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_NE(status.message().find(name), std::string::npos) << status;
  }
  ModuleOptimizer::ParamState misshapen = good;
  misshapen.exp_avg_sq = at::ones({3, 2}, at::kDouble);
  absl::Status status = (*opt)->SetState("head.w", misshapen);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_NE(status.message().find("head.w"), std::string::npos) << status;
  EXPECT_FALSE((*opt)->StateOf("head.w").has_value());  // the failed call set nothing
  EXPECT_FALSE((*opt)->StateOf("tower.w").has_value());
  // A float32 state is converted to the parameter's float64.
  ASSERT_TRUE((*opt)->SetState("head.w", good).ok());
  std::optional<ModuleOptimizer::ParamState> state = (*opt)->StateOf("head.w");
  ASSERT_TRUE(state.has_value());
  EXPECT_EQ(state->step, 7);
  EXPECT_EQ(state->exp_avg.scalar_type(), at::kDouble);
  EXPECT_TRUE(at::equal(state->exp_avg_sq, at::full({2, 3}, 0.5, at::kDouble)));
  (*opt)->ClearState("head.w");
  EXPECT_FALSE((*opt)->StateOf("head.w").has_value());
}

TEST(ModuleOptimizerTest, NormsAndBiasesNeverDecayEmbeddingsDecayUnlessConfigured) {
  for (const bool no_decay_embeddings : {false, true}) {
    nn::ParameterSet set(1, at::kDouble, 0, 1, nn::InitStyle::kTraining);
    ASSERT_TRUE(set.Add("w", {2, 2}, -1, nn::InitRule::Constant(1.0)).ok());
    ASSERT_TRUE(set.Add("norm", {2}, -1, nn::InitRule::Constant(1.0)).ok());
    ASSERT_TRUE(set.Add("embed", {3, 2}, -1, nn::InitRule::Constant(1.0)).ok());
    ASSERT_TRUE(set.MarkEmbedding("embed").ok());
    EXPECT_EQ(set.MarkEmbedding("nope").code(), absl::StatusCode::kNotFound);
    hetpar::v1::Optimizer options = Adam(0.1, 0.5);
    options.set_no_decay_embeddings(no_decay_embeddings);
    auto opt = ModuleOptimizer::Create(&set, options);
    ASSERT_TRUE(opt.ok()) << opt.status();
    EXPECT_TRUE((*opt)->Decays("w"));
    EXPECT_FALSE((*opt)->Decays("norm"));
    EXPECT_EQ((*opt)->Decays("embed"), !no_decay_embeddings);
    // Zero gradients: Adam's update is 0, so whatever moves is weight decay, x (1 - lr wd).
    ASSERT_TRUE((*opt)->Step(0, 1.0).ok());
    EXPECT_NEAR(set.Find("w")->tensor.sum().item<double>(), 4 * 0.95, 1e-12);
    EXPECT_EQ(set.Find("norm")->tensor.sum().item<double>(), 2.0);
    EXPECT_NEAR(set.Find("embed")->tensor.sum().item<double>(),
                no_decay_embeddings ? 6.0 : 6 * 0.95, 1e-12);
  }
}

TEST(ModuleOptimizerTest, Bfloat16ParametersStepOnFloat32Masters) {
  nn::ParameterSet set(1, at::kBFloat16, 0, 1, nn::InitStyle::kTraining);
  ASSERT_TRUE(set.Add("w", {2, 2}, -1, nn::InitRule::Constant(1.0)).ok());
  auto opt = ModuleOptimizer::Create(&set, Adam(1e-4, 0.0));
  ASSERT_TRUE(opt.ok()) << opt.status();
  EXPECT_TRUE((*opt)->HasMasters());
  EXPECT_EQ((*opt)->StateDtype(), at::kFloat);
  const at::Tensor& w = set.Find("w")->tensor;
  // A constant gradient: every bias-corrected Adam update is lr (m_hat / sqrt(v_hat) = 1). One
  // update, 1e-4, is far below bfloat16's spacing below 1.0 (2^-8): bfloat16 weights updated in
  // place would never move.
  for (int step = 0; step < 40; ++step) {
    w.mutable_grad() = at::ones({2, 2}, at::kFloat);
    ASSERT_TRUE((*opt)->Step(step, 1.0).ok());
  }
  std::optional<ModuleOptimizer::ParamState> state = (*opt)->StateOf("w");
  ASSERT_TRUE(state.has_value());
  ASSERT_TRUE(state->master.defined());
  EXPECT_EQ(state->master.scalar_type(), at::kFloat);
  EXPECT_EQ(state->exp_avg.scalar_type(), at::kFloat);
  EXPECT_NEAR(state->master[0][0].item<double>(), 1.0 - 40 * 1e-4, 1e-6);
  // The parameter is the master rounded to bfloat16: 0.996 is nearest to 1 - 2^-8.
  EXPECT_EQ(w.scalar_type(), at::kBFloat16);
  EXPECT_EQ(w[0][0].item<double>(), 1.0 - std::ldexp(1.0, -8));
}

TEST(ModuleOptimizerTest, Bfloat16GradientsAccumulateInFloat32) {
  nn::ParameterSet set(1, at::kBFloat16, 0, 1, nn::InitStyle::kTraining);
  ASSERT_TRUE(set.Add("w", {1, 1}, -1, nn::InitRule::Constant(1.0)).ok());
  EXPECT_EQ(set.grad_dtype(), at::kFloat);
  const at::Tensor& w = set.Find("w")->tensor;
  // Two waves: gradients 1 and 2^-9. Their sum is exact in float32; bfloat16 (8 significant
  // bits) would round it back to 1.
  for (const double x : {1.0, std::ldexp(1.0, -9)}) {
    (w * at::full({1, 1}, x, at::kBFloat16)).sum().backward();
  }
  ASSERT_TRUE(w.grad().defined());
  EXPECT_EQ(w.grad().scalar_type(), at::kFloat);
  EXPECT_EQ(w.grad().item<double>(), 1.0 + std::ldexp(1.0, -9));
}

TEST(ModuleOptimizerTest, Bfloat16SetStateTakesTheMasterAndClearStateTheParameter) {
  nn::ParameterSet set(1, at::kBFloat16, 0, 1, nn::InitStyle::kTraining);
  ASSERT_TRUE(set.Add("w", {1, 1}, -1, nn::InitRule::Constant(1.0)).ok());
  auto opt = ModuleOptimizer::Create(&set, Adam(1e-3, 0.0));
  ASSERT_TRUE(opt.ok()) << opt.status();
  ModuleOptimizer::ParamState state;
  state.exp_avg = at::full({1, 1}, 0.25, at::kFloat);
  state.exp_avg_sq = at::full({1, 1}, 0.5, at::kFloat);
  state.step = 5;
  state.master = at::full({1, 1}, 0.999, at::kFloat);
  ASSERT_TRUE((*opt)->SetState("w", state).ok());
  const at::Tensor& w = set.Find("w")->tensor;
  EXPECT_EQ(w.item<double>(), at::full({1, 1}, 0.999, at::kBFloat16).item<double>());
  std::optional<ModuleOptimizer::ParamState> got = (*opt)->StateOf("w");
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(got->master.item<float>(), 0.999f);
  EXPECT_FALSE(got->master.is_same(state.master));
  {
    at::NoGradGuard no_grad;
    w.fill_(0.5);
  }
  (*opt)->ClearState("w");
  EXPECT_FALSE((*opt)->StateOf("w").has_value());
  // The next step starts from the parameter's value (0.5), not the old master.
  w.mutable_grad() = at::ones({1, 1}, at::kFloat);
  ASSERT_TRUE((*opt)->Step(0, 1.0).ok());
  EXPECT_NEAR((*opt)->StateOf("w")->master.item<double>(), 0.5 - 1e-3, 1e-7);
}

TEST(ModuleOptimizerTest, LinearWarmup) {
  nn::ParameterSet set(1, at::kDouble, 0, 1, nn::InitStyle::kTraining);
  ASSERT_TRUE(set.Add("p", {1}, -1, nn::InitRule::Constant(1.0)).ok());
  auto opt = ModuleOptimizer::Create(&set, Adam(0.4, 0.0, 4));
  ASSERT_TRUE(opt.ok());
  EXPECT_DOUBLE_EQ((*opt)->LearningRate(0), 0.1);
  EXPECT_DOUBLE_EQ((*opt)->LearningRate(3), 0.4);
  EXPECT_DOUBLE_EQ((*opt)->LearningRate(10), 0.4);
}

TEST(ModuleOptimizerTest, RejectsNonPositiveLr) {
  nn::ParameterSet set(1, at::kDouble, 0, 1, nn::InitStyle::kTraining);
  EXPECT_FALSE(ModuleOptimizer::Create(&set, Adam(0.0, 0.0)).ok());
}

}  // namespace
}  // namespace hetpar::train
