#include "common/nn/tp_ops.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <tuple>

#include "common/nn/test_ranks.h"
#include "gtest/gtest.h"

namespace hetpar::nn {
namespace {

using testing::RunRanks;

at::Tensor Random(std::vector<int64_t> shape, uint64_t seed, at::ScalarType dtype = at::kDouble) {
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::normal(0.0, 1.0, shape, generator, at::TensorOptions().dtype(at::kDouble)).to(dtype);
}

// Max |a - b| / max |b| over all elements (0 when both are zero).
double RelativeError(const at::Tensor& a, const at::Tensor& b) {
  at::Tensor x = a.detach().to(at::kDouble);
  at::Tensor y = b.detach().to(at::kDouble);
  EXPECT_EQ(x.sizes(), y.sizes());
  if (x.sizes() != y.sizes()) return 1e300;
  const double scale = y.abs().max().item<double>();
  const double diff = (x - y).abs().max().item<double>();
  return scale == 0 ? diff : diff / scale;
}

at::Tensor PadRows(const at::Tensor& x, int64_t rows) {
  if (x.size(0) == rows) return x;
  std::vector<int64_t> shape = x.sizes().vec();
  shape[0] = rows - x.size(0);
  return at::cat({x, at::zeros(shape, x.options())});
}

TEST(SequenceShardTest, PadsToAMultipleOfTheGroup) {
  SequenceShard s = ShardSequence(7, 3, 4);
  EXPECT_EQ(s.rows, 7);
  EXPECT_EQ(s.padded_rows, 8);
  EXPECT_EQ(s.shard_rows, 2);
  EXPECT_EQ(s.begin, 6);
  EXPECT_EQ(s.end, 7);
  s = ShardSequence(2, 3, 4);  // the last ranks hold only padding
  EXPECT_EQ(s.shard_rows, 1);
  EXPECT_EQ(s.begin, 2);
  EXPECT_EQ(s.end, 2);
  s = ShardSequence(12, 0, 1);
  EXPECT_EQ(s.padded_rows, 12);
  EXPECT_EQ(s.begin, 0);
  EXPECT_EQ(s.end, 12);
}

class TpOpsTest : public ::testing::TestWithParam<std::tuple<int, at::ScalarType>> {
 protected:
  int tp() const { return std::get<0>(GetParam()); }
  at::ScalarType dtype() const { return std::get<1>(GetParam()); }
  double tolerance() const { return dtype() == at::kDouble ? 1e-12 : 1e-6; }
};

TEST_P(TpOpsTest, VocabParallelCrossEntropyEqualsFullSoftmax) {
  const int64_t rows = 7, vocab = 16;
  at::Tensor logits = Random({rows, vocab}, 1, at::kDouble) * 3;
  logits[2] += 1000.0;  // a row that overflows exp() without the max shift
  const at::Tensor targets = at::tensor({0, 15, 4, 8, 7, 3, 12}, at::kLong);
  logits = logits.to(dtype()).to(at::kDouble);  // the values every rank sees, exactly
  const at::Tensor weights = Random({rows}, 2, dtype()).to(at::kDouble);
  // Reference from the full logits, in float64.
  at::Tensor full = logits.clone().requires_grad_(true);
  at::Tensor ref_loss = at::cross_entropy_loss(full, targets, {}, at::Reduction::None);
  (ref_loss * weights).sum().backward();
  const at::Tensor ref_grad = full.grad();

  absl::Status status = RunRanks(tp(), [&](int rank, Communicator& comm) {
    const int64_t part = vocab / tp();
    at::Tensor local = logits.narrow(1, rank * part, part).to(dtype()).clone().requires_grad_(true);
    at::Tensor loss = VocabParallelCrossEntropy(local, targets, rank * part, comm.group());
    EXPECT_EQ(loss.scalar_type(), dtype());
    EXPECT_LE(RelativeError(loss, ref_loss), tolerance()) << "rank " << rank;
    (loss * weights.to(loss.scalar_type())).sum().backward();
    EXPECT_EQ(local.grad().scalar_type(), dtype());
    EXPECT_LE(RelativeError(local.grad(), ref_grad.narrow(1, rank * part, part)), tolerance())
        << "rank " << rank;
    return absl::OkStatus();
  });
  ASSERT_TRUE(status.ok()) << status;
}

// A two-layer MLP (column-parallel, GELU, row-parallel) against the same MLP in one process,
// with and without sequence parallelism, on a row count that does not divide by the group.
TEST_P(TpOpsTest, ColumnRowMlpEqualsDenseWithAndWithoutSequenceParallelism) {
  const int64_t rows = 7, hidden = 8, inner = 16;
  const at::Tensor x = Random({rows, hidden}, 3, dtype());
  const at::Tensor w1 = Random({inner, hidden}, 4, dtype());
  const at::Tensor b1 = Random({inner}, 5, dtype());
  const at::Tensor w2 = Random({hidden, inner}, 6, dtype());
  const at::Tensor b2 = Random({hidden}, 7, dtype());
  const at::Tensor out_grad = Random({rows, hidden}, 8, dtype());
  std::vector<at::Tensor> ref = {x.clone(), w1.clone(), b1.clone(), w2.clone(), b2.clone()};
  for (auto& t : ref) t.requires_grad_(true);
  at::Tensor ref_y = at::linear(at::gelu(at::linear(ref[0], ref[1], ref[2])), ref[3], ref[4]);
  (ref_y * out_grad).sum().backward();

  for (bool sp : {false, true}) {
    absl::Status status = RunRanks(tp(), [&](int rank, Communicator& comm) {
      TensorParallel group{comm.group(), sp};
      const int64_t part = inner / tp();
      at::Tensor xin = x.clone().requires_grad_(true);
      at::Tensor w1l = w1.narrow(0, rank * part, part).clone().requires_grad_(true);
      at::Tensor b1l = b1.narrow(0, rank * part, part).clone().requires_grad_(true);
      at::Tensor w2l = w2.narrow(1, rank * part, part).clone().requires_grad_(true);
      at::Tensor b2r = b2.clone().requires_grad_(true);
      at::Tensor h = EnterTensorParallel(ToSequenceLayout(xin, group), rows, group);
      at::Tensor y =
          RowParallelLinear(at::gelu(ColumnParallelLinear(h, w1l, b1l)), w2l, b2r, group);
      const SequenceShard shard = ShardSequence(rows, rank, tp());
      at::Tensor g = out_grad;
      at::Tensor expected_y = ref_y.detach();
      if (group.sharded()) {
        g = PadRows(out_grad, shard.padded_rows)
                .narrow(0, rank * shard.shard_rows, shard.shard_rows);
        expected_y = PadRows(expected_y, shard.padded_rows)
                         .narrow(0, rank * shard.shard_rows, shard.shard_rows);
        // Padding rows hold the bias only; compare the real rows.
        const int64_t real = shard.end - shard.begin;
        EXPECT_LE(RelativeError(y.narrow(0, 0, real), expected_y.narrow(0, 0, real)), tolerance())
            << "sp rank " << rank;
      } else {
        EXPECT_LE(RelativeError(y, expected_y), tolerance()) << "rank " << rank;
      }
      (y * g).sum().backward();
      EXPECT_LE(RelativeError(xin.grad(), ref[0].grad()), tolerance()) << "x rank " << rank;
      EXPECT_LE(RelativeError(w1l.grad(), ref[1].grad().narrow(0, rank * part, part)), tolerance());
      EXPECT_LE(RelativeError(b1l.grad(), ref[2].grad().narrow(0, rank * part, part)), tolerance());
      EXPECT_LE(RelativeError(w2l.grad(), ref[3].grad().narrow(1, rank * part, part)), tolerance());
      at::Tensor b2_grad = b2r.grad().clone();
      if (group.sharded()) {
        // The replicated bias saw this rank's rows only: its gradient is a partial sum.
        comm.group()->AllReduce(b2_grad);
      }
      EXPECT_LE(RelativeError(b2_grad, ref[4].grad()), tolerance()) << "b2 rank " << rank;
      return absl::OkStatus();
    });
    ASSERT_TRUE(status.ok()) << status << " sp=" << sp;
  }
}

TEST_P(TpOpsTest, VocabParallelEmbeddingEqualsFullLookup) {
  const int64_t vocab = 16, hidden = 4;
  const at::Tensor weight = Random({vocab, hidden}, 9, dtype());
  const at::Tensor ids = at::tensor({3, 15, 0, 8, 8, 11, 4}, at::kLong);
  const at::Tensor out_grad = Random({7, hidden}, 10, dtype());
  at::Tensor ref_weight = weight.clone().requires_grad_(true);
  at::Tensor ref = at::embedding(ref_weight, ids);
  (ref * out_grad).sum().backward();
  for (bool sp : {false, true}) {
    absl::Status status = RunRanks(tp(), [&](int rank, Communicator& comm) {
      TensorParallel group{comm.group(), sp};
      const int64_t part = vocab / tp();
      at::Tensor local = weight.narrow(0, rank * part, part).clone().requires_grad_(true);
      at::Tensor y = LeaveTensorParallel(VocabParallelEmbedding(ids, local, rank * part), group);
      at::Tensor g = out_grad;
      at::Tensor expected = ref.detach();
      if (group.sharded()) {
        const SequenceShard shard = ShardSequence(7, rank, tp());
        g = PadRows(g, shard.padded_rows).narrow(0, rank * shard.shard_rows, shard.shard_rows);
        expected = PadRows(expected, shard.padded_rows)
                       .narrow(0, rank * shard.shard_rows, shard.shard_rows);
      }
      EXPECT_TRUE(at::equal(y, expected)) << "rank " << rank << " sp " << sp;
      (y * g).sum().backward();
      EXPECT_LE(RelativeError(local.grad(), ref_weight.grad().narrow(0, rank * part, part)),
                tolerance())
          << "rank " << rank << " sp " << sp;
      return absl::OkStatus();
    });
    ASSERT_TRUE(status.ok()) << status;
  }
}

INSTANTIATE_TEST_SUITE_P(TpAndDtype, TpOpsTest,
                         ::testing::Combine(::testing::Values(1, 2, 4),
                                            ::testing::Values(at::kDouble, at::kFloat)));

TEST(TpOpsBf16Test, CrossEntropyAndNormsStayCloseToFloat32) {
  const at::Tensor logits = Random({5, 32}, 11);
  const at::Tensor targets = at::tensor({1, 2, 30, 31, 0}, at::kLong);
  absl::Status status = RunRanks(2, [&](int rank, Communicator& comm) {
    at::Tensor local = logits.narrow(1, rank * 16, 16);
    at::Tensor f32 =
        VocabParallelCrossEntropy(local.to(at::kFloat), targets, rank * 16, comm.group());
    at::Tensor bf16 =
        VocabParallelCrossEntropy(local.to(at::kBFloat16), targets, rank * 16, comm.group());
    EXPECT_EQ(bf16.scalar_type(), at::kFloat);  // computed and returned in float32
    EXPECT_LE(RelativeError(bf16, f32), 2e-2);
    return absl::OkStatus();
  });
  ASSERT_TRUE(status.ok()) << status;
  const at::Tensor x = Random({6, 16}, 12);
  const at::Tensor scale = Random({16}, 13);
  const at::Tensor bias = Random({16}, 14);
  at::Tensor rms = RmsNorm(x, scale, 1e-5);
  at::Tensor manual = x / at::sqrt(x.pow(2).mean(-1, true) + 1e-5) * scale;
  EXPECT_LE(RelativeError(rms, manual), 1e-14);
  EXPECT_EQ(RmsNorm(x.to(at::kBFloat16), scale.to(at::kBFloat16), 1e-5).scalar_type(),
            at::kBFloat16);
  EXPECT_LE(RelativeError(RmsNorm(x.to(at::kBFloat16), scale.to(at::kBFloat16), 1e-5), rms), 3e-2);
  at::Tensor ln = LayerNorm(x, scale, bias, 1e-6);
  EXPECT_LE(RelativeError(ln, at::layer_norm(x, {16}, scale, bias, 1e-6)), 1e-14);
  EXPECT_LE(RelativeError(LayerNorm(x.to(at::kBFloat16), scale.to(at::kBFloat16),
                                    bias.to(at::kBFloat16), 1e-6),
                          ln),
            3e-2);
}

}  // namespace
}  // namespace hetpar::nn
