#include "common/nn/parameters.h"

#include <ATen/ATen.h>

#include "common/nn/test_ranks.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hetpar::nn {
namespace {

using ::testing::HasSubstr;
using testing::RunRanks;

at::Tensor Full(const std::string& name, const std::vector<int64_t>& shape, const InitRule& rule,
                at::ScalarType dtype = at::kDouble, int64_t seed = 1234) {
  return InitSlice(seed, name, shape, rule, -1, 0, 0, dtype);
}

TEST(ParametersTest, SlicesOfEveryTpSizeEqualTheFullTensor) {
  const InitRule rule = InitRule::Normal(0.02);
  for (const std::vector<int64_t>& shape :
       std::vector<std::vector<int64_t>>{{16}, {8, 12}, {12, 4, 4}}) {
    for (int dim = 0; dim < static_cast<int>(shape.size()); ++dim) {
      at::Tensor full = Full("p", shape, rule);
      for (int tp : {1, 2, 4}) {
        const int64_t length = shape[dim] / tp;
        for (int rank = 0; rank < tp; ++rank) {
          at::Tensor part =
              InitSlice(1234, "p", shape, rule, dim, rank * length, length, at::kDouble);
          EXPECT_TRUE(at::equal(part, full.narrow(dim, rank * length, length)))
              << "shape dims " << shape.size() << " split " << dim << " tp " << tp << " rank "
              << rank;
        }
      }
    }
  }
}

TEST(ParametersTest, InitDependsOnSeedAndNameOnly) {
  const InitRule rule = InitRule::Normal(1.0);
  at::Tensor a = Full("llm.layers.0.attn.qkv.weight", {6, 5}, rule);
  EXPECT_TRUE(at::equal(a, Full("llm.layers.0.attn.qkv.weight", {6, 5}, rule)));
  EXPECT_FALSE(at::equal(a, Full("llm.layers.1.attn.qkv.weight", {6, 5}, rule)));
  EXPECT_FALSE(at::equal(a, Full("llm.layers.0.attn.qkv.weight", {6, 5}, rule, at::kDouble, 99)));
  // Rows differ from each other (each row has its own stream).
  EXPECT_FALSE(at::equal(a[0], a[1]));
  EXPECT_NE(ParameterSeed(1, "x"), ParameterSeed(2, "x"));
  EXPECT_NE(ParameterSeed(1, "x"), ParameterSeed(1, "y"));
  EXPECT_EQ(ParameterSeed(1, "x"), ParameterSeed(1, "x"));
}

TEST(ParametersTest, DtypesRoundTheSameFloat64Draw) {
  const InitRule rule = InitRule::Normal(0.5);
  at::Tensor f64 = Full("w", {4, 8}, rule, at::kDouble);
  EXPECT_TRUE(at::equal(Full("w", {4, 8}, rule, at::kFloat), f64.to(at::kFloat)));
  EXPECT_TRUE(at::equal(Full("w", {4, 8}, rule, at::kBFloat16), f64.to(at::kBFloat16)));
}

TEST(ParametersTest, NormalStatisticsAndConstants) {
  at::Tensor w = Full("big", {256, 256}, InitRule::Normal(0.02, 0.5));
  EXPECT_NEAR(w.mean().item<double>(), 0.5, 0.001);
  EXPECT_NEAR(w.std().item<double>(), 0.02, 0.001);
  EXPECT_TRUE(
      at::equal(Full("c", {3, 2}, InitRule::Constant(1.5)), at::full({3, 2}, 1.5, at::kDouble)));
}

TEST(ParametersTest, ParameterSetRecordsSlicingAndMatchesTp1) {
  ParameterSet single(7, at::kFloat, 0, 1, InitStyle::kTraining);
  ASSERT_TRUE(single.Add("m.col", {8, 6}, 0, InitRule::Normal(0.02)).ok());
  ASSERT_TRUE(single.Add("m.row", {6, 8}, 1, InitRule::Normal(0.02)).ok());
  ASSERT_TRUE(single.Add("m.norm", {6}, -1, single.NormScaleInit(), true).ok());
  for (int rank = 0; rank < 2; ++rank) {
    ParameterSet part(7, at::kFloat, rank, 2, InitStyle::kTraining);
    ASSERT_TRUE(part.Add("m.col", {8, 6}, 0, InitRule::Normal(0.02)).ok());
    ASSERT_TRUE(part.Add("m.row", {6, 8}, 1, InitRule::Normal(0.02)).ok());
    ASSERT_TRUE(part.Add("m.norm", {6}, -1, part.NormScaleInit(), true).ok());
    ASSERT_EQ(part.parameters().size(), 3u);
    for (const NamedParameter& p : part.parameters()) {
      const NamedParameter* full = single.Find(p.name);
      ASSERT_NE(full, nullptr) << p.name;
      EXPECT_EQ(p.full_shape, full->full_shape);
      EXPECT_TRUE(p.tensor.requires_grad());
      EXPECT_TRUE(p.tensor.is_leaf());
      at::Tensor expected = full->tensor.detach();
      if (p.slice.split_dim >= 0) {
        EXPECT_EQ(p.slice.length, full->full_shape[p.slice.split_dim] / 2) << p.name;
        EXPECT_EQ(p.slice.offset, rank * p.slice.length) << p.name;
        expected = expected.narrow(p.slice.split_dim, p.slice.offset, p.slice.length);
      }
      EXPECT_TRUE(at::equal(p.tensor.detach(), expected)) << p.name << " rank " << rank;
    }
    EXPECT_EQ(part.LocalNumel(), 24 + 24 + 6);
    EXPECT_EQ(part.FullNumel(), 48 + 48 + 6);
    EXPECT_TRUE(part.Find("m.norm")->grad_partial_over_sequence);
    EXPECT_FALSE(part.Find("m.col")->grad_partial_over_sequence);
  }
  EXPECT_TRUE(at::equal(single.Find("m.norm")->tensor.detach(), at::ones({6})));
}

TEST(ParametersTest, AllRandomStyleDrawsBiasesAndNormScales) {
  ParameterSet set(7, at::kDouble, 0, 1, InitStyle::kAllRandom);
  auto bias = set.Add("b", {64}, -1, set.BiasInit());
  auto scale = set.Add("s", {64}, -1, set.NormScaleInit());
  ASSERT_TRUE(bias.ok() && scale.ok());
  EXPECT_GT(bias->abs().max().item<double>(), 0.0);
  EXPECT_NEAR(scale->mean().item<double>(), 1.0, 0.05);
  EXPECT_GT(scale->std().item<double>(), 0.03);
}

TEST(ParametersTest, AddRejectsBadShapesAndDuplicates) {
  ParameterSet set(1, at::kFloat, 0, 4, InitStyle::kTraining);
  auto odd = set.Add("llm.layers.0.mlp.gate.weight", {6, 8}, 0, InitRule::Normal(0.02));
  ASSERT_FALSE(odd.ok());
  EXPECT_EQ(odd.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(odd.status().message()),
              HasSubstr("llm.layers.0.mlp.gate.weight: dimension 0 of [6, 8] (6) does not divide "
                        "by the tensor-parallel size 4"));
  ASSERT_TRUE(set.Add("a", {8, 8}, 0, InitRule::Normal(0.02)).ok());
  auto again = set.Add("a", {8, 8}, 0, InitRule::Normal(0.02));
  EXPECT_EQ(again.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_FALSE(set.Add("e", {0, 8}, 0, InitRule::Normal(0.02)).ok());
  EXPECT_FALSE(set.Add("d", {8, 8}, 2, InitRule::Normal(0.02)).ok());
}

TEST(ParametersTest, TorchDtypeMapsRunSpecDtypes) {
  EXPECT_EQ(*TorchDtype(hetpar::v1::DTYPE_FLOAT32), at::kFloat);
  EXPECT_EQ(*TorchDtype(hetpar::v1::DTYPE_FLOAT64), at::kDouble);
  EXPECT_EQ(*TorchDtype(hetpar::v1::DTYPE_BFLOAT16), at::kBFloat16);
  auto bad = TorchDtype(hetpar::v1::DTYPE_UNSPECIFIED);
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("expected float32, float64"));
}

TEST(ParametersTest, GatherFullTensorAndReducePartialGradsOverThreads) {
  ParameterSet reference(3, at::kDouble, 0, 1, InitStyle::kAllRandom);
  ASSERT_TRUE(reference.Add("col", {4, 6}, 0, InitRule::Normal(1.0)).ok());
  ASSERT_TRUE(reference.Add("row", {6, 4}, 1, InitRule::Normal(1.0)).ok());
  absl::Status status = RunRanks(2, [&](int rank, Communicator& comm) {
    ParameterSet set(3, at::kDouble, rank, 2, InitStyle::kAllRandom);
    for (const auto& [name, dim] : {std::pair<std::string, int>{"col", 0}, {"row", 1}}) {
      auto t =
          set.Add(name, name == "col" ? std::vector<int64_t>{4, 6} : std::vector<int64_t>{6, 4},
                  dim, InitRule::Normal(1.0));
      if (!t.ok()) return t.status();
    }
    auto norm = set.Add("norm", {5}, -1, InitRule::Constant(1.0), true);
    if (!norm.ok()) return norm.status();
    for (const NamedParameter& p : set.parameters()) {
      if (p.name == "norm") continue;
      auto full = GatherFullTensor(comm, p, p.tensor.detach());
      if (!full.ok()) return full.status();
      EXPECT_TRUE(at::equal(*full, reference.Find(p.name)->tensor.detach()))
          << p.name << " rank " << rank;
    }
    auto norm2 = set.Add("norm2", {3}, -1, InitRule::Constant(1.0), true);
    if (!norm2.ok()) return norm2.status();
    // Rank r's partial gradient of "norm" is (r + 1) everywhere; "norm2" has a gradient on rank 0
    // only (an undefined gradient counts as zero).
    set.parameters()[2].tensor.mutable_grad() = at::full({5}, rank + 1.0, at::kDouble);
    if (rank == 0) set.parameters()[3].tensor.mutable_grad() = at::full({3}, 7.0, at::kDouble);
    if (auto s = set.ReducePartialGrads(*comm.group()); !s.ok()) return s;
    EXPECT_TRUE(at::equal(set.Find("norm")->tensor.grad(), at::full({5}, 3.0, at::kDouble)));
    EXPECT_TRUE(at::equal(set.Find("norm2")->tensor.grad(), at::full({3}, 7.0, at::kDouble)));
    // Gradients of split parameters are left alone.
    EXPECT_FALSE(set.Find("col")->tensor.grad().defined());
    set.ZeroGrad();
    EXPECT_FALSE(set.Find("norm")->tensor.grad().defined());
    return absl::OkStatus();
  });
  ASSERT_TRUE(status.ok()) << status;
}

}  // namespace
}  // namespace hetpar::nn
