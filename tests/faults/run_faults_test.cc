// Faults of whole runs, as a user meets them: each is survived (an encoder replica lost) or ends
// in a clear error within a bounded time, and leaves no process behind.
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
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
using ::testing::Not;
using testing::PollUntil;
using testing::RunCommand;

const std::string kBin = HETPAR_BIN;
const std::string kEncoder = HETPAR_ENCODER_BIN;
const std::string kTiny = std::string(HETPAR_SOURCE_DIR) + "/configs/tiny.yaml";

std::string ReadFile(const std::string& path) { return testing::ReadTextFile(path); }

// Pids of processes whose command line contains `needle` (other than this test).
std::vector<pid_t> ProcessesWith(const std::string& needle) {
  return testing::ProcessesWith({needle});
}

class RunFaultsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = (fs::temp_directory_path() /
            ("hetpar_faults_" + std::to_string(::getpid()) + "_" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name()))
               .string();
    fs::create_directories(dir_);
  }
  void TearDown() override {
    // Nothing this test started may outlive it.
    EXPECT_TRUE(ProcessesWith(dir_).empty()) << "processes left running for " << dir_;
    for (pid_t pid : ProcessesWith(dir_)) ::kill(pid, SIGKILL);
    fs::remove_all(dir_);
  }

  std::vector<std::string> DataFlags() const {
    return {"--set", "data.manifest=" + dir_ + "/data/train.jsonl",
            "--set", "data.val_manifest=" + dir_ + "/data/val.jsonl",
            "--set", "data.tokenizer=" + dir_ + "/data/tokenizer.model",
            "--set", "data.synth.samples=" + std::to_string(samples_),
            "--set", "data.synth.val_samples=8"};
  }

  std::vector<std::string> RunArgs(int steps) const {
    std::vector<std::string> argv = {kBin,        "run",
                                     "--config",  kTiny,
                                     "--out",     dir_ + "/run",
                                     "--steps",   std::to_string(steps),
                                     "--threads", "1"};
    for (const auto& f : DataFlags()) argv.push_back(f);
    return argv;
  }

  // Pids of this test's workers of `binary` (hetpar-encoder, hetpar-llm), in pid order.
  std::vector<pid_t> WorkersOf(const std::string& binary) const {
    std::vector<pid_t> pids;
    for (pid_t pid : ProcessesWith(binary + " --coordinator")) {
      if (ReadFile("/proc/" + std::to_string(pid) + "/cmdline").find(dir_) != std::string::npos) {
        pids.push_back(pid);
      }
    }
    return pids;
  }

  // Polls `path` until it has `lines` lines (committed steps in metrics.jsonl); false if it has
  // fewer after 180 s (a deadline for a loaded machine: four workers load libtorch first).
  static bool WaitForLines(const std::string& path, int lines) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(180);
    while (std::chrono::steady_clock::now() < deadline) {
      const std::string text = ReadFile(path);
      if (std::count(text.begin(), text.end(), '\n') >= lines) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return false;
  }

  // `hetpar coordinator` on the tiny config, with a run directory and a data set (generated) of
  // this test's own, admitting workers for `register_timeout_s`.
  std::vector<std::string> CoordinatorArgs(int register_timeout_s) const {
    return {kBin,       "coordinator",
            "--config", kTiny,
            "--listen", "127.0.0.1:0",
            "--out",    dir_ + "/run",
            "--set",    absl::StrCat("coordinator.register_timeout_s=", register_timeout_s),
            "--set",    "data.manifest=" + dir_ + "/x.jsonl",
            "--set",    "data.tokenizer=" + dir_ + "/x.model"};
  }

  // The address `hetpar coordinator` prints in <dir>/coordinator.log once listening; "" if it
  // has not within 120 s (it loads the data set first on a loaded machine).
  std::string AwaitCoordinatorAddress() const {
    const auto by = std::chrono::steady_clock::now() + std::chrono::seconds(120);
    while (std::chrono::steady_clock::now() < by) {
      const std::string log = ReadFile(dir_ + "/coordinator.log");
      const size_t at = log.find("listening on ");
      if (at != std::string::npos) return log.substr(at + 13, log.find(';', at) - at - 13);
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return "";
  }

  // Asserts that `path` reaches `lines` lines, showing the run's log if it does not.
  void ExpectLines(const std::string& path, int lines) const {
    ASSERT_TRUE(WaitForLines(path, lines))
        << "fewer than " << lines << " lines in " << path << " after 180 s\n"
        << ReadFile(path) << "\n"
        << ReadFile(dir_ + "/hetpar-run.log");
  }

  // Why a tmpfs cannot be mounted on `dir` in a mount namespace of its own here (not root; a
  // container's default seccomp or AppArmor profile denies mounts), or "" when it can.
  static std::string CannotMountTmpfs(const std::string& dir) {
    if (::geteuid() != 0) return "a tmpfs in a mount namespace needs root";
    auto probe = RunCommand({"unshare", "--mount", "--propagation", "private", "mount", "-t",
                             "tmpfs", "-o", "size=1m", "hetpar-probe", dir},
                            30);
    if (probe.ok() && probe->exit_code == 0) return "";
    return "cannot mount a tmpfs in a mount namespace here: " +
           (probe.ok() ? probe->stderr_text : probe.status().ToString());
  }

  // Two steps into `checkpoints` (the checkpoint of step 2), without an evaluation.
  void TrainTwoStepsInto(const std::string& checkpoints) const {
    std::vector<std::string> argv = RunArgs(2);
    argv.insert(argv.end(), {"--set", "checkpoint.dir=" + checkpoints, "--set",
                             "checkpoint.every=2", "--set", "data.val_manifest=\"\""});
    auto trained = RunCommand(argv, 240);
    ASSERT_TRUE(trained.ok()) << trained.status();
    ASSERT_EQ(trained->exit_code, 0) << trained->stderr_text;
  }

  // `argv` run in a mount namespace of its own, once the shell command `mount` (which names the
  // directory `dir` as "$0") has run there.
  static std::vector<std::string> InMountNamespace(const std::string& mount, const std::string& dir,
                                                   const std::vector<std::string>& argv) {
    std::vector<std::string> wrapped = {"unshare",
                                        "--mount",
                                        "--propagation",
                                        "private",
                                        "sh",
                                        "-c",
                                        mount + " && shift && exec \"$@\"",
                                        dir,
                                        "--"};
    wrapped.insert(wrapped.end(), argv.begin(), argv.end());
    return wrapped;
  }

  // `argv` run in a mount namespace of its own, with a tmpfs of `size` mounted on `dir` first.
  static std::vector<std::string> WithTmpfsOn(const std::string& dir, const std::string& size,
                                              const std::vector<std::string>& argv) {
    return InMountNamespace("mount -t tmpfs -o size=" + size + " hetpar-test \"$0\"", dir, argv);
  }

  // Why `dir` cannot be made read-only (a bind mount remounted read-only) in a mount namespace
  // of its own here, or "" when it can.
  static std::string CannotMountReadOnly(const std::string& dir) {
    if (::geteuid() != 0) return "a read-only bind mount in a mount namespace needs root";
    auto probe = RunCommand(WithReadOnly(dir, {"true"}), 30);
    if (probe.ok() && probe->exit_code == 0) return "";
    return "cannot remount a directory read-only in a mount namespace here: " +
           (probe.ok() ? probe->stderr_text : probe.status().ToString());
  }

  // `argv` run in a mount namespace of its own, where `dir` is read-only.
  static std::vector<std::string> WithReadOnly(const std::string& dir,
                                               const std::vector<std::string>& argv) {
    return InMountNamespace("mount --bind \"$0\" \"$0\" && mount -o remount,bind,ro \"$0\"", dir,
                            argv);
  }

  std::string dir_;
  int samples_ = 128;  // training samples of the synthetic data set
};

TEST_F(RunFaultsTest, MissingDatasetIsNamed) {
  auto r = RunCommand({kBin, "run", "--config", kTiny, "--out", dir_ + "/run", "--set",
                       "data.synth.samples=0", "--set",
                       "data.manifest=" + dir_ + "/nowhere/train.jsonl"});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->exit_code, 2);
  EXPECT_THAT(r->stderr_text, HasSubstr("data.manifest: file '" + dir_ +
                                        "/nowhere/train.jsonl' "
                                        "does not exist"));
}

