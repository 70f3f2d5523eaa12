// `hetpar plan` as a user runs it: the text and JSON views of a config's step plan.
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/util/subprocess.h"

namespace hetpar {
namespace {

using ::testing::HasSubstr;
using testing::RunCommand;

const std::string kBin = HETPAR_BIN;
const std::string kTiny = std::string(HETPAR_SOURCE_DIR) + "/configs/tiny.yaml";
const std::string kLarge = std::string(HETPAR_SOURCE_DIR) + "/configs/large-example.yaml";

TEST(CliPlanTest, TinyTextShowsLayoutsRoutesAndLoad) {
  auto r = RunCommand({kBin, "plan", "--config", kTiny});
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->exit_code, 0) << r->stderr_text;
  EXPECT_THAT(r->stdout_text, HasSubstr("encoder    dp 2 x tp 1, ranks [0, 2)"));
  EXPECT_THAT(r->stdout_text, HasSubstr("llm        dp 1 x tp 2, ranks [2, 4)"));
  EXPECT_THAT(r->stdout_text, HasSubstr("Routes"));
  EXPECT_THAT(r->stdout_text, HasSubstr("Per-rank load"));
}

TEST(CliPlanTest, FrozenEncoderPlansNoGradientsBack) {
  auto r = RunCommand({kBin, "plan", "--config", kTiny, "--set", "encoder.frozen=true"});
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->exit_code, 0) << r->stderr_text;
  EXPECT_THAT(r->stdout_text, HasSubstr("none backward (the encoder is frozen)"));
  EXPECT_THAT(r->stdout_text, HasSubstr("no gradients come back"));
  auto trained = RunCommand({kBin, "plan", "--config", kTiny});
  ASSERT_TRUE(trained.ok());
  EXPECT_THAT(trained->stdout_text, HasSubstr("gradients take each route back"));
}

TEST(CliPlanTest, ShowsCpShardsAndPpStages) {
  // configs/tiny.yaml: seq_len 128, 2 LLM layers.
  auto r = RunCommand({kBin, "plan", "--config", kTiny, "--set", "llm.layout.cp=2"});
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->exit_code, 0) << r->stderr_text;
  EXPECT_THAT(r->stdout_text, HasSubstr("cp shards  positions of each sequence (padded to 128): "
                                        "cp0 [0, 32) + [96, 128); cp1 [32, 96)"));
  r = RunCommand({kBin, "plan", "--config", kTiny, "--set", "llm.layout.pp=2"});
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->exit_code, 0) << r->stderr_text;
  EXPECT_THAT(r->stdout_text, HasSubstr("pp stages  pp0 layers [0, 1); pp1 layers [1, 2); image "
                                        "rows land on stage 0, the loss on stage 1"));
}

TEST(CliPlanTest, JsonIsConsistent) {
  auto r = RunCommand({kBin, "plan", "--config", kTiny, "--json", "--images-per-sample", "1-1"});
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->exit_code, 0) << r->stderr_text;
  auto j = nlohmann::json::parse(r->stdout_text);
  EXPECT_EQ(j["world_size"], 4);
  EXPECT_EQ(j["batch"]["samples"], 8);
  // One image per sample: 8 images of 16 rows each, every row sent once forward.
  EXPECT_EQ(j["batch"]["images"], 8);
  EXPECT_EQ(j["batch"]["image_rows"], 8 * 16);
  EXPECT_EQ(j["boundary"]["bytes"], 8 * 16 * 64 * 4);
  int64_t link_bytes = 0;
  for (const auto& link : j["links"]) link_bytes += link["bytes"].get<int64_t>();
  EXPECT_EQ(link_bytes, j["boundary"]["bytes"].get<int64_t>());
  int64_t sent = 0, received = 0;
  for (const auto& rank : j["ranks"]) {
    sent += rank["bytes_sent"].get<int64_t>();
    received += rank["bytes_received"].get<int64_t>();
  }
  EXPECT_EQ(sent, link_bytes);
  EXPECT_EQ(received, link_bytes);
}

