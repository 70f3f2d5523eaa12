#include "common/plan/schedule.h"

#include <algorithm>
#include <map>
#include <random>

#include "common/plan/synthetic_batch.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hetpar::plan {
namespace {

using ::testing::HasSubstr;

const CostModel kLlmCost{10.0, 0.5};
const CostModel kEncoderCost{4.0, 1.0};

std::vector<SampleDescriptor> Batch(int64_t n, uint64_t seed, int64_t max_images = 4,
                                    int64_t tokens = 8, int64_t first_id = 0) {
  SyntheticBatchOptions o;
  o.samples = n;
  o.first_id = first_id;
  o.min_images = 0;
  o.max_images = max_images;
  o.min_text_tokens = 0;
  o.max_text_tokens = 40;
  o.tokens_per_image = tokens;
  o.seq_len = 40 + max_images * tokens;
  o.seed = seed;
  auto batch = SyntheticBatch(o);
  EXPECT_TRUE(batch.ok()) << batch.status();
  return *batch;
}

// Checks every structural property of an assignment pair and the stated balance bounds.
void CheckAssignments(const std::vector<SampleDescriptor>& samples, const LlmAssignment& llm,
                      const EncoderAssignment& enc, int64_t micro_batch) {
  const int64_t batch = static_cast<int64_t>(samples.size());
  // Every sample in exactly one microbatch, which matches sample_replica / sample_wave.
  std::vector<int> seen(batch, 0);
  std::vector<double> replica_cost(llm.replicas, 0);
  for (int64_t d = 0; d < llm.replicas; ++d) {
    for (int64_t m = 0; m < llm.waves; ++m) {
      const LlmMicrobatch& mb = llm.At(d, m);
      ASSERT_EQ(mb.replica, d);
      ASSERT_EQ(mb.wave, m);
      if (mb.samples.empty()) {
        // Only the last wave of a replica taking one wave fewer, after the ones taking them all.
        ASSERT_EQ(m, llm.waves - 1) << "replica " << d;
        ASSERT_GT(d, 0);
        ASSERT_TRUE(d + 1 == llm.replicas || llm.At(d + 1, m).samples.empty()) << "replica " << d;
      } else {
        ASSERT_EQ(static_cast<int64_t>(mb.samples.size()), micro_batch);
      }
      ASSERT_TRUE(std::is_sorted(mb.samples.begin(), mb.samples.end()));
      int64_t tokens = 0;
      int64_t loss = 0;
      int64_t image_rows = 0;
      for (int64_t s : mb.samples) {
        ++seen[s];
        ASSERT_EQ(llm.sample_replica[s], d);
        ASSERT_EQ(llm.sample_wave[s], m);
        tokens += samples[s].sequence_length();
        loss += samples[s].loss_tokens;
        image_rows += samples[s].image_tokens();
        replica_cost[d] += kLlmCost.Cost(samples[s].sequence_length());
      }
      ASSERT_EQ(mb.tokens, tokens);
      ASSERT_EQ(mb.loss_tokens, loss);
      ASSERT_EQ(mb.image_rows, image_rows);
    }
  }
  for (int64_t s = 0; s < batch; ++s) ASSERT_EQ(seen[s], 1) << "sample " << s;
  // LLM balance: LPT with equal capacities stays within mean + the largest sample.
  double total = 0, max = 0, largest = 0;
  for (int64_t d = 0; d < llm.replicas; ++d) {
    ASSERT_NEAR(replica_cost[d], llm.replica_cost[d], 1e-6 * (1 + replica_cost[d]));
    total += replica_cost[d];
    max = std::max(max, replica_cost[d]);
  }
  for (const auto& s : samples) largest = std::max(largest, kLlmCost.Cost(s.sequence_length()));
  ASSERT_LE(max, total / static_cast<double>(llm.replicas) + largest + 1e-6);

  // Every image in exactly one job, of its sample's wave, at consistent row offsets.
  ASSERT_EQ(enc.total_images(), [&] {
    int64_t n = 0;
    for (const auto& s : samples) n += s.image_count();
    return n;
  }());
  std::vector<int> image_seen(enc.total_images(), 0);
  std::map<std::pair<int64_t, int64_t>, double> wave_load;  // (wave, replica) -> cost
  for (int64_t j = 0; j < static_cast<int64_t>(enc.jobs.size()); ++j) {
    const EncoderJob& job = enc.jobs[j];
    ASSERT_FALSE(job.images.empty());
    if (j > 0) {
      ASSERT_LT(std::make_pair(enc.jobs[j - 1].replica, enc.jobs[j - 1].wave),
                std::make_pair(job.replica, job.wave));
    }
    ASSERT_EQ(enc.Find(job.replica, job.wave), &job);
    int64_t rows = 0;
    for (size_t i = 0; i < job.images.size(); ++i) {
      const ImageRef& ref = job.images[i];
      if (i > 0) {
        ASSERT_LT(std::make_pair(job.images[i - 1].sample, job.images[i - 1].image),
                  std::make_pair(ref.sample, ref.image));
      }
      ASSERT_EQ(llm.sample_wave[ref.sample], job.wave);
      const int64_t flat = enc.FlatImage(ref.sample, ref.image);
      ++image_seen[flat];
      ASSERT_EQ(enc.image_job[flat], j);
      ASSERT_EQ(enc.image_row_offset[flat], rows);
      ASSERT_EQ(job.row_offsets[i], rows);
      rows += samples[ref.sample].tokens_per_image;
      wave_load[{job.wave, job.replica}] += kEncoderCost.Cost(samples[ref.sample].tokens_per_image);
    }
    ASSERT_EQ(job.rows, rows);
  }
  for (int64_t f = 0; f < enc.total_images(); ++f) ASSERT_EQ(image_seen[f], 1) << "image " << f;
  // Per wave: max <= mean + largest image (Graham), mean over all encoder replicas.
  for (int64_t m = 0; m < enc.waves; ++m) {
    double wave_total = 0, wave_max = 0, wave_largest = 0;
    for (int64_t e = 0; e < enc.replicas; ++e) {
      auto it = wave_load.find({m, e});
      const double load = it == wave_load.end() ? 0 : it->second;
      wave_total += load;
      wave_max = std::max(wave_max, load);
    }
    for (int64_t d = 0; d < llm.replicas; ++d) {
      for (int64_t s : llm.At(d, m).samples) {
        if (samples[s].image_count() > 0) {
          wave_largest = std::max(wave_largest, kEncoderCost.Cost(samples[s].tokens_per_image));
        }
      }
    }
    ASSERT_LE(wave_max, wave_total / static_cast<double>(enc.replicas) + wave_largest + 1e-6)
        << "wave " << m;
  }
}

TEST(ScheduleTest, RandomBatchesKeepEveryPropertyAndBound) {
  std::mt19937_64 rng(20240611);
  for (int trial = 0; trial < 1500; ++trial) {
    const int64_t replicas = 1 + rng() % 7;
    const int64_t waves = 1 + rng() % 5;
    const int64_t micro_batch = 1 + rng() % 3;
    const int64_t enc_replicas = 1 + rng() % 9;
    // Every other trial over fewer microbatches than replicas x waves, as after a lost replica:
    // `short_replicas` of them take one wave fewer.
    const int64_t short_replicas = waves > 1 && trial % 2 == 1 ? rng() % replicas : 0;
    auto samples = Batch((replicas * waves - short_replicas) * micro_batch, rng(), rng() % 7,
                         1 + rng() % 12, rng() % 1000);
    // Vary tokens per image inside the batch too.
    for (auto& s : samples) {
      if (rng() % 3 == 0 && s.image_count() > 0) {
        s = MakeSample(s.id, s.image_count(), 1 + rng() % 5, s.text_tokens, s.loss_tokens);
      }
    }
    const uint64_t seed = rng();
    auto llm = AssignLlm(samples, replicas, waves, micro_batch, kLlmCost, kEncoderCost, seed, 3);
    ASSERT_TRUE(llm.ok()) << llm.status();
    auto enc = AssignEncoder(samples, *llm, enc_replicas, kEncoderCost, seed, 3);
    ASSERT_TRUE(enc.ok()) << enc.status();
    SCOPED_TRACE(::testing::Message()
                 << "trial " << trial << " llm dp " << replicas << " waves " << waves << " mb "
                 << micro_batch << " enc dp " << enc_replicas << " short " << short_replicas);
    CheckAssignments(samples, *llm, *enc, micro_batch);
    if (HasFatalFailure()) return;
    std::vector<int64_t> per_replica(replicas, 0);
    for (int64_t r : llm->sample_replica) ++per_replica[r];
    for (int64_t d = 0; d < replicas; ++d) {
      const int64_t expected = d < replicas - short_replicas ? waves : waves - 1;
      ASSERT_EQ(per_replica[d], expected * micro_batch) << "replica " << d;
    }
    // Deterministic.
    auto llm2 = AssignLlm(samples, replicas, waves, micro_batch, kLlmCost, kEncoderCost, seed, 3);
    auto enc2 = AssignEncoder(samples, *llm2, enc_replicas, kEncoderCost, seed, 3);
    ASSERT_TRUE(*llm == *llm2);
    ASSERT_TRUE(*enc == *enc2);
  }
}

TEST(ScheduleTest, BalancesEqualSamplesExactly) {
  // 12 samples with 2 images each over 3 LLM replicas x 2 waves x 2, encoders 4: every
  // replica gets equal LLM work; every wave's 12 images spread 3 per encoder replica.
  std::vector<SampleDescriptor> samples;
  for (int64_t i = 0; i < 12; ++i) samples.push_back(MakeSample(i, 2, 8, 10, 5));
  auto llm = AssignLlm(samples, 3, 2, 2, kLlmCost, kEncoderCost, 1, 0);
  ASSERT_TRUE(llm.ok());
  EXPECT_DOUBLE_EQ(llm->imbalance, 1.0);
  auto enc = AssignEncoder(samples, *llm, 4, kEncoderCost, 1, 0);
  ASSERT_TRUE(enc.ok());
  EXPECT_DOUBLE_EQ(enc->step_imbalance, 1.0);
  EXPECT_DOUBLE_EQ(enc->worst_wave_imbalance, 1.0);
  for (const EncoderJob& job : enc->jobs) EXPECT_EQ(job.images.size(), 3u);
}

TEST(ScheduleTest, SpreadsImagesOverWaves) {
  // Half the samples carry 4 images, half none; waves should get equal image counts.
  std::vector<SampleDescriptor> samples;
  for (int64_t i = 0; i < 16; ++i) samples.push_back(MakeSample(i, i % 2 == 0 ? 4 : 0, 8, 10, 5));
  auto llm = AssignLlm(samples, 2, 4, 2, kLlmCost, kEncoderCost, 9, 0);
  ASSERT_TRUE(llm.ok());
  for (int64_t m = 0; m < 4; ++m) {
    int64_t images = 0;
    for (int64_t d = 0; d < 2; ++d) {
      for (int64_t s : llm->At(d, m).samples) images += samples[s].image_count();
    }
    EXPECT_EQ(images, 8) << "wave " << m;
  }
}

TEST(ScheduleTest, ImagesOfOneSampleMaySplitOverEncoderReplicas) {
  std::vector<SampleDescriptor> samples = {MakeSample(5, 6, 8, 4, 2)};
  auto llm = AssignLlm(samples, 1, 1, 1, kLlmCost, kEncoderCost, 0, 0);
  ASSERT_TRUE(llm.ok());
  auto enc = AssignEncoder(samples, *llm, 3, kEncoderCost, 0, 0);
  ASSERT_TRUE(enc.ok());
  ASSERT_EQ(enc->jobs.size(), 3u);
  for (const EncoderJob& job : enc->jobs) EXPECT_EQ(job.images.size(), 2u);
}

TEST(ScheduleTest, StepChangesTieBreaksButStaysValid) {
  std::vector<SampleDescriptor> samples;
  for (int64_t i = 0; i < 32; ++i) samples.push_back(MakeSample(100 + i, 2, 8, 10, 5));
  std::vector<std::vector<int64_t>> placements;
  for (int64_t step = 0; step < 6; ++step) {
    auto llm = AssignLlm(samples, 4, 4, 2, kLlmCost, kEncoderCost, 77, step);
    ASSERT_TRUE(llm.ok());
    auto enc = AssignEncoder(samples, *llm, 3, kEncoderCost, 77, step);
    ASSERT_TRUE(enc.ok());
    CheckAssignments(samples, *llm, *enc, 2);
    placements.push_back(llm->sample_replica);
  }
  // Equal-cost samples are ordered by the (seed, step) hash, so steps differ somewhere.
  bool any_difference = false;
  for (size_t i = 1; i < placements.size(); ++i) any_difference |= placements[i] != placements[0];
  EXPECT_TRUE(any_difference);
}

// Over fewer replicas than the layout's (some left the run) the microbatches need not divide:
// the first replicas take every wave, the others one fewer.
TEST(ScheduleTest, ReplicasMayTakeOneWaveFewer) {
  struct Case {
    int64_t batch, replicas, waves, micro_batch;
    std::vector<int64_t> samples_per_replica;
  };
  for (const Case& c : {Case{9, 2, 5, 1, {5, 4}}, Case{10, 3, 2, 2, {4, 4, 2}},
                        Case{4, 3, 2, 1, {2, 1, 1}}, Case{21, 4, 6, 1, {6, 5, 5, 5}}}) {
    SCOPED_TRACE(::testing::Message() << c.batch << " samples over " << c.replicas << " replicas");
    const auto samples = Batch(c.batch, 7);
    auto llm = AssignLlm(samples, c.replicas, c.waves, c.micro_batch, kLlmCost, kEncoderCost, 3, 1);
    ASSERT_TRUE(llm.ok()) << llm.status();
    std::vector<int64_t> per_replica(c.replicas, 0);
    for (int64_t s = 0; s < c.batch; ++s) ++per_replica[llm->sample_replica[s]];
    EXPECT_EQ(per_replica, c.samples_per_replica);
    auto enc = AssignEncoder(samples, *llm, 2, kEncoderCost, 3, 1);
    ASSERT_TRUE(enc.ok()) << enc.status();
    CheckAssignments(samples, *llm, *enc, c.micro_batch);
  }
}

TEST(ScheduleTest, RejectsWrongBatchSize) {
  auto samples = Batch(7, 1);
  auto llm = AssignLlm(samples, 2, 2, 2, kLlmCost, kEncoderCost, 0, 0);
  ASSERT_FALSE(llm.ok());
  EXPECT_THAT(std::string(llm.status().message()),
              HasSubstr("has 7 samples; expected micro_batch 2 x 3 to 4 microbatches for 2 waves "
                        "over llm dp 2 (a replica may take one wave fewer)"));
  // Too many samples for the waves, and too few for every replica to take one.
  EXPECT_FALSE(AssignLlm(Batch(8, 1), 3, 2, 1, kLlmCost, kEncoderCost, 0, 0).ok());
  auto too_few = AssignLlm(Batch(2, 1), 3, 1, 1, kLlmCost, kEncoderCost, 0, 0);
  ASSERT_FALSE(too_few.ok());
  EXPECT_THAT(std::string(too_few.status().message()),
              HasSubstr("has 2 samples; expected micro_batch 1 x 3 microbatches for 1 waves over "
                        "llm dp 3"));
  EXPECT_FALSE(AssignLlm(samples, 0, 1, 1, kLlmCost, kEncoderCost, 0, 0).ok());
  auto ok = AssignLlm(Batch(4, 1), 2, 2, 1, kLlmCost, kEncoderCost, 0, 0);
  ASSERT_TRUE(ok.ok());
  EXPECT_FALSE(AssignEncoder(Batch(4, 1), *ok, 0, kEncoderCost, 0, 0).ok());
  EXPECT_FALSE(AssignEncoder(Batch(6, 1), *ok, 2, kEncoderCost, 0, 0).ok());
  LlmAssignment tampered = *ok;
  tampered.microbatches[0].samples[0] = 9;
  auto bad = AssignEncoder(Batch(4, 1), tampered, 2, kEncoderCost, 0, 0);
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("lists batch position 9"));
}

}  // namespace
}  // namespace hetpar::plan
