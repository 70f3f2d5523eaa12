// An encoder pool that changes while it trains, as a user meets it through `hetpar run`: workers
// killed and replaced, the pool resized with `hetpar scale`. Any layout is exact, so in float64
// each run's losses and final parameters equal an uninterrupted run's and the single-process
// reference's, and the sample ledger shows every sample trained exactly once. Real processes on
// loopback (gRPC, UCX, Gloo), ended by pid.
#include <signal.h>
#include <sys/types.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/util/subprocess.h"

namespace hetpar {
namespace {

namespace fs = std::filesystem;
using testing::ChildProcess;
using ::testing::HasSubstr;
using testing::RunCommand;

const std::string kBin = HETPAR_BIN;
const std::string kTiny = std::string(HETPAR_SOURCE_DIR) + "/configs/tiny.yaml";

std::string ReadFile(const std::string& path) { return testing::ReadTextFile(path); }
using testing::ProcessesWith;

struct RunLines {
  std::map<int64_t, double> loss;
  nlohmann::json final_params;
  std::vector<nlohmann::json> pool_changes;
  nlohmann::json ledger;
};

RunLines ReadRun(const std::string& run_dir) {
  RunLines out;
  std::istringstream in(ReadFile(run_dir + "/metrics.jsonl"));
  std::string line;
  while (std::getline(in, line)) {
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded()) continue;
    if (j.contains("step")) out.loss[j["step"].get<int64_t>()] = j["loss"].get<double>();
    if (j.contains("final_params")) out.final_params = j["final_params"];
    if (j.contains("pool_change")) out.pool_changes.push_back(j["pool_change"]);
    if (j.contains("ledger")) out.ledger = j["ledger"];
  }
  return out;
}

class EncoderPoolTest : public ::testing::Test {
 protected:
  static constexpr int kSteps = 60;
  int steps_ = kSteps;  // of every run the test starts

  void SetUp() override {
    dir_ = (fs::temp_directory_path() /
            ("hetpar_pool_" + std::to_string(::getpid()) + "_" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name()))
               .string();
    fs::create_directories(dir_);
  }
  void TearDown() override {
    EXPECT_TRUE(ProcessesWith({dir_}).empty()) << "processes left running for " << dir_;
    for (pid_t pid : ProcessesWith({dir_})) ::kill(pid, SIGKILL);
    fs::remove_all(dir_);
  }

  // `hetpar run` (or --reference) of tiny in float64 with `sets` into `out`.
  std::vector<std::string> RunArgs(const std::string& out, const std::vector<std::string>& sets,
                                   bool reference = false) const {
    std::vector<std::string> argv = {kBin,        "run",
                                     "--config",  kTiny,
                                     "--out",     dir_ + "/" + out,
                                     "--steps",   std::to_string(steps_),
                                     "--threads", "1"};
    if (reference) argv.push_back("--reference");
    for (const std::string& s : std::vector<std::string>{
             "run.dtype=float64", "data.manifest=" + dir_ + "/data/train.jsonl",
             "data.val_manifest=" + dir_ + "/data/val.jsonl",
             "data.tokenizer=" + dir_ + "/data/tokenizer.model", "data.synth.samples=256",
             "data.synth.val_samples=8"}) {
      argv.insert(argv.end(), {"--set", s});
    }
    for (const std::string& s : sets) argv.insert(argv.end(), {"--set", s});
    return argv;
  }

  // Polls until `done` holds, at most `seconds`; false if it never did.
  static bool WaitFor(const std::function<bool()>& done, int seconds = 90) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
    while (std::chrono::steady_clock::now() < deadline) {
      if (done()) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return done();
  }

  int CommittedSteps(const std::string& out) const {
    return static_cast<int>(ReadRun(dir_ + "/" + out).loss.size());
  }
  int PoolChanges(const std::string& out, const std::string& kind) const {
    int n = 0;
    for (const auto& change : ReadRun(dir_ + "/" + out).pool_changes) {
      n += change["kind"].get<std::string>() == kind ? 1 : 0;
    }
    return n;
  }