TEST_F(RunFaultsTest, CorruptImageIsNamedWithItsSample) {
  // Generate the data set, then break one image that a sample uses.
  auto synth = RunCommand(
      {kBin, "data", "synth", "--out", dir_ + "/data", "--samples", "32", "--val-samples", "4"});
  ASSERT_TRUE(synth.ok() && synth->exit_code == 0) << (synth.ok() ? synth->stderr_text : "");
  std::string victim;
  for (const auto& entry : fs::recursive_directory_iterator(dir_ + "/data")) {
    if (entry.path().extension() == ".png") {
      victim = entry.path().string();
      break;
    }
  }
  ASSERT_FALSE(victim.empty());
  std::ofstream(victim, std::ios::trunc) << "not a png";
  for (const auto& entry : fs::directory_iterator(dir_ + "/data")) {
    if (entry.path().string().find(".index") != std::string::npos) fs::remove(entry.path());
  }
  auto r = RunCommand(RunArgs(2), 120);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_NE(r->exit_code, 0);
  EXPECT_THAT(r->stderr_text, HasSubstr(fs::path(victim).filename().string()));
}

TEST_F(RunFaultsTest, WorkerWithAWrongTokenIsRejected) {
  ::setenv("HETPAR_TOKEN", "the-right-token", 1);
  auto coordinator = ChildProcess::Start(CoordinatorArgs(30), dir_ + "/coordinator.log");
  ASSERT_TRUE(coordinator.ok());
  // The coordinator prints its address once listening (within 120 s on a loaded machine).
  const std::string address = AwaitCoordinatorAddress();
  ASSERT_FALSE(address.empty()) << ReadFile(dir_ + "/coordinator.log");
  ::setenv("HETPAR_TOKEN", "a-wrong-token", 1);
  // Rejected at once, well before its waits' 120 s --timeout (the bound below leaves a loaded
  // machine time to start the worker, which loads libtorch first).
  const auto start = std::chrono::steady_clock::now();
  auto worker = RunCommand(
      {kEncoder, "--coordinator", address, "--timeout", "120", "--out", dir_ + "/w"}, 180);
  ::unsetenv("HETPAR_TOKEN");
  ASSERT_TRUE(worker.ok()) << worker.status();
  EXPECT_EQ(worker->exit_code, 1);
  EXPECT_THAT(worker->stderr_text, HasSubstr("UNAUTHENTICATED"));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(90));
  coordinator->Signal(SIGTERM);
  auto code = coordinator->Wait(30);
  EXPECT_TRUE(code.ok()) << code.status();
  EXPECT_THAT(ReadFile(dir_ + "/coordinator.log"), HasSubstr("wrong run token"));
}

// On the coordinator's machine a worker started by hand finds the token the coordinator
// generated for itself (as `hetpar status` does), without --token-file or HETPAR_TOKEN.
TEST_F(RunFaultsTest, AWorkerOnTheCoordinatorsMachineUsesItsGeneratedToken) {
  ::setenv("XDG_RUNTIME_DIR", dir_.c_str(), 1);  // where the generated token goes
  ::unsetenv("HETPAR_TOKEN");
  ::unsetenv("HETPAR_TOKEN_FILE");
  auto coordinator = ChildProcess::Start(CoordinatorArgs(120), dir_ + "/coordinator.log");
  ASSERT_TRUE(coordinator.ok());
  const std::string address = AwaitCoordinatorAddress();
  ASSERT_FALSE(address.empty()) << ReadFile(dir_ + "/coordinator.log");
  auto worker = ChildProcess::Start(
      {kEncoder, "--coordinator", address, "--rank", "0", "--out", dir_ + "/w"},
      dir_ + "/worker.log");
  ASSERT_TRUE(worker.ok());
  bool registered = false;
  const auto registered_by = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (!registered && std::chrono::steady_clock::now() < registered_by) {
    registered = ReadFile(dir_ + "/coordinator.log").find("registered enc0") != std::string::npos;
    if (!registered) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_TRUE(registered) << ReadFile(dir_ + "/worker.log");
  coordinator->Signal(SIGTERM);
  auto code = coordinator->Wait(60);
  EXPECT_TRUE(code.ok()) << code.status();
  auto worker_code = worker->Wait(60);
  EXPECT_TRUE(worker_code.ok()) << worker_code.status();
  ::unsetenv("XDG_RUNTIME_DIR");
}

// `hetpar run` takes the run token of coordinator.token_file: its workers train with it, and the
// copy it keeps for `hetpar status` on this machine is that token.
TEST_F(RunFaultsTest, ARunTakesTheTokenOfItsConfigsTokenFile) {
  ::setenv("XDG_RUNTIME_DIR", dir_.c_str(), 1);  // where the run keeps its copy
  ::unsetenv("HETPAR_TOKEN");
  ::unsetenv("HETPAR_TOKEN_FILE");
  const std::string token_file = dir_ + "/chosen.token";
  std::ofstream(token_file) << "a-token-the-user-chose\n";
  std::vector<std::string> argv = RunArgs(40);
  argv.insert(argv.end(), {"--set", "coordinator.token_file=" + token_file});
  auto run = ChildProcess::Start(argv, dir_ + "/hetpar-run.log");
  ASSERT_TRUE(run.ok());
  ASSERT_NO_FATAL_FAILURE(ExpectLines(dir_ + "/run/metrics.jsonl", 1));
  std::string kept;
  EXPECT_TRUE(PollUntil(
      [&] {
        std::error_code error;
        for (const auto& entry : std::filesystem::directory_iterator(dir_ + "/hetpar", error)) {
          const std::string name = entry.path().filename().string();
          if (name.rfind("coordinator-", 0) == 0) kept = ReadFile(entry.path().string());
        }
        return !kept.empty();
      },
      absl::Seconds(60)));
  EXPECT_EQ(kept.substr(0, kept.find_last_not_of("\n") + 1), "a-token-the-user-chose");
  auto code = run->Wait(120);
  ::unsetenv("XDG_RUNTIME_DIR");
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0) << ReadFile(dir_ + "/hetpar-run.log");
}

// A worker asking for a rank that is still held (after a crash, by its own lost process until the
// coordinator sees it gone; here by a live worker) waits within --connect-timeout instead of
// exiting, and takes the rank once its holder is gone.
TEST_F(RunFaultsTest, AWorkerAskingForAHeldRankTakesItOnceItsHolderIsGone) {
  ::setenv("XDG_RUNTIME_DIR", dir_.c_str(), 1);  // where the generated token goes
  ::unsetenv("HETPAR_TOKEN");
  ::unsetenv("HETPAR_TOKEN_FILE");
  auto coordinator = ChildProcess::Start(CoordinatorArgs(300), dir_ + "/coordinator.log");
  ASSERT_TRUE(coordinator.ok());
  const std::string address = AwaitCoordinatorAddress();
  ASSERT_FALSE(address.empty()) << ReadFile(dir_ + "/coordinator.log");
  const auto registrations = [&] {
    const std::string log = ReadFile(dir_ + "/coordinator.log");
    int n = 0;
    for (size_t at = log.find("registered enc0"); at != std::string::npos;
         at = log.find("registered enc0", at + 1)) {
      ++n;
    }
    return n;
  };
  auto holder = ChildProcess::Start(
      {kEncoder, "--coordinator", address, "--rank", "0", "--out", dir_ + "/holder"},
      dir_ + "/holder.log");
  ASSERT_TRUE(holder.ok());
  ASSERT_TRUE(PollUntil([&] { return registrations() == 1; }, absl::Seconds(120)))
      << ReadFile(dir_ + "/holder.log");
  auto second = ChildProcess::Start({kEncoder, "--coordinator", address, "--rank", "0",
                                     "--connect-timeout", "300", "--out", dir_ + "/second"},
                                    dir_ + "/second.log");
  ASSERT_TRUE(second.ok());
  ASSERT_TRUE(PollUntil(
      [&] {
        const std::string log = ReadFile(dir_ + "/second.log");
        return log.find("registration refused: ") != std::string::npos &&
               log.find("encoder rank 0 is already held by worker enc0-") != std::string::npos &&
               log.find("trying again") != std::string::npos;
      },
      absl::Seconds(120)))
      << ReadFile(dir_ + "/second.log");
  EXPECT_EQ(registrations(), 1);
  holder->Signal(SIGKILL);
  ASSERT_TRUE(holder->Wait(30).ok());
  EXPECT_TRUE(PollUntil([&] { return registrations() == 2; }, absl::Seconds(120)))
      << ReadFile(dir_ + "/coordinator.log") << ReadFile(dir_ + "/second.log");
  EXPECT_FALSE(second->Wait(0).ok())
      << "the second worker exited: " << ReadFile(dir_ + "/second.log");
  coordinator->Signal(SIGTERM);
  auto code = coordinator->Wait(60);
  EXPECT_TRUE(code.ok()) << code.status();
  auto second_code = second->Wait(60);
  EXPECT_TRUE(second_code.ok()) << second_code.status();
  ::unsetenv("XDG_RUNTIME_DIR");
}

