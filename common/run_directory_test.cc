// A run's output directory: created fresh, and continued after a coordinator restart, keeping
// the metrics lines of the steps before the one the run resumes from byte for byte.
#include "common/run_directory.h"

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "common/config/config.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace hetpar {
namespace {

namespace fs = std::filesystem;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

class RunDirectoryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::temp_directory_path() / "run_directory_test.XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
    spec_.mutable_run()->set_name("tiny-run");
  }
  void TearDown() override {
    std::error_code ec;
    if (!dir_.empty()) fs::remove_all(dir_, ec);
  }

  static std::string ReadText(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
  }

  static void WriteText(const std::string& path, const std::string& text) {
    std::ofstream out(path, std::ios::binary);
    out << text;
    ASSERT_TRUE(out.good()) << path;
  }

  static std::vector<std::string> Lines(const std::string& text) {
    std::vector<std::string> lines;
    std::istringstream in(text);
    for (std::string line; std::getline(in, line);) lines.push_back(line);
    return lines;
  }

  // A step line as the coordinator writes one.
  static std::string StepLine(int step) {
    return nlohmann::json{
        {"step", step}, {"loss", 2.5 - 0.125 * step}, {"grad_norm", 1.0 + step}, {"tokens", 96},
        {"images", 4},  {"step_time_s", 0.25}}
        .dump();
  }

  std::string dir_;
  hetpar::v1::RunSpec spec_;
};

TEST_F(RunDirectoryTest, CreateWritesConfigAndEmptyMetrics) {
  const std::string path = dir_ + "/run";  // absent: created
  absl::StatusOr<std::unique_ptr<RunDirectory>> run = RunDirectory::Create(path, spec_);
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_EQ((*run)->path(), path);
  EXPECT_TRUE(fs::is_directory(path + "/log"));
  EXPECT_EQ((*run)->LogPath("coordinator"), path + "/log/coordinator.log");
  const std::string config = ReadText(path + "/config.yaml");
  EXPECT_THAT(config, HasSubstr("tiny-run"));
  EXPECT_EQ(config, config::RunSpecToYaml(spec_));
  ASSERT_TRUE(fs::exists(path + "/metrics.jsonl"));
  EXPECT_EQ(fs::file_size(path + "/metrics.jsonl"), 0u);
}

TEST_F(RunDirectoryTest, CreateTruncatesOldMetrics) {
  WriteText(dir_ + "/metrics.jsonl", StepLine(0) + "\n" + StepLine(1) + "\n");
  absl::StatusOr<std::unique_ptr<RunDirectory>> run = RunDirectory::Create(dir_, spec_);
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_EQ(ReadText(dir_ + "/metrics.jsonl"), "");
}

// One process at a time: a second Create or Continue on a directory in use (a second
// coordinator, a run with the same out_dir) is refused before it changes anything, naming the
// holder's pid; once the first is gone, it goes.
TEST_F(RunDirectoryTest, ADirectoryInUseIsRefusedUntouched) {
  absl::StatusOr<std::unique_ptr<RunDirectory>> first = RunDirectory::Create(dir_, spec_);
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE((*first)->AppendMetrics(StepLine(0)).ok());
  hetpar::v1::RunSpec other = spec_;
  other.mutable_run()->set_name("other");
  for (int continued = 0; continued < 2; ++continued) {
    absl::StatusOr<std::unique_ptr<RunDirectory>> second =
        continued ? RunDirectory::Continue(dir_, other, 0) : RunDirectory::Create(dir_, other);
    ASSERT_FALSE(second.ok());
    EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(std::string(second.status().message()),
                ::testing::HasSubstr("run directory " + dir_ +
                                     " is in use by another hetpar "
                                     "process (pid " +
                                     std::to_string(::getpid()) + ")"));
    EXPECT_EQ(ReadText(dir_ + "/metrics.jsonl"), StepLine(0) + "\n");
    EXPECT_EQ(ReadText(dir_ + "/config.yaml"), config::RunSpecToYaml(spec_));
  }
  first->reset();
  absl::StatusOr<std::unique_ptr<RunDirectory>> after = RunDirectory::Continue(dir_, other, 1);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(ReadText(dir_ + "/config.yaml"), config::RunSpecToYaml(other));
}