  // The encoder workers of the run in `out`.
  std::vector<pid_t> Encoders(const std::string& out) const {
    return ProcessesWith({"hetpar-encoder --coordinator", "--out " + dir_ + "/" + out + " "});
  }

  // The same losses (each step) and final parameter sums, to the parity tests' tolerance.
  void ExpectSameNumbers(const RunLines& a, const RunLines& b, const std::string& what) {
    ASSERT_EQ(a.loss.size(), static_cast<size_t>(steps_)) << what;
    ASSERT_EQ(b.loss.size(), static_cast<size_t>(steps_)) << what;
    for (int64_t step = 0; step < steps_; ++step) {
      EXPECT_NEAR(a.loss.at(step), b.loss.at(step), 1e-9 * std::fabs(b.loss.at(step)))
          << what << ", step " << step;
    }
    for (const char* m : {"encoder", "llm"}) {
      for (const char* sum : {"sum", "l2"}) {
        const double x = a.final_params[m][sum].get<double>();
        const double y = b.final_params[m][sum].get<double>();
        EXPECT_NEAR(x, y, 1e-9 * std::max(1.0, std::fabs(y))) << what << ", " << m << " " << sum;
      }
    }
  }

  // Compares the run in `out` with an uninterrupted run and the reference of the same spec, and
  // checks its ledger.
  void ExpectUninterruptedNumbers(const std::string& out, const std::vector<std::string>& sets) {
    auto straight = RunCommand(RunArgs("straight", sets), 300);
    ASSERT_TRUE(straight.ok()) << straight.status();
    ASSERT_EQ(straight->exit_code, 0) << straight->stderr_text;
    auto reference = RunCommand(RunArgs("reference", sets, /*reference=*/true), 300);
    ASSERT_TRUE(reference.ok()) << reference.status();
    ASSERT_EQ(reference->exit_code, 0) << reference->stderr_text;
    const RunLines run = ReadRun(dir_ + "/" + out);
    ExpectSameNumbers(run, ReadRun(dir_ + "/straight"), "against an uninterrupted run");
    ExpectSameNumbers(run, ReadRun(dir_ + "/reference"), "against the reference");
    // Every sample of the steps trained once: tiny's global batch is 8.
    ASSERT_FALSE(run.ledger.is_null()) << ReadFile(dir_ + "/" + out + "/metrics.jsonl");
    EXPECT_EQ(run.ledger["trained"].get<int64_t>(), steps_ * 8);
    EXPECT_EQ(run.ledger["repeated"].get<int64_t>(), 0);
    EXPECT_EQ(run.ledger["lost"].get<int64_t>(), 0);
  }

  // `hetpar run --replace-workers 1` with `sets`, whose LLM has `llm_workers` ranks: LLM rank
  // `victim` is killed after 3 steps, its replica comes back and joins, and the run equals an
  // uninterrupted one and the reference. Returns hetpar run's log.
  std::string KillAnLlmWorkerAndReplaceIt(const std::vector<std::string>& sets, size_t llm_workers,
                                          int64_t victim) {
    std::vector<std::string> argv = RunArgs("run", sets);
    argv.insert(argv.end(), {"--replace-workers", "1"});
    auto run = ChildProcess::Start(argv, dir_ + "/hetpar-run.log");
    EXPECT_TRUE(run.ok());
    if (!run.ok()) return "";
    const std::string log_path = dir_ + "/hetpar-run.log";
    EXPECT_TRUE(WaitFor([&] { return CommittedSteps("run") >= 3; })) << ReadFile(log_path);
    const std::string out = "--out " + dir_ + "/run ";
    EXPECT_EQ(ProcessesWith({"hetpar-llm --coordinator", out}).size(), llm_workers)
        << ReadFile(log_path);
    const std::vector<pid_t> killed =
        ProcessesWith({"hetpar-llm --coordinator", absl::StrCat("--rank ", victim, " "), out});
    EXPECT_EQ(killed.size(), 1u) << ReadFile(log_path);
    if (killed.size() != 1) return "";
    EXPECT_EQ(::kill(killed[0], SIGKILL), 0);
    EXPECT_TRUE(WaitFor([&] { return PoolChanges("run", "joined") == 1; })) << ReadFile(log_path);
    EXPECT_LT(CommittedSteps("run"), steps_) << "the run ended before the replacement joined";
    auto code = run->Wait(180);
    EXPECT_TRUE(code.ok()) << code.status();
    const std::string log = ReadFile(log_path);
    EXPECT_EQ(code.value_or(-1), 0) << log;
    const RunLines lines = ReadRun(dir_ + "/run");
    EXPECT_EQ(lines.pool_changes.size(), 2u);
    if (lines.pool_changes.size() == 2) {
      EXPECT_EQ(lines.pool_changes[0]["module"], "llm");
      EXPECT_EQ(lines.pool_changes[1]["kind"], "joined");
      EXPECT_EQ(lines.pool_changes[1]["replicas"].get<int64_t>(), 2);
    }
    ExpectJoinedStateEqualsItsSource("run");
    ExpectUninterruptedNumbers("run", sets);
    return log;
  }

