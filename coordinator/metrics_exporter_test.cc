#include "coordinator/metrics_exporter.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <httplib.h>

#include <map>
#include <sstream>
#include <string>

namespace hetpar::coordinator {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

v1::StatusResponse SampleStatus() {
  v1::StatusResponse s;
  s.set_run_name("tiny \"a\"");
  s.set_state(v1::RUN_STATE_RUNNING);
  s.set_generation(1);
  s.set_committed_steps(7);
  s.set_first_step(4);  // resumed from the checkpoint of step 4
  s.set_total_steps(100);
  s.set_aborted_steps(1);
  s.set_tokens_total(3500);
  s.set_images_total(70);
  s.set_expected_workers(3);
  s.set_peak_tflops(4);
  for (v1::WorkerRole role : {v1::WORKER_ROLE_ENCODER, v1::WORKER_ROLE_LLM, v1::WORKER_ROLE_LLM}) {
    v1::WorkerStatus* w = s.add_workers();
    w->set_role(role);
    w->set_alive(true);
  }
  // Newest first: step 6 committed; an aborted attempt before it is ignored.
  v1::StepTiming* t = s.add_recent_steps();
  t->set_step(6);
  t->set_committed(true);
  t->set_duration_s(0.5);
  t->set_tokens(500);
  t->set_images(10);
  t->set_loss(2.25);
  v1::ModuleStepSplit& llm = (*t->mutable_modules())["llm"];
  llm.set_ranks(2);
  llm.set_compute_s(0.25);
  llm.set_model_flops(1e12);
  v1::StepTiming* aborted = s.add_recent_steps();
  aborted->set_step(6);
  aborted->set_committed(false);
  aborted->set_duration_s(9);
  return s;
}

// name{labels} -> value, for every sample line.
std::map<std::string, std::string> Samples(const std::string& text) {
  std::map<std::string, std::string> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    const size_t space = line.rfind(' ');
    out[line.substr(0, space)] = line.substr(space + 1);
  }
  return out;
}

TEST(RenderPrometheusTest, LatestCommittedStepRatesAndTotals) {
  const std::string text = RenderPrometheus(SampleStatus());
  const auto samples = Samples(text);
  const std::string run = "run=\"tiny \\\"a\\\"\"";  // the quote in the run name escaped
  EXPECT_EQ(samples.at("hetpar_step_time_seconds{" + run + "}"), "0.5");
  EXPECT_EQ(samples.at("hetpar_tokens_per_second{" + run + "}"), "1000");  // 500 / 0.5 s
  EXPECT_EQ(samples.at("hetpar_images_per_second{" + run + "}"), "20");
  EXPECT_EQ(samples.at("hetpar_tokens_total{" + run + "}"), "3500");
  EXPECT_EQ(samples.at("hetpar_steps_aborted_total{" + run + "}"), "1");
  // The counter counts this coordinator's commits (3 since step 4); the gauge where the run is.
  EXPECT_EQ(samples.at("hetpar_steps_committed_total{" + run + "}"), "3");
  EXPECT_EQ(samples.at("hetpar_step{" + run + "}"), "7");
  EXPECT_EQ(samples.at("hetpar_run_state{" + run + ",state=\"running\"}"), "1");
  EXPECT_EQ(samples.at("hetpar_run_state{" + run + ",state=\"done\"}"), "0");
  EXPECT_EQ(samples.at("hetpar_workers{" + run + ",role=\"llm\",state=\"alive\"}"), "2");
  EXPECT_EQ(samples.at("hetpar_module_seconds{" + run + ",module=\"llm\",phase=\"compute\"}"),
            "0.25");
  // 1e12 FLOPs in 0.5 s: 2 TFLOPS; 1 per rank on 2 ranks; 25 % of a 4 TFLOPS peak.
  EXPECT_EQ(samples.at("hetpar_module_tflops{" + run + ",module=\"llm\"}"), "2");
  EXPECT_EQ(samples.at("hetpar_module_tflops_per_rank{" + run + ",module=\"llm\"}"), "1");
  EXPECT_EQ(samples.at("hetpar_module_utilization{" + run + ",module=\"llm\"}"), "0.25");
}

TEST(RenderPrometheusTest, EveryFamilyHasOneHelpAndTypeBeforeItsSamples) {
  const std::string text = RenderPrometheus(SampleStatus());
  std::istringstream in(text);
  std::string line;
  std::map<std::string, int> types;
  std::string current;
  while (std::getline(in, line)) {
    if (line.rfind("# TYPE ", 0) == 0) {
      current = line.substr(7, line.find(' ', 7) - 7);
      ++types[current];
    } else if (line[0] != '#') {
      EXPECT_EQ(line.rfind(current, 0), 0u) << line << " outside its family " << current;
    }
  }
  for (const auto& [name, count] : types) EXPECT_EQ(count, 1) << name;
  EXPECT_GE(types.size(), 20u);
}

TEST(RenderPrometheusTest, NoStepYetMeansNoPerStepGauges) {
  v1::StatusResponse s;
  s.set_run_name("r");
  const std::string text = RenderPrometheus(s);
  EXPECT_THAT(text, Not(HasSubstr("hetpar_step_time_seconds")));
  EXPECT_THAT(text, HasSubstr("hetpar_steps_committed_total{run=\"r\"} 0"));
}

TEST(MetricsExporterTest, ServesMetricsOverHttp) {
  auto exporter = MetricsExporter::Start("127.0.0.1:0", [] { return SampleStatus(); });
  ASSERT_TRUE(exporter.ok()) << exporter.status();
  ASSERT_GT((*exporter)->port(), 0);
  httplib::Client client("127.0.0.1", (*exporter)->port());
  client.set_connection_timeout(10);
  client.set_read_timeout(10);
  auto response = client.Get("/metrics");
  ASSERT_TRUE(response) << "no answer from " << (*exporter)->url();
  EXPECT_EQ(response->status, 200);
  EXPECT_THAT(response->get_header_value("Content-Type"), HasSubstr("version=0.0.4"));
  EXPECT_THAT(response->body, HasSubstr("hetpar_step_time_seconds"));
  EXPECT_EQ((*exporter)->url(),
            "http://127.0.0.1:" + std::to_string((*exporter)->port()) + "/metrics");
}

TEST(MetricsExporterTest, RefusesABadAddress) {
  auto exporter = MetricsExporter::Start("no-port", [] { return v1::StatusResponse(); });
  ASSERT_FALSE(exporter.ok());
  EXPECT_THAT(exporter.status().message(), HasSubstr("'no-port' is not host:port"));
}

}  // namespace
}  // namespace hetpar::coordinator