// A coordinator address without a port is refused at once (exit 2), not retried until the
// connect timeout (120 s here, past the 60 s this command is given).
TEST_F(RunFaultsTest, AWorkerGivenAnAddressWithoutAPortStopsAtOnce) {
  ::setenv("HETPAR_TOKEN", "a-run-token-of-forty-characters-0123456", 1);
  auto worker = RunCommand({kEncoder, "--coordinator", "coordinator.example", "--connect-timeout",
                            "120", "--out", dir_ + "/w"},
                           60);
  ::unsetenv("HETPAR_TOKEN");
  ASSERT_TRUE(worker.ok()) << worker.status();
  EXPECT_EQ(worker->exit_code, 2) << worker->stderr_text;
  EXPECT_THAT(worker->stderr_text,
              HasSubstr("--coordinator: coordinator address 'coordinator.example' has no port "
                        "(1 to 65535)"));
}

// A worker killed (SIGKILL, at whatever point of a step it is) in a module with two or three DP
// replicas takes its replica out of the run; the step is planned again over the others and the
// run goes on. Any layout is exact, so in float64 the losses and final parameters are an
// uninterrupted run's (which the parity tests hold to the single-process reference).
class ReplicaLossTest : public RunFaultsTest {
 protected:
  // Runs with `layout` flags, kills the last of the `workers` processes whose command line starts
  // with `binary`, and compares with a straight run of the same layout; `module` names the pool
  // that shrank to `replicas_left`.
  void KillOneAndCompare(const std::string& binary, const std::vector<std::string>& layout,
                         const std::string& module, size_t workers = 2, int64_t replicas_left = 1) {
    const std::vector<std::string> flags = Float64With(layout);
    std::vector<std::string> argv = RunArgs(kSteps);
    argv.insert(argv.end(), flags.begin(), flags.end());
    auto run = ChildProcess::Start(argv, dir_ + "/hetpar-run.log");
    ASSERT_TRUE(run.ok());
    ASSERT_NO_FATAL_FAILURE(ExpectLines(dir_ + "/run/metrics.jsonl", 3));
    const std::vector<pid_t> victims = WorkersOf(binary);
    ASSERT_EQ(victims.size(), workers) << ReadFile(dir_ + "/hetpar-run.log");
    ASSERT_EQ(::kill(victims.back(), SIGKILL), 0);
    auto code = run->Wait(120);
    ASSERT_TRUE(code.ok()) << code.status() << "\n" << ReadFile(dir_ + "/hetpar-run.log");
    ASSERT_EQ(*code, 0) << ReadFile(dir_ + "/hetpar-run.log");
    // Told while the run trains, or at its end when it ended before the exit was seen.
    const std::string log = ReadFile(dir_ + "/hetpar-run.log");
    EXPECT_TRUE(log.find("exited with code 137; the coordinator decides") != std::string::npos ||
                log.find("exited with code 137; the coordinator had taken its replica out") !=
                    std::string::npos)
        << log;
    ExpectTheStraightRunsResults(flags, module, module + " rank", replicas_left);
  }

  // Steps enough that the run is still training when the kill lands: the kill follows the third
  // metrics line, which the run writes up to a few steps behind its commits, and a kill after the
  // last commit is no replica loss.
  static constexpr int kSteps = 24;

  // float64 (where any layout is exact) with `layout`'s --set values.
  static std::vector<std::string> Float64With(const std::vector<std::string>& layout) {
    std::vector<std::string> flags = {"--set", "run.dtype=float64"};
    for (const std::string& f : layout) flags.insert(flags.end(), {"--set", f});
    return flags;
  }

  // Runs kSteps straight (no fault) with `flags` into <dir>/straight and holds the run in
  // <dir>/run to its losses and final parameters; its one pool change is `module` shrinking to
  // `replicas_left`, for a cause that says `cause`.
  void ExpectTheStraightRunsResults(const std::vector<std::string>& flags,
                                    const std::string& module, const std::string& cause,
                                    int64_t replicas_left = 1) {
    std::vector<std::string> straight = RunArgs(kSteps);
    straight[5] = dir_ + "/straight";  // the value of --out
    straight.insert(straight.end(), flags.begin(), flags.end());
    auto whole = RunCommand(straight, 120);
    ASSERT_TRUE(whole.ok()) << whole.status();
    ASSERT_EQ(whole->exit_code, 0) << whole->stderr_text;

    struct Lines {
      std::map<int64_t, double> loss;
      nlohmann::json final_params;
      std::vector<nlohmann::json> pool_changes;
    };
    auto read = [&](const std::string& run_dir) {
      Lines out;
      std::istringstream in(ReadFile(run_dir + "/metrics.jsonl"));
      std::string line;
      while (std::getline(in, line)) {
        const nlohmann::json j = nlohmann::json::parse(line);
        if (j.contains("step")) out.loss[j["step"].get<int64_t>()] = j["loss"].get<double>();
        if (j.contains("final_params")) out.final_params = j["final_params"];
        if (j.contains("pool_change")) out.pool_changes.push_back(j["pool_change"]);
      }
      return out;
    };
    const std::string metrics = dir_ + "/run/metrics.jsonl";
    const Lines a = read(dir_ + "/run");
    const Lines b = read(dir_ + "/straight");
    ASSERT_EQ(a.loss.size(), static_cast<size_t>(kSteps)) << ReadFile(metrics);
    ASSERT_EQ(b.loss.size(), static_cast<size_t>(kSteps));
    for (int64_t step = 0; step < kSteps; ++step) {
      EXPECT_NEAR(a.loss.at(step), b.loss.at(step), 1e-9 * std::fabs(b.loss.at(step)))
          << "step " << step;
    }
    for (const char* m : {"encoder", "llm"}) {
      for (const char* what : {"sum", "l2"}) {
        const double x = a.final_params[m][what].get<double>();
        const double y = b.final_params[m][what].get<double>();
        EXPECT_NEAR(x, y, 1e-9 * std::max(1.0, std::fabs(y))) << m << " " << what;
      }
    }
    // The loss is on record, with the pool left and the time to the next committed step.
    ASSERT_EQ(a.pool_changes.size(), 1u) << ReadFile(metrics);
    EXPECT_EQ(a.pool_changes[0]["module"].get<std::string>(), module);
    EXPECT_EQ(a.pool_changes[0]["replicas"].get<int64_t>(), replicas_left);
    EXPECT_GE(a.pool_changes[0]["step"].get<int64_t>(), 2);
    EXPECT_GE(a.pool_changes[0]["recovery_s"].get<double>(), 0);
    EXPECT_THAT(a.pool_changes[0]["cause"].get<std::string>(), HasSubstr(cause));
    EXPECT_TRUE(b.pool_changes.empty());
  }
};

TEST_F(ReplicaLossTest, AKilledEncoderReplicaIsDroppedAndTheRunMatchesAnUninterruptedOne) {
  KillOneAndCompare("hetpar-encoder", {}, "encoder");  // tiny: encoder dp 2, llm dp 1 x tp 2
}

// Three LLM replicas of three waves of one sample: the nine microbatches go 5 and 4 over the two
// left, one replica taking a wave fewer.
TEST_F(ReplicaLossTest, AKilledLlmReplicaIsDroppedAndTheRunMatchesAnUninterruptedOne) {
  KillOneAndCompare(
      "hetpar-llm",
      {"llm.layout.dp=3", "llm.layout.tp=1", "run.micro_batch=1", "run.global_batch=9"}, "llm",
      /*workers=*/3, /*replicas_left=*/2);
}

// With pipeline stages, an attempt aborted mid-pipeline leaves stage messages in flight between
// the ranks that go on (train::StageLink::Abandon).
TEST_F(ReplicaLossTest, AKilledEncoderReplicaOfAPipelinedRunIsDroppedAndTheRunMatches) {
  KillOneAndCompare("hetpar-encoder", {"llm.layout.pp=2", "llm.layout.tp=1"}, "encoder");
}

TEST_F(ReplicaLossTest, AKilledLlmStageTakesItsReplicaOutAndThePipelinedRunMatches) {
  // Six LLM ranks (dp 3 x pp 2); the last is stage 1 of replica 2, whose stage 0 leaves with it.
  // The batch's nine microbatches then go 5 and 4: both stages of one replica run a wave fewer.
  KillOneAndCompare("hetpar-llm",
                    {"llm.layout.dp=3", "llm.layout.tp=1", "llm.layout.pp=2", "run.micro_batch=1",
                     "run.global_batch=9"},
                    "llm", /*workers=*/6, /*replicas_left=*/2);
}

