#include "common/train/grad_reducer.h"

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/nn/test_ranks.h"
#include "common/status.h"
#include "common/train/optimizer.h"
#include "gtest/gtest.h"

namespace hetpar::train {
namespace {

using nn::testing::RunRanks;

// Three float64 matrices of 4, 6 and 8 elements: with a bucket of 6 elements (48 bytes) every
// parameter is its own bucket ("c" first: reverse registration order).
std::unique_ptr<nn::ParameterSet> MakeSet() {
  auto set = std::make_unique<nn::ParameterSet>(5, at::kDouble, 0, 1, nn::InitStyle::kTraining);
  EXPECT_TRUE(set->Add("a", {2, 2}, -1, nn::InitRule::Normal(1.0)).ok());
  EXPECT_TRUE(set->Add("b", {2, 3}, -1, nn::InitRule::Normal(1.0)).ok());
  EXPECT_TRUE(set->Add("c", {2, 4}, -1, nn::InitRule::Normal(1.0)).ok());
  return set;
}

// The input that multiplies parameter `name` in wave `wave` of rank `rank`; the loss
// sum(p * x) has gradient x, so the expected sums need no autograd.
at::Tensor Input(const std::string& name, int rank, int wave, at::IntArrayRef shape) {
  const double seed = 0.37 * (rank + 1) + 0.11 * wave + static_cast<double>(name[0]);
  return at::arange(c10::multiply_integers(shape), at::kDouble).mul(seed).sin().reshape(shape);
}

// One backward over the named parameters of `set`.
void Backward(nn::ParameterSet& set, const std::vector<std::string>& names, int rank, int wave) {
  at::Tensor loss = at::zeros({}, at::kDouble);
  for (const std::string& name : names) {
    const at::Tensor& p = set.Find(name)->tensor;
    loss = loss + (p * Input(name, rank, wave, p.sizes())).sum();
  }
  loss.backward();
}

TEST(GradientReducerTest, SumsOverRanksAndWavesWithBucketsStartedDuringTheLastBackward) {
  constexpr int kRanks = 2;
  absl::Status status = RunRanks(kRanks, [&](int rank, nn::Communicator& dp) -> absl::Status {
    auto set = MakeSet();
    GradientReducer reducer(set.get(), 6 * 8);
    EXPECT_EQ(reducer.buckets(), 3);
    for (int step = 0; step < 2; ++step) {  // the second step starts from zeroed buckets
      HETPAR_RETURN_IF_ERROR(reducer.BeginStep(&dp));
      const void* before = set->Find("b")->tensor.grad().data_ptr();
      Backward(*set, {"a", "b", "c"}, rank, 0);
      reducer.ArmLastBackward();
      Backward(*set, {"a", "b", "c"}, rank, 1);
      HETPAR_RETURN_IF_ERROR(reducer.Finish());
      // Every bucket was complete within the last backward, and the gradients were summed where
      // they accumulated: no copy.
      EXPECT_EQ(reducer.started_during_backward(), 3);
      EXPECT_EQ(set->Find("b")->tensor.grad().data_ptr(), before);
      for (const char* name : {"a", "b", "c"}) {
        const at::Tensor& p = set->Find(name)->tensor;
        at::Tensor expected = at::zeros(p.sizes(), at::kDouble);
        for (int r = 0; r < kRanks; ++r) {
          for (int wave = 0; wave < 2; ++wave) expected += Input(name, r, wave, p.sizes());
        }
        EXPECT_TRUE(at::allclose(p.grad(), expected, 1e-14, 0))
            << "rank " << rank << " step " << step << " parameter " << name;
      }
      set->ZeroGrad();  // as the optimizer step does
    }
    return absl::OkStatus();
  });
  EXPECT_TRUE(status.ok()) << status;
}

// After an LLM replica left the run, the replicas left may take different numbers of waves
// (plan::AssignLlm): each arms its own last backward, and the sums are over every wave of every
// rank.
TEST(GradientReducerTest, RanksTakingDifferentNumbersOfWavesSumThemAll) {
  constexpr int kRanks = 2;
  const int waves_of[kRanks] = {3, 2};
  absl::Status status = RunRanks(kRanks, [&](int rank, nn::Communicator& dp) -> absl::Status {
    auto set = MakeSet();
    GradientReducer reducer(set.get(), 6 * 8);
    HETPAR_RETURN_IF_ERROR(reducer.BeginStep(&dp));
    for (int wave = 0; wave < waves_of[rank]; ++wave) {
      if (wave + 1 == waves_of[rank]) reducer.ArmLastBackward();
      Backward(*set, {"a", "b", "c"}, rank, wave);
    }
    HETPAR_RETURN_IF_ERROR(reducer.Finish());
    EXPECT_EQ(reducer.started_during_backward(), 3);
    for (const char* name : {"a", "b", "c"}) {
      const at::Tensor& p = set->Find(name)->tensor;
      at::Tensor expected = at::zeros(p.sizes(), at::kDouble);
      for (int r = 0; r < kRanks; ++r) {
        for (int wave = 0; wave < waves_of[r]; ++wave) expected += Input(name, r, wave, p.sizes());
      }
      EXPECT_TRUE(at::allclose(p.grad(), expected, 1e-14, 0))
          << "rank " << rank << " parameter " << name;
    }
    return absl::OkStatus();
  });
  EXPECT_TRUE(status.ok()) << status;
}

TEST(GradientReducerTest, AParameterWithoutAGradientInTheLastBackwardIsSummedByFinish) {
  constexpr int kRanks = 2;
  absl::Status status = RunRanks(kRanks, [&](int rank, nn::Communicator& dp) -> absl::Status {
    auto set = MakeSet();
    // One bucket for all: 18 elements.
    GradientReducer reducer(set.get(), 18 * 8);
    EXPECT_EQ(reducer.buckets(), 1);
    HETPAR_RETURN_IF_ERROR(reducer.BeginStep(&dp));
    Backward(*set, {"a", "b", "c"}, rank, 0);
    reducer.ArmLastBackward();
    // Rank 1's last wave does not use "a": its bucket is never complete during backward there,
    // while rank 0's is; both still issue the same one all-reduce.
    Backward(
        *set,
        rank == 0 ? std::vector<std::string>{"a", "b", "c"} : std::vector<std::string>{"b", "c"},
        rank, 1);
    HETPAR_RETURN_IF_ERROR(reducer.Finish());
    EXPECT_EQ(reducer.started_during_backward(), rank == 0 ? 1 : 0);
    const at::Tensor& a = set->Find("a")->tensor;
    const at::Tensor expected =
        Input("a", 0, 0, a.sizes()) + Input("a", 1, 0, a.sizes()) + Input("a", 0, 1, a.sizes());
    EXPECT_TRUE(at::allclose(a.grad(), expected, 1e-14, 0)) << "rank " << rank;
    return absl::OkStatus();
  });
  EXPECT_TRUE(status.ok()) << status;
}

TEST(GradientReducerTest, FrozenParametersAreLeftOut) {
  auto set = MakeSet();
  set->Freeze("b");
  GradientReducer reducer(set.get(), 1 << 20);
  EXPECT_EQ(reducer.buckets(), 1);
  auto single = nn::Communicator::CreateSingle();
  ASSERT_TRUE(reducer.BeginStep(single.get()).ok());
  EXPECT_FALSE(set->Find("b")->tensor.grad().defined());
  EXPECT_TRUE(set->Find("a")->tensor.grad().defined());
  EXPECT_EQ(set->Find("a")->tensor.grad().sum().item<double>(), 0.0);
  Backward(*set, {"a", "c"}, 0, 0);
  ASSERT_TRUE(reducer.Finish().ok());
  const at::Tensor& c = set->Find("c")->tensor;
  EXPECT_TRUE(at::allclose(c.grad(), Input("c", 0, 0, c.sizes()), 1e-15, 0));
}

TEST(GradientReducerTest, FinishWithoutBeginStepFails) {
  auto set = MakeSet();
  GradientReducer reducer(set.get(), 1 << 20);
  EXPECT_EQ(reducer.Finish().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(GradBucketBytesTest, FromMib) {
  hetpar::v1::RunSpec spec;
  spec.mutable_run()->set_grad_bucket_mib(0.5);
  EXPECT_EQ(GradBucketBytes(spec), 512 * 1024);
}

}  // namespace
}  // namespace hetpar::train
