#include "common/trace/recorder.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "nlohmann/json.hpp"

namespace hetpar::trace {
namespace {

using ::testing::HasSubstr;

TEST(StepRangeTest, ParsesARangeOrOneStepAndRefusesTheRest) {
  EXPECT_EQ(*ParseStepRange("2:5"), std::make_pair(int64_t{2}, int64_t{5}));
  EXPECT_EQ(*ParseStepRange("7"), std::make_pair(int64_t{7}, int64_t{7}));
  for (const char* bad : {"5:2", "-1:3", "a:b", "1:2:3", ""}) {
    EXPECT_THAT(ParseStepRange(bad).status().message(), HasSubstr("expected FIRST:LAST")) << bad;
  }
}

TEST(RecorderTest, RecordsOnlyTheConfiguredStepsWithTheirStep) {
  Recorder& r = Recorder::Process();
  r.Configure(1, 2);
  for (int64_t step = 0; step < 4; ++step) {
    r.BeginStep(step);
    Record(kLlmLane, "forward+backward", "compute", Clock::now(), {{"wave", step * 10}});
  }
  const std::vector<std::string> events = r.TakeJson(3);
  ASSERT_EQ(events.size(), 2u);
  for (size_t i = 0; i < events.size(); ++i) {
    const nlohmann::json e = nlohmann::json::parse(events[i]);
    EXPECT_EQ(e["name"], "forward+backward");
    EXPECT_EQ(e["ph"], "X");
    EXPECT_EQ(e["pid"], 3);
    EXPECT_EQ(e["tid"], static_cast<int>(kLlmLane));
    EXPECT_EQ(e["args"]["step"], static_cast<int64_t>(i + 1));
    EXPECT_EQ(e["args"]["wave"], static_cast<int64_t>((i + 1) * 10));
    EXPECT_GE(e["dur"].get<double>(), 0);
  }
  EXPECT_TRUE(r.TakeJson(3).empty());  // taken
  r.Configure(-1, -1);
  r.BeginStep(1);
  EXPECT_FALSE(r.on());
}

TEST(MergeTest, OneFileSortedByTimeWithProcessAndLaneNames) {
  const std::string dir = ::testing::TempDir() + "/trace-merge-" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  ASSERT_TRUE(AppendEvents(dir + "/rank-1.jsonl",
                           {ProcessNameEvent(1, "rank 1: llm dp 0 tp 0"),
                            R"({"name":"b","ph":"X","ts":20,"dur":1,"pid":1,"tid":2})"})
                  .ok());
  ASSERT_TRUE(AppendEvents(dir + "/rank-0.jsonl",
                           {R"({"name":"a","ph":"X","ts":10,"dur":1,"pid":0,"tid":1})",
                            R"({"name":"c","ph":"X","ts":30,"dur":1,"pid":0,"tid":1})"})
                  .ok());
  auto count = MergeTraceFiles(dir, dir + "/trace.json");
  ASSERT_TRUE(count.ok()) << count.status();
  EXPECT_EQ(*count, 3);
  std::ifstream in(dir + "/trace.json");
  const nlohmann::json trace = nlohmann::json::parse(in);
  std::string order;
  int thread_names = 0;
  bool process_name = false;
  for (const nlohmann::json& e : trace["traceEvents"]) {
    if (e["ph"] == "X") order += e["name"].get<std::string>();
    if (e["name"] == "thread_name") ++thread_names;
    if (e["name"] == "process_name") process_name = e["args"]["name"] == "rank 1: llm dp 0 tp 0";
  }
  EXPECT_EQ(order, "abc");
  EXPECT_EQ(thread_names, 8);  // 4 lanes x 2 ranks
  EXPECT_TRUE(process_name);
  EXPECT_TRUE(absl::IsNotFound(MergeTraceFiles(dir + "/none", dir + "/x.json").status()));
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace hetpar::trace