// A worker whose step hangs while its session thread goes on heartbeating is never declared dead
// by its heartbeats. Here an encoder opens an image on storage that does not answer (a FIFO with
// no writer holds open() as a hung network file system would). The attempt it holds up is
// aborted (its LLM peer's receive runs past failure.peer_timeout_s); not given up
// failure.peer_timeout_s later, the encoder is lost as stuck: its session is ended, its process
// exits, its replica leaves. The step is tried again on the replica left, whose read of the same
// image the storage then answers, and the run matches an uninterrupted one.
TEST_F(ReplicaLossTest, AnEncoderHungReadingAnImageIsLostAsStuckAndTheRunMatches) {
  samples_ = kSteps * 8;  // tiny's global batch is 8: every sample is read within the run
  std::vector<std::string> synth = {kBin, "data", "synth", "--config", kTiny};
  for (const auto& f : DataFlags()) synth.push_back(f);
  auto made = RunCommand(synth, 120);
  ASSERT_TRUE(made.ok()) << made.status();
  ASSERT_EQ(made->exit_code, 0) << made->stderr_text;
  const std::string image = dir_ + "/data/images/train/train-000000-0.png";
  const std::string png = ReadFile(image);
  ASSERT_FALSE(png.empty());
  ASSERT_LT(png.size(), static_cast<size_t>(PIPE_BUF));  // one write into the FIFO, never partial
  ASSERT_EQ(::unlink(image.c_str()), 0);
  ASSERT_EQ(::mkfifo(image.c_str(), 0600), 0) << std::strerror(errno);

  // Both timeouts well above a step on a loaded machine, far below the defaults (600 s, 300 s).
  const std::vector<std::string> flags =
      Float64With({"failure.step_timeout_s=60", "failure.peer_timeout_s=20"});
  std::vector<std::string> argv = RunArgs(kSteps);
  argv.insert(argv.end(), flags.begin(), flags.end());
  auto run = ChildProcess::Start(argv, dir_ + "/hetpar-run.log");
  ASSERT_TRUE(run.ok());
  const std::string log = dir_ + "/hetpar-run.log";
  auto wait_for = [](const std::function<bool()>& done, int seconds) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
    while (!done()) {
      if (std::chrono::steady_clock::now() > deadline) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return true;
  };
  // Whether `hetpar run` has exited (it stays to be reaped by Wait).
  auto run_ended = [&] {
    siginfo_t info{};
    return ::waitid(P_PID, run->pid(), &info, WEXITED | WNOHANG | WNOWAIT) == 0 &&
           info.si_pid == run->pid();
  };
  // Found stuck: after the receive's 20 s and 20 s more, once the workers have started.
  const auto found_stuck = [&] {
    return ReadFile(log).find("is dead: stuck") != std::string::npos;
  };
  ASSERT_TRUE(wait_for([&] { return found_stuck() || run_ended(); }, 300)) << ReadFile(log);
  ASSERT_TRUE(found_stuck()) << ReadFile(log);
  // Its process exits (its read still hangs), and only then may the image be served: to the
  // retry's reader, not to the lost encoder.
  ASSERT_TRUE(wait_for([&] { return WorkersOf("hetpar-encoder").size() == 1; }, 60))
      << ReadFile(log);
  int fd = -1;
  ASSERT_TRUE(wait_for(
      [&] {
        // ENXIO while no process has the FIFO open for reading.
        fd = ::open(image.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);
        return fd >= 0 || errno != ENXIO;
      },
      60))
      << "the retry did not read the image\n" << ReadFile(log);
  ASSERT_GE(fd, 0) << std::strerror(errno);
  EXPECT_EQ(::write(fd, png.data(), png.size()), static_cast<ssize_t>(png.size()));
  ::close(fd);
  // The image is a file again, for the straight run.
  ASSERT_EQ(::unlink(image.c_str()), 0);
  {
    std::ofstream out(image, std::ios::binary);
    out << png;
  }

  auto code = run->Wait(120);
  ASSERT_TRUE(code.ok()) << code.status() << "\n" << ReadFile(log);
  ASSERT_EQ(*code, 0) << ReadFile(log);
  EXPECT_THAT(ReadFile(log), HasSubstr("though it still sends heartbeats"));
  EXPECT_THAT(ReadFile(log), HasSubstr("exited with code 1; the coordinator decides"));
  ExpectTheStraightRunsResults(flags, "encoder", "lost: stuck: it did not give up");
}

// A worker whose loss the run cannot survive (tiny's LLM is one replica at tp 2: the killed rank's
// shard is held by no other worker) fails the run. Every worker left exits on its own with the
// coordinator's reason, instead of gathering final outputs over groups whose peer is gone (and
// being killed by `hetpar run` after its 15 s grace), and `hetpar run` reports that reason.
TEST_F(RunFaultsTest, ALossTheRunCannotSurviveEndsEveryWorkerWithTheRunsReason) {
  auto run = ChildProcess::Start(RunArgs(40), dir_ + "/hetpar-run.log");
  ASSERT_TRUE(run.ok());
  ASSERT_NO_FATAL_FAILURE(ExpectLines(dir_ + "/run/metrics.jsonl", 3));
  const std::vector<pid_t> llm = WorkersOf("hetpar-llm");
  ASSERT_EQ(llm.size(), 2u) << ReadFile(dir_ + "/hetpar-run.log");
  ASSERT_EQ(::kill(llm[1], SIGKILL), 0);
  auto code = run->Wait(120);
  ASSERT_TRUE(code.ok()) << code.status() << "\n" << ReadFile(dir_ + "/hetpar-run.log");
  const std::string log = ReadFile(dir_ + "/hetpar-run.log");
  EXPECT_EQ(*code, 1) << log;
  EXPECT_THAT(log, HasSubstr("hetpar run: tiny failed after"));
  EXPECT_THAT(log, HasSubstr("the run cannot go on: its llm shard (parameters and optimizer "
                             "state) is held by no other worker"));
  // After the reason, the one worker that did not end with it: the killed one, with its log.
  EXPECT_THAT(log, HasSubstr("exited with code 137; the end of its log:"));
  EXPECT_THAT(log, ::testing::Not(HasSubstr("exited with code 1;"))) << log;
  // The three workers left each said why they stopped; the killed one could not.
  int ended_with_the_reason = 0;
  for (const char* name : {"encoder-0", "encoder-1", "llm-0", "llm-1"}) {
    const std::string worker_log = ReadFile(dir_ + "/run/log/" + name + ".log");
    if (worker_log.find("worker failed: ABORTED: run failed: ") != std::string::npos &&
        worker_log.find("held by no other worker") != std::string::npos) {
      ++ended_with_the_reason;
    } else {
      EXPECT_THAT(name, HasSubstr("llm")) << worker_log;
    }
  }
  EXPECT_EQ(ended_with_the_reason, 3) << log;
}

