// What a worker writes into the run directory: step timing lines, owned-parameter sums and the
// model file, read back and checked value by value.
#include "common/worker/outputs.h"

#include <ATen/ATen.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/nn/export.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace hetpar::worker {
namespace {

std::string TempDir() {
  std::string pattern = (std::filesystem::temp_directory_path() / "outputs_test.XXXXXX").string();
  const char* dir = ::mkdtemp(pattern.data());
  EXPECT_NE(dir, nullptr);
  return dir == nullptr ? "" : std::string(dir);
}

std::vector<nlohmann::json> ReadLines(const std::string& path) {
  std::ifstream in(path);
  std::vector<nlohmann::json> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(nlohmann::json::parse(line));
  return lines;
}

TEST(WorkerOutputsTest, StepTimingsAppendOneLinePerStepAndModule) {
  const std::string dir = TempDir();
  ASSERT_TRUE(AppendStepTimings(dir, 3, 0, {"encoder", {{"compute_s", 0.25}}}).ok());
  ASSERT_TRUE(AppendStepTimings(dir, 3, 0, {"llm", {{"compute_s", 0.5}, {"tokens", 96}}}).ok());
  ASSERT_TRUE(AppendStepTimings(dir, 3, 1, {"encoder", {{"compute_s", 0.125}}}).ok());
  const auto lines = ReadLines(dir + "/workers/rank-3.steps.jsonl");
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_EQ(lines[0]["step"], 0);
  EXPECT_EQ(lines[0]["module"], "encoder");
  EXPECT_EQ(lines[0]["compute_s"], 0.25);
  EXPECT_EQ(lines[1]["module"], "llm");
  EXPECT_EQ(lines[1]["tokens"], 96);
  EXPECT_EQ(lines[2]["step"], 1);
  EXPECT_EQ(lines[2]["compute_s"], 0.125);
  // Nothing is written without a run directory.
  EXPECT_TRUE(AppendStepTimings("", 3, 0, {"encoder", {}}).ok());
  std::filesystem::remove_all(dir);
}

TEST(WorkerOutputsTest, ModuleOutputsHoldTheOwnedSumsAndOnReplicaZeroTheModel) {
  const std::string dir = TempDir();
  nn::ParameterSet params(7, at::kDouble, 0, 1, nn::InitStyle::kTraining);
  auto w = params.Add("w", {2, 3}, -1, nn::InitRule::Constant(1.5));
  auto b = params.Add("b", {3}, -1, nn::InitRule::Constant(-2.0));
  ASSERT_TRUE(w.ok() && b.ok());
  auto tp = nn::Communicator::CreateSingle();
  // The sender stands in for the coordinator: it copies each file under its name into `dir`,
  // and records the names and that the local file is gone once the outputs are written.
  std::vector<std::string> names;
  std::vector<std::string> local_files;
  const OutputSender send = [&](const std::string& name, const std::string& local_path) {
    names.push_back(name);
    local_files.push_back(local_path);
    std::filesystem::create_directories(std::filesystem::path(dir + "/" + name).parent_path());
    std::filesystem::copy_file(local_path, dir + "/" + name);
    return absl::OkStatus();
  };
  ASSERT_TRUE(WriteModuleOutputs(send, 4, "llm", 0, params, *tp, *tp).ok());
  ASSERT_TRUE(WriteModuleOutputs(send, 5, "encoder", 1, params, *tp, *tp).ok());
  EXPECT_THAT(names, testing::ElementsAre("workers/rank-4-llm.json", "model/llm.hpar",
                                          "workers/rank-5-encoder.json"));
  for (const std::string& file : local_files) EXPECT_FALSE(std::filesystem::exists(file)) << file;

  const auto sums = ReadLines(dir + "/workers/rank-4-llm.json");
  ASSERT_EQ(sums.size(), 1u);
  EXPECT_EQ(sums[0]["world_rank"], 4);
  EXPECT_EQ(sums[0]["dp"], 0);
  // 6 x 1.5 + 3 x -2 and 6 x 2.25 + 3 x 4.
  EXPECT_DOUBLE_EQ(sums[0]["sum"].get<double>(), 3.0);
  EXPECT_DOUBLE_EQ(sums[0]["square_sum"].get<double>(), 25.5);
  auto model = nn::ReadFullParameters(dir + "/model/llm.hpar");
  ASSERT_TRUE(model.ok()) << model.status();
  ASSERT_EQ(model->size(), 2u);
  EXPECT_EQ((*model)[0].name, "w");
  EXPECT_TRUE(at::equal((*model)[0].tensor, at::full({2, 3}, 1.5, at::kDouble)));
  EXPECT_TRUE(at::equal((*model)[1].tensor, at::full({3}, -2.0, at::kDouble)));
  // A replica other than 0 writes its sums but no model file.
  EXPECT_EQ(ReadLines(dir + "/workers/rank-5-encoder.json")[0]["dp"], 1);
  EXPECT_FALSE(std::filesystem::exists(dir + "/model/encoder.hpar"));
  std::filesystem::remove_all(dir);
}

// The scratch directory of outputs under way (which may hold a whole model file) is removed by
// RemoveOutputScratch, as a signal's exit does before it ends the process without destructors.
TEST(WorkerOutputsTest, OutputScratchIsRemovedForAnExitThatSkipsDestructors) {
  nn::ParameterSet params(7, at::kDouble, 0, 1, nn::InitStyle::kTraining);
  ASSERT_TRUE(params.Add("w", {2, 3}, -1, nn::InitRule::Constant(1.5)).ok());
  auto tp = nn::Communicator::CreateSingle();
  std::string scratch;
  const OutputSender send = [&](const std::string&, const std::string& local_path) {
    scratch = std::filesystem::path(local_path).parent_path().string();
    EXPECT_TRUE(std::filesystem::exists(scratch));
    RemoveOutputScratch();
    return absl::CancelledError("the process exits");
  };
  EXPECT_EQ(WriteModuleOutputs(send, 4, "llm", 0, params, *tp, *tp).code(),
            absl::StatusCode::kCancelled);
  ASSERT_FALSE(scratch.empty());
  EXPECT_FALSE(std::filesystem::exists(scratch)) << scratch;
}

// At a worker's start: the scratch directories of a process that is gone, and this process's own
// from before a restart (execve keeps the pid), are removed; a live process's are not.
TEST(WorkerOutputsTest, StaleOutputScratchIsSweptAtStart) {
  const std::string tmp = TempDir();
  const char* previous = std::getenv("TMPDIR");
  const std::string saved = previous == nullptr ? "" : previous;
  ASSERT_EQ(::setenv("TMPDIR", tmp.c_str(), 1), 0);
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ASSERT_GT(child, 0);
  ASSERT_EQ(::waitpid(child, nullptr, 0), child);  // gone from here on
  const auto make = [&](const std::string& name) {
    std::filesystem::create_directories(tmp + "/" + name);
    std::ofstream(tmp + "/" + name + "/llm.hpar") << "model";
    return tmp + "/" + name;
  };
  const std::string gone = make(absl::StrCat("hetpar-llm-outputs-", child, ".aaaaaa"));
  const std::string own = make(absl::StrCat("hetpar-encoder-outputs-", ::getpid(), ".bbbbbb"));
  const std::string live = make(absl::StrCat("hetpar-llm-outputs-", ::getppid(), ".cccccc"));
  const std::string other = make("hetpar-index-cache");
  EXPECT_EQ(SweepStaleOutputScratch(), 2);
  if (saved.empty()) {
    ::unsetenv("TMPDIR");
  } else {
    ::setenv("TMPDIR", saved.c_str(), 1);
  }
  EXPECT_FALSE(std::filesystem::exists(gone));
  EXPECT_FALSE(std::filesystem::exists(own));
  EXPECT_TRUE(std::filesystem::exists(live));
  EXPECT_TRUE(std::filesystem::exists(other));
  std::filesystem::remove_all(tmp);
}

}  // namespace
}  // namespace hetpar::worker