TEST_F(RunDirectoryTest, AppendMetricsAppendsWholeLines) {
  absl::StatusOr<std::unique_ptr<RunDirectory>> run = RunDirectory::Create(dir_, spec_);
  ASSERT_TRUE(run.ok()) << run.status();
  ASSERT_TRUE((*run)->AppendMetrics(StepLine(0)).ok());
  // Flushed: visible before the RunDirectory closes.
  EXPECT_EQ(ReadText(dir_ + "/metrics.jsonl"), StepLine(0) + "\n");
  ASSERT_TRUE((*run)->AppendMetrics(StepLine(1)).ok());
  ASSERT_TRUE((*run)->AppendMetrics(R"({"final_params": {"encoder": {"sum": 1.5}}})").ok());
  EXPECT_EQ(ReadText(dir_ + "/metrics.jsonl"),
            StepLine(0) + "\n" + StepLine(1) + "\n" +
                R"({"final_params": {"encoder": {"sum": 1.5}}})" + "\n");
}

TEST_F(RunDirectoryTest, ContinueKeepsTheStepsBeforeTheFirstStepByteForByte) {
  std::string before;
  for (int step = 0; step < 6; ++step) before += StepLine(step) + "\n";
  const std::string final_params =
      R"({"final_params": {"encoder": {"sum": 1.5, "l2": 2.0}, "llm": {"sum": -3.0, "l2": 4.0}}})";
  const std::string eval = R"({"eval": {"loss": 1.75, "samples": 32}})";
  before += final_params + "\n" + eval + "\n";
  WriteText(dir_ + "/metrics.jsonl", before);
  const std::string kept = StepLine(0) + "\n" + StepLine(1) + "\n" + StepLine(2) + "\n";
  // The kept lines are the file's own first three lines, byte for byte.
  ASSERT_EQ(before.substr(0, kept.size()), kept);

  absl::StatusOr<std::unique_ptr<RunDirectory>> run =
      RunDirectory::Continue(dir_, spec_, /*first_step=*/3);
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_EQ(ReadText(dir_ + "/metrics.jsonl"), kept);
  EXPECT_EQ(ReadText(dir_ + "/config.yaml"), config::RunSpecToYaml(spec_));

  ASSERT_TRUE((*run)->AppendMetrics(StepLine(3)).ok());
  EXPECT_EQ(ReadText(dir_ + "/metrics.jsonl"), kept + StepLine(3) + "\n");
  EXPECT_THAT(Lines(ReadText(dir_ + "/metrics.jsonl")),
              ElementsAre(StepLine(0), StepLine(1), StepLine(2), StepLine(3)));
}

TEST_F(RunDirectoryTest, ContinueFromStepZeroKeepsNothing) {
  WriteText(dir_ + "/metrics.jsonl", StepLine(0) + "\n" + StepLine(1) + "\n");
  absl::StatusOr<std::unique_ptr<RunDirectory>> run =
      RunDirectory::Continue(dir_, spec_, /*first_step=*/0);
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_EQ(ReadText(dir_ + "/metrics.jsonl"), "");
}

TEST_F(RunDirectoryTest, ContinueWithoutMetricsStartsAnEmptyFile) {
  const std::string path = dir_ + "/run";  // not even the directory exists
  absl::StatusOr<std::unique_ptr<RunDirectory>> run =
      RunDirectory::Continue(path, spec_, /*first_step=*/5);
  ASSERT_TRUE(run.ok()) << run.status();
  ASSERT_TRUE(fs::exists(path + "/metrics.jsonl"));
  EXPECT_EQ(ReadText(path + "/metrics.jsonl"), "");
  EXPECT_TRUE(fs::is_directory(path + "/log"));
  EXPECT_EQ(ReadText(path + "/config.yaml"), config::RunSpecToYaml(spec_));
  ASSERT_TRUE((*run)->AppendMetrics(StepLine(5)).ok());
  EXPECT_EQ(ReadText(path + "/metrics.jsonl"), StepLine(5) + "\n");
}

