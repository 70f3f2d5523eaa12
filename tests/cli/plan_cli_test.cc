// `hetpar plan` as a user runs it: the text and JSON views of a config's step plan.
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

}  // namespace
}  // namespace hetpar
