#include "coordinator/cli/step_metrics.h"

#include <stdio.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "common/run_directory.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace hetpar::cli {
namespace {

namespace fs = std::filesystem;

class StepMetricsWriterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::temp_directory_path() / "step_metrics_test.XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
    v1::RunSpec spec;
    spec.mutable_run()->set_name("metrics");
    absl::StatusOr<std::unique_ptr<RunDirectory>> run = RunDirectory::Create(dir_, spec);
    ASSERT_TRUE(run.ok()) << run.status();
    run_ = *std::move(run);
  }
  void TearDown() override {
    run_.reset();
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

  static v1::StepTiming Timing(int64_t step, bool committed = true) {
    v1::StepTiming t;
    t.set_step(step);
    t.set_committed(committed);
    t.set_loss(10.0 - 0.25 * step);
    t.set_duration_s(0.5);
    return t;
  }

  // metrics.jsonl's lines, parsed.
  std::vector<nlohmann::json> Lines() const {
    std::vector<nlohmann::json> lines;
    std::ifstream in(dir_ + "/metrics.jsonl");
    for (std::string line; std::getline(in, line);) lines.push_back(nlohmann::json::parse(line));
    return lines;
  }

  std::string dir_;
  std::unique_ptr<RunDirectory> run_;
};

// The coordinator's status holds its latest 32 attempts; the writer writes from the steps taken,
// however many committed between two calls.
TEST_F(StepMetricsWriterTest, EveryTakenStepGetsOneLineInOrder) {
  std::vector<int64_t> seen;
  StepMetricsWriter writer(run_.get(), 0,
                           [&](const v1::StepTiming& t) { seen.push_back(t.step()); });
  std::vector<v1::StepTiming> taken;
  for (int64_t step = 0; step < 40; ++step) taken.push_back(Timing(step));
  ASSERT_TRUE(writer.Follow(v1::StatusResponse(), taken).ok());
  // Nothing new; then an aborted attempt, a step already written, and the next step.
  ASSERT_TRUE(writer.Follow(v1::StatusResponse(), {}).ok());
  ASSERT_TRUE(
      writer.Follow(v1::StatusResponse(), {Timing(40, /*committed=*/false), Timing(39), Timing(40)})
          .ok());
  const std::vector<nlohmann::json> lines = Lines();
  ASSERT_EQ(lines.size(), 41u);
  for (int64_t step = 0; step <= 40; ++step) {
    EXPECT_EQ(lines[step]["step"].get<int64_t>(), step);
    EXPECT_DOUBLE_EQ(lines[step]["loss"].get<double>(), 10.0 - 0.25 * step);
  }
  EXPECT_EQ(writer.written(), 41);
  EXPECT_EQ(seen.size(), 41u);
}

TEST_F(StepMetricsWriterTest, AResumedRunStartsAtItsFirstStep) {
  StepMetricsWriter writer(run_.get(), 0, nullptr, /*first_step=*/6);
  ASSERT_TRUE(writer.Follow(v1::StatusResponse(), {Timing(5), Timing(6), Timing(7)}).ok());
  const std::vector<nlohmann::json> lines = Lines();
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0]["step"].get<int64_t>(), 6);
  EXPECT_EQ(lines[1]["step"].get<int64_t>(), 7);
}

// The lines `hetpar run` and `hetpar coordinator` print in a log, committing steps one second
// apart with 100 tokens and 2 GFLOP each.
std::vector<std::string> ProgressLines(int64_t total, int64_t first_step, int64_t log_every) {
  char* text = nullptr;
  size_t size = 0;
  std::FILE* out = ::open_memstream(&text, &size);
  const absl::Time start = absl::FromUnixSeconds(1000);
  ProgressLine line(total, first_step, log_every, /*log_every_s=*/0, /*tty=*/false, start, out);
  for (int64_t step = first_step; step < total; ++step) {
    v1::StepTiming t;
    t.set_step(step);
    t.set_loss(2.5);
    t.set_tokens(100);
    t.set_duration_s(1.0);
    (*t.mutable_modules())["llm"].set_model_flops(2e9);
    line.Committed(t, start + absl::Seconds(step - first_step + 1));
  }
  std::fclose(out);
  std::vector<std::string> lines;
  std::istringstream in(std::string(text, size));
  std::free(text);
  for (std::string l; std::getline(in, l);) lines.push_back(l);
  return lines;
}

TEST(ProgressLineTest, ALineEveryLogEveryStepsAndAtTheLast) {
  EXPECT_EQ(ProgressLines(12, 0, 5),
            (std::vector<std::string>{
                "step 5/12 [##########..............] loss 2.5000  100 tok/s  2.0 GFLOP/s  ETA 7s",
                "step 10/12 [####################....] loss 2.5000  100 tok/s  2.0 GFLOP/s  ETA 2s",
                "step 12/12 [########################] loss 2.5000  100 tok/s  2.0 GFLOP/s  ETA 0s"}));
}

TEST(ProgressLineTest, AResumedRunsEtaCountsOnlyTheStepsItTrained) {
  // Resumed at step 6: by step 10 it trained 4 steps in 4 s, 2 are left.
  const std::vector<std::string> lines = ProgressLines(12, 6, 5);
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_THAT(lines[0], ::testing::StartsWith("step 10/12 "));
  EXPECT_THAT(lines[0], ::testing::EndsWith("ETA 2s"));
}

}  // namespace
}  // namespace hetpar::cli
