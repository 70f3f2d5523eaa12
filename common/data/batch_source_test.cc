// BatchSource::RecordFor: a worker whose data index is not the coordinator's (its manifest lacks
// the first line, so every position holds the next sample; or its samples carry other ids)
// refuses the plan's samples, naming both descriptions, instead of training other samples than
// the plan's.
#include "common/data/batch_source.h"

#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/config/config.h"
#include "common/data/synth.h"
#include "common/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hetpar::data {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

class BatchSourceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = (fs::temp_directory_path() / "hetpar_batch_source_XXXXXX").string();
    ASSERT_NE(::mkdtemp(dir_.data()), nullptr);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // tiny.yaml's model over `manifest` in this test's directory (a synthetic set of 24 samples,
  // generated on first use).
  v1::RunSpec Spec(const std::string& manifest) const {
    config::LoadOptions load;
    load.overrides = {"data.manifest=" + dir_ + "/" + manifest,
                      "data.val_manifest=" + dir_ + "/val.jsonl",
                      "data.tokenizer=" + dir_ + "/tokenizer.model", "data.synth.samples=24",
                      "data.synth.val_samples=4"};
    load.check_files = false;
    absl::StatusOr<config::LoadedRunSpec> loaded =
        config::LoadRunSpecFile(std::string(HETPAR_SOURCE_DIR) + "/configs/tiny.yaml", load);
    EXPECT_TRUE(loaded.ok()) << loaded.status();
    return loaded->spec;
  }

  std::string dir_;
};

TEST_F(BatchSourceTest, AWorkerWhoseIndexIsNotTheCoordinatorsRefusesThePlansSamples) {
  auto coordinator = BatchSource::Create(Spec("train.jsonl"));
  ASSERT_TRUE(coordinator.ok()) << coordinator.status();
  // The same data set but for its first line.
  std::ifstream in(dir_ + "/train.jsonl");
  std::string line;
  std::getline(in, line);
  std::ostringstream rest;
  rest << in.rdbuf();
  std::ofstream(dir_ + "/shifted.jsonl") << rest.str();
  auto worker = BatchSource::Create(Spec("shifted.jsonl"));
  ASSERT_TRUE(worker.ok()) << worker.status();

  auto batch = (*coordinator)->Take({}, 8);
  ASSERT_TRUE(batch.ok()) << batch.status();
  int refused = 0;
  for (const plan::SampleDescriptor& sample : batch->samples) {
    // The coordinator's own index agrees with its plan.
    auto same = (*coordinator)->RecordFor(sample);
    ASSERT_TRUE(same.ok()) << same.status();
    EXPECT_EQ((*same)->ordinal, sample.id);
    auto other = (*worker)->RecordFor(sample);
    if (other.ok()) continue;
    ++refused;
    EXPECT_EQ(other.status().code(), absl::StatusCode::kFailedPrecondition);
    // No attempt of the step would go otherwise: the coordinator fails the run at once.
    EXPECT_TRUE(IsEndsRun(other.status()));
    EXPECT_THAT(std::string(other.status().message()),
                HasSubstr(absl::StrCat("data index position ", sample.id, " (sample '")));
    EXPECT_THAT(std::string(other.status().message()),
                HasSubstr("this worker's data index differs from the coordinator's"));
  }
  // Each position holds another sample, whatever its shape: its id differs.
  EXPECT_EQ(refused, 8) << "of 8 samples";

  // A position past the end of this worker's index (the coordinator's holds more samples).
  plan::SampleDescriptor past = batch->samples.front();
  past.id = static_cast<int64_t>((*worker)->index().records.size());
  auto missing = (*worker)->RecordFor(past);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(std::string(missing.status().message()),
              HasSubstr(absl::StrCat("sample id ", past.id, " is outside the data index of ",
                                     past.id, " samples")));
  EXPECT_TRUE(IsEndsRun(missing.status()));
}

