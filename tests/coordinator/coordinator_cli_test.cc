// `hetpar coordinator`, `status`, `stop` and `scale` as a user runs them, with simulated worker
// processes running steps planned from the RunSpec.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "common/plan/synthetic_batch.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/coordinator/coordinator_test_util.h"

namespace hetpar::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

const std::string kTiny = kSourceDir + "/configs/tiny.yaml";

class CoordinatorCliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // A generated token lands in this user's runtime directory: keep it inside the test.
    setenv("XDG_RUNTIME_DIR", dir_.path().c_str(), 1);
    unsetenv("HETPAR_TOKEN");
    unsetenv("HETPAR_COORDINATOR");
  }

  absl::StatusOr<CommandResult> Hetpar(std::vector<std::string> args) {
    args.insert(args.begin(), kHetparBin);
    return RunCommand(args, 60);
  }

  TempDir dir_;
};

// `hetpar status` text with the durations that move on their own (uptime, CPU time, the time
// left to register) blanked.
std::string StatusWithoutClock(const std::string& text) {
  static const std::regex kDuration("[0-9]+(\\.[0-9]+)?[sh]\\b");
  return std::regex_replace(text, kDuration, "<t>");
}

TEST_F(CoordinatorCliTest, TinyConfigWaitsForItsWorkersAndStops) {
  auto coordinator = StartCoordinator({"--config", kTiny}, dir_.File("coordinator.log"));
  ASSERT_TRUE(coordinator.ok()) << coordinator.status();
  const std::string token_file = dir_.path() + "/hetpar/coordinator-" +
                                 coordinator->address.substr(coordinator->address.rfind(':') + 1) +
                                 ".token";
  ASSERT_TRUE(std::filesystem::exists(token_file));
  const std::string token = ReadFile(token_file).substr(0, 64);
  ASSERT_EQ(token.size(), 64u);

  // The data position shows once the coordinator has opened the data set (on a thread of its
  // own): from then on nothing that status shows moves while no worker registers.
  auto status = Hetpar({"status", "--coordinator", coordinator->address});
  for (int i = 0; i < 600 && status.ok() && !absl::StrContains(status->stdout_text, "data at ");
       ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    status = Hetpar({"status", "--coordinator", coordinator->address});
  }
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(status->exit_code, 0) << status->stderr_text;
  EXPECT_THAT(status->stdout_text, HasSubstr("data at epoch=0,offset=0"));
  EXPECT_THAT(status->stdout_text, HasSubstr("run tiny: waiting"));
  EXPECT_THAT(status->stdout_text, HasSubstr("workers: 0 of 4 registered"));
  EXPECT_THAT(status->stdout_text, HasSubstr("steps: 0 of 3000 committed"));
  EXPECT_THAT(status->stdout_text, HasSubstr("encoder rank 0 (dp 0, tp 0)"));
  EXPECT_THAT(status->stdout_text, HasSubstr("encoder rank 1 (dp 1, tp 0)"));
  EXPECT_THAT(status->stdout_text, HasSubstr("llm rank 0 (dp 0, tp 0, cp 0, pp 0)"));
  EXPECT_THAT(status->stdout_text, HasSubstr("llm rank 1 (dp 0, tp 1, cp 0, pp 0)"));
  EXPECT_THAT(status->stdout_text, Not(HasSubstr(token)));

  auto json = Hetpar({"status", "--json", "--coordinator", coordinator->address});
  ASSERT_TRUE(json.ok());
  EXPECT_EQ(json->exit_code, 0);
  EXPECT_THAT(json->stdout_text, HasSubstr("\"state\": \"RUN_STATE_WAITING\""));
  EXPECT_THAT(json->stdout_text, HasSubstr("\"expectedWorkers\": \"4\""));
  EXPECT_THAT(json->stdout_text, Not(HasSubstr("requestedEncoderReplicas")));

  // A wrong token is refused and logged with the caller's address, never with a token.
  setenv("HETPAR_TOKEN", "not-the-run-token", 1);
  auto refused = Hetpar({"status", "--coordinator", coordinator->address});
  unsetenv("HETPAR_TOKEN");
  ASSERT_TRUE(refused.ok());
  EXPECT_EQ(refused->exit_code, 1);
  EXPECT_THAT(refused->stderr_text, HasSubstr("missing or wrong run token"));

  // A pool size out of range is refused, naming the bounds (tiny.yaml: encoder.layout.dp 2),
  // and changes nothing that status shows.
  auto scale = Hetpar({"scale", "--encoders", "3", "--coordinator", coordinator->address});
  ASSERT_TRUE(scale.ok());
  EXPECT_EQ(scale->exit_code, 2) << scale->stdout_text;
  EXPECT_THAT(scale->stderr_text,
              HasSubstr("encoder_replicas=3 is out of range: the pool holds 1 "
                        "(failure.min_encoder_replicas) to 2 (encoder.layout.dp) replicas"));
  EXPECT_EQ(scale->stdout_text, "");
  auto after_scale = Hetpar({"status", "--coordinator", coordinator->address});
  ASSERT_TRUE(after_scale.ok());
  EXPECT_EQ(after_scale->exit_code, 0) << after_scale->stderr_text;
  EXPECT_EQ(StatusWithoutClock(after_scale->stdout_text), StatusWithoutClock(status->stdout_text));
  // One in range becomes the pool's target.
  scale = Hetpar({"scale", "--encoder-dp", "1", "--coordinator", coordinator->address});
  ASSERT_TRUE(scale.ok());
  EXPECT_EQ(scale->exit_code, 0) << scale->stderr_text;
  EXPECT_THAT(scale->stdout_text, HasSubstr("encoder pool: target 1 replicas (was 2)"));
  after_scale = Hetpar({"status", "--coordinator", coordinator->address});
  ASSERT_TRUE(after_scale.ok());
  EXPECT_THAT(after_scale->stdout_text, HasSubstr("(target 1)"));
  auto scale_help = Hetpar({"scale", "--help"});
  ASSERT_TRUE(scale_help.ok());
  EXPECT_EQ(scale_help->exit_code, 0);
  EXPECT_THAT(scale_help->stdout_text, HasSubstr("encoder.layout.dp"));

  // A stop with a checkpoint the run cannot write (tiny.yaml sets no checkpoint.dir) is refused,
  // and the run goes on.
  auto no_checkpoint =
      Hetpar({"stop", "--checkpoint", "--coordinator", coordinator->address});
  ASSERT_TRUE(no_checkpoint.ok());
  EXPECT_EQ(no_checkpoint->exit_code, 2) << no_checkpoint->stdout_text;
  EXPECT_THAT(no_checkpoint->stderr_text,
              HasSubstr("the run writes no checkpoints (checkpoint.dir is not set)"));
  auto still = Hetpar({"status", "--coordinator", coordinator->address});
  ASSERT_TRUE(still.ok());
  EXPECT_EQ(StatusWithoutClock(still->stdout_text), StatusWithoutClock(after_scale->stdout_text));

  auto stop = Hetpar({"stop", "--wait", "20", "--coordinator", coordinator->address});
  ASSERT_TRUE(stop.ok());
  EXPECT_EQ(stop->exit_code, 0) << stop->stderr_text;
  EXPECT_THAT(stop->stdout_text, HasSubstr("the run has ended"));
  auto exit_code = coordinator->process.Wait(20);
  ASSERT_TRUE(exit_code.ok()) << exit_code.status();
  EXPECT_EQ(*exit_code, 0);
  const std::string log = ReadFile(coordinator->log);
  EXPECT_THAT(log, HasSubstr("rejected Admin.Status from ipv4:127.0.0.1:"));
  EXPECT_THAT(log, HasSubstr("run tiny stopped after "));
  EXPECT_THAT(log, HasSubstr(" steps: stop requested"));
  EXPECT_THAT(log, HasSubstr("hetpar coordinator: run tiny stopped after 0 of 3000 steps (stop "
                             "requested); without checkpoint.dir, a coordinator started again "
                             "on it starts over"));
  EXPECT_THAT(log, Not(HasSubstr(token)));
  EXPECT_THAT(log, Not(HasSubstr("not-the-run-token")));
  // The generated token goes with the coordinator.
  EXPECT_FALSE(std::filesystem::exists(token_file));
}

