// `hetpar data synth | index | check | show` as a user runs them.
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "common/atomic_file.h"
#include "common/data/file_util.h"
#include "common/data/index.h"
#include "common/data/loader.h"
#include "common/data/manifest.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/util/subprocess.h"

namespace hetpar {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::Not;
using testing::RunCommand;

const std::string kBin = HETPAR_BIN;
const std::string kSource = HETPAR_SOURCE_DIR;

class DataCliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = (fs::temp_directory_path() / "hetpar_data_cli_XXXXXX").string();
    ASSERT_NE(::mkdtemp(dir_.data()), nullptr);
  }
  void TearDown() override { fs::remove_all(dir_); }

  testing::CommandResult Run(std::vector<std::string> args) {
    args.insert(args.begin(), kBin);
    absl::StatusOr<testing::CommandResult> r = RunCommand(args, 120);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *r : testing::CommandResult{};
  }

  // configs/tiny.yaml with its data section pointed into the test directory.
  std::string TinyConfig(const std::string& extra = "") {
    std::ifstream in(kSource + "/configs/tiny.yaml");
    std::stringstream text;
    text << in.rdbuf();
    std::string yaml = text.str();
    for (const char* file : {"train.jsonl", "val.jsonl", "tokenizer.model"}) {
      const std::string from = std::string("../data/tiny/") + file;
      yaml.replace(yaml.find(from), from.size(), dir_ + "/tiny/" + file);
    }
    yaml += extra;
    const std::string path = dir_ + "/tiny.yaml";
    std::ofstream(path) << yaml;
    return path;
  }

  static int64_t Lines(const std::string& path) {
    std::ifstream in(path);
    int64_t n = 0;
    for (std::string line; std::getline(in, line);) n += !line.empty();
    return n;
  }

  std::string dir_;
};