TEST_F(RunDirectoryTest, ContinueKeepsThePoolChangesBeforeTheFirstStep) {
  // A replica lost at step 2's boundary (history, kept) and one that joined at step 4's (trained
  // again from step 3: it goes, the run's own history after the restart says what happens then).
  const std::string lost =
      R"({"pool_change": {"step": 2, "generation": 2, "module": "encoder", "kind": "lost"}})";
  const std::string joined =
      R"({"pool_change": {"step": 4, "generation": 3, "module": "encoder", "kind": "joined"}})";
  WriteText(dir_ + "/metrics.jsonl", StepLine(0) + "\n" + StepLine(1) + "\n" + StepLine(2) + "\n" +
                                         lost + "\n" + StepLine(3) + "\n" + StepLine(4) + "\n" +
                                         joined + "\n" + R"({"pool_change": {"step": "1"}})" +
                                         "\n" + R"({"pool_change": 7})" + "\n");
  absl::StatusOr<std::unique_ptr<RunDirectory>> run =
      RunDirectory::Continue(dir_, spec_, /*first_step=*/3);
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_THAT(Lines(ReadText(dir_ + "/metrics.jsonl")),
              ElementsAre(StepLine(0), StepLine(1), StepLine(2), lost));
  // A pool change line is not a step's line.
  EXPECT_EQ(RunDirectory::StepAfterLastLine(dir_, 0), 3);
}

TEST_F(RunDirectoryTest, ContinueDropsMalformedLines) {
  // A line cut short by a crash, a non-JSON line, and lines that are JSON but not step lines.
  WriteText(dir_ + "/metrics.jsonl", StepLine(0) + "\n" + "not json at all\n" + StepLine(1) + "\n" +
                                         R"({"step": "2", "loss": 1.0})" + "\n" + "[1, 2]\n" +
                                         R"({"step": 1.5})" + "\n" + R"({"step": 2, "loss": 1.)");
  absl::StatusOr<std::unique_ptr<RunDirectory>> run =
      RunDirectory::Continue(dir_, spec_, /*first_step=*/4);
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_EQ(ReadText(dir_ + "/metrics.jsonl"), StepLine(0) + "\n" + StepLine(1) + "\n");
  ASSERT_TRUE((*run)->AppendMetrics(StepLine(2)).ok());
  EXPECT_THAT(Lines(ReadText(dir_ + "/metrics.jsonl")),
              ElementsAre(StepLine(0), StepLine(1), StepLine(2)));
}

TEST_F(RunDirectoryTest, StepAfterLastLineIsWhereTheRecordOfTheRunEnds) {
  // Steps 3, 4, 5 and 7 have lines (5 twice, in no order), 6 has only a line cut short; then
  // the end-of-run lines.
  WriteText(dir_ + "/metrics.jsonl", StepLine(4) + "\n" + StepLine(3) + "\n" + StepLine(5) + "\n" +
                                         StepLine(5) + "\n" + StepLine(7) + "\n" +
                                         R"({"step": 6, "loss": 1.)" + "\n" +
                                         R"({"final_params": {"encoder": {"sum": 1.5}}})" + "\n");
  EXPECT_EQ(RunDirectory::StepAfterLastLine(dir_, 0), 8);  // the gap at 6 does not count
  EXPECT_EQ(RunDirectory::StepAfterLastLine(dir_, 3), 8);
  EXPECT_EQ(RunDirectory::StepAfterLastLine(dir_, 8), 8);
  EXPECT_EQ(RunDirectory::StepAfterLastLine(dir_, 10), 10);  // no line from the first step on
  EXPECT_EQ(RunDirectory::StepAfterLastLine(dir_ + "/absent", 2), 2);
}

}  // namespace
}  // namespace hetpar