// A start refused (a run token too short) or failed (its port taken) leaves no journal: the next
// start is a new run, not the continuation of one that never ran (refused, were its config
// changed in between).
TEST_F(CoordinatorCliTest, AStartThatFailsLeavesNoRunToContinue) {
  const std::string out = dir_.File("run");
  std::ofstream(dir_.File("short.token")) << "12345";
  auto refused = Hetpar({"coordinator", "--config", kTiny, "--listen", "127.0.0.1:0", "--out", out,
                         "--token-file", dir_.File("short.token")});
  ASSERT_TRUE(refused.ok()) << refused.status();
  EXPECT_EQ(refused->exit_code, 2) << refused->stderr_text;
  EXPECT_FALSE(std::filesystem::exists(out + "/journal.json"));

  // A port this test listens on.
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  ASSERT_EQ(::listen(fd, 1), 0);
  socklen_t length = sizeof(address);
  ASSERT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length), 0);
  const std::string port = std::to_string(ntohs(address.sin_port));
  auto failed =
      Hetpar({"coordinator", "--config", kTiny, "--listen", "127.0.0.1:" + port, "--out", out});
  ::close(fd);
  ASSERT_TRUE(failed.ok()) << failed.status();
  EXPECT_EQ(failed->exit_code, 1) << failed->stderr_text;
  EXPECT_THAT(failed->stderr_text, HasSubstr("cannot start the coordinator"));
  EXPECT_FALSE(std::filesystem::exists(out + "/journal.json"));
}