TEST_F(DataCliTest, SynthWritesADataSetTheLoaderReadsBack) {
  testing::CommandResult r = Run({"data", "synth", "--out", dir_ + "/set", "--samples", "40",
                                  "--val-samples", "6", "--seed", "3"});
  ASSERT_EQ(r.exit_code, 0) << r.stderr_text;
  EXPECT_THAT(r.stdout_text,
              HasSubstr("wrote 40 training samples to " + dir_ + "/set/train.jsonl"));
  EXPECT_THAT(r.stdout_text, HasSubstr("wrote 6 validation samples"));
  EXPECT_THAT(r.stdout_text, HasSubstr("tokenizer: " + dir_ + "/set/tokenizer.model"));
  EXPECT_EQ(Lines(dir_ + "/set/train.jsonl"), 40);
  EXPECT_EQ(Lines(dir_ + "/set/val.jsonl"), 6);

  data::LoaderOptions o;
  o.manifest = dir_ + "/set/train.jsonl";
  o.tokenizer = dir_ + "/set/tokenizer.model";
  o.image_size = 32;
  o.tokens_per_image = 16;
  o.seq_len = 128;
  o.max_vocab = 256;
  absl::StatusOr<std::unique_ptr<data::DataLoader>> loader = data::DataLoader::Create(o);
  ASSERT_TRUE(loader.ok()) << loader.status();
  absl::StatusOr<data::DataIndex> index = data::ReadIndex(dir_ + "/set/train.jsonl.index");
  ASSERT_TRUE(index.ok()) << index.status();
  ASSERT_EQ(index->records.size(), 40u);
  for (int64_t i = 0; i < 40; ++i) {
    absl::StatusOr<data::LoadedSample> s = (*loader)->Load(i);
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_EQ(index->records[static_cast<size_t>(i)].loss_tokens, s->tokens.loss_tokens);
    EXPECT_EQ(index->records[static_cast<size_t>(i)].image_offsets, s->tokens.image_offsets);
  }

  // A second run refuses to overwrite without --force, and the same seed reproduces the bytes.
  const std::string before = *data::ReadFileToString(dir_ + "/set/train.jsonl");
  const std::string model = *data::ReadFileToString(dir_ + "/set/tokenizer.model");
  r = Run({"data", "synth", "--out", dir_ + "/set", "--samples", "40"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.stderr_text, HasSubstr("already exists; pass --force"));
  r = Run({"data", "synth", "--out", dir_ + "/set", "--samples", "40", "--val-samples", "6",
           "--seed", "3", "--force"});
  ASSERT_EQ(r.exit_code, 0) << r.stderr_text;
  EXPECT_EQ(*data::ReadFileToString(dir_ + "/set/train.jsonl"), before);
  EXPECT_EQ(*data::ReadFileToString(dir_ + "/set/tokenizer.model"), model);
}

TEST_F(DataCliTest, SynthFromTheTinyConfigThenIndexCheckShow) {
  const std::string config = TinyConfig();
  testing::CommandResult r = Run({"data", "synth", "--config", config});
  ASSERT_EQ(r.exit_code, 0) << r.stderr_text;
  EXPECT_THAT(r.stdout_text, HasSubstr("wrote 1024 training samples"));
  EXPECT_THAT(r.stdout_text, HasSubstr("wrote 128 validation samples"));
  EXPECT_EQ(Lines(dir_ + "/tiny/train.jsonl"), 1024);
  EXPECT_EQ(Lines(dir_ + "/tiny/val.jsonl"), 128);

  // The config is now valid with its files checked.
  r = Run({"validate", "--config", config});
  EXPECT_EQ(r.exit_code, 0) << r.stderr_text;

  r = Run({"data", "index", "--config", config});
  ASSERT_EQ(r.exit_code, 0) << r.stderr_text;
  EXPECT_THAT(r.stdout_text, HasSubstr("index " + dir_ +
                                       "/tiny/train.jsonl.index (up to date): "
                                       "1024 samples, 0 skipped"));
  r = Run({"data", "index", "--config", config, "--split", "val", "--rebuild", "--threads", "2"});
  ASSERT_EQ(r.exit_code, 0) << r.stderr_text;
  EXPECT_THAT(r.stdout_text, HasSubstr("(built): 128 samples"));

  r = Run({"data", "check", "--config", config, "--split", "val"});
  ASSERT_EQ(r.exit_code, 0) << r.stdout_text << r.stderr_text;
  EXPECT_THAT(r.stdout_text,
              HasSubstr("128 good, 0 bad, 0 index mismatches (" + dir_ + "/tiny/val.jsonl.index)"));
  // An index whose token checksum of one sample is not the sample's (the same shapes, other ids):
  // a mismatch, named.
  {
    const std::string path = dir_ + "/tiny/val.jsonl.index";
    std::string text = *data::ReadFileToString(path);
    const size_t at = text.find("\"token_crc\":");
    ASSERT_NE(at, std::string::npos) << "no token_crc in " << path;
    const size_t digit = at + std::string("\"token_crc\":").size();
    text[digit] = text[digit] == '1' ? '2' : '1';
    ASSERT_TRUE(WriteFileAtomically(path, text).ok());
    r = Run({"data", "check", "--config", config, "--split", "val"});
    EXPECT_EQ(r.exit_code, 1) << r.stdout_text << r.stderr_text;
    EXPECT_THAT(r.stdout_text, HasSubstr("128 good, 0 bad, 1 index mismatches"));
    EXPECT_THAT(r.stdout_text, HasSubstr("loss tokens, token checksum "));
  }

  r = Run({"data", "show", "--config", config, "--id", "train-000000"});
  ASSERT_EQ(r.exit_code, 0) << r.stderr_text;
  EXPECT_THAT(r.stdout_text, HasSubstr("sample 'train-000000'"));
  EXPECT_THAT(r.stdout_text, HasSubstr("<s>"));
  EXPECT_THAT(r.stdout_text, HasSubstr("</s>"));

  // A different seq_len makes the index stale: it is rebuilt.
  r = Run({"data", "index", "--config", config, "--set", "llm.model.seq_len=120"});
  ASSERT_EQ(r.exit_code, 0) << r.stderr_text;
  EXPECT_THAT(r.stdout_text, HasSubstr("(built): 1024 samples"));
  EXPECT_THAT(r.stderr_text, HasSubstr("seq_len is 120 (index: 128)"));
}

TEST_F(DataCliTest, BadSamplesAreNamedAndCanBeSkipped) {
  const std::string config = TinyConfig();
  ASSERT_EQ(
      Run({"data", "synth", "--config", config, "--samples", "24", "--val-samples", "4"}).exit_code,
      0);
  // Corrupt one image and delete another, both named by the manifest.
  absl::StatusOr<data::Manifest> m = data::ReadManifest(dir_ + "/tiny/train.jsonl", false);
  ASSERT_TRUE(m.ok());
  std::vector<const data::ManifestRecord*> with_images;
  for (const data::ManifestRecord& r : m->records) {
    if (!r.images.empty()) with_images.push_back(&r);
  }
  ASSERT_GE(with_images.size(), 2u);
  const std::string corrupt = m->ResolveImagePath(with_images[0]->images[0]);
  const std::string gone = m->ResolveImagePath(with_images[1]->images[0]);
  std::string png = *data::ReadFileToString(corrupt);
  png.resize(png.size() - 20);
  ASSERT_TRUE(WriteFileAtomically(corrupt, png).ok());
  fs::remove(gone);

  testing::CommandResult r = Run({"data", "check", "--config", config});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.stdout_text, HasSubstr("bad: sample '" + with_images[0]->id + "'"));
  EXPECT_THAT(r.stdout_text, HasSubstr("corrupt PNG " + corrupt));
  EXPECT_THAT(r.stdout_text, HasSubstr("bad: sample '" + with_images[1]->id + "'"));
  EXPECT_THAT(r.stdout_text, HasSubstr("image file not found: " + gone));
  EXPECT_THAT(r.stdout_text, HasSubstr("22 good, 2 bad"));

  r = Run({"data", "index", "--config", config, "--rebuild"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.stderr_text, HasSubstr("2 bad sample(s)"));
  EXPECT_THAT(r.stderr_text, HasSubstr(with_images[0]->id));
  EXPECT_THAT(r.stderr_text, HasSubstr(with_images[1]->id));

  r = Run({"data", "index", "--config", config, "--set", "data.skip_bad_samples=true"});
  ASSERT_EQ(r.exit_code, 0) << r.stderr_text;
  EXPECT_THAT(r.stdout_text, HasSubstr("22 samples, 2 skipped"));
  // Each skipped sample is in the log (stderr) with its id and path.
  EXPECT_THAT(r.stderr_text, HasSubstr("skipping bad sample: sample '" + with_images[0]->id));
  EXPECT_THAT(r.stderr_text, HasSubstr("skipped bad sample: sample '" + with_images[1]->id));
  absl::StatusOr<data::DataIndex> index = data::ReadIndex(dir_ + "/tiny/train.jsonl.index");
  ASSERT_TRUE(index.ok());
  EXPECT_EQ(index->Find(with_images[0]->id), nullptr);
  EXPECT_NE(
      index->Find(m->records[0].id == with_images[0]->id ? m->records[2].id : m->records[0].id),
      nullptr);
  // `show --position` takes the index's positions (the ids of step plans and worker errors),
  // which the skipped samples shift off the manifest's ordinals.
  const data::IndexRecord& last = index->records.back();
  ASSERT_NE(last.ordinal, static_cast<int64_t>(index->records.size()) - 1);
  r = Run({"data", "show", "--config", config, "--set", "data.skip_bad_samples=true", "--position",
           "21"});
  ASSERT_EQ(r.exit_code, 0) << r.stderr_text;
  EXPECT_THAT(r.stdout_text, HasSubstr("sample '" + last.id + "' (index position 21, "));
  r = Run({"data", "show", "--config", config, "--set", "data.skip_bad_samples=true", "--position",
           "22"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.stderr_text, HasSubstr("--position 22 is outside the data index"));
  EXPECT_THAT(r.stderr_text, HasSubstr("of 22 samples (positions 0 to 21)"));
  r = Run({"data", "show", "--config", config});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.stderr_text, HasSubstr("--id ID or --position N"));

  // A malformed manifest line is listed with the rest, without data.skip_bad_samples: the
  // check goes on to every other sample.
  std::ofstream(dir_ + "/tiny/train.jsonl", std::ios::app) << "{\"id\": broken\n";
  r = Run({"data", "check", "--config", config});
  EXPECT_EQ(r.exit_code, 1) << r.stderr_text;
  EXPECT_THAT(r.stdout_text, HasSubstr("train.jsonl:25): not valid JSON"));
  EXPECT_THAT(r.stdout_text, HasSubstr("image file not found: " + gone));
  EXPECT_THAT(r.stdout_text, HasSubstr("corrupt PNG " + corrupt));
  EXPECT_THAT(r.stdout_text, HasSubstr("22 good, 3 bad"));
}

// `hetpar data index` fails when it cannot write the index (here data.index below a regular
// file), naming the path, rather than reporting an index it did not keep.
TEST_F(DataCliTest, IndexFailsWhenTheIndexCannotBeWritten) {
  const std::string config = TinyConfig();
  ASSERT_EQ(
      Run({"data", "synth", "--config", config, "--samples", "8", "--val-samples", "2"}).exit_code,
      0);
  const std::string path = dir_ + "/tiny/train.jsonl/train.jsonl.index";
  testing::CommandResult r =
      Run({"data", "index", "--config", config, "--rebuild", "--set", "data.index=" + path});
  EXPECT_EQ(r.exit_code, 1) << r.stdout_text << r.stderr_text;
  EXPECT_THAT(r.stderr_text, HasSubstr(path));
  r = Run({"data", "index", "--config", config, "--set", "data.index=" + path});
  EXPECT_EQ(r.exit_code, 1) << r.stdout_text << r.stderr_text;
  EXPECT_THAT(r.stderr_text, HasSubstr(path));
  EXPECT_THAT(r.stdout_text, Not(HasSubstr("(built)")));
}

// An image path that is a FIFO (no writer) is listed as bad by `check`, which goes on, instead of
// blocking in the read for good.
TEST_F(DataCliTest, CheckListsAFifoImageWithoutWaitingForAWriter) {
  const std::string config = TinyConfig();
  ASSERT_EQ(
      Run({"data", "synth", "--config", config, "--samples", "8", "--val-samples", "2"}).exit_code,
      0);
  absl::StatusOr<data::Manifest> m = data::ReadManifest(dir_ + "/tiny/train.jsonl", false);
  ASSERT_TRUE(m.ok());
  const data::ManifestRecord* with_image = nullptr;
  for (const data::ManifestRecord& r : m->records) {
    if (!r.images.empty() && with_image == nullptr) with_image = &r;
  }
  ASSERT_NE(with_image, nullptr);
  const std::string fifo = m->ResolveImagePath(with_image->images[0]);
  ASSERT_EQ(::unlink(fifo.c_str()), 0);
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  testing::CommandResult r = Run({"data", "check", "--config", config});
  EXPECT_EQ(r.exit_code, 1) << r.stderr_text;
  EXPECT_THAT(r.stdout_text, HasSubstr("bad: sample '" + with_image->id + "'"));
  EXPECT_THAT(r.stdout_text, HasSubstr(fifo + " is not a regular file"));
  EXPECT_THAT(r.stdout_text, HasSubstr("7 good, 1 bad"));
}

TEST_F(DataCliTest, UsageErrorsExitTwo) {
  testing::CommandResult r = Run({"data", "synth", "--samples", "5"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.stderr_text, HasSubstr("exactly one of --out DIR and --config FILE"));
  r = Run({"data", "synth", "--out", dir_ + "/x"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.stderr_text, HasSubstr("--samples N"));
  r = Run({"data", "synth", "--out", dir_ + "/x", "--samples", "4", "--seq-len", "20"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.stderr_text, HasSubstr("seq_len=20"));
  r = Run({"data", "index", "--config", TinyConfig(), "--split", "test"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.stderr_text, HasSubstr("expected train or val"));
  r = Run({"data"});
  EXPECT_EQ(r.exit_code, 2);
  r = Run({"data", "--help"});
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_THAT(r.stdout_text, HasSubstr("synth"));
  EXPECT_THAT(r.stdout_text, HasSubstr("check"));
  EXPECT_THAT(r.stdout_text, Not(HasSubstr("torch")));
}

}  // namespace
}  // namespace hetpar