TEST(CliPlanTest, TextOnlyBatchHasNoTransfers) {
  auto r = RunCommand({kBin, "plan", "--config", kTiny, "--json", "--images-per-sample", "0"});
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->exit_code, 0) << r->stderr_text;
  auto j = nlohmann::json::parse(r->stdout_text);
  EXPECT_EQ(j["batch"]["images"], 0);
  EXPECT_EQ(j["boundary"]["messages"], 0);
}

TEST(CliPlanTest, LargeExamplePlans) {
  auto r = RunCommand({kBin, "plan", "--config", kLarge, "--json"}, 120);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->exit_code, 0) << r->stderr_text;
  auto j = nlohmann::json::parse(r->stdout_text);
  EXPECT_EQ(j["world_size"], 16 + 32);
}

TEST(CliPlanTest, BadRangeExitsTwo) {
  auto r = RunCommand({kBin, "plan", "--config", kTiny, "--images-per-sample", "3-1"});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->exit_code, 2);
  EXPECT_THAT(r->stderr_text, HasSubstr("--images-per-sample"));
}

TEST(CliPlanTest, EstimateOnAPresetPrintsTheBreakdown) {
  auto r = RunCommand({kBin, "plan", "--config", kLarge, "--estimate", "--cluster", "h100-sxm",
                       "--estimate-steps", "1"},
                      120);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->exit_code, 0) << r->stderr_text;
  EXPECT_THAT(r->stdout_text, HasSubstr("on h100-sxm"));
  EXPECT_THAT(r->stdout_text, HasSubstr("placement   non_colocated, 48 devices"));
  EXPECT_THAT(r->stdout_text, HasSubstr("step time"));
  EXPECT_THAT(r->stdout_text, HasSubstr("Breakdown"));
  EXPECT_THAT(r->stdout_text, HasSubstr("Memory per device"));
}

TEST(CliPlanTest, EstimateJsonAddsUp) {
  auto r = RunCommand({kBin, "plan", "--config", kTiny, "--estimate", "--json", "--cluster",
                       "a100-80g", "--estimate-steps", "2"});
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->exit_code, 0) << r->stderr_text;
  auto j = nlohmann::json::parse(r->stdout_text);
  EXPECT_EQ(j["placement"], "non_colocated");
  EXPECT_EQ(j["encoder_layout"], "dp2 tp1");
  EXPECT_EQ(j["llm_layout"], "dp1 tp2");
  EXPECT_EQ(j["gpus"], 4);
  EXPECT_EQ(j["cluster"], "a100-80g");
  const double step = j["step_time_s"].get<double>();
  ASSERT_GT(step, 0);
  // TFLOPS per GPU: both modules' model FLOPs over the step and the 4 devices.
  const double tflop =
      j["encoder"]["model_tflop"].get<double>() + j["llm"]["model_tflop"].get<double>();
  EXPECT_NEAR(j["tflops_per_gpu"].get<double>(), tflop / step / 4, 1e-9 * tflop / step);
  EXPECT_NEAR(j["tokens_per_s_per_gpu"].get<double>(),
              j["tokens_per_step"].get<double>() / step / 4, 1e-6);
  EXPECT_GT(j["memory_gib_per_gpu"].get<double>(), 4.0);  // the preset reserves 4 GiB
  EXPECT_TRUE(j["fits_memory"].get<bool>());
}