// A run killed while it writes a checkpoint every step (SIGKILL of an LLM worker, at whatever
// point of a save it is) leaves its newest complete checkpoint loadable: resuming from it trains
// the next steps as a run that was never interrupted.
TEST_F(RunFaultsTest, AKilledRunResumesFromItsNewestCompleteCheckpoint) {
  const std::string checkpoints = dir_ + "/ckpt";
  std::vector<std::string> argv = RunArgs(400);
  for (const std::string& flag : std::vector<std::string>{
           "run.dtype=float64", "checkpoint.dir=" + checkpoints, "checkpoint.every=1"}) {
    argv.insert(argv.end(), {"--set", flag});
  }
  auto run = ChildProcess::Start(argv, dir_ + "/hetpar-run.log");
  ASSERT_TRUE(run.ok());
  const std::string metrics = dir_ + "/run/metrics.jsonl";
  // A worker finishes its shard of step k's checkpoint while it trains step k + 1, so the
  // checkpoint of step 3 is complete once a fifth step has committed.
  ASSERT_NO_FATAL_FAILURE(ExpectLines(metrics, 5));
  const std::vector<pid_t> victims = WorkersOf("hetpar-llm");
  ASSERT_FALSE(victims.empty()) << ReadFile(dir_ + "/hetpar-run.log");
  ASSERT_EQ(::kill(victims[0], SIGKILL), 0);
  auto code = run->Wait(90);
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 1);
  // An LLM rank's shard is held by no other worker: the run stops, saying how to resume.
  const std::string log = ReadFile(dir_ + "/hetpar-run.log");
  EXPECT_THAT(log, HasSubstr("held by no other worker"));
  EXPECT_THAT(log, HasSubstr("resume it from its newest checkpoint under " + checkpoints));
  // The newest checkpoint with a manifest.
  int64_t newest = -1;
  for (const auto& entry : fs::directory_iterator(checkpoints)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("step-", 0) != 0 || !fs::exists(entry.path() / "manifest.json")) continue;
    newest = std::max<int64_t>(newest, std::stoll(name.substr(5)));
  }
  ASSERT_GE(newest, 3) << "no complete checkpoint";
  char name[32];
  std::snprintf(name, sizeof(name), "step-%06lld", static_cast<long long>(newest));
  const int steps = static_cast<int>(newest) + 2;
  std::vector<std::string> resume = RunArgs(steps);
  resume[5] = dir_ + "/resumed";  // the value of --out
  // Into the same checkpoint directory, keeping one: the checkpoint it resumes from is pruned
  // while it trains, and its evaluation at the end (which reads its config.yaml) must not need it.
  resume.insert(resume.end(), {"--set", "run.dtype=float64", "--set",
                               "checkpoint.dir=" + checkpoints, "--set", "checkpoint.every=1",
                               "--set", "checkpoint.keep=1", "--resume", checkpoints + "/" + name});
  auto resumed = RunCommand(resume, 120);
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  ASSERT_EQ(resumed->exit_code, 0) << resumed->stderr_text;
  EXPECT_FALSE(fs::exists(checkpoints + "/" + name));
  std::vector<std::string> straight = RunArgs(steps);
  straight[5] = dir_ + "/straight";
  straight.insert(straight.end(), {"--set", "run.dtype=float64"});
  auto whole = RunCommand(straight, 120);
  ASSERT_TRUE(whole.ok()) << whole.status();
  ASSERT_EQ(whole->exit_code, 0) << whole->stderr_text;
  auto lines = [&](const std::string& run) {
    std::map<int64_t, nlohmann::json> by_step;
    std::istringstream in(ReadFile(run + "/metrics.jsonl"));
    std::string line;
    while (std::getline(in, line)) {
      const nlohmann::json j = nlohmann::json::parse(line);
      by_step[j.contains("step") ? j["step"].get<int64_t>() : -1] = j;  // -1: final_params, eval
    }
    return by_step;
  };
  const auto a = lines(dir_ + "/resumed");
  const auto b = lines(dir_ + "/straight");
  for (int64_t step = newest; step < steps; ++step) {
    ASSERT_TRUE(a.count(step) && b.count(step)) << "step " << step;
    EXPECT_NEAR(a.at(step)["loss"].get<double>(), b.at(step)["loss"].get<double>(),
                1e-9 * std::fabs(b.at(step)["loss"].get<double>()))
        << "step " << step;
  }
  EXPECT_EQ(a.count(newest - 1), 0u);  // the resumed run starts at the checkpoint's step
}

// A checkpoint write that never returns (step 2's manifest is a FIFO with no writer: reading it
// blocks in open(), as a file system that stopped answering does) is given up after half of
// failure.step_timeout_s when the next save needs it, before the coordinator's step deadline: the
// run fails, naming the step and the directory, instead of waiting forever.
TEST_F(RunFaultsTest, ACheckpointWriteThatHangsFailsTheRunNamingItsStepAndDirectory) {
  const std::string checkpoints = dir_ + "/ckpt";
  fs::create_directories(checkpoints + "/step-000002");
  ASSERT_EQ(::mkfifo((checkpoints + "/step-000002/manifest.json").c_str(), 0600), 0);
  std::vector<std::string> argv = RunArgs(4);
  for (const std::string& flag :
       std::vector<std::string>{"checkpoint.dir=" + checkpoints, "checkpoint.every=1",
                                "failure.step_timeout_s=30"}) {
    argv.insert(argv.end(), {"--set", flag});
  }
  auto result = RunCommand(argv, 240);
  ASSERT_TRUE(result.ok()) << result.status();
  const std::string log = ReadFile(dir_ + "/hetpar-run.log") + result->stdout_text +
                          result->stderr_text;
  EXPECT_EQ(result->exit_code, 1) << log;
  EXPECT_THAT(log, HasSubstr("checkpoint of step 2 is still being written after 15.0 s "
                             "(half of failure.step_timeout_s): is checkpoint.dir (" +
                             checkpoints + ")"));
  // A hang may be one node's: the writer's replica is lost, and here (the tiny LLM has one
  // replica) that ends the run.
  EXPECT_THAT(log, HasSubstr("the run cannot go on"));
  // Step 1's checkpoint was written in full before.
  EXPECT_TRUE(fs::exists(checkpoints + "/step-000001/manifest.json"));
}

// A checkpoint write that fails for a reason that may be the writing node's own (here step 2's
// directory is a file in the way, standing for an I/O error) loses the writer's replica, named
// with the writer's error, and the run goes on: the next replica writes the later checkpoints.
TEST_F(RunFaultsTest, ACheckpointWriteErrorOfOneWriterLosesItsReplicaAndTheRunGoesOn) {
  const std::string checkpoints = dir_ + "/ckpt";
  fs::create_directories(checkpoints);
  { std::ofstream(checkpoints + "/step-000002") << "in the way\n"; }
  std::vector<std::string> argv = RunArgs(6);
  for (const std::string& flag :
       std::vector<std::string>{"checkpoint.dir=" + checkpoints, "checkpoint.every=1",
                                "llm.layout.tp=1", "llm.layout.dp=2"}) {
    argv.insert(argv.end(), {"--set", flag});
  }
  auto result = RunCommand(argv, 240);
  ASSERT_TRUE(result.ok()) << result.status();
  const std::string log = result->stdout_text + result->stderr_text;
  EXPECT_EQ(result->exit_code, 0) << log;
  // The loss names the writer's error (WorkerFailure), not only its session's end.
  EXPECT_THAT(log, HasSubstr("(dp 0, tp 0), host 127.0.0.1) is dead: failed: committing step 2: "
                             "writing the encoder checkpoint of step 2 into " +
                             checkpoints + ": creating checkpoint directory " + checkpoints +
                             "/step-000002: Not a directory"));
  EXPECT_THAT(log, HasSubstr("left the run"));
  EXPECT_TRUE(fs::exists(checkpoints + "/step-000006/manifest.json")) << log;
}

// A full checkpoint.dir (a 5 MiB tmpfs, in a mount namespace of the run's own, holds two of the
// tiny model's checkpoints, and none is pruned: checkpoint.keep) is every replica's: the run fails
// at once with the writer's error, said by the coordinator, instead of losing its replicas one
// after another (each module has two here, so the first loss alone would be survived).
TEST_F(RunFaultsTest, AFullCheckpointDirectoryFailsTheRunWithTheWritersError) {
  const std::string checkpoints = dir_ + "/ckpt";
  fs::create_directories(checkpoints);
  if (const std::string why = CannotMountTmpfs(checkpoints); !why.empty()) GTEST_SKIP() << why;
  std::vector<std::string> argv = WithTmpfsOn(checkpoints, "5m", RunArgs(6));
  for (const std::string& flag :
       std::vector<std::string>{"checkpoint.dir=" + checkpoints, "checkpoint.every=1",
                                "checkpoint.keep=100", "llm.layout.tp=1", "llm.layout.dp=2"}) {
    argv.insert(argv.end(), {"--set", flag});
  }
  auto result = RunCommand(argv, 240);
  ASSERT_TRUE(result.ok()) << result.status();
  const std::string log = result->stdout_text + result->stderr_text;
  EXPECT_EQ(result->exit_code, 1) << log;
  EXPECT_THAT(log, ::testing::ContainsRegex(
                       "run tiny failed: worker \\S+ \\((encoder|llm) rank 0 \\(dp 0[^)]*\\), "
                       "host [^)]*\\) failed: committing step [0-9]+: writing the (encoder|llm) "
                       "checkpoint of step [0-9]+ into "));
  EXPECT_THAT(log, HasSubstr("No space left on device; every replica would meet this error in "
                             "turn, so the run stops"));
  EXPECT_THAT(log, Not(HasSubstr("left the run")));
}

