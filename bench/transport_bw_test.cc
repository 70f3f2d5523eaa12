// bench/transport_bw as gpu-check and a user run it, with budgets small enough for a unit test
// (no timing is asserted): --memory cuda prints one "skipped" line and exits 0 where no CUDA device
// is visible, and on a GPU measures (every rate above zero); the host mode still moves and checks
// the bytes (a worker that receives a wrong byte fails the run); a pair past --limit is not run
// at the later sizes; a bad --memory is rejected.
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/util/subprocess.h"

namespace hetpar {
namespace {

using ::testing::HasSubstr;
using testing::RunCommand;
using ::testing::StartsWith;

const std::string kBin = TRANSPORT_BW_BIN;

// The stdout lines, each parsed as JSON (a line that is not JSON fails the test).
std::vector<nlohmann::json> JsonLines(const std::string& text) {
  std::vector<nlohmann::json> lines;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    const std::string line = text.substr(start, end - start);
    start = end + 1;
    if (line.empty()) continue;
    nlohmann::json parsed = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    EXPECT_FALSE(parsed.is_discarded()) << "not JSON: " << line;
    if (!parsed.is_discarded()) lines.push_back(parsed);
  }
  return lines;
}

TEST(TransportBwTest, CudaMemoryIsSkippedWithoutAGpuAndMeasuredWithOne) {
  auto r = RunCommand({kBin, "--memory", "cuda", "--sizes", "65536", "--reps", "1", "--budget",
                       "1048576", "--skip", "ucx_raw"},
                      240);
  ASSERT_TRUE(r.ok()) << r.status();
  const std::vector<nlohmann::json> lines = JsonLines(r->stdout_text);
  ASSERT_EQ(lines.size(), 1u) << r->stdout_text << r->stderr_text;
  const nlohmann::json& line = lines[0];
  EXPECT_EQ(line.value("bench", ""), "transport_bw");
  if (line.contains("skipped")) {
    // No CUDA device here: one line, exit 0, like gpu_bench.
    EXPECT_EQ(r->exit_code, 0) << r->stderr_text;
    EXPECT_THAT(line["skipped"].get<std::string>(), StartsWith("no CUDA device: "));
    EXPECT_THAT(line["skipped"].get<std::string>(), HasSubstr("device_count() = "));
    return;
  }
  // A GPU: the workers' CUDA buffers crossed and were checked, the d2d baseline ran.
  ASSERT_EQ(r->exit_code, 0) << r->stdout_text << r->stderr_text;
  EXPECT_EQ(line.value("memory", ""), "cuda");
  EXPECT_EQ(line.value("size", 0), 65536);
  EXPECT_GT(line.value("hetpar_gbps", 0.0), 0);
  EXPECT_GT(line.value("hetpar_bidir_gbps", 0.0), 0);
  EXPECT_GT(line.value("d2d_gbps", 0.0), 0);
  EXPECT_GT(line.value("hetpar_vs_d2d", 0.0), 0);
  EXPECT_EQ(line.value("gloo", ""), "skipped: host memory only");
}

TEST(TransportBwTest, HostMemoryMovesAndChecksTheBytes) {
  auto r = RunCommand(
      {kBin, "--sizes", "65536", "--reps", "1", "--budget", "1048576", "--skip", "ucx_raw,gloo"},
      240);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->exit_code, 0) << r->stdout_text << r->stderr_text;
  const std::vector<nlohmann::json> lines = JsonLines(r->stdout_text);
  ASSERT_EQ(lines.size(), 1u) << r->stdout_text;
  const nlohmann::json& line = lines[0];
  EXPECT_EQ(line.value("bench", ""), "transport_bw");
  EXPECT_EQ(line.value("memory", ""), "host");
  EXPECT_EQ(line.value("size", 0), 65536);
  EXPECT_GT(line.value("hetpar_gbps", 0.0), 0);
  EXPECT_GT(line.value("hetpar_bidir_gbps", 0.0), 0);
  EXPECT_GT(line.value("memcpy_gbps", 0.0), 0);
  EXPECT_EQ(line.value("gloo_gbps", -1.0), 0);     // skipped
  EXPECT_EQ(line.value("ucx_raw_gbps", -1.0), 0);  // skipped
}

TEST(TransportBwTest, APairPastItsLimitIsNotRunAtTheLaterSizes) {
  // 8192 messages of 16 MiB (128 GiB, the most a size sends) cannot cross within the pair's 1 s
  // limit on any machine: the pair is ended at 1 s, and at the next size it is not started again.
  auto r = RunCommand({kBin, "--sizes", "16777216,65536", "--reps", "2", "--budget", "137438953472",
                       "--limit", "1", "--skip", "ucx_raw,gloo,memcpy"},
                      240);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->exit_code, 1) << r->stdout_text << r->stderr_text;
  const std::vector<nlohmann::json> lines = JsonLines(r->stdout_text);
  ASSERT_EQ(lines.size(), 2u) << r->stdout_text << r->stderr_text;
  EXPECT_EQ(lines[0].value("size", 0), 16777216);
  EXPECT_THAT(lines[0].value("error", ""),
              HasSubstr("hetpar rank 0 (both ranks together) did not finish within 1s"));
  EXPECT_EQ(lines[0].value("hetpar_gbps", -1.0), 0);
  EXPECT_EQ(lines[1].value("size", 0), 65536);
  EXPECT_EQ(lines[1].value("error", ""),
            "hetpar pair: not run: the hetpar pair run past --limit at 16777216 bytes");
}

TEST(TransportBwTest, UnknownMemoryKindIsRejected) {
  auto r = RunCommand({kBin, "--memory", "gpu"});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->exit_code, 2);
  EXPECT_THAT(r->stderr_text, HasSubstr("bad value 'gpu' for --memory"));
  EXPECT_EQ(r->stdout_text, "");
}

}  // namespace
}  // namespace hetpar