TEST(CliPlanTest, SearchRanksCandidatesAndShowsTheBestHomogeneous) {
  auto r = RunCommand({kBin, "plan", "--config", kTiny, "--search", "--gpus", "4", "--top", "3",
                       "--json", "--cluster", "h100-sxm", "--estimate-steps", "1"},
                      120);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->exit_code, 0) << r->stderr_text;
  std::istringstream lines(r->stdout_text);
  std::string line;
  std::vector<nlohmann::json> candidates;
  while (std::getline(lines, line)) candidates.push_back(nlohmann::json::parse(line));
  ASSERT_GE(candidates.size(), 3u);
  bool homogeneous = false;
  for (size_t i = 0; i < candidates.size(); ++i) {
    const auto& c = candidates[i];
    for (const char* key : {"placement", "encoder_layout", "llm_layout", "gpus", "step_time_s",
                            "tflops_per_gpu", "tokens_per_s_per_gpu", "memory_gib_per_gpu"}) {
      EXPECT_TRUE(c.contains(key)) << key << " missing from " << line;
    }
    EXPECT_EQ(c["gpus"], 4);
    if (i > 0) {
      EXPECT_GT(c["rank"].get<int>(), candidates[i - 1]["rank"].get<int>());
      EXPECT_LE(c["tokens_per_s_per_gpu"].get<double>(),
                candidates[i - 1]["tokens_per_s_per_gpu"].get<double>());
    }
    if (c["placement"] == "homogeneous") {
      homogeneous = true;
      EXPECT_EQ(c["encoder_layout"], c["llm_layout"]);
      EXPECT_NEAR(c["gain_vs_best_homogeneous"].get<double>(), 0, 1e-12);
    }
  }
  EXPECT_TRUE(homogeneous) << r->stdout_text;
}

TEST(CliPlanTest, SearchOffersRunnablePipelinedLlms) {
  auto r = RunCommand(
      {kBin, "plan", "--config", kTiny, "--search", "--gpus", "8", "--top", "200", "--max-pp", "2",
       "--json", "--cluster", "h100-sxm", "--estimate-steps", "1", "--set", "run.max_inflight=1"},
      120);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->exit_code, 0) << r->stderr_text;
  std::istringstream lines(r->stdout_text);
  std::string line;
  int pipelined = 0;
  int homogeneous = 0;
  while (std::getline(lines, line)) {
    const auto c = nlohmann::json::parse(line);
    // The colocated candidates take max_inflight's default (a colocated run refuses another),
    // so the base's 1 does not drop them.
    if (c["placement"] == "homogeneous") ++homogeneous;
    if (c["llm_layout"].get<std::string>().find("pp2") == std::string::npos) continue;
    ++pipelined;
    // One job in flight is too few for 2 stages fed by an encoder pool: the search raises it.
    EXPECT_TRUE(c["runnable"].get<bool>()) << line;
  }
  EXPECT_GT(pipelined, 0) << r->stdout_text;
  EXPECT_GT(homogeneous, 0) << r->stdout_text;
}

TEST(CliPlanTest, PlannerInputErrorsExitTwo) {
  auto no_budget = RunCommand({kBin, "plan", "--config", kTiny, "--search"});
  ASSERT_TRUE(no_budget.ok());
  EXPECT_EQ(no_budget->exit_code, 2);
  EXPECT_THAT(no_budget->stderr_text, HasSubstr("--search needs --gpus"));

  auto both = RunCommand({kBin, "plan", "--config", kTiny, "--search", "--estimate"});
  ASSERT_TRUE(both.ok());
  EXPECT_EQ(both->exit_code, 2);

  auto unknown = RunCommand({kBin, "plan", "--config", kTiny, "--estimate", "--cluster", "tpu"});
  ASSERT_TRUE(unknown.ok());
  EXPECT_EQ(unknown->exit_code, 2);
  EXPECT_THAT(unknown->stderr_text, HasSubstr("h100-sxm"));

  char dir[] = "/tmp/hetpar-plan-cli.XXXXXX";
  ASSERT_NE(::mkdtemp(dir), nullptr);
  const std::string file = std::string(dir) + "/cluster.yaml";
  std::ofstream(file) << "devices_per_node: 8\nmemory_gib: 80\nmemory_gbps: 3000\n"
                         "peak_tflops: {bfloat16: 900}\ncompute_efficiency: 0.5\n"
                         "intra_node: {collective_gbps: 300, p2p_gbps: 100}\nnics: 8\n";
  auto bad = RunCommand({kBin, "plan", "--config", kTiny, "--estimate", "--cluster", file});
  ASSERT_TRUE(bad.ok());
  EXPECT_EQ(bad->exit_code, 2);
  EXPECT_THAT(bad->stderr_text, HasSubstr(file + ":7: nics is not a cluster field"));
  // tiny.yaml trains in float32; the file has only a bfloat16 peak.
  std::ofstream(file) << "devices_per_node: 8\nmemory_gib: 80\nmemory_gbps: 3000\n"
                         "peak_tflops: {bfloat16: 900}\ncompute_efficiency: 0.5\n"
                         "intra_node: {collective_gbps: 300, p2p_gbps: 100}\n";
  auto dtype = RunCommand({kBin, "plan", "--config", kTiny, "--estimate", "--cluster", file});
  ASSERT_TRUE(dtype.ok());
  EXPECT_EQ(dtype->exit_code, 2);
  EXPECT_THAT(dtype->stderr_text, HasSubstr("peak_tflops.float32"));
  std::remove(file.c_str());
  ::rmdir(dir);
}

