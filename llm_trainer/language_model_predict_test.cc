// LanguageModel::Predict and VocabParallelArgmax: the vocab-parallel argmax equals the argmax of
// the full logits (ties to the smallest id) on every TP rank, for TP groups of 1, 2 and 4 ranks
// run as threads.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <limits>
#include <mutex>
#include <set>

#include "absl/strings/str_cat.h"
#include "common/nn/test_ranks.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "llm_trainer/language_model.h"
#include "tests/util/tiny_llm.h"

namespace hetpar::llm {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kVocab = 40;
constexpr int64_t kPlaceholder = 39;
constexpr int64_t kHidden = testing::kTinyLlmHidden;

hetpar::v1::LlmModel TinyModel() { return testing::TinyLlm(kVocab); }

LlmOptions Options(bool sequence_parallel = false) {
  LlmOptions options;
  options.dtype = at::kDouble;
  options.seed = 23;
  options.sequence_parallel = sequence_parallel;
  options.init_style = nn::InitStyle::kAllRandom;
  return options;
}

LlmSample MakeSample(std::string id, int64_t length, int64_t salt,
                     std::vector<int64_t> image_positions = {}) {
  LlmSample s;
  s.id = std::move(id);
  for (int64_t i = 0; i < length; ++i) s.tokens.push_back((i * 5 + salt * 11 + 2) % (kVocab - 1));
  for (int64_t p : image_positions) s.tokens[p] = kPlaceholder;
  s.labels.assign(s.tokens.size(), 0);
  s.loss_mask.assign(s.tokens.size(), 0);
  s.image_positions = std::move(image_positions);
  s.image_rows = static_cast<int64_t>(s.image_positions.size());
  return s;
}

// Samples with 0, 1 (3 rows) and 2 (2 + 3 rows) images: 36 positions, 8 image rows.
std::vector<LlmSample> MixedBatch() {
  return {MakeSample("text", 9, 1), MakeSample("one-image", 12, 2, {2, 3, 4}),
          MakeSample("two-images", 15, 3, {1, 2, 8, 9, 10})};
}

at::Tensor Random(std::vector<int64_t> shape, uint64_t seed) {
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::normal(0.0, 1.0, shape, generator, at::TensorOptions().dtype(at::kDouble));
}

// The argmax of each row of a full [rows, vocab] tensor, by hand: the first largest value.
std::vector<int64_t> FirstArgmax(const at::Tensor& full) {
  const at::Tensor logits = full.to(at::kDouble).contiguous();
  std::vector<int64_t> out;
  for (int64_t r = 0; r < logits.size(0); ++r) {
    const double* row = logits.data_ptr<double>() + r * logits.size(1);
    int64_t best = 0;
    for (int64_t v = 1; v < logits.size(1); ++v) {
      if (row[v] > row[best]) best = v;
    }
    out.push_back(best);
  }
  return out;
}

std::vector<int64_t> ToVector(const at::Tensor& ids) {
  const at::Tensor c = ids.contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

std::vector<int64_t> Flatten(const std::vector<std::vector<int32_t>>& per_sample) {
  std::vector<int64_t> out;
  for (const auto& sample : per_sample) out.insert(out.end(), sample.begin(), sample.end());
  return out;
}

// Logits with ties inside a rank's slice, across ranks' slices, everywhere, infinities, and 64
// random rows, over a vocabulary of 8 (tp 4: two columns per rank).
at::Tensor CraftedLogits() {
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> rows = {
      {0, 1, 2, 3, 4, 5, 6, 7},                          // max in the last slice
      {7, 6, 5, 4, 3, 2, 1, 0},                          // max in the first slice
      {0, 0, 3, 1, 0, 0, 3, 1},                          // tie across the slices of ranks 1 and 3
      {0, 0, 0, 0, 5, 5, 0, 0},                          // tie inside rank 2's slice
      {0, 9, 0, 9, 0, 9, 0, 9},                          // tie on every rank
      {2, 2, 2, 2, 2, 2, 2, 2},                          // all equal
      {-inf, -inf, -inf, -inf, -inf, -inf, -inf, -inf},  // no finite logit
      {1, -inf, inf, 0, inf, 3, -1, inf},                // +inf ties
      {-3, -2, -1, -0.5, -0.25, -2, -7, -0.25},          // negative, tie at 4 and 7
  };
  at::Tensor crafted = at::zeros({static_cast<int64_t>(rows.size()), 8}, at::kDouble);
  for (size_t r = 0; r < rows.size(); ++r) {
    for (size_t v = 0; v < 8; ++v) crafted[r][v] = rows[r][v];
  }
  // Random rows rounded to quarters, so ties across slices happen often.
  at::Tensor random = Random({64, 8}, 5).mul(2).round().div(4);
  return at::cat({crafted, random}, 0);
}

TEST(VocabParallelArgmaxTest, EqualsTheFullArgmaxWithTiesToTheSmallestIdOnEveryRank) {
  const at::Tensor full = CraftedLogits();
  const std::vector<int64_t> expected = FirstArgmax(full);
  EXPECT_EQ(std::vector<int64_t>(expected.begin(), expected.begin() + 9),
            (std::vector<int64_t>{7, 0, 2, 4, 1, 0, 0, 2, 4}));
  for (at::ScalarType dtype : {at::kDouble, at::kFloat, at::kBFloat16}) {
    for (int tp : {1, 2, 4}) {
      SCOPED_TRACE(absl::StrCat("tp=", tp, " dtype=", nn::DtypeName(dtype)));
      const int64_t width = 8 / tp;
      absl::Status status = nn::testing::RunRanks(tp, [&](int rank, nn::Communicator& comm) {
        const at::Tensor local = full.narrow(1, rank * width, width).to(dtype);
        absl::StatusOr<at::Tensor> ids = VocabParallelArgmax(local, rank * width, *comm.group());
        if (!ids.ok()) return ids.status();
        EXPECT_EQ(ids->scalar_type(), at::kLong);
        EXPECT_EQ(ToVector(*ids), expected) << "rank " << rank;
        return absl::OkStatus();
      });
      EXPECT_TRUE(status.ok()) << status;
    }
  }
}

TEST(VocabParallelArgmaxTest, NanLogitOnOneRankFailsOnEveryRank) {
  at::Tensor full = CraftedLogits().narrow(0, 0, 4).clone();
  full[2][6] = std::numeric_limits<double>::quiet_NaN();  // rank 1 of 2 holds it
  std::mutex mu;
  std::vector<std::string> messages;
  absl::Status status = nn::testing::RunRanks(2, [&](int rank, nn::Communicator& comm) {
    absl::StatusOr<at::Tensor> ids =
        VocabParallelArgmax(full.narrow(1, rank * 4, 4), rank * 4, *comm.group());
    EXPECT_EQ(ids.status().code(), absl::StatusCode::kInvalidArgument) << "rank " << rank;
    std::lock_guard<std::mutex> lock(mu);
    messages.push_back(std::string(ids.status().message()));
    return absl::OkStatus();
  });
  ASSERT_TRUE(status.ok()) << status;
  ASSERT_EQ(messages.size(), 2u);
  for (const std::string& m : messages) EXPECT_THAT(m, HasSubstr("row 2 has a NaN logit"));
}

TEST(VocabParallelArgmaxTest, RejectsMalformedLogits) {
  auto single = nn::Communicator::CreateSingle();
  EXPECT_EQ(VocabParallelArgmax(at::zeros({4}, at::kDouble), 0, *single->group()).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(VocabParallelArgmax(at::Tensor(), 0, *single->group()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

struct RankPrediction {
  std::vector<std::vector<int32_t>> ids;
  at::Tensor logits;  // this rank's slice
};

// Predict and LocalLogits on every rank of a TP group of `tp` threads.
std::vector<RankPrediction> PredictAtTp(int tp, bool sequence_parallel,
                                        const std::vector<LlmSample>& samples,
                                        const at::Tensor& image_rows,
                                        bool zero_output_head = false) {
  std::vector<RankPrediction> out(tp);
  absl::Status status = nn::testing::RunRanks(tp, [&](int rank, nn::Communicator& comm) {
    auto lm = LanguageModel::Create(TinyModel(), Options(sequence_parallel), comm);
    if (!lm.ok()) return lm.status();
    if (zero_output_head) {
      at::NoGradGuard no_grad;
      (*lm)->parameters().Find("llm.output.weight")->tensor.zero_();
    }
    auto ids = (*lm)->Predict(samples, image_rows);
    if (!ids.ok()) return ids.status();
    auto logits = (*lm)->LocalLogits(samples, image_rows);
    if (!logits.ok()) return logits.status();
    EXPECT_FALSE(logits->requires_grad());
    for (const nn::NamedParameter& p : (*lm)->parameters().parameters()) {
      EXPECT_FALSE(p.tensor.grad().defined()) << p.name;
    }
    out[rank] = {*std::move(ids), *std::move(logits)};
    return absl::OkStatus();
  });
  EXPECT_TRUE(status.ok()) << status;
  return out;
}

TEST(PredictTest, SingleRankEqualsTheArgmaxOfTheFullLogits) {
  const std::vector<LlmSample> samples = MixedBatch();
  const at::Tensor rows = Random({8, kHidden}, 3);
  const std::vector<RankPrediction> single = PredictAtTp(1, false, samples, rows);
  ASSERT_EQ(single[0].ids.size(), 3u);
  for (size_t s = 0; s < samples.size(); ++s) {
    EXPECT_EQ(single[0].ids[s].size(), samples[s].tokens.size()) << samples[s].id;
  }
  ASSERT_EQ(single[0].logits.sizes(), (std::vector<int64_t>{36, kVocab}));
  const std::vector<int64_t> predicted = Flatten(single[0].ids);
  EXPECT_EQ(predicted, FirstArgmax(single[0].logits));
  // The predictions are not one constant (a broken argmax returning 0 everywhere would pass
  // the comparisons below).
  EXPECT_GE(std::set<int64_t>(predicted.begin(), predicted.end()).size(), 4u);
}

TEST(PredictTest, EveryTpSizeAndRankPredictsWhatTheSingleProcessModelPredicts) {
  const std::vector<LlmSample> samples = MixedBatch();
  const at::Tensor rows = Random({8, kHidden}, 3);
  const std::vector<RankPrediction> single = PredictAtTp(1, false, samples, rows);
  const at::Tensor full_logits = single[0].logits;
  for (int tp : {2, 4}) {
    for (bool sp : {false, true}) {
      SCOPED_TRACE(absl::StrCat("tp=", tp, " sp=", sp));
      const std::vector<RankPrediction> ranks = PredictAtTp(tp, sp, samples, rows);
      ASSERT_EQ(static_cast<int>(ranks.size()), tp);
      std::vector<at::Tensor> slices;
      for (int rank = 0; rank < tp; ++rank) {
        EXPECT_EQ(ranks[rank].ids, single[0].ids) << "rank " << rank;
        ASSERT_EQ(ranks[rank].logits.sizes(), (std::vector<int64_t>{36, kVocab / tp}));
        slices.push_back(ranks[rank].logits);
      }
      // The slices are the columns of the full logits (to float64 rounding).
      const at::Tensor joined = at::cat(slices, 1);
      const double error = (joined - full_logits).abs().max().item<double>();
      EXPECT_LE(error, 1e-12 * full_logits.abs().max().item<double>());
    }
  }
}

TEST(PredictTest, ExactTiesAcrossRanksGoToTheSmallestId) {
  // A zero output head makes every logit exactly 0: the argmax is token 0 on every rank, though
  // every rank's own slice ties too.
  const std::vector<LlmSample> samples = MixedBatch();
  const at::Tensor rows = Random({8, kHidden}, 3);
  for (int tp : {1, 2, 4}) {
    const std::vector<RankPrediction> ranks = PredictAtTp(tp, false, samples, rows, true);
    for (int rank = 0; rank < tp; ++rank) {
      EXPECT_EQ(Flatten(ranks[rank].ids), std::vector<int64_t>(36, 0))
          << "tp=" << tp << " rank " << rank;
    }
  }
}

TEST(PredictTest, ImageRowsChangeThePredictionsOfTheirSamplesOnly) {
  std::vector<LlmSample> samples = MixedBatch();
  const at::Tensor rows = Random({8, kHidden}, 3);
  const std::vector<RankPrediction> base = PredictAtTp(1, false, samples, rows);
  // Other rows for the second sample's image (rows 0..2): the text-only sample and the
  // prefix before the first placeholder keep their predictions.
  at::Tensor changed = rows.clone();
  changed.narrow(0, 0, 3).mul_(-3.0);
  const std::vector<RankPrediction> other = PredictAtTp(1, false, samples, changed);
  EXPECT_EQ(other[0].ids[0], base[0].ids[0]);
  EXPECT_EQ(other[0].ids[2], base[0].ids[2]);
  EXPECT_EQ(std::vector<int32_t>(other[0].ids[1].begin(), other[0].ids[1].begin() + 2),
            std::vector<int32_t>(base[0].ids[1].begin(), base[0].ids[1].begin() + 2));
  EXPECT_GT((other[0].logits.narrow(0, 9, 12) - base[0].logits.narrow(0, 9, 12))
                .abs()
                .max()
                .item<double>(),
            1e-3);
}

TEST(PredictTest, BadInputsNameTheSample) {
  auto single = nn::Communicator::CreateSingle();
  auto lm = LanguageModel::Create(TinyModel(), Options(), *single);
  ASSERT_TRUE(lm.ok()) << lm.status();
  std::vector<LlmSample> samples = MixedBatch();
  samples[2].tokens[5] = kVocab;
  auto ids = (*lm)->Predict(samples, Random({8, kHidden}, 3));
  EXPECT_EQ(ids.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(ids.status().message()), HasSubstr("two-images"));
  // Image rows that do not match the placeholders.
  auto short_rows = (*lm)->Predict(MixedBatch(), Random({7, kHidden}, 3));
  EXPECT_EQ(short_rows.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(short_rows.status().message()), HasSubstr("7 rows"));
  auto empty = (*lm)->Predict({}, at::Tensor());
  EXPECT_EQ(empty.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace hetpar::llm