// A sample that tokenizes otherwise now than when the index was built (here with the tokenizer of
// another synthetic data set, of half the vocabulary) is refused, named, instead of being trained
// in the shapes and loss divisor of the stale index.
TEST_F(BatchSourceTest, TokensThatNoLongerMatchTheIndexAreRefusedNamingTheSample) {
  auto source = BatchSource::Create(Spec("train.jsonl"));
  ASSERT_TRUE(source.ok()) << source.status();
  absl::StatusOr<const IndexRecord*> record = (*source)->Record(3);
  ASSERT_TRUE(record.ok()) << record.status();
  absl::StatusOr<TokenSequence> now = (*source)->loader().Tokenize((*record)->ordinal);
  ASSERT_TRUE(now.ok()) << now.status();
  EXPECT_TRUE((*source)->CheckTokens(**record, *now).ok());
  SynthOptions small = SynthOptionsForDirectory(dir_ + "/small");
  small.samples = 4;
  small.val_samples = 0;
  small.val_manifest.clear();
  small.vocab_size = 128;
  small.seq_len = 1024;  // longer sequences under the smaller vocabulary
  absl::StatusOr<SynthReport> generated = GenerateSyntheticDataset(small);
  ASSERT_TRUE(generated.ok()) << generated.status();
  LoaderOptions retokenized = (*source)->loader().options();
  retokenized.tokenizer = small.tokenizer;
  absl::StatusOr<std::unique_ptr<DataLoader>> other = DataLoader::Create(retokenized);
  ASSERT_TRUE(other.ok()) << other.status();
  absl::StatusOr<TokenSequence> changed = (*other)->Tokenize((*record)->ordinal);
  ASSERT_TRUE(changed.ok()) << changed.status();
  ASSERT_NE(changed->text_tokens, now->text_tokens);
  const absl::Status refused = (*source)->CheckTokens(**record, *changed);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(refused.message()),
              HasSubstr(absl::StrCat("sample '", (*record)->id, "' (", dir_,
                                     "/train.jsonl:", (*record)->line, ") has ",
                                     changed->text_tokens, " text tokens")));
  EXPECT_THAT(std::string(refused.message()), HasSubstr("the index is stale"));
  EXPECT_TRUE(IsEndsRun(refused));
}

// Two tokenizations of a sample with every length alike but another id (another bos, a revised
// vocabulary) train other labels: the token checksum tells them apart, in the plan (coordinator
// against worker) and against the index (the index against the tokenizer now). An index or a
// plan without checksums (written before they were) is compared by its shapes only.
TEST_F(BatchSourceTest, TheSameShapesWithOtherTokenIdsAreRefused) {
  auto source = BatchSource::Create(Spec("train.jsonl"));
  ASSERT_TRUE(source.ok()) << source.status();
  absl::StatusOr<const IndexRecord*> record = (*source)->Record(5);
  ASSERT_TRUE(record.ok()) << record.status();
  ASSERT_NE((*record)->token_checksum, 0u);
  absl::StatusOr<TokenSequence> now = (*source)->loader().Tokenize((*record)->ordinal);
  ASSERT_TRUE(now.ok()) << now.status();
  TokenSequence other_ids = *now;
  other_ids.input_ids.back() ^= 1;
  const absl::Status refused = (*source)->CheckTokens(**record, other_ids);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(IsEndsRun(refused));
  EXPECT_THAT(
      std::string(refused.message()),
      HasSubstr(absl::StrCat("token checksum ", absl::Hex(other_ids.Checksum(), absl::kZeroPad8),
                             " as tokenized now")));
  IndexRecord unchecked = **record;
  unchecked.token_checksum = 0;
  EXPECT_TRUE((*source)->CheckTokens(unchecked, other_ids).ok());

  auto batch = (*source)->Take({}, 4);
  ASSERT_TRUE(batch.ok()) << batch.status();
  plan::SampleDescriptor planned = batch->samples.front();
  ASSERT_TRUE((*source)->RecordFor(planned).ok());
  planned.token_checksum ^= 0x10u;
  absl::StatusOr<const IndexRecord*> foreign = (*source)->RecordFor(planned);
  EXPECT_EQ(foreign.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(IsEndsRun(foreign.status()));
  EXPECT_THAT(
      std::string(foreign.status().message()),
      HasSubstr(absl::StrCat("the coordinator's plan says id checksum ",
                             absl::Hex(planned.id_checksum, absl::kZeroPad8), ", token checksum ",
                             absl::Hex(planned.token_checksum, absl::kZeroPad8))));
  planned.token_checksum = 0;
  EXPECT_TRUE((*source)->RecordFor(planned).ok());
}

// The same samples, shapes and images under other ids (another copy of the data set, renamed):
// no shape tells them apart, the ids do.
TEST_F(BatchSourceTest, ASampleOfTheSameShapeUnderAnotherIdIsRefused) {
  auto coordinator = BatchSource::Create(Spec("train.jsonl"));
  ASSERT_TRUE(coordinator.ok()) << coordinator.status();
  std::ifstream in(dir_ + "/train.jsonl");
  std::ofstream renamed(dir_ + "/renamed.jsonl");
  std::string line;
  while (std::getline(in, line)) {
    const size_t at = line.find("\"id\":\"");
    ASSERT_NE(at, std::string::npos) << line;
    renamed << line.insert(at + 6, "copy-") << "\n";
  }
  renamed.close();
  auto worker = BatchSource::Create(Spec("renamed.jsonl"));
  ASSERT_TRUE(worker.ok()) << worker.status();
  auto batch = (*coordinator)->Take({}, 8);
  ASSERT_TRUE(batch.ok()) << batch.status();
  for (const plan::SampleDescriptor& sample : batch->samples) {
    const auto& mine = (*worker)->RecordFor(sample);
    ASSERT_FALSE(mine.ok()) << "position " << sample.id;
    EXPECT_THAT(std::string(mine.status().message()),
                HasSubstr(absl::StrCat("data index position ", sample.id, " (sample 'copy-")));
  }
}

}  // namespace
}  // namespace hetpar::data