// A data set on a read-only mount (a bind mount remounted read-only, in a mount namespace of the
// run's own), shipped without its index: the run's processes keep the index under
// checkpoint.dir, built once (by `hetpar run` before the workers start; the workers read it)
// instead of by each of them at every start; a later `hetpar data index` finds it there, up to
// date. (Processes building it at once share the build through its lock: index_test.)
TEST_F(RunFaultsTest, AReadOnlyDataSetHasItsIndexKeptUnderTheCheckpointDirectory) {
  const std::string data = dir_ + "/data";
  fs::create_directories(data);
  if (const std::string why = CannotMountReadOnly(data); !why.empty()) GTEST_SKIP() << why;
  std::vector<std::string> synth = {kBin, "data", "synth", "--config", kTiny};
  for (const std::string& flag : DataFlags()) synth.push_back(flag);
  auto made = RunCommand(synth, 120);
  ASSERT_TRUE(made.ok()) << made.status();
  ASSERT_EQ(made->exit_code, 0) << made->stderr_text;
  ASSERT_TRUE(fs::remove(data + "/train.jsonl.index"));

  const std::string checkpoints = dir_ + "/ckpt";
  std::vector<std::string> argv = RunArgs(2);
  argv.insert(argv.end(),
              {"--set", "checkpoint.dir=" + checkpoints, "--set", "data.val_manifest=\"\""});
  auto result = RunCommand(WithReadOnly(data, argv), 240);
  ASSERT_TRUE(result.ok()) << result.status();
  std::string log = result->stdout_text + result->stderr_text;
  for (const auto& entry : fs::directory_iterator(dir_ + "/run/log")) {
    absl::StrAppend(&log, ReadFile(entry.path().string()));
  }
  ASSERT_EQ(result->exit_code, 0) << log;
  EXPECT_FALSE(fs::exists(data + "/train.jsonl.index")) << "the read-only data set was written";
  std::vector<std::string> kept;
  for (const auto& entry : fs::directory_iterator(checkpoints + "/data-index")) {
    if (entry.path().extension() == ".index") kept.push_back(entry.path().string());
  }
  ASSERT_EQ(kept.size(), 1u) << log;
  EXPECT_EQ(fs::path(kept[0]).filename().string().rfind("train.jsonl-", 0), 0u) << kept[0];
  std::istringstream index(ReadFile(kept[0]));
  std::string header;
  ASSERT_TRUE(std::getline(index, header)) << kept[0];
  EXPECT_EQ(nlohmann::json::parse(header).at("samples").get<int>(), samples_) << header;
  const std::string indexing = "indexing " + data + "/train.jsonl: ";
  size_t builds = 0;
  for (size_t at = log.find(indexing); at != std::string::npos; at = log.find(indexing, at + 1)) {
    ++builds;
  }
  EXPECT_EQ(builds, 1u) << "the run's processes did not share one build of the index\n" << log;
  EXPECT_THAT(log, HasSubstr("the data index " + data +
                             "/train.jsonl.index is missing and cannot be written there ("));
  EXPECT_THAT(log, HasSubstr("): using " + kept[0]));

  std::vector<std::string> reindex = {kBin, "data", "index", "--config", kTiny};
  for (const std::string& flag : DataFlags()) reindex.push_back(flag);
  reindex.insert(reindex.end(), {"--set", "checkpoint.dir=" + checkpoints});
  auto again = RunCommand(WithReadOnly(data, reindex), 120);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->exit_code, 0) << again->stderr_text;
  EXPECT_THAT(
      again->stdout_text,
      HasSubstr("index " + kept[0] + " (up to date): " + std::to_string(samples_) + " samples"));
}

// A checkpoint that is complete stays a success when the older ones cannot be pruned: here an
// incomplete step-000001 is a mount point (a tmpfs, in a mount namespace of the run's own), whose
// removal fails with EBUSY. The writer says so, and the run (one LLM replica, which a lost writer
// would end) completes with the later checkpoints.
TEST_F(RunFaultsTest, ACheckpointWhoseOlderOnesCannotBePrunedIsStillASuccess) {
  const std::string checkpoints = dir_ + "/ckpt";
  const std::string stuck = checkpoints + "/step-000001";
  fs::create_directories(stuck);
  if (const std::string why = CannotMountTmpfs(stuck); !why.empty()) GTEST_SKIP() << why;
  std::vector<std::string> argv = WithTmpfsOn(stuck, "1m", RunArgs(4));
  for (const std::string& flag : std::vector<std::string>{
           "checkpoint.dir=" + checkpoints, "checkpoint.every=2", "checkpoint.keep=1"}) {
    argv.insert(argv.end(), {"--set", flag});
  }
  auto result = RunCommand(argv, 240);
  ASSERT_TRUE(result.ok()) << result.status();
  std::string log = result->stdout_text + result->stderr_text;
  for (const auto& entry : fs::directory_iterator(dir_ + "/run/log")) {
    absl::StrAppend(&log, ReadFile(entry.path().string()));
  }
  EXPECT_EQ(result->exit_code, 0) << log;
  EXPECT_THAT(log, HasSubstr("the checkpoint of step 2 is complete, but older ones are not pruned "
                             "(checkpoint.keep 1): removing checkpoint " +
                             stuck + ": Device or resource busy"));
  EXPECT_THAT(log, Not(HasSubstr("left the run")));
  EXPECT_TRUE(fs::exists(checkpoints + "/step-000004/manifest.json")) << log;
  EXPECT_FALSE(fs::exists(checkpoints + "/step-000002")) << log;  // keep 1: pruned at step 4
}

// A resume from a checkpoint whose shard is corrupt (a byte flipped in the LLM's TP rank 0 shard,
// which both LLM ranks read) fails the run at once, and the run's reason is the loading rank's
// own error, naming the shard and its CRC-32, not only that its session ended.
TEST_F(RunFaultsTest, AResumeFromACorruptShardFailsTheRunNamingTheShard) {
  const std::string checkpoints = dir_ + "/ckpt";
  ASSERT_NO_FATAL_FAILURE(TrainTwoStepsInto(checkpoints));
  const std::string shard = checkpoints + "/step-000002/llm-pp0-tp0.hpar";
  {
    std::fstream f(shard, std::ios::in | std::ios::out | std::ios::binary);
    ASSERT_TRUE(f) << shard;
    f.seekg(static_cast<std::streamoff>(fs::file_size(shard) / 2));
    char byte = 0;
    f.read(&byte, 1);
    f.seekp(static_cast<std::streamoff>(fs::file_size(shard) / 2));
    byte = static_cast<char>(byte ^ 0xff);
    f.write(&byte, 1);
  }
  std::vector<std::string> resumed = RunArgs(4);
  *(std::find(resumed.begin(), resumed.end(), "--out") + 1) = dir_ + "/resumed";
  resumed.insert(resumed.end(), {"--resume", checkpoints + "/step-000002", "--set",
                                 "checkpoint.dir=" + checkpoints, "--set", "checkpoint.every=2",
                                 "--set", "data.val_manifest=\"\""});
  auto result = RunCommand(resumed, 240);
  ASSERT_TRUE(result.ok()) << result.status();
  const std::string log = result->stdout_text + result->stderr_text;
  EXPECT_EQ(result->exit_code, 1) << log;
  EXPECT_THAT(log, ::testing::ContainsRegex(
                       "hetpar run: tiny failed after 2 committed steps: worker \\S+ \\(llm rank "
                       "[01] [^\n]* lost: failed: resuming the llm from checkpoint.resume_from="));
  EXPECT_THAT(log, HasSubstr("checkpoint shard " + shard + ": entry '"));
  EXPECT_THAT(log, HasSubstr("fails its CRC-32"));
}

// A resumed run takes every parameter from its checkpoint: the init_from files it started from
// may be gone (a purged scratch file system), and the resume still runs and is evaluated.
TEST_F(RunFaultsTest, AResumeNeedsNotTheInitFromFilesItsRunStartedFrom) {
  const std::string checkpoints = dir_ + "/ckpt";
  ASSERT_NO_FATAL_FAILURE(TrainTwoStepsInto(checkpoints));
  std::vector<std::string> resumed = RunArgs(4);
  *(std::find(resumed.begin(), resumed.end(), "--out") + 1) = dir_ + "/resumed";
  resumed.insert(resumed.end(), {"--resume", checkpoints + "/step-000002", "--set",
                                 "checkpoint.dir=" + checkpoints, "--set",
                                 "encoder.init_from=" + dir_ + "/gone/encoder.hpar", "--set",
                                 "llm.init_from=" + dir_ + "/gone/llm.hpar"});
  auto result = RunCommand(resumed, 240);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->exit_code, 0) << result->stdout_text << result->stderr_text;
  // Trained to the end, and evaluated (hetpar-reference evaluate reads the model files alone).
  const std::string metrics = ReadFile(dir_ + "/resumed/metrics.jsonl");
  EXPECT_THAT(metrics, HasSubstr("\"step\":3"));
  EXPECT_THAT(metrics, HasSubstr("\"eval\""));
  // Without the resume, the missing file is refused as before.
  std::vector<std::string> fresh = RunArgs(2);
  *(std::find(fresh.begin(), fresh.end(), "--out") + 1) = dir_ + "/fresh";
  fresh.insert(fresh.end(), {"--set", "encoder.init_from=" + dir_ + "/gone/encoder.hpar"});
  auto refused = RunCommand(fresh, 60);
  ASSERT_TRUE(refused.ok()) << refused.status();
  EXPECT_EQ(refused->exit_code, 2);
  EXPECT_THAT(refused->stderr_text, HasSubstr("encoder.init_from"));
}