// Flags that would do nothing where they are given are refused, naming the flag.
TEST(CliPlanTest, FlagsThatDoNothingHereAreRefused) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--gpus", "8"}, "--gpus applies to --search only"},
      {{"--top", "3"}, "--top applies to --search only"},
      {{"--max-pp", "2"}, "--max-pp applies to --search only"},
      {{"--estimate-steps", "2"}, "--estimate-steps applies to --estimate and --search only"},
      {{"--from-data", "--images-per-sample", "1-1"},
       "--images-per-sample describes synthetic batches"},
      {{"--samples", "0"}, "--samples 0 must be >= 1"},
      {{"--samples", "-5"}, "--samples -5 must be >= 1"},
      {{"--search", "--gpus", "4", "--top", "0"}, "--top 0 must be >= 1"},
      {{"--cluster", "a100-80g"}, "--cluster applies to --estimate and --search only"},
      {{"--estimate", "--wave", "1"}, "--wave applies to a plain plan only"},
  };
  for (const auto& [flags, message] : cases) {
    std::vector<std::string> argv = {kBin, "plan", "--config", kTiny};
    argv.insert(argv.end(), flags.begin(), flags.end());
    auto r = RunCommand(argv);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->exit_code, 2) << message << ": " << r->stdout_text;
    EXPECT_THAT(r->stderr_text, HasSubstr(message));
  }
}

// --from-data plans the batch a run draws at that step: its images are the run's.
TEST(CliPlanTest, FromDataPlansTheBatchTheRunDraws) {
  char dir[] = "/tmp/hetpar-plan-data.XXXXXX";
  ASSERT_NE(::mkdtemp(dir), nullptr);
  const std::string d = dir;
  const std::vector<std::string> data = {
      "--set", "data.manifest=" + d + "/train.jsonl", "--set", "data.val_manifest=" + d + "/val.jsonl",
      "--set", "data.tokenizer=" + d + "/tokenizer.model", "--set", "data.synth.samples=24",
      "--set", "data.synth.val_samples=4"};
  std::vector<std::string> run = {kBin, "run", "--config", kTiny, "--steps", "2", "--threads", "1",
                                  "--out", d + "/run"};
  run.insert(run.end(), data.begin(), data.end());
  auto trained = RunCommand(run, 300);
  ASSERT_TRUE(trained.ok()) << trained.status();
  ASSERT_EQ(trained->exit_code, 0) << trained->stderr_text;
  std::map<int64_t, int64_t> images;  // by step, from the run's metrics
  std::ifstream metrics(d + "/run/metrics.jsonl");
  for (std::string line; std::getline(metrics, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains("step")) images[j["step"].get<int64_t>()] = j["images"].get<int64_t>();
  }
  ASSERT_EQ(images.size(), 2u);
  for (int64_t step : {0, 1}) {
    std::vector<std::string> plan = {kBin, "plan", "--config", kTiny, "--from-data", "--json",
                                     "--step", std::to_string(step)};
    plan.insert(plan.end(), data.begin(), data.end());
    auto r = RunCommand(plan);
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(r->exit_code, 0) << r->stderr_text;
    const auto j = nlohmann::json::parse(r->stdout_text);
    EXPECT_EQ(j["batch"]["from_data"], d + "/train.jsonl");
    EXPECT_FALSE(j["batch"].contains("synthetic"));
    EXPECT_EQ(j["batch"]["images"].get<int64_t>(), images.at(step)) << "step " << step;
  }
  std::filesystem::remove_all(d);
}

}  // namespace
}  // namespace hetpar