TEST_F(CoordinatorCliTest, MissingWorkersFailTheRunWithTheListOfRanks) {
  setenv("HETPAR_TOKEN", "a-token-for-this-test", 1);
  // The timeout counts from the coordinator's start: long enough for the one worker to start and
  // register on a loaded machine, so that exactly the other three are missing.
  auto coordinator = StartCoordinator(
      {"--config", kTiny, "--set", "coordinator.register_timeout_s=10"}, dir_.File("c.log"));
  ASSERT_TRUE(coordinator.ok()) << coordinator.status();
  auto worker = StartSimWorker(coordinator->address, "encoder", "enc-a", dir_.File("w.log"));
  ASSERT_TRUE(worker.ok());
  auto exit_code = coordinator->process.Wait(30);
  ASSERT_TRUE(exit_code.ok()) << exit_code.status();
  EXPECT_EQ(*exit_code, 1);
  const std::string log = ReadFile(coordinator->log);
  EXPECT_THAT(log, HasSubstr("run tiny failed: 3 of 4 ranks not registered within "
                             "register_timeout 10s; missing: encoder rank 1 (dp 1, tp 0); "
                             "llm rank 0 (dp 0, tp 0, cp 0, pp 0); "
                             "llm rank 1 (dp 0, tp 1, cp 0, pp 0)"));
  // The registered worker was told to stop.
  auto worker_exit = worker->Wait(20);
  ASSERT_TRUE(worker_exit.ok());
  EXPECT_THAT(ReadFile(dir_.File("w.log")), HasSubstr("stop: run failed: 3 of 4 ranks"));
}