// A checkpoint records where the data order stood (the index size, the epoch and the offset into
// it); a resume over a data set of another size mid-epoch is refused before any worker starts,
// naming both sizes, instead of going on in another order.
TEST_F(RunFaultsTest, AResumeOverDataOfAnotherSizeMidEpochIsRefused) {
  const std::string checkpoints = dir_ + "/ckpt";
  ASSERT_NO_FATAL_FAILURE(TrainTwoStepsInto(checkpoints));
  const nlohmann::json manifest =
      nlohmann::json::parse(ReadFile(checkpoints + "/step-000002/manifest.json"), nullptr, false);
  ASSERT_TRUE(manifest.is_object()) << ReadFile(checkpoints + "/step-000002/manifest.json");
  // 2 steps of global_batch 8 over the 128 samples, and the digest of their ids.
  nlohmann::json data = manifest["extra"]["data"];
  ASSERT_TRUE(data.is_object()) << manifest.dump();
  ASSERT_TRUE(data["index_digest"].is_number_unsigned()) << data.dump();
  EXPECT_NE(data["index_digest"].get<uint64_t>(), 0u);
  data.erase("index_digest");
  EXPECT_EQ(data, nlohmann::json::parse(R"({"index_samples": 128, "epoch": 0, "offset": 16})"));
  std::vector<std::string> resumed = RunArgs(4);
  for (std::string& arg : resumed) {
    // Another data set, of 100 samples.
    if (const size_t at = arg.find(dir_ + "/data/"); at != std::string::npos) {
      arg.replace(at, dir_.size() + 6, dir_ + "/data2/");
    }
    if (arg == "data.synth.samples=128") arg = "data.synth.samples=100";
  }
  // Into the run's own directory, as a resume usually goes: the refusal leaves it as it was.
  const std::string metrics = ReadFile(dir_ + "/run/metrics.jsonl");
  const std::string config = ReadFile(dir_ + "/run/config.yaml");
  ASSERT_THAT(metrics, HasSubstr("final_params"));
  resumed.insert(resumed.end(), {"--resume", checkpoints + "/step-000002", "--set",
                                 "checkpoint.dir=" + checkpoints});
  auto refused = RunCommand(resumed, 120);
  ASSERT_TRUE(refused.ok()) << refused.status();
  EXPECT_EQ(refused->exit_code, 2) << refused->stdout_text << refused->stderr_text;
  EXPECT_THAT(refused->stderr_text,
              HasSubstr("stopped 16 samples into epoch 0 of a data index of 128 samples, and "
                        "data.manifest='" +
                        dir_ + "/data2/train.jsonl' now indexes 100"));
  EXPECT_TRUE(WorkersOf("hetpar-llm").empty());
  EXPECT_EQ(ReadFile(dir_ + "/run/metrics.jsonl"), metrics);
  EXPECT_EQ(ReadFile(dir_ + "/run/config.yaml"), config);
}

// A new run refuses a checkpoint.dir that holds another run's checkpoints (it would overwrite
// them step by step and prune them) and names the newest; resuming from it there is allowed.
TEST_F(RunFaultsTest, ANewRunRefusesACheckpointDirectoryThatHoldsAnotherRunsCheckpoints) {
  const std::string checkpoints = dir_ + "/ckpt";
  std::vector<std::string> first = RunArgs(2);
  first.insert(first.end(), {"--set", "checkpoint.dir=" + checkpoints});
  auto written = RunCommand(first, 240);
  ASSERT_TRUE(written.ok()) << written.status();
  ASSERT_EQ(written->exit_code, 0) << written->stderr_text;
  const std::string manifest = checkpoints + "/step-000002/manifest.json";
  const std::string before = ReadFile(manifest);
  ASSERT_FALSE(before.empty());

  std::vector<std::string> other = RunArgs(2);
  other[5] = dir_ + "/other";  // the value of --out
  other.insert(other.end(), {"--set", "checkpoint.dir=" + checkpoints, "--set", "run.name=other"});
  auto refused = RunCommand(other, 240);
  ASSERT_TRUE(refused.ok()) << refused.status();
  EXPECT_EQ(refused->exit_code, 2) << refused->stderr_text;
  EXPECT_THAT(refused->stderr_text,
              HasSubstr("checkpoint.dir '" + checkpoints + "' already holds checkpoints (the "
                        "newest: " + checkpoints + "/step-000002, step 2, written by run 'tiny')"));
  EXPECT_EQ(ReadFile(manifest), before);
  EXPECT_TRUE(ProcessesWith(dir_ + "/other").empty());

  std::vector<std::string> resumed = RunArgs(4);
  resumed[5] = dir_ + "/resumed";
  resumed.insert(resumed.end(), {"--set", "checkpoint.dir=" + checkpoints, "--resume",
                                 checkpoints + "/step-000002/"});
  auto continued = RunCommand(resumed, 240);
  ASSERT_TRUE(continued.ok()) << continued.status();
  EXPECT_EQ(continued->exit_code, 0) << continued->stderr_text;
  EXPECT_TRUE(fs::exists(checkpoints + "/step-000004/manifest.json"));
}

// A terminal's Ctrl-C goes to its whole foreground process group (here made with setsid). The
// workers are in groups of their own: only `hetpar run` gets it, and it stops the run through
// the coordinator, instead of every worker ending at once and being lost to the run first.
TEST_F(RunFaultsTest, CtrlCStopsEveryWorkerCleanly) {
  std::vector<std::string> argv = {"setsid"};
  for (const std::string& a : RunArgs(400)) argv.push_back(a);
  auto run = ChildProcess::Start(argv, dir_ + "/hetpar-run.log");
  ASSERT_TRUE(run.ok());
  const std::string metrics = dir_ + "/run/metrics.jsonl";
  ASSERT_NO_FATAL_FAILURE(ExpectLines(metrics, 2));
  ASSERT_EQ(ProcessesWith("--out " + dir_ + "/run --threads").size(), 4u)
      << ReadFile(dir_ + "/hetpar-run.log");
  ASSERT_EQ(::kill(-run->pid(), SIGINT), 0);
  auto code = run->Wait(60);
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 130);
  // Stopped as asked, not failed, and how it goes on: without checkpoint.dir, it cannot.
  const std::string run_log = ReadFile(dir_ + "/hetpar-run.log");
  EXPECT_THAT(run_log, HasSubstr("hetpar run: tiny stopped (interrupted) after "));
  EXPECT_THAT(run_log, HasSubstr(" of 400 steps; it wrote no checkpoint (no checkpoint.dir)"));
  EXPECT_THAT(run_log, ::testing::Not(HasSubstr("tiny failed")));
  EXPECT_THAT(run_log, ::testing::Not(HasSubstr("exited with code")));
  // Every worker saw the stop and exited by itself, with no error of its own.
  for (const char* name : {"encoder-0", "encoder-1", "llm-0", "llm-1"}) {
    const std::string log = ReadFile(dir_ + "/run/log/" + name + ".log");
    EXPECT_THAT(log, HasSubstr("stop:")) << name << ":\n" << log;
    EXPECT_THAT(log, ::testing::Not(HasSubstr("worker failed"))) << name;
  }
}