  // A joined rank logs the parameter sums of the state it received; its source logs the same.
  void ExpectJoinedStateEqualsItsSource(const std::string& out) const {
    const std::regex line(
        "(?:encoder|llm) state (received from|sent by) replica \\d+ for the joined "
        "replica\\(s\\) \\[[0-9, ]+\\] in [^;]*; (tp rank \\d+ parameter sum "
        "[^\\n]*)");
    std::map<std::string, std::vector<std::string>> by_direction;
    for (const auto& entry : fs::directory_iterator(dir_ + "/" + out + "/log")) {
      const std::string text = ReadFile(entry.path().string());
      for (auto it = std::sregex_iterator(text.begin(), text.end(), line);
           it != std::sregex_iterator(); ++it) {
        by_direction[(*it)[1]].push_back((*it)[2]);
      }
    }
    ASSERT_FALSE(by_direction["received from"].empty()) << "no joined rank received state";
    for (const std::string& received : by_direction["received from"]) {
      EXPECT_THAT(by_direction["sent by"], ::testing::Contains(received));
    }
  }

  std::string dir_;
};

// SIGKILL of an encoder worker, three times, at whatever point of a step it is: the first two
// are replaced (--replace-workers 2) and join with a live replica's state; after the third the
// pool goes on with one replica.
TEST_F(EncoderPoolTest, AnEncoderKilledThreeTimesAndReplacedTwiceTrainsAsAnUninterruptedRun) {
  std::vector<std::string> argv = RunArgs("run", {});
  argv.insert(argv.end(), {"--replace-workers", "2"});
  auto run = ChildProcess::Start(argv, dir_ + "/hetpar-run.log");
  ASSERT_TRUE(run.ok());
  std::mt19937 random(std::random_device{}());
  for (int kill = 1; kill <= 3; ++kill) {
    // Kill once the run trains with a full pool (after a join, once the join's step committed).
    ASSERT_TRUE(WaitFor([&] {
      return CommittedSteps("run") >= 2 && PoolChanges("run", "joined") == kill - 1 &&
             Encoders("run").size() == 2;
    })) << "kill "
        << kill << ":\n"
        << ReadFile(dir_ + "/hetpar-run.log");
    std::vector<pid_t> encoders = Encoders("run");
    ASSERT_EQ(encoders.size(), 2u);
    const pid_t victim = encoders[random() % encoders.size()];
    std::cerr << "kill " << kill << ": encoder pid " << victim << " after " << CommittedSteps("run")
              << " steps\n";
    ASSERT_EQ(::kill(victim, SIGKILL), 0);
    ASSERT_TRUE(WaitFor([&] { return PoolChanges("run", "lost") == kill; }))
        << ReadFile(dir_ + "/hetpar-run.log");
  }
  ASSERT_LT(CommittedSteps("run"), kSteps) << "the run ended before the third kill took effect";
  auto code = run->Wait(180);
  ASSERT_TRUE(code.ok()) << code.status();
  const std::string log = ReadFile(dir_ + "/hetpar-run.log");
  ASSERT_EQ(*code, 0) << log;
  EXPECT_THAT(log, HasSubstr("(replacement 2 of --replace-workers 2)"));
  const RunLines lines = ReadRun(dir_ + "/run");
  EXPECT_EQ(PoolChanges("run", "lost"), 3);
  EXPECT_EQ(PoolChanges("run", "joined"), 2);
  EXPECT_EQ(lines.pool_changes.back()["replicas"].get<int64_t>(), 1);
  ExpectJoinedStateEqualsItsSource("run");
  ExpectUninterruptedNumbers("run", {});
}

// The same for an LLM worker of a run whose LLM has two replicas: the lost replica admits a
// replacement, which joins with the LLM's state from the other replica.
TEST_F(EncoderPoolTest, AKilledLlmWorkerReplacedTrainsAsAnUninterruptedRun) {
  KillAnLlmWorkerAndReplaceIt({"llm.layout.dp=2", "llm.layout.tp=1"}, 2,
                              std::random_device{}() % 2);
}

// With pipeline stages a replica is two processes: the coordinator ends the killed stage's peer,
// and `hetpar run` starts both again as one replacement (--replace-workers 1); each joined stage
// takes its state from the same stage of the live replica.
TEST_F(EncoderPoolTest, AKilledLlmStageIsReplacedWithItsReplicaAndThePipelinedRunMatches) {
  steps_ = 120;  // time for two processes to start and join
  // LLM rank 3: stage 1 of replica 1, whose stage 0 is LLM rank 1.
  const std::string log =
      KillAnLlmWorkerAndReplaceIt({"llm.layout.dp=2", "llm.layout.tp=1", "llm.layout.pp=2"}, 4, 3);
  EXPECT_THAT(log, HasSubstr("started llm-1.1"));
  EXPECT_THAT(log, HasSubstr("started llm-3.1"));
  EXPECT_THAT(log, HasSubstr("(replacement 1 of --replace-workers 1)"));
  EXPECT_THAT(log, ::testing::Not(HasSubstr("replacement 2")));
}

// SIGTERM to an encoder worker (a pod removed): it asks to leave, its replica leaves at the next
// step boundary, and the worker exits 0 without writing outputs; the run goes on.
TEST_F(EncoderPoolTest, AnEncoderWorkerGivenSigtermLeavesCleanlyAndTheRunGoesOn) {
  auto run = ChildProcess::Start(RunArgs("run", {}), dir_ + "/hetpar-run.log");
  ASSERT_TRUE(run.ok());
  const std::string log_path = dir_ + "/hetpar-run.log";
  ASSERT_TRUE(WaitFor([&] { return CommittedSteps("run") >= 3; })) << ReadFile(log_path);
  const std::vector<pid_t> encoders = Encoders("run");
  ASSERT_EQ(encoders.size(), 2u) << ReadFile(log_path);
  ASSERT_EQ(::kill(encoders[1], SIGTERM), 0);
  ASSERT_TRUE(WaitFor([&] { return PoolChanges("run", "removed") == 1; })) << ReadFile(log_path);
  auto code = run->Wait(180);
  ASSERT_TRUE(code.ok()) << code.status();
  const std::string log = ReadFile(log_path);
  ASSERT_EQ(*code, 0) << log;
  // hetpar run saw no worker fail: the one that left exited 0.
  EXPECT_THAT(log, ::testing::Not(HasSubstr("exited with code"))) << log;
  const RunLines lines = ReadRun(dir_ + "/run");
  EXPECT_EQ(lines.loss.size(), static_cast<size_t>(kSteps));
  ASSERT_EQ(lines.pool_changes.size(), 1u);
  EXPECT_THAT(lines.pool_changes[0]["cause"].get<std::string>(), HasSubstr("asked to leave"));
  EXPECT_EQ(lines.pool_changes[0]["replicas"].get<int64_t>(), 1);
  EXPECT_EQ(lines.ledger["repeated"].get<int64_t>(), 0);
  EXPECT_EQ(lines.ledger["lost"].get<int64_t>(), 0);
  std::string left;
  for (const auto& entry : fs::directory_iterator(dir_ + "/run/log")) {
    const std::string text = ReadFile(entry.path().string());
    if (text.find("SIGTERM: asked the coordinator to let this worker leave") != std::string::npos) {
      left = text;
    }
  }
  ASSERT_FALSE(left.empty()) << "no worker logged its SIGTERM";
  EXPECT_THAT(left, HasSubstr("leaving the run: "));
  EXPECT_THAT(left, HasSubstr("left the run"));
  EXPECT_THAT(left, ::testing::Not(HasSubstr("worker failed")));
}

// `hetpar scale` on a running pool of encoder.layout.dp 3 that starts with 2 replicas:
// 2 -> 3 -> 1 -> 2.
TEST_F(EncoderPoolTest, APoolResizedTwoThreeOneTwoTrainsAsAnUninterruptedRun) {
  const std::vector<std::string> sets = {"encoder.layout.dp=3", "encoder.initial_replicas=2"};
  auto run = ChildProcess::Start(RunArgs("run", sets), dir_ + "/hetpar-run.log");
  ASSERT_TRUE(run.ok());
  std::string address;
  ASSERT_TRUE(WaitFor([&] {
    const std::string log = ReadFile(dir_ + "/hetpar-run.log");
    std::smatch m;
    if (std::regex_search(log, m, std::regex("coordinator on ([0-9.]+:[0-9]+),"))) address = m[1];
    return !address.empty();
  })) << ReadFile(dir_ + "/hetpar-run.log");
  auto scale = [&](int replicas) {
    auto r = RunCommand(
        {kBin, "scale", "--encoders", std::to_string(replicas), "--coordinator", address}, 60);
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(r->exit_code, 0) << r->stderr_text;
    EXPECT_THAT(r->stdout_text, HasSubstr("encoder pool: target " + std::to_string(replicas)));
  };
  const std::string log_path = dir_ + "/hetpar-run.log";
  ASSERT_TRUE(WaitFor([&] { return CommittedSteps("run") >= 2; })) << ReadFile(log_path);
  EXPECT_EQ(Encoders("run").size(), 2u);
  scale(3);
  ASSERT_TRUE(WaitFor([&] { return PoolChanges("run", "joined") == 1; })) << ReadFile(log_path);
  scale(1);
  ASSERT_TRUE(WaitFor([&] { return PoolChanges("run", "removed") == 2; })) << ReadFile(log_path);
  // The removed workers left cleanly (exit 0, no outputs).
  ASSERT_TRUE(WaitFor([&] { return Encoders("run").size() == 1; })) << ReadFile(log_path);
  scale(2);
  ASSERT_TRUE(WaitFor([&] { return PoolChanges("run", "joined") == 2; })) << ReadFile(log_path);
  ASSERT_LT(CommittedSteps("run"), kSteps) << "the run ended before the last resize took effect";
  auto code = run->Wait(180);
  ASSERT_TRUE(code.ok()) << code.status();
  ASSERT_EQ(*code, 0) << ReadFile(log_path);
  const RunLines lines = ReadRun(dir_ + "/run");
  std::vector<int64_t> sizes;
  for (const auto& change : lines.pool_changes) sizes.push_back(change["replicas"].get<int64_t>());
  EXPECT_THAT(sizes, ::testing::ElementsAre(3, 2, 1, 2));
  for (const auto& entry : fs::directory_iterator(dir_ + "/run/log")) {
    EXPECT_THAT(ReadFile(entry.path().string()), ::testing::Not(HasSubstr("worker failed")))
        << entry.path();
  }
  ExpectJoinedStateEqualsItsSource("run");
  ExpectUninterruptedNumbers("run", sets);
}

}  // namespace
}  // namespace hetpar
