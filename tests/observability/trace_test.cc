// `hetpar run --trace 1:2` of a 4-step tiny run: trace.json is valid trace-event JSON with, for
// every rank, the step protocol (compute, gradient-norm wait, commit wait, optimizer), its
// module's work (encoder forward and backward per job, LLM waves), its boundary messages (bytes,
// peer) and collectives, only for steps 1 and 2, on a clock every rank shares, and no events of
// one rank's lane overlapping impossibly (on a lane, two events are disjoint or nested).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "nlohmann/json.hpp"
#include "tests/coordinator/coordinator_test_util.h"
#include "tests/util/subprocess.h"

namespace hetpar::testing {
namespace {

double NowMicros() {
  return std::chrono::duration<double, std::micro>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

TEST(TraceTest, TwoStepsOfEveryRankOnOneClock) {
  TempDir dir;
  const double before_us = NowMicros();
  auto r = RunCommand({kHetparBin,  "run",
                       "--config",  kSourceDir + "/configs/tiny.yaml",
                       "--steps",   "4",
                       "--trace",   "1:2",
                       "--threads", "1",
                       "--out",     dir.File("run"),
                       "--set",     "data.manifest=" + dir.File("data/train.jsonl"),
                       "--set",     "data.val_manifest=" + dir.File("data/val.jsonl"),
                       "--set",     "data.synth.val_samples=4",
                       "--set",     "data.tokenizer=" + dir.File("data/tokenizer.model"),
                       "--set",     "data.synth.samples=64"},
                      300);
  const double after_us = NowMicros();
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->exit_code, 0) << r->stderr_text;
  EXPECT_THAT(r->stderr_text, ::testing::HasSubstr("trace.json"));

  std::ifstream in(dir.File("run/trace.json"));
  ASSERT_TRUE(in) << r->stderr_text;
  const nlohmann::json trace = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  ASSERT_FALSE(trace.is_discarded()) << "trace.json is not JSON";
  ASSERT_TRUE(trace["traceEvents"].is_array());

  // configs/tiny.yaml: world ranks 0, 1 are the encoder replicas, 2, 3 the LLM's TP ranks.
  std::set<int64_t> named;
  std::map<int64_t, std::multiset<std::string>> names;  // pid -> event names
  std::map<std::pair<int64_t, int64_t>, std::vector<std::pair<double, double>>> lanes;
  for (const nlohmann::json& e : trace["traceEvents"]) {
    const int64_t pid = e["pid"].get<int64_t>();
    if (e["ph"] == "M") {
      if (e["name"] == "process_name") named.insert(pid);
      continue;
    }
    ASSERT_EQ(e["ph"], "X") << e.dump();
    const double ts = e["ts"].get<double>();
    const double dur = e["dur"].get<double>();
    EXPECT_GE(dur, 0) << e.dump();
    // One clock: every event lies inside the run as this test saw it.
    EXPECT_GE(ts, before_us) << e.dump();
    EXPECT_LE(ts + dur, after_us) << e.dump();
    const int64_t step = e["args"]["step"].get<int64_t>();
    EXPECT_TRUE(step == 1 || step == 2) << e.dump();
    const std::string name = e["name"].get<std::string>();
    names[pid].insert(name);
    const int64_t tid = e["tid"].get<int64_t>();
    if (tid ==
        3) {  // the bridge lane: a message with its size and the peer it came from or went to
      EXPECT_GT(e["args"]["bytes"].get<int64_t>(), 0) << e.dump();
      const int64_t peer = e["args"]["peer"].get<int64_t>();
      EXPECT_EQ(pid < 2, peer >= 2) << "rank " << pid << " exchanged with rank " << peer;
    } else {
      lanes[{pid, tid}].push_back({ts, ts + dur});
    }
  }
  EXPECT_EQ(named, (std::set<int64_t>{0, 1, 2, 3}));
  for (int64_t pid = 0; pid < 4; ++pid) {
    const auto& n = names[pid];
    for (const char* step_event : {"compute", "gradient norm wait", "commit wait", "optimizer"}) {
      EXPECT_EQ(n.count(step_event), 2u) << "rank " << pid << ": " << step_event;
    }
    EXPECT_GE(n.count("gradient all-reduce"), 2u) << "rank " << pid;
    if (pid < 2) {
      EXPECT_GE(n.count("forward"), 2u) << "rank " << pid;
      EXPECT_EQ(n.count("forward"), n.count("backward")) << "rank " << pid;
      EXPECT_GE(n.count("send image rows"), 1u) << "rank " << pid;
      EXPECT_GE(n.count("receive gradients"), 1u) << "rank " << pid;
    } else {
      // tiny: global batch 8, micro batch 2, LLM dp 1: 4 waves a step.
      EXPECT_EQ(n.count("forward"), 8u) << "rank " << pid;
      EXPECT_EQ(n.count("backward"), 8u) << "rank " << pid;
      EXPECT_GE(n.count("receive image rows"), 1u) << "rank " << pid;
      EXPECT_GE(n.count("send gradients"), 1u) << "rank " << pid;
      EXPECT_GE(n.count("tp all-reduce image rows"), 1u) << "rank " << pid;
    }
  }
  // On one lane of one rank, events run one after another or one inside another.
  for (auto& [lane, spans] : lanes) {
    std::sort(spans.begin(), spans.end());
    for (size_t i = 0; i < spans.size(); ++i) {
      for (size_t j = i + 1; j < spans.size() && spans[j].first < spans[i].second; ++j) {
        const bool nested = spans[j].second <= spans[i].second + 1.0;  // 1 us of rounding
        EXPECT_TRUE(nested) << "rank " << lane.first << " lane " << lane.second << ": ["
                            << spans[i].first << ", " << spans[i].second << ") and ["
                            << spans[j].first << ", " << spans[j].second << ") overlap";
      }
    }
  }
}

TEST(TraceTest, ABadRangeIsRefused) {
  auto r = RunCommand(
      {kHetparBin, "run", "--config", kSourceDir + "/configs/tiny.yaml", "--trace", "3:1"}, 60);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_NE(r->exit_code, 0);
  EXPECT_THAT(r->stderr_text, ::testing::HasSubstr("trace steps '3:1'"));
}

}  // namespace
}  // namespace hetpar::testing