// A second Ctrl-C of the terminal (here to the group setsid made) ends every worker at once, and
// a worker writing the checkpoint of a committed step lets the write finish before it exits:
// step 2's write is held (its manifest is a FIFO with no writer, as a slow file system would hold
// it) past the first Ctrl-C's stop, until the writer says it waits, and it is complete after.
TEST_F(RunFaultsTest, CtrlCOfTheTerminalLetsTheCheckpointBeingWrittenFinish) {
  const std::string checkpoints = dir_ + "/ckpt";
  fs::create_directories(checkpoints + "/step-000002");
  const std::string fifo = checkpoints + "/step-000002/manifest.json";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  std::vector<std::string> argv = {"setsid"};
  for (const std::string& a : RunArgs(400)) argv.push_back(a);
  // Half of step_timeout_s bounds the wait: long enough for a loaded machine.
  argv.insert(argv.end(), {"--set", "checkpoint.dir=" + checkpoints, "--set", "checkpoint.every=2",
                           "--set", "failure.step_timeout_s=120"});
  auto run = ChildProcess::Start(argv, dir_ + "/hetpar-run.log");
  ASSERT_TRUE(run.ok()) << run.status();
  // Steps 0 to 2 commit; step 2's write is held.
  ASSERT_NO_FATAL_FAILURE(ExpectLines(dir_ + "/run/metrics.jsonl", 3));
  const std::string writer = dir_ + "/run/log/encoder-0.log";  // replica 0 writes
  ASSERT_THAT(ReadFile(writer), Not(HasSubstr("encoder-pp0-tp0 of step 2")));
  ASSERT_EQ(::kill(-run->pid(), SIGINT), 0);
  ASSERT_TRUE(PollUntil(
      [&] {
        return ReadFile(dir_ + "/hetpar-run.log").find("interrupted; stopping every worker") !=
               std::string::npos;
      },
      absl::Seconds(60)))
      << ReadFile(dir_ + "/hetpar-run.log");
  ASSERT_EQ(::kill(-run->pid(), SIGINT), 0);
  ASSERT_TRUE(PollUntil(
      [&] {
        return ReadFile(writer).find(
                   "waiting for the checkpoint being written to finish before "
                   "exiting") != std::string::npos;
      },
      absl::Seconds(60)))
      << ReadFile(writer) << ReadFile(dir_ + "/hetpar-run.log");
  // Let the write go on (opened and closed again until the run ends, for a writer that comes to
  // the FIFO late).
  std::optional<int> code;
  ASSERT_TRUE(PollUntil(
      [&] {
        const int fd = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);
        if (fd >= 0) ::close(fd);
        absl::StatusOr<int> ended = run->Wait(0);
        if (ended.ok()) code = *ended;
        return ended.ok();
      },
      absl::Seconds(90)))
      << ReadFile(dir_ + "/hetpar-run.log");
  const std::string text = ReadFile(writer);
  const size_t waiting = text.find("waiting for the checkpoint being written to finish");
  const size_t written = text.find("checkpoint shard encoder-pp0-tp0 of step 2");
  ASSERT_NE(written, std::string::npos) << text;
  EXPECT_LT(waiting, written) << text;
  EXPECT_THAT(text, Not(HasSubstr("exiting without the checkpoint")));
  // Complete: its manifest is a file now, written after every shard.
  EXPECT_TRUE(fs::is_regular_file(fifo)) << ReadFile(dir_ + "/hetpar-run.log");
  EXPECT_THAT(ReadFile(dir_ + "/hetpar-run.log"),
              HasSubstr("another signal; ending every worker now"));
  EXPECT_EQ(code, 130);
}

// A step whose gradient norm is not finite is committed without an update, and still writes the
// checkpoint it is due: a learning rate of 1e30 makes step 0's update overflow the weights, so
// steps 1 to 3 are skipped, and the checkpoints of steps 2 and 4 (after steps 1 and 3) are there.
// (No validation split: the diverged model's evaluation has nothing to say.)
TEST_F(RunFaultsTest, ASkippedStepStillWritesTheCheckpointItIsDue) {
  const std::string checkpoints = dir_ + "/ckpt";
  std::vector<std::string> argv = RunArgs(4);
  argv.insert(argv.end(), {"--set", "checkpoint.dir=" + checkpoints, "--set", "checkpoint.every=2",
                           "--set", "llm.optimizer.lr=1e30", "--set", "encoder.optimizer.lr=1e30",
                           "--set", "data.val_manifest=\"\""});
  auto run = RunCommand(argv, 240);
  ASSERT_TRUE(run.ok()) << run.status();
  ASSERT_EQ(run->exit_code, 0) << run->stderr_text;
  EXPECT_THAT(ReadFile(dir_ + "/run/log/llm-0.log"),
              HasSubstr("step 3 skipped: its gradient norm"));
  for (const char* step : {"step-000002", "step-000004"}) {
    EXPECT_TRUE(fs::exists(checkpoints + "/" + step + "/manifest.json")) << step;
  }
}

// Ctrl-C stops `hetpar run --reference` the same way: exit 130 and a stop, not a failure.
TEST_F(RunFaultsTest, CtrlCStopsAReferenceRun) {
  std::vector<std::string> argv = RunArgs(4000);
  argv.push_back("--reference");
  auto run = ChildProcess::Start(argv, dir_ + "/hetpar-run.log");
  ASSERT_TRUE(run.ok());
  ASSERT_NO_FATAL_FAILURE(ExpectLines(dir_ + "/run/metrics.jsonl", 2));
  ASSERT_TRUE(run->Signal(SIGINT));
  auto code = run->Wait(60);
  ASSERT_TRUE(code.ok()) << code.status();
  const std::string run_log = ReadFile(dir_ + "/hetpar-run.log");
  EXPECT_EQ(*code, 130) << run_log;
  EXPECT_THAT(run_log, HasSubstr("hetpar run: the reference run stopped (interrupted) before its "
                                 "last step; its log: " +
                                 dir_ + "/run/log/reference.log"));
  EXPECT_THAT(run_log, ::testing::Not(HasSubstr("failed")));
  EXPECT_TRUE(ProcessesWith(dir_ + "/run --progress").empty());
}

// SIGTERM (a scheduler ending the job) with checkpoint.dir set: the step in flight commits, every
// rank checkpoints it, then the run stops; the checkpoint holds every committed step.
TEST_F(RunFaultsTest, SigtermCheckpointsTheStepInFlightThenStops) {
  const std::string checkpoints = dir_ + "/ckpt";
  std::vector<std::string> argv = RunArgs(400);
  argv.insert(argv.end(), {"--set", "checkpoint.dir=" + checkpoints});  // every: 0, no periodic
  auto run = ChildProcess::Start(argv, dir_ + "/hetpar-run.log");
  ASSERT_TRUE(run.ok());
  const std::string metrics = dir_ + "/run/metrics.jsonl";
  ASSERT_NO_FATAL_FAILURE(ExpectLines(metrics, 2));
  ASSERT_TRUE(run->Signal(SIGTERM));
  auto code = run->Wait(60);
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 130);
  const std::string log = ReadFile(dir_ + "/hetpar-run.log");
  EXPECT_THAT(log, HasSubstr("stopping every worker after a checkpoint of the step in flight"));
  int64_t committed = 0;  // the step lines (the sample ledger's line follows them)
  {
    std::istringstream in(ReadFile(metrics));
    for (std::string line; std::getline(in, line);) {
      committed += nlohmann::json::parse(line).contains("step") ? 1 : 0;
    }
  }
  ASSERT_GE(committed, 2);
  char name[32];
  std::snprintf(name, sizeof(name), "step-%06lld", static_cast<long long>(committed));
  EXPECT_TRUE(fs::exists(checkpoints + "/" + name + "/manifest.json")) << name << "\n" << log;
  EXPECT_THAT(log, HasSubstr(absl::StrCat("hetpar run: tiny stopped (terminated) after ", committed,
                                          " of 400 steps; continue it with --resume ", checkpoints,
                                          "/", name)));
  for (const char* worker : {"encoder-0", "llm-0", "llm-1"}) {
    const std::string worker_log = ReadFile(dir_ + "/run/log/" + worker + ".log");
    EXPECT_THAT(worker_log, HasSubstr(absl::StrCat("of step ", committed, ":"))) << worker;
    EXPECT_THAT(worker_log, ::testing::Not(HasSubstr("worker failed"))) << worker;
  }
}

TEST_F(RunFaultsTest, MissingWorkersAreListedWhenRegistrationTimesOut) {
  ::setenv("HETPAR_TOKEN", "token-for-missing", 1);
  auto coordinator = RunCommand(CoordinatorArgs(2), 60);
  ::unsetenv("HETPAR_TOKEN");
  ASSERT_TRUE(coordinator.ok()) << coordinator.status();
  EXPECT_EQ(coordinator->exit_code, 1);
  const std::string out = coordinator->stdout_text + coordinator->stderr_text;
  EXPECT_THAT(out, HasSubstr("encoder rank 0"));
  EXPECT_THAT(out, HasSubstr("llm rank 1"));
}

}  // namespace
}  // namespace hetpar