TEST_F(CoordinatorCliTest, WorkersRunPlannedStepsToCompletion) {
  setenv("HETPAR_TOKEN", "a-token-for-this-test", 1);
  auto coordinator = StartCoordinator(
      {"--config", kTiny, "--synthetic-batches", "--set", "run.steps=3"}, dir_.File("c.log"));
  ASSERT_TRUE(coordinator.ok()) << coordinator.status();
  std::vector<ChildProcess> workers;
  const std::vector<std::pair<std::string, std::string>> roles = {
      {"encoder", "enc-a"}, {"encoder", "enc-b"}, {"llm", "llm-a"}, {"llm", "llm-b"}};
  for (const auto& [role, host] : roles) {
    auto w = StartSimWorker(coordinator->address, role, host, dir_.File(host + ".log"));
    ASSERT_TRUE(w.ok());
    workers.push_back(*std::move(w));
  }
  auto exit_code = coordinator->process.Wait(60);
  ASSERT_TRUE(exit_code.ok()) << exit_code.status() << "\n" << ReadFile(coordinator->log);
  EXPECT_EQ(*exit_code, 0) << ReadFile(coordinator->log);
  EXPECT_THAT(ReadFile(coordinator->log), HasSubstr("3/3 steps committed"));
  // Grad-norm contributors: encoder rank 0 (world 0), llm ranks 0 and 1 (world 2 and 3):
  // 0.25 x (1 + 3 + 4) = 2, so the norm is sqrt(2).
  for (size_t i = 0; i < workers.size(); ++i) {
    auto worker_exit = workers[i].Wait(20);
    ASSERT_TRUE(worker_exit.ok());
    const std::string log = ReadFile(dir_.File(roles[i].second + ".log"));
    EXPECT_EQ(*worker_exit, 0) << log;
    EXPECT_THAT(log, HasSubstr("assignment generation 1 peers 2"));
    // Ranks go to workers in registration order; each plan is for the worker's own rank.
    auto world_rank =
        AwaitInFile(dir_.File(roles[i].second + ".log"), "world_rank ([0-9]+)", absl::Seconds(1));
    ASSERT_TRUE(world_rank.ok());
    EXPECT_EQ(*world_rank == "0" || *world_rank == "1", roles[i].first == "encoder");
    for (int step = 0; step < 3; ++step) {
      EXPECT_THAT(log, HasSubstr(absl::StrCat("plan step ", step, " rank ", *world_rank)));
      EXPECT_THAT(log, HasSubstr(absl::StrCat("grad_norm step ", step, " norm 1.41421")));
      // loss_sum = 1.5 x loss tokens on the loss rank, so the step loss is 1.5.
      EXPECT_THAT(log, HasSubstr(absl::StrCat("commit step ", step, " loss 1.5")));
    }
    EXPECT_THAT(log, HasSubstr("stop: completed 3 steps"));
    EXPECT_THAT(log, HasSubstr("closed: OK"));
  }
  // What each step trains, from this test's inputs: --synthetic-batches draws 0 to 3 images and
  // 8 to 64 (seq_len / 2) text tokens per sample from tiny.yaml's run.seed 1234; step s trains
  // samples 8s .. 8s + 7 (run.global_batch 8); an image is (32 / 8)^2 = 16 tokens and every
  // sample fits llm.model.seq_len 128.
  std::vector<int64_t> expected_tokens, expected_images;
  for (int step = 0; step < 3; ++step) {
    plan::SyntheticBatchOptions options;
    options.samples = 8;
    options.first_id = 8 * step;
    options.min_images = 0;
    options.max_images = 3;
    options.min_text_tokens = 8;
    options.max_text_tokens = 64;
    options.tokens_per_image = 16;
    options.seq_len = 128;
    options.seed = 1234;
    auto samples = plan::SyntheticBatch(options);
    ASSERT_TRUE(samples.ok()) << samples.status();
    int64_t tokens = 0, images = 0;
    for (const plan::SampleDescriptor& sample : *samples) {
      tokens += sample.sequence_length();
      images += sample.image_count();
    }
    expected_tokens.push_back(tokens);
    expected_images.push_back(images);
  }
  // The steps do carry images, so the comparison below can tell a count that is lost.
  ASSERT_GT(expected_images[0] + expected_images[1] + expected_images[2], 0);
  // The coordinator's run directory: one metrics line per step, with each module's split
  // combined from the reports (slowest rank's compute, bridge bytes added up).
  std::ifstream metrics(coordinator->log + ".run/metrics.jsonl");
  std::vector<nlohmann::json> lines;
  nlohmann::json ledger;
  for (std::string line; std::getline(metrics, line);) {
    nlohmann::json j = nlohmann::json::parse(line);
    if (j.contains("ledger")) {
      ledger = j["ledger"];
    } else {
      lines.push_back(std::move(j));
    }
  }
  ASSERT_EQ(lines.size(), 3u);
  // The sample ledger: 3 steps of 8 samples, each trained once.
  ASSERT_FALSE(ledger.is_null());
  EXPECT_EQ(ledger["trained"].get<int64_t>(), 24);
  EXPECT_EQ(ledger["repeated"].get<int64_t>(), 0);
  EXPECT_EQ(ledger["lost"].get<int64_t>(), 0);
  for (int step = 0; step < 3; ++step) {
    const nlohmann::json& j = lines[step];
    EXPECT_EQ(j["step"], step);
    EXPECT_DOUBLE_EQ(j["loss"].get<double>(), 1.5);
    EXPECT_NEAR(j["grad_norm"].get<double>(), std::sqrt(2.0), 1e-12);
    EXPECT_EQ(j["tokens"].get<int64_t>(), expected_tokens[step]);
    EXPECT_EQ(j["images"].get<int64_t>(), expected_images[step]);
    EXPECT_DOUBLE_EQ(j["encoder"]["compute_s"].get<double>(), 0.002);  // world ranks 0, 1
    EXPECT_DOUBLE_EQ(j["llm"]["compute_s"].get<double>(), 0.004);      // world ranks 2, 3
    EXPECT_EQ(j["encoder"]["bridge_bytes"], 200);
    EXPECT_EQ(j["llm"]["bridge_bytes"], 200);
    // Model FLOPs of the planned samples (their formula is checked in flops_test), and the
    // step's rate is both modules' FLOPs over its time.
    const double encoder_tflop = j["encoder"]["model_tflop"].get<double>();
    const double llm_tflop = j["llm"]["model_tflop"].get<double>();
    EXPECT_GT(llm_tflop, 0);
    EXPECT_EQ(encoder_tflop > 0, expected_images[step] > 0);
    EXPECT_NEAR(j["tflops"].get<double>(),
                (encoder_tflop + llm_tflop) / j["step_time_s"].get<double>(), 1e-12);
    EXPECT_NEAR(j["llm"]["tflops_per_rank"].get<double>(),
                llm_tflop / j["step_time_s"].get<double>() / 2, 1e-12);  // 2 LLM ranks
    EXPECT_FALSE(j["llm"].contains("utilization"));  // run.peak_tflops is not set
  }
  EXPECT_THAT(ReadFile(coordinator->log + ".run/config.yaml"), HasSubstr("steps: 3\n"));
}

TEST_F(CoordinatorCliTest, StatusWatchFollowsTheRunToItsEnd) {
  setenv("HETPAR_TOKEN", "a-token-for-this-test", 1);
  // --linger keeps the finished run's status up, so the watcher cannot miss the end.
  auto coordinator = StartCoordinator(
      {"--config", kTiny, "--synthetic-batches", "--set", "run.steps=3", "--linger"},
      dir_.File("c.log"));
  ASSERT_TRUE(coordinator.ok()) << coordinator.status();
  auto watch = ChildProcess::Start(
      {kHetparBin, "status", "--watch", "--interval", "0.1", "--coordinator", coordinator->address},
      dir_.File("watch.log"));
  ASSERT_TRUE(watch.ok()) << watch.status();
  // The watcher has drawn the waiting run before any worker exists.
  ASSERT_TRUE(AwaitInFile(dir_.File("watch.log"), "run tiny: waiting", absl::Seconds(30)).ok())
      << ReadFile(dir_.File("watch.log"));
  std::vector<ChildProcess> workers;
  for (const auto& [role, host] : std::vector<std::pair<std::string, std::string>>{
           {"encoder", "enc-a"}, {"encoder", "enc-b"}, {"llm", "llm-a"}, {"llm", "llm-b"}}) {
    auto w = StartSimWorker(coordinator->address, role, host, dir_.File(host + ".log"));
    ASSERT_TRUE(w.ok());
    workers.push_back(*std::move(w));
  }
  auto watch_exit = watch->Wait(60);
  ASSERT_TRUE(watch_exit.ok()) << watch_exit.status();
  const std::string text = ReadFile(dir_.File("watch.log"));
  EXPECT_EQ(*watch_exit, 0) << text;
  // In a log (not a terminal) each redraw is printed after a blank line; the last is the end.
  const size_t last = text.rfind("run tiny: ");
  ASSERT_NE(last, std::string::npos);
  EXPECT_GT(last, 0u) << "only one status printed:\n" << text;
  EXPECT_THAT(text.substr(last), HasSubstr("run tiny: done"));
  EXPECT_THAT(text.substr(last), HasSubstr("steps: 3 of 3 committed"));
  EXPECT_THAT(text.substr(last), HasSubstr("TFLOPS"));
  coordinator->process.Signal(SIGTERM);
  auto exit_code = coordinator->process.Wait(20);
  ASSERT_TRUE(exit_code.ok()) << exit_code.status();
  EXPECT_EQ(*exit_code, 0) << ReadFile(coordinator->log);
  for (ChildProcess& w : workers) (void)w.Wait(20);
}

}  // namespace
}  // namespace hetpar::testing
