// A run as a cluster runs it: `hetpar coordinator` and each worker binary started as separate
// processes, each in a working directory of its own, sharing no run directory. The coordinator's
// run directory must come out as `hetpar run` writes it (the workers send their outputs through
// the control plane), and a coordinator killed mid-run and restarted on its run directory must
// finish the run with the same numbers as a run that was never interrupted.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
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
using testing::RunCommand;

const std::string kBin = HETPAR_BIN;
const std::string kEncoder = HETPAR_ENCODER_BIN;
const std::string kLlm = HETPAR_LLM_BIN;
const std::string kTiny = std::string(HETPAR_SOURCE_DIR) + "/configs/tiny.yaml";
constexpr int kSteps = 8;

std::string ReadFile(const std::string& path) { return testing::ReadTextFile(path); }

int CountLines(const std::string& path) {
  const std::string text = ReadFile(path);
  return static_cast<int>(std::count(text.begin(), text.end(), '\n'));
}

// Polls until `done()` holds, at most `timeout_s`; returns whether it did.
template <typename Fn>
bool WaitFor(Fn done, double timeout_s) {
  return testing::PollUntil(done, absl::Seconds(timeout_s));
}

// The lines of a run's metrics.jsonl by step (-1: final_params, -2: eval, -3: the ledger).
std::map<int64_t, nlohmann::json> MetricsByStep(const std::string& run_dir) {
  std::map<int64_t, nlohmann::json> by_step;
  std::istringstream in(ReadFile(run_dir + "/metrics.jsonl"));
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json j = nlohmann::json::parse(line);
    if (j.contains("pool_change")) continue;  // the pool's changes, not a step's line
    const int64_t key = j.contains("final_params") ? -1
                        : j.contains("eval")       ? -2
                        : j.contains("ledger")     ? -3
                                                   : j.at("step").get<int64_t>();
    EXPECT_EQ(by_step.count(key), 0u) << "two lines for " << key << " in " << run_dir;
    by_step[key] = j;
  }
  return by_step;
}

class ClusterRunTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = (fs::temp_directory_path() /
            ("hetpar_cluster_" + std::to_string(::getpid()) + "_" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name()))
               .string();
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    std::ofstream(dir_ + "/token") << "cluster-run-test-token-4b9d2e7a1c\n";
    fs::permissions(dir_ + "/token", fs::perms::owner_read | fs::perms::owner_write);
  }
  void TearDown() override {
    for (ChildProcess& p : processes_) p.Signal(SIGKILL);
    processes_.clear();
    fs::remove_all(dir_);
  }

  // The run's settings, the same for every process: 8 float64 steps of the tiny config on a
  // small synthetic data set in the test's directory.
  std::vector<std::string> Settings(const std::vector<std::string>& extra = {}) const {
    std::vector<std::string> sets = {"run.dtype=float64",
                                     "run.steps=" + std::to_string(steps_),
                                     "data.manifest=" + dir_ + "/data/train.jsonl",
                                     "data.val_manifest=" + dir_ + "/data/val.jsonl",
                                     "data.tokenizer=" + dir_ + "/data/tokenizer.model",
                                     "data.synth.samples=128",
                                     "data.synth.val_samples=8"};
    sets.insert(sets.end(), extra.begin(), extra.end());
    std::vector<std::string> flags;
    for (const std::string& s : sets) flags.insert(flags.end(), {"--set", s});
    return flags;
  }

  // Starts `argv` with `cwd` as its working directory (created), its output in <cwd>.log.
  ChildProcess* StartIn(const std::string& cwd, const std::vector<std::string>& argv) {
    fs::create_directories(cwd);
    std::vector<std::string> shell = {"/bin/sh", "-c", "cd \"$0\" && exec \"$@\"", cwd};
    shell.insert(shell.end(), argv.begin(), argv.end());
    auto child = ChildProcess::Start(shell, cwd + ".log");
    EXPECT_TRUE(child.ok()) << child.status();
    if (!child.ok()) return nullptr;
    processes_.push_back(*std::move(child));
    return &processes_.back();
  }

  // The command line of `hetpar coordinator` in <dir>/coordinator (created), its run directory
  // <dir>/coordinator/run (given relative to its working directory).
  std::vector<std::string> CoordinatorArgv(const std::string& listen,
                                           const std::vector<std::string>& extra) const {
    std::vector<std::string> argv = {"/bin/sh",
                                     "-c",
                                     "cd \"$0\" && exec \"$@\"",
                                     dir_ + "/coordinator",
                                     kBin,
                                     "coordinator",
                                     "--config",
                                     kTiny,
                                     "--listen",
                                     listen,
                                     "--token-file",
                                     dir_ + "/token",
                                     "--out",
                                     "run",
                                     "--eval-threads",
                                     "1"};
    for (const std::string& f : Settings(extra)) argv.push_back(f);
    fs::create_directories(dir_ + "/coordinator");
    return argv;
  }

  // `hetpar coordinator` (CoordinatorArgv), its output in <dir>/<log_name>.
  ChildProcess* StartCoordinator(const std::string& listen, const std::vector<std::string>& extra,
                                 const std::string& log_name) {
    auto child = ChildProcess::Start(CoordinatorArgv(listen, extra), dir_ + "/" + log_name);
    EXPECT_TRUE(child.ok()) << child.status();
    if (!child.ok()) return nullptr;
    processes_.push_back(*std::move(child));
    return &processes_.back();
  }

  // The coordinator's chosen port, from its log.
  std::string AwaitPort(const std::string& log_name) {
    std::string port;
    WaitFor(
        [&] {
          const std::string text = ReadFile(dir_ + "/" + log_name);
          const size_t at = text.find("listening on 127.0.0.1:");
          if (at == std::string::npos) return false;
          port = text.substr(at + 23, text.find_first_not_of("0123456789", at + 23) - at - 23);
          return !port.empty();
        },
        60);
    return port;
  }

  // Two encoder ranks and two LLM ranks (the tiny layout), each in <dir>/worker-<i>, with no
  // --out: they keep nothing of the run's outputs.
  std::vector<ChildProcess*> StartWorkers(const std::string& address) {
    std::vector<ChildProcess*> workers;
    for (int i = 0; i < 4; ++i) {
      const bool encoder = i < 2;
      workers.push_back(StartIn(
          absl::StrCat(dir_, "/worker-", i),
          {encoder ? kEncoder : kLlm, "--coordinator", address, "--token-file", dir_ + "/token",
           "--rank", std::to_string(encoder ? i : i - 2), "--threads", "1", "--timeout", "120"}));
    }
    return workers;
  }

  // `hetpar coordinator` on a free port (its output in `log_name`) and the four workers on that
  // port; no coordinator when it did not start or print its port (the failure is reported).
  struct Cluster {
    ChildProcess* coordinator = nullptr;
    std::string port;
    std::vector<ChildProcess*> workers;
  };
  Cluster StartCluster(const std::vector<std::string>& extra,
                       const std::string& log_name = "coordinator.log") {
    Cluster cluster;
    ChildProcess* coordinator = StartCoordinator("127.0.0.1:0", extra, log_name);
    if (coordinator == nullptr) return cluster;
    cluster.port = AwaitPort(log_name);
    EXPECT_FALSE(cluster.port.empty()) << ReadFile(dir_ + "/" + log_name);
    if (cluster.port.empty()) return cluster;
    cluster.coordinator = coordinator;
    cluster.workers = StartWorkers("127.0.0.1:" + cluster.port);
    return cluster;
  }

  // Waits for `cluster`'s coordinator to exit 0 (its log, <dir>/<log_name>, shown if it does not)
  // and for its workers to exit.
  void RunToTheEnd(const Cluster& cluster, const std::string& log_name) {
    ASSERT_NE(cluster.coordinator, nullptr);
    auto code = cluster.coordinator->Wait(300);
    ASSERT_TRUE(code.ok()) << code.status();
    ASSERT_EQ(*code, 0) << ReadFile(dir_ + "/" + log_name);
    for (ChildProcess* w : cluster.workers) ASSERT_TRUE(w->Wait(60).ok());
  }

  // Where a live process's threads wait (state and kernel wait channel of each), for a failure
  // message: what a worker that did not register was doing.
  // Whether process `pid` ignores `signal` (its SigIgn mask in /proc).
  static bool Ignores(pid_t pid, int signal) {
    std::istringstream status(ReadFile(absl::StrCat("/proc/", pid, "/status")));
    for (std::string line; std::getline(status, line);) {
      if (line.rfind("SigIgn:", 0) != 0) continue;
      return (std::stoull(line.substr(7), nullptr, 16) >> (signal - 1)) & 1;
    }
    return false;
  }

  // Where a worker's threads wait, or how it ended: a process that has exited is reaped here and
  // its exit code told (128 + signal when a signal ended it).
  static std::string ThreadsOf(ChildProcess* process) {
    const pid_t pid = process->pid();
    std::string out = absl::StrCat("process ", pid, ":\n");
    if (absl::StatusOr<int> code = process->Wait(0); code.ok()) {
      absl::StrAppend(&out, "  exited with code ", *code,
                      *code > 128 ? absl::StrCat(" (signal ", *code - 128, ": ",
                                                 strsignal(*code - 128), ")")
                                  : "",
                      "\n");
      return out;
    }
    std::error_code error;
    const std::string task = absl::StrCat("/proc/", pid, "/task");
    for (const auto& entry : fs::directory_iterator(task, error)) {
      const std::string dir = entry.path().string();
      std::string stat = ReadFile(dir + "/stat");
      const size_t close = stat.rfind(')');
      std::string comm = ReadFile(dir + "/comm");
      while (!comm.empty() && comm.back() == '\n') comm.pop_back();
      absl::StrAppend(&out, "  ", entry.path().filename().string(), " ", comm, " state ",
                      close == std::string::npos ? "?" : stat.substr(close + 2, 1), " wchan ",
                      ReadFile(dir + "/wchan"), "\n");
    }
    if (error) absl::StrAppend(&out, "  (gone: ", error.message(), ")\n");
    return out;
  }

  // `hetpar run --reference` of the same settings: the numbers to compare with.
  std::string ReferenceRun() {
    std::vector<std::string> argv = {
        kBin,        "run", "--config", kTiny, "--reference", "--out", dir_ + "/reference",
        "--threads", "1"};
    for (const std::string& f : Settings()) argv.push_back(f);
    auto r = RunCommand(argv, 300);
    EXPECT_TRUE(r.ok()) << r.status();
    if (r.ok()) {
      EXPECT_EQ(r->exit_code, 0) << r->stderr_text;
    }
    return dir_ + "/reference";
  }

  // The coordinator's run directory holds what `hetpar run` writes, and its numbers agree with
  // the reference's.
  void ExpectTheRunDirectoryOfHetparRun(const std::string& run) {
    for (const char* file :
         {"config.yaml", "metrics.jsonl", "eval.json", "model/encoder.hpar", "model/llm.hpar"}) {
      EXPECT_TRUE(fs::exists(run + "/" + file)) << file << " missing from " << run;
    }
    EXPECT_FALSE(fs::exists(run + "/model/llm.hpar.stage-0"));
    const std::string reference = ReferenceRun();
    const auto a = MetricsByStep(run);
    const auto b = MetricsByStep(reference);
    for (int64_t step = 0; step < steps_; ++step) EXPECT_EQ(a.count(step), 1u) << step;
    ASSERT_EQ(a.count(-1), 1u) << "no final_params line";
    ASSERT_EQ(a.count(-2), 1u) << "no eval line";
    ASSERT_EQ(b.count(-2), 1u);
    const auto accuracy = [](const nlohmann::json& line) {
      return line["eval"]["with_images"]["caption_token_accuracy"].get<double>();
    };
    EXPECT_NEAR(accuracy(a.at(-2)), accuracy(b.at(-2)), 1e-9);
    auto compare = RunCommand({kBin, "compare", run, reference});
    ASSERT_TRUE(compare.ok()) << compare.status();
    EXPECT_EQ(compare->exit_code, 0) << compare->stdout_text << compare->stderr_text;
    EXPECT_THAT(compare->stdout_text, HasSubstr("runs agree"));
  }

  // The --ready-file of worker i (encoder ranks first, then LLM ranks), kept by its restarts.
  std::string Ready(int i) const { return absl::StrCat(dir_, "/ready-", i); }

  std::string dir_;
  int64_t steps_ = kSteps;              // run.steps of the runs Settings describes
  std::deque<ChildProcess> processes_;  // stable addresses: tests hold pointers
};

TEST_F(ClusterRunTest, SeparateProcessesInSeparateDirectoriesWriteTheRunDirectoryOfHetparRun) {
  const Cluster cluster = StartCluster({});
  ASSERT_NE(cluster.coordinator, nullptr);
  const std::vector<ChildProcess*>& workers = cluster.workers;
  auto code = cluster.coordinator->Wait(300);
  ASSERT_TRUE(code.ok()) << code.status();
  ASSERT_EQ(*code, 0) << ReadFile(dir_ + "/coordinator.log");
  for (int i = 0; i < 4; ++i) {
    auto worker_code = workers[i]->Wait(60);
    ASSERT_TRUE(worker_code.ok()) << worker_code.status();
    EXPECT_EQ(*worker_code, 0) << ReadFile(absl::StrCat(dir_, "/worker-", i, ".log"));
    // A worker's working directory holds nothing of the run's outputs.
    EXPECT_TRUE(fs::is_empty(absl::StrCat(dir_, "/worker-", i)));
  }
  // The coordinator's log shows the run's progress (a line every run.log_every steps and at the
  // last), as `hetpar run` does.
  EXPECT_THAT(ReadFile(dir_ + "/coordinator.log"),
              HasSubstr("step 8/8 [########################] loss "));
  ExpectTheRunDirectoryOfHetparRun(dir_ + "/coordinator/run");
}

// A coordinator whose end-of-run evaluation fails (a deployed coordinator may lack the run's
// device; here the model diverged: a learning rate of 1e30 in float32 leaves NaN weights, whose
// logits have no argmax) leaves the trained run done, exits 0, and says how to evaluate it again.
TEST_F(ClusterRunTest, AFailedEvaluationLeavesTheTrainedRunDoneAndSaysHowToRunItAgain) {
  const Cluster cluster =
      StartCluster({"run.dtype=float32", "llm.optimizer.lr=1e30", "encoder.optimizer.lr=1e30"});
  ASSERT_NE(cluster.coordinator, nullptr);
  auto code = cluster.coordinator->Wait(300);
  ASSERT_TRUE(code.ok()) << code.status();
  const std::string log = ReadFile(dir_ + "/coordinator.log");
  ASSERT_EQ(*code, 0) << log;
  EXPECT_THAT(log, HasSubstr("the run is done, but the evaluation failed (exit 1)"));
  EXPECT_THAT(log, HasSubstr("NaN logit"));
  EXPECT_THAT(log, HasSubstr("hetpar-reference evaluate --config "));
  const std::string run = dir_ + "/coordinator/run";
  EXPECT_EQ(nlohmann::json::parse(ReadFile(run + "/journal.json"))["state"], "done");
  EXPECT_TRUE(fs::exists(run + "/model/llm.hpar"));
  for (ChildProcess* w : cluster.workers) {
    auto worker_code = w->Wait(60);
    ASSERT_TRUE(worker_code.ok()) << worker_code.status();
    EXPECT_EQ(*worker_code, 0);
  }
}

TEST_F(ClusterRunTest, ACoordinatorKilledMidRunAndRestartedOnItsRunDirectoryFinishesTheRun) {
  // Steps enough that the run is still going when the test sees its first checkpoint (8 of the
  // tiny model's can all pass in half a second, before a poll sees one).
  steps_ = 40;
  // Every checkpoint kept: the coordinator writes metrics.jsonl's lines up to a few steps behind
  // the commits, and the restart resumes from the newest checkpoint its lines reach, which
  // checkpoint.keep's default of 2 may have pruned.
  const std::vector<std::string> checkpoints = {"checkpoint.dir=" + dir_ + "/checkpoints",
                                                "checkpoint.every=2", "checkpoint.keep=100"};
  const Cluster cluster = StartCluster(checkpoints);
  ASSERT_NE(cluster.coordinator, nullptr);
  ChildProcess* first = cluster.coordinator;
  const std::string& port = cluster.port;
  const std::vector<ChildProcess*>& workers = cluster.workers;
  std::vector<pid_t> pids;
  for (ChildProcess* w : workers) pids.push_back(w->pid());
  // Killed once a checkpoint of step 4 or later is complete, a step after step 4 committed and
  // the journal recorded step 4's commit.
  const std::string run = dir_ + "/coordinator/run";
  std::string complete;
  ASSERT_TRUE(WaitFor(
      [&] {
        std::error_code error;
        for (const auto& entry : fs::directory_iterator(dir_ + "/checkpoints", error)) {
          if (entry.path().filename().string() >= "step-000004" &&
              fs::exists(entry.path() / "manifest.json")) {
            complete = (entry.path() / "manifest.json").string();
          }
        }
        if (complete.empty() || CountLines(run + "/metrics.jsonl") < 5) return false;
        // The coordinator rewrites its journal right after it appends a step's metrics line: a
        // kill between the two would leave the journal a step behind the lines.
        const nlohmann::json j = nlohmann::json::parse(ReadFile(run + "/journal.json"), nullptr,
                                                       /*allow_exceptions=*/false);
        return j.is_object() && j.contains("committed_steps") &&
               j["committed_steps"].is_number_integer() && j["committed_steps"].get<int64_t>() >= 4;
      },
      120))
      << ReadFile(dir_ + "/coordinator.log");
  // The checkpoint records the RunSpec it was written under.
  const nlohmann::json manifest = nlohmann::json::parse(ReadFile(complete));
  EXPECT_THAT(manifest["extra"]["runspec"].get<std::string>(), HasSubstr("name: \"tiny\""));
  EXPECT_THAT(manifest["extra"]["runspec"].get<std::string>(), HasSubstr("every: 2"));
  ASSERT_TRUE(first->Signal(SIGKILL));
  ASSERT_TRUE(first->Wait(30).ok());
  const nlohmann::json journal = nlohmann::json::parse(ReadFile(run + "/journal.json"));
  EXPECT_EQ(journal["state"], "running");
  EXPECT_GE(journal["committed_steps"].get<int64_t>(), 4);
  EXPECT_EQ(journal["generation"].get<int64_t>(), 1);
  // The coordinator writes metrics.jsonl a little behind the commits, and the workers complete a
  // checkpoint right after its step's commit: a kill can leave the newest checkpoint past the last
  // line. Made certain here: the lines of the step before the newest checkpoint and later go.
  // Once every worker has replaced itself to register again, none writes or removes a checkpoint
  // until the restart.
  ASSERT_TRUE(WaitFor(
      [&] {
        for (int i = 0; i < 4; ++i) {
          if (ReadFile(absl::StrCat(dir_, "/worker-", i, ".log"))
                  .find("registering again after the coordinator was lost") == std::string::npos) {
            return false;
          }
        }
        return true;
      },
      60));
  int64_t newest = 0;
  for (const auto& entry : fs::directory_iterator(dir_ + "/checkpoints")) {
    if (!fs::exists(entry.path() / "manifest.json")) continue;
    newest = std::max(
        newest,
        nlohmann::json::parse(ReadFile((entry.path() / "manifest.json")))["step"].get<int64_t>());
  }
  ASSERT_GE(newest, 4);
  {
    std::istringstream lines(ReadFile(run + "/metrics.jsonl"));
    std::string kept;
    for (std::string line; std::getline(lines, line);) {
      const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (!j.is_object() || !j.contains("step") || !j["step"].is_number_integer() ||
          j["step"].get<int64_t>() < newest - 1) {
        kept += line + "\n";
      }
    }
    std::ofstream(run + "/metrics.jsonl", std::ios::trunc) << kept;
  }

  // The same command on the same port and run directory; the workers, still alive, register
  // with it again.
  ChildProcess* second = StartCoordinator("127.0.0.1:" + port, checkpoints, "restarted.log");
  ASSERT_NE(second, nullptr);
  auto code = second->Wait(300);
  ASSERT_TRUE(code.ok()) << code.status();
  ASSERT_EQ(*code, 0) << ReadFile(dir_ + "/restarted.log");
  // It continued from a checkpoint (not from step 0), at a step the first coordinator had passed.
  const std::string restarted = ReadFile(dir_ + "/restarted.log");
  EXPECT_THAT(restarted, HasSubstr("continuing run tiny from its journal"));
  EXPECT_THAT(restarted, HasSubstr("resuming at step "));
  EXPECT_THAT(restarted, HasSubstr("from " + dir_ + "/checkpoints/step-0000"));
  // From an older checkpoint than the newest, whose step has a line: the steps after it get
  // their lines again (checked below against a run never interrupted).
  EXPECT_THAT(restarted, HasSubstr(absl::StrFormat(
                             "rather than from the newer %s/checkpoints/step-%06d", dir_, newest)))
      << restarted;
  for (int i = 0; i < 4; ++i) {
    auto worker_code = workers[i]->Wait(60);
    ASSERT_TRUE(worker_code.ok()) << worker_code.status();
    const std::string log = ReadFile(absl::StrCat(dir_, "/worker-", i, ".log"));
    EXPECT_EQ(*worker_code, 0) << log;
    // The same process (same pid) registered again.
    EXPECT_THAT(log, HasSubstr("lost the coordinator")) << i;
    EXPECT_THAT(log, HasSubstr("registering again after the coordinator was lost")) << i;
    EXPECT_EQ(workers[i]->pid(), pids[i]);
    EXPECT_THAT(log, HasSubstr("AdamW state from " + dir_ + "/checkpoints/step-0000")) << i;
  }
  const nlohmann::json after = nlohmann::json::parse(ReadFile(run + "/journal.json"));
  EXPECT_EQ(after["state"], "done");
  EXPECT_EQ(after["committed_steps"].get<int64_t>(), steps_);
  EXPECT_EQ(after["restarts"].get<int64_t>(), 1);
  EXPECT_GE(after["generation"].get<int64_t>(), 2);
  ExpectTheRunDirectoryOfHetparRun(run);
  // The ledger is the whole run's, the steps the lost coordinator committed included: every
  // step's global_batch of 8 (configs/tiny.yaml) trained once.
  const auto lines = MetricsByStep(run);
  ASSERT_EQ(lines.count(-3), 1u) << "no ledger line";
  EXPECT_EQ(lines.at(-3)["ledger"]["trained"].get<int64_t>(), steps_ * 8) << lines.at(-3);
  EXPECT_EQ(lines.at(-3)["ledger"]["repeated"].get<int64_t>(), 0) << lines.at(-3);
  EXPECT_EQ(lines.at(-3)["ledger"]["lost"].get<int64_t>(), 0) << lines.at(-3);
}

// A worker that restarts itself to register again (its coordinator lost) first waits for the
// checkpoint it is writing, so that a restarted coordinator finds it complete. Step 4's write
// blocks (its directory holds a manifest that is a FIFO with no writer, as a slow file system
// would hold it); the coordinator is killed; only once the test lets the write go on does the
// writer finish it, and only then does it restart.
TEST_F(ClusterRunTest, AWorkerRestartingItselfWaitsForTheCheckpointItIsWriting) {
  steps_ = 40;
  const std::string checkpoints = dir_ + "/checkpoints";
  fs::create_directories(checkpoints + "/step-000004");
  const std::string fifo = checkpoints + "/step-000004/manifest.json";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  // Half of step_timeout_s bounds the wait: long enough for a loaded machine.
  const Cluster cluster =
      StartCluster({"checkpoint.dir=" + checkpoints, "checkpoint.every=2",
                    "failure.step_timeout_s=120", "coordinator.register_timeout_s=600"});
  ASSERT_NE(cluster.coordinator, nullptr);
  const std::string log = dir_ + "/worker-0.log";  // encoder rank 0: replica 0 writes
  const std::string run = dir_ + "/coordinator/run";
  // Steps 0 to 4 commit (the steps after step 3's commit while step 4's write is blocked).
  ASSERT_TRUE(WaitFor([&] { return CountLines(run + "/metrics.jsonl") >= 5; }, 120))
      << ReadFile(dir_ + "/coordinator.log");
  ASSERT_THAT(ReadFile(log), Not(HasSubstr("encoder-pp0-tp0 of step 4")));
  ASSERT_TRUE(cluster.coordinator->Signal(SIGKILL));
  ASSERT_TRUE(cluster.coordinator->Wait(30).ok());
  ASSERT_TRUE(WaitFor(
      [&] {
        return ReadFile(log).find("waiting for the checkpoint being written to finish") !=
               std::string::npos;
      },
      60))
      << ReadFile(log);
  // Not restarted while the write is blocked.
  EXPECT_THAT(ReadFile(log), Not(HasSubstr("registering again after the coordinator was lost")));
  // Let the write go on: the writers blocked opening the FIFO (encoder rank 0, both LLM ranks)
  // read an empty manifest, take it for another write's, remove it and write their shards. Opened
  // and closed again until the encoder's restart, for a writer that comes to it late.
  ASSERT_TRUE(WaitFor(
      [&] {
        const int fd = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);
        if (fd >= 0) ::close(fd);
        return ReadFile(log).find("registering again after the coordinator was lost") !=
               std::string::npos;
      },
      60))
      << ReadFile(log);
  const std::string text = ReadFile(log);
  const size_t waiting = text.find("waiting for the checkpoint being written to finish");
  const size_t written = text.find("checkpoint shard encoder-pp0-tp0 of step 4");
  const size_t restarted = text.find("registering again after the coordinator was lost");
  ASSERT_NE(written, std::string::npos) << text;
  EXPECT_LT(waiting, written) << text;
  EXPECT_LT(written, restarted) << text;
  EXPECT_THAT(text, Not(HasSubstr("still running past their deadline"))) << text;
}

// A restart picks its checkpoint while the workers of the lost coordinator still write a later
// one; with checkpoint.keep 1, their completion of that one prunes the older ones, and would
// remove the picked one before the restart's workers have read it. The restart pins it
// (common/checkpoint_pin.h). Here step 4's write blocks (its manifest a FIFO with no writer) until
// the restarted coordinator has pinned step 2; then the writers complete step 4 and prune, and
// the run still resumes from step 2 and finishes, pruning as before once the pin is let go.
TEST_F(ClusterRunTest, ARestartKeepsTheCheckpointItResumesFromFromTheLostRunsPruning) {
  steps_ = 40;
  const std::string checkpoints = dir_ + "/checkpoints";
  fs::create_directories(checkpoints + "/step-000004");
  const std::string fifo = checkpoints + "/step-000004/manifest.json";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  // Half of step_timeout_s bounds a restarting worker's wait for its write: far longer than the
  // test holds the write back on a loaded machine.
  const std::vector<std::string> settings = {"checkpoint.dir=" + checkpoints, "checkpoint.every=2",
                                             "checkpoint.keep=1", "failure.step_timeout_s=600",
                                             "coordinator.register_timeout_s=600"};
  const Cluster cluster = StartCluster(settings);
  ASSERT_NE(cluster.coordinator, nullptr);
  const std::string run = dir_ + "/coordinator/run";
  ASSERT_TRUE(WaitFor([&] { return CountLines(run + "/metrics.jsonl") >= 5; }, 120))
      << ReadFile(dir_ + "/coordinator.log");
  ASSERT_TRUE(fs::exists(checkpoints + "/step-000002/manifest.json"));
  ASSERT_TRUE(cluster.coordinator->Signal(SIGKILL));
  ASSERT_TRUE(cluster.coordinator->Wait(30).ok());
  const std::string pin = checkpoints + "/step-000002/resume-pin";
  ChildProcess* second = StartCoordinator("127.0.0.1:" + cluster.port, settings, "restarted.log");
  ASSERT_NE(second, nullptr);
  // The pin is written in place: it may exist, empty, a moment before it names its holder.
  ASSERT_TRUE(WaitFor(
      [&] {
        return ReadFile(pin).find("hetpar coordinator of run tiny, generation 2") !=
               std::string::npos;
      },
      120))
      << ReadFile(dir_ + "/restarted.log");
  const auto logs = [&] {
    std::string text;
    for (int i = 0; i < 4; ++i) text += ReadFile(absl::StrCat(dir_, "/worker-", i, ".log"));
    return text;
  };
  // Let the write go on (opened and closed again until every writer has come to it).
  ASSERT_TRUE(WaitFor(
      [&] {
        const int fd = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);
        if (fd >= 0) ::close(fd);
        return logs().find("checkpoint of step 4 complete") != std::string::npos;
      },
      120))
      << logs();
  auto code = second->Wait(300);
  ASSERT_TRUE(code.ok()) << code.status();
  const std::string restarted = ReadFile(dir_ + "/restarted.log");
  ASSERT_EQ(*code, 0) << restarted << logs();
  EXPECT_THAT(restarted,
              HasSubstr(absl::StrFormat("resuming at step 2 from %s/step-000002", checkpoints)));
  for (ChildProcess* w : cluster.workers) ASSERT_TRUE(w->Wait(60).ok());
  // The lost run's writers completed step 4 after the restart had pinned step 2, and the
  // restart's workers read step 2 all the same.
  const std::string text = logs();
  EXPECT_THAT(text, HasSubstr("AdamW state from " + checkpoints + "/step-000002")) << text;
  const nlohmann::json after = nlohmann::json::parse(ReadFile(run + "/journal.json"));
  EXPECT_EQ(after["state"], "done");
  EXPECT_EQ(after["committed_steps"].get<int64_t>(), steps_);
  // Let go after the restart's first commit: pruned since, as checkpoint.keep 1 says.
  EXPECT_FALSE(fs::exists(checkpoints + "/step-000002")) << "the pin was never let go";
  EXPECT_TRUE(fs::exists(absl::StrFormat("%s/step-%06d/manifest.json", checkpoints, steps_)));
}

// The coordinator lost after the last step committed, while it gathered the outputs: its journal
// says "stopping" with every step committed, and the newest checkpoint is of the last step. A
// coordinator restarted on the run directory, with fresh workers, finishes the run from that
// checkpoint without training a step again.
TEST_F(ClusterRunTest, ACoordinatorLostWhileGatheringTheOutputsIsRestartedAndFinishesTheRun) {
  const std::vector<std::string> checkpoints = {"checkpoint.dir=" + dir_ + "/checkpoints",
                                                "checkpoint.every=4"};
  ASSERT_NO_FATAL_FAILURE(RunToTheEnd(StartCluster(checkpoints), "coordinator.log"));
  ASSERT_TRUE(fs::exists(dir_ + "/checkpoints/step-000008/manifest.json"));
  const std::string run = dir_ + "/coordinator/run";
  nlohmann::json journal = nlohmann::json::parse(ReadFile(run + "/journal.json"));
  ASSERT_EQ(journal["state"], "done");
  journal["state"] = "stopping";
  std::ofstream(run + "/journal.json", std::ios::trunc) << journal.dump(2);

  // With its checkpoints out of reach (a file system not mounted), a restart refuses to train
  // the run again from step 0, and leaves the run directory as it was.
  fs::rename(dir_ + "/checkpoints", dir_ + "/checkpoints-away");
  const std::string metrics = ReadFile(run + "/metrics.jsonl");
  auto refused = RunCommand(CoordinatorArgv("127.0.0.1:0", checkpoints), 120);
  ASSERT_TRUE(refused.ok()) << refused.status();
  EXPECT_EQ(refused->exit_code, 1) << refused->stdout_text;
  EXPECT_THAT(refused->stderr_text,
              HasSubstr(absl::StrFormat("records the complete checkpoint "
                                        "%s/checkpoints/step-000008 (step 8), but no complete "
                                        "checkpoint of this run from step 1 on can be read in "
                                        "checkpoint.dir '%s/checkpoints' now",
                                        dir_, dir_)));
  EXPECT_EQ(ReadFile(run + "/metrics.jsonl"), metrics);
  EXPECT_EQ(nlohmann::json::parse(ReadFile(run + "/journal.json")), journal);
  fs::rename(dir_ + "/checkpoints-away", dir_ + "/checkpoints");

  const Cluster again = StartCluster(checkpoints, "restarted.log");
  ASSERT_NE(again.coordinator, nullptr);
  const std::vector<ChildProcess*>& workers = again.workers;
  auto code = again.coordinator->Wait(300);
  ASSERT_TRUE(code.ok()) << code.status();
  const std::string restarted = ReadFile(dir_ + "/restarted.log");
  ASSERT_EQ(*code, 0) << restarted;
  // Every step's line was written, so the checkpoint of the last step leaves nothing to train
  // again: the workers write the outputs from it.
  EXPECT_THAT(restarted, HasSubstr(absl::StrFormat(
                             "resuming at step 8 from %s/checkpoints/step-000008", dir_)));
  EXPECT_THAT(restarted, HasSubstr("stopping run tiny: completed 8 steps"));
  EXPECT_THAT(restarted, Not(HasSubstr("step 8/8")));  // no step committed (the progress line)
  for (int i = 0; i < 4; ++i) {
    auto worker_code = workers[i]->Wait(60);
    ASSERT_TRUE(worker_code.ok()) << worker_code.status();
    EXPECT_EQ(*worker_code, 0) << ReadFile(absl::StrCat(dir_, "/worker-", i, ".log"));
  }
  EXPECT_EQ(nlohmann::json::parse(ReadFile(run + "/journal.json"))["state"], "done");
  ExpectTheRunDirectoryOfHetparRun(run);
  const auto lines = MetricsByStep(run);
  ASSERT_EQ(lines.count(-3), 1u) << "no ledger line";
  EXPECT_EQ(lines.at(-3)["ledger"]["trained"].get<int64_t>(), kSteps * 8) << lines.at(-3);
}

// A run started from init_from files, its coordinator lost as it gathered the outputs, and the
// files removed since (a scratch volume cleaned): a restart continues from the run's own
// checkpoint, which holds every parameter, without them. With no checkpoint of the run left it
// would start over, and then it refuses, naming the missing file.
TEST_F(ClusterRunTest, ARestartFromACheckpointNeedsNotTheInitFromFilesTheRunStartedFrom) {
  // The files: the model a one-step `hetpar run` writes.
  std::vector<std::string> first = {kBin,           "run",       "--config", kTiny,     "--out",
                                    dir_ + "/init", "--threads", "1",        "--steps", "1"};
  for (const std::string& f : Settings()) first.push_back(f);
  auto made = RunCommand(first, 300);
  ASSERT_TRUE(made.ok()) << made.status();
  ASSERT_EQ(made->exit_code, 0) << made->stderr_text;
  const std::vector<std::string> settings = {
      "checkpoint.dir=" + dir_ + "/checkpoints", "checkpoint.every=4",
      "encoder.init_from=" + dir_ + "/init/model/encoder.hpar",
      "llm.init_from=" + dir_ + "/init/model/llm.hpar"};
  ASSERT_NO_FATAL_FAILURE(RunToTheEnd(StartCluster(settings), "coordinator.log"));
  const std::string run = dir_ + "/coordinator/run";
  nlohmann::json journal = nlohmann::json::parse(ReadFile(run + "/journal.json"));
  journal["state"] = "stopping";
  std::ofstream(run + "/journal.json", std::ios::trunc) << journal.dump(2);
  fs::rename(dir_ + "/init", dir_ + "/init-gone");

  ASSERT_NO_FATAL_FAILURE(RunToTheEnd(StartCluster(settings, "restarted.log"), "restarted.log"));
  EXPECT_THAT(ReadFile(dir_ + "/restarted.log"),
              HasSubstr("resuming at step 8 from " + dir_ + "/checkpoints/step-000008"));
  EXPECT_EQ(nlohmann::json::parse(ReadFile(run + "/journal.json"))["state"], "done");

  // No checkpoint left, nor one in the journal: the run would start over from its init_from
  // files, which are gone.
  journal = nlohmann::json::parse(ReadFile(run + "/journal.json"));
  journal["state"] = "running";
  journal["last_checkpoint"] = "";
  journal["last_checkpoint_step"] = -1;
  std::ofstream(run + "/journal.json", std::ios::trunc) << journal.dump(2);
  fs::remove_all(dir_ + "/checkpoints");
  auto refused = RunCommand(CoordinatorArgv("127.0.0.1:0", settings), 120);
  ASSERT_TRUE(refused.ok()) << refused.status();
  EXPECT_EQ(refused->exit_code, 2) << refused->stdout_text << refused->stderr_text;
  EXPECT_THAT(refused->stderr_text,
              HasSubstr("cannot continue run tiny: no complete checkpoint of it is in "
                        "checkpoint.dir '" +
                        dir_ + "/checkpoints', so it would start over"));
  EXPECT_THAT(refused->stderr_text, HasSubstr("encoder.init_from"));
}

// Run "tiny" resumed from its step 4 with another learning rate, in the directory where the run it
// resumed from (also "tiny") went on to steps 6 and 8. Its coordinator lost after step 7 (whose
// line it had not written yet), a restart must continue from the resumed run's own checkpoints,
// not from the other run's step 6: it resumes at step 4, and its losses are those of the
// uninterrupted resumed run.
TEST_F(ClusterRunTest, ARestartPassesOverTheCheckpointsOfTheRunItResumedFrom) {
  const std::string checkpoints = dir_ + "/checkpoints";
  ASSERT_NO_FATAL_FAILURE(RunToTheEnd(
      StartCluster({"checkpoint.dir=" + checkpoints, "checkpoint.every=2", "checkpoint.keep=10"},
                   "a.log"),
      "a.log"));
  ASSERT_TRUE(fs::exists(checkpoints + "/step-000006/manifest.json"));
  const std::string run = dir_ + "/coordinator/run";
  fs::remove_all(run);  // the resumed run's directory (same path), afresh

  const std::vector<std::string> resumed = {
      "checkpoint.dir=" + checkpoints, "checkpoint.every=100", "checkpoint.keep=10",
      "checkpoint.resume_from=" + checkpoints + "/step-000004", "llm.optimizer.lr=0.003"};
  ASSERT_NO_FATAL_FAILURE(RunToTheEnd(StartCluster(resumed, "b.log"), "b.log"));
  const auto uninterrupted = MetricsByStep(run);
  ASSERT_EQ(uninterrupted.count(7), 1u);
  // Its coordinator lost after step 7's commit, before that step's line.
  nlohmann::json journal = nlohmann::json::parse(ReadFile(run + "/journal.json"));
  journal["state"] = "running";
  std::ofstream(run + "/journal.json", std::ios::trunc) << journal.dump(2);
  {
    std::istringstream lines(ReadFile(run + "/metrics.jsonl"));
    std::string kept;
    for (std::string line; std::getline(lines, line);) {
      const nlohmann::json j = nlohmann::json::parse(line);
      if (j.contains("step") && j["step"].is_number_integer() && j["step"].get<int64_t>() < 7) {
        kept += line + "\n";
      }
    }
    std::ofstream(run + "/metrics.jsonl", std::ios::trunc) << kept;
  }

  ASSERT_NO_FATAL_FAILURE(RunToTheEnd(StartCluster(resumed, "restarted.log"), "restarted.log"));
  const std::string restarted = ReadFile(dir_ + "/restarted.log");
  EXPECT_THAT(restarted, HasSubstr(absl::StrFormat("resuming at step 4 rather than from the newer "
                                                   "%s/step-000008",
                                                   checkpoints)));
  const auto lines = MetricsByStep(run);
  for (int64_t step = 4; step < 8; ++step) {
    ASSERT_EQ(lines.count(step), 1u) << step;
    EXPECT_EQ(lines.at(step)["loss"].get<double>(), uninterrupted.at(step)["loss"].get<double>())
        << "step " << step;
  }

  // Lost again, now as it gathered the outputs, and checkpoint.keep has pruned the checkpoint
  // the run started from (step 4), which its config still names: the journal says where the
  // run started, and a restart finishes it from its own last checkpoint.
  journal = nlohmann::json::parse(ReadFile(run + "/journal.json"));
  ASSERT_EQ(journal["state"], "done");
  EXPECT_EQ(journal["first_step"], 4);
  journal["state"] = "stopping";
  std::ofstream(run + "/journal.json", std::ios::trunc) << journal.dump(2);
  fs::remove_all(checkpoints + "/step-000004");
  ASSERT_NO_FATAL_FAILURE(RunToTheEnd(StartCluster(resumed, "again.log"), "again.log"));
  EXPECT_THAT(ReadFile(dir_ + "/again.log"),
              HasSubstr("resuming at step 8 from " + checkpoints + "/step-000008"));
}

// An encoder replica lost, then the coordinator: the restarted coordinator waits
// register_timeout for the lost replica's rank, then starts on the replica left and finishes the
// run with the reference's numbers.
TEST_F(ClusterRunTest, ARestartAfterAnEncoderReplicaWasLostGoesOnWithoutIt) {
  // Steps enough that the run is still going when the test holds and kills its workers below
  // (eight tiny steps can all be over within a second).
  steps_ = 40;
  // Every checkpoint kept: metrics.jsonl's lines can end a few steps before the newest
  // checkpoint, and the restart resumes from the newest one they reach.
  const std::vector<std::string> checkpoints = {"checkpoint.dir=" + dir_ + "/checkpoints",
                                                "checkpoint.every=2", "checkpoint.keep=100"};
  // The first coordinator must not take LLM rank 0, held below until it is killed, as lost (the
  // run would fail with it): a heartbeat timeout no loaded machine reaches.
  std::vector<std::string> first_settings = checkpoints;
  first_settings.push_back("coordinator.heartbeat_timeout_s=120");
  const Cluster cluster = StartCluster(first_settings);
  ASSERT_NE(cluster.coordinator, nullptr);
  ChildProcess* first = cluster.coordinator;
  const std::string& port = cluster.port;
  const std::vector<ChildProcess*>& workers = cluster.workers;
  const std::string run = dir_ + "/coordinator/run";
  // A complete checkpoint to restart from.
  const auto any_checkpoint = [&] {
    std::error_code error;
    for (const auto& entry : fs::directory_iterator(dir_ + "/checkpoints", error)) {
      if (fs::exists(entry.path() / "manifest.json")) return true;
    }
    return false;
  };
  ASSERT_TRUE(
      WaitFor([&] { return any_checkpoint() && CountLines(run + "/metrics.jsonl") >= 3; }, 120))
      << ReadFile(dir_ + "/coordinator.log");
  // LLM rank 1 restarts when the coordinator is lost below, while rank 0 is held. Rank 0, let go
  // mid-step, writes to its TP group's Gloo socket to rank 1, which the restart closed; Gloo
  // writes with writev, so a worker that did not ignore SIGPIPE died there without a word.
  for (int i : {0, 2, 3}) EXPECT_TRUE(Ignores(workers[i]->pid(), SIGPIPE)) << "worker " << i;
  // LLM rank 0 held (no step commits while it is stopped), then encoder rank 1 killed: its
  // replica leaves the run.
  ASSERT_TRUE(workers[2]->Signal(SIGSTOP));
  ASSERT_TRUE(workers[1]->Signal(SIGKILL));
  ASSERT_TRUE(WaitFor(
      [&] {
        return ReadFile(dir_ + "/coordinator.log").find("encoder replica 1 left the run") !=
               std::string::npos;
      },
      60))
      << ReadFile(dir_ + "/coordinator.log");
  ASSERT_TRUE(first->Signal(SIGKILL));
  ASSERT_TRUE(first->Wait(30).ok());
  ASSERT_TRUE(workers[2]->Signal(SIGCONT));

  // The coordinator section may differ from the lost coordinator's: a shorter register_timeout,
  // still long enough for the three workers left to reconnect on a loaded machine.
  // (Each worker left restarts its process and loads libtorch again before it registers.)
  std::vector<std::string> restart = checkpoints;
  restart.push_back("coordinator.register_timeout_s=25");
  ChildProcess* second = StartCoordinator("127.0.0.1:" + port, restart, "restarted.log");
  ASSERT_NE(second, nullptr);
  auto code = second->Wait(300);
  ASSERT_TRUE(code.ok()) << code.status();
  const std::string restarted = ReadFile(dir_ + "/restarted.log");
  ASSERT_EQ(*code, 0) << restarted << "\nLLM rank 0:\n"
                      << ReadFile(dir_ + "/worker-2.log") << ThreadsOf(workers[2])
                      << "\nLLM rank 1:\n"
                      << ReadFile(dir_ + "/worker-3.log") << ThreadsOf(workers[3]);
  EXPECT_THAT(restarted, HasSubstr("encoder replica 1 did not register within register_timeout 25s "
                                   "of the coordinator's restart"));
  EXPECT_THAT(restarted, HasSubstr("on 1 of 2 encoder replicas [0]"));
  for (int i : {0, 2, 3}) {
    auto worker_code = workers[i]->Wait(60);
    ASSERT_TRUE(worker_code.ok()) << worker_code.status();
    EXPECT_EQ(*worker_code, 0) << ReadFile(absl::StrCat(dir_, "/worker-", i, ".log"));
  }
  ExpectTheRunDirectoryOfHetparRun(run);
  // The replica's leaving at the restart has its pool_change line.
  int restart_changes = 0;
  std::istringstream lines(ReadFile(run + "/metrics.jsonl"));
  for (std::string line; std::getline(lines, line);) {
    const nlohmann::json j = nlohmann::json::parse(line);
    if (!j.contains("pool_change")) continue;
    if (j["pool_change"]["cause"].get<std::string>().find("coordinator's restart") ==
        std::string::npos) {
      continue;
    }
    ++restart_changes;
    EXPECT_EQ(j["pool_change"]["replica"], 1);
    EXPECT_EQ(j["pool_change"]["kind"], "lost");
    EXPECT_EQ(j["pool_change"]["replicas"], 1);
  }
  EXPECT_EQ(restart_changes, 1);
}

// Kubernetes restarts a pod that dies, and every worker runs with --linger there (a finished
// run's pods stay idle instead of being restarted into it). An LLM replica of two pipeline
// stages loses stage 1: the coordinator ends stage 0 too, which must exit rather than linger so
// that it is restarted with its peer; both register into the vacant replica and join the run.
TEST_F(ClusterRunTest, ALingeringPeerOfALostWorkerExitsAndItsReplicaComesBack) {
  // Steps enough for the replica to come back well before the end; the test stops the run then.
  const std::vector<std::string> layout = {"llm.layout.dp=2", "llm.layout.tp=1", "llm.layout.pp=2",
                                           "run.steps=2000"};
  ChildProcess* coordinator = StartCoordinator("127.0.0.1:0", layout, "coordinator.log");
  ASSERT_NE(coordinator, nullptr);
  const std::string port = AwaitPort("coordinator.log");
  ASSERT_FALSE(port.empty());
  // Two encoder ranks, then LLM ranks 0 to 3: (dp 0, pp 0), (dp 1, pp 0), (dp 0, pp 1), (dp 1, pp
  // 1).
  auto start = [&](int i, const std::string& name) {
    const bool encoder = i < 2;
    return StartIn(absl::StrCat(dir_, "/", name),
                   {encoder ? kEncoder : kLlm, "--coordinator", "127.0.0.1:" + port, "--token-file",
                    dir_ + "/token", "--rank", std::to_string(encoder ? i : i - 2), "--threads",
                    "1", "--timeout", "120", "--linger", "--ready-file", Ready(i)});
  };
  std::vector<ChildProcess*> workers;
  for (int i = 0; i < 6; ++i) workers.push_back(start(i, absl::StrCat("worker-", i)));
  for (ChildProcess* w : workers) ASSERT_NE(w, nullptr);
  const std::string run = dir_ + "/coordinator/run";
  ASSERT_TRUE(WaitFor([&] { return CountLines(run + "/metrics.jsonl") >= 3; }, 120))
      << ReadFile(dir_ + "/coordinator.log");
  ASSERT_TRUE(workers[5]->Signal(SIGKILL));  // LLM rank 3: stage 1 of replica 1
  // Stage 0 of replica 1 (LLM rank 1) exits by itself, with a failure naming why.
  auto peer = workers[3]->Wait(60);
  ASSERT_TRUE(peer.ok()) << peer.status() << "\n" << ReadFile(dir_ + "/worker-3.log");
  EXPECT_EQ(*peer, 1);
  const std::string peer_log = ReadFile(dir_ + "/worker-3.log");
  EXPECT_THAT(peer_log, HasSubstr("llm replica 1 left the run"));
  EXPECT_THAT(peer_log, HasSubstr("not lingering"));
  // Its ready file went as it stopped training; the killed one's is left, as after a crash.
  EXPECT_FALSE(fs::exists(Ready(3)));
  EXPECT_EQ(ReadFile(Ready(5)), "trains with the run since step 0\n");
  // Restarted, both join the run at a step boundary with the live replica's state.
  ASSERT_NE(start(3, "worker-3-again"), nullptr);
  ASSERT_NE(start(5, "worker-5-again"), nullptr);
  // The file the killed worker left is gone before its successor registers (which then makes
  // its own, naming a later step).
  ASSERT_TRUE(WaitFor(
      [&] {
        return ReadFile(dir_ + "/worker-5-again.log").find("registering with the coordinator") !=
               std::string::npos;
      },
      60))
      << ReadFile(dir_ + "/worker-5-again.log");
  EXPECT_NE(ReadFile(Ready(5)), "trains with the run since step 0\n");
  ASSERT_TRUE(WaitFor(
      [&] {
        return ReadFile(dir_ + "/coordinator.log").find("llm replica 1 joined the run") !=
               std::string::npos;
      },
      120))
      << ReadFile(dir_ + "/coordinator.log");
  // Stage 0 of the joined replica takes the state of stage 0 of replica 0 before its first step.
  EXPECT_TRUE(WaitFor(
      [&] {
        return ReadFile(dir_ + "/worker-3-again.log")
                   .find("llm state received from replica 0 for the joined replica(s) [1]") !=
               std::string::npos;
      },
      60))
      << ReadFile(dir_ + "/worker-3-again.log");
  // The restarted ones are ready once they have trained a step with the run, a step after the
  // first (they joined a running run).
  for (int i : {3, 5}) {
    int64_t since = -1;
    ASSERT_TRUE(WaitFor(
        [&] {
          return std::sscanf(ReadFile(Ready(i)).c_str(), "trains with the run since step %ld",
                             &since) == 1;
        },
        60))
        << ReadFile(absl::StrCat(dir_, "/worker-", i, "-again.log"));
    EXPECT_GT(since, 0) << i;
  }
}

// A worker's --ready-file (a Kubernetes readiness probe's, docs/deploy.md) exists while the
// worker trains with the run: a copy left by an earlier start is removed as it starts, it is
// made once the worker has committed its first step, and removed when the run ends, though the
// worker lingers.
TEST_F(ClusterRunTest, AWorkersReadyFileExistsWhileItTrainsWithTheRun) {
  steps_ = 100000;  // the test stops the run
  ChildProcess* coordinator = StartCoordinator("127.0.0.1:0", {}, "coordinator.log");
  ASSERT_NE(coordinator, nullptr);
  const std::string port = AwaitPort("coordinator.log");
  ASSERT_FALSE(port.empty());
  std::vector<ChildProcess*> workers;
  const auto log = [&](int i) { return absl::StrCat(dir_, "/worker-", i, ".log"); };
  const auto start = [&](int i) {
    std::ofstream(Ready(i)) << "left by an earlier start\n";
    const bool encoder = i < 2;
    workers.push_back(
        StartIn(absl::StrCat(dir_, "/worker-", i),
                {encoder ? kEncoder : kLlm, "--coordinator", "127.0.0.1:" + port, "--token-file",
                 dir_ + "/token", "--rank", std::to_string(encoder ? i : i - 2), "--threads", "1",
                 "--timeout", "120", "--linger", "--ready-file", Ready(i)}));
    ASSERT_NE(workers.back(), nullptr);
  };
  // Three of the four ranks: registered, they wait for the fourth, and none is ready.
  for (int i = 0; i < 3; ++i) start(i);
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(WaitFor(
        [&] {
          return ReadFile(log(i)).find("registering with the coordinator") != std::string::npos;
        },
        60))
        << ReadFile(log(i));
    EXPECT_FALSE(fs::exists(Ready(i))) << ReadFile(log(i));
  }
  start(3);
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(WaitFor(
        [&] { return ReadFile(Ready(i)).rfind("trains with the run since step ", 0) == 0; }, 120))
        << ReadFile(log(i));
    EXPECT_EQ(ReadFile(Ready(i)), "trains with the run since step 0\n");
  }
  auto stop = RunCommand({kBin, "stop", "--wait", "60", "--coordinator", "127.0.0.1:" + port,
                          "--token-file", dir_ + "/token"},
                         90);
  ASSERT_TRUE(stop.ok()) << stop.status();
  EXPECT_EQ(stop->exit_code, 0) << stop->stderr_text;
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(WaitFor(
        [&] { return ReadFile(log(i)).find("idle until terminated") != std::string::npos; }, 60))
        << ReadFile(log(i));
    EXPECT_FALSE(fs::exists(Ready(i))) << ReadFile(log(i));
    ASSERT_TRUE(workers[i]->Signal(SIGTERM));
    auto code = workers[i]->Wait(60);
    ASSERT_TRUE(code.ok()) << code.status();
    EXPECT_EQ(*code, 0) << ReadFile(log(i));
  }
}

// A --ready-file the worker could never make fails its start, naming the flag and the path.
TEST(WorkerReadyFileTest, AReadyFileInAMissingDirectoryFailsTheStart) {
  auto result = RunCommand(
      {kEncoder, "--coordinator", "127.0.0.1:1", "--ready-file", "/nonexistent-hetpar-dir/ready"},
      60);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->exit_code, 2);
  EXPECT_THAT(result->stderr_text,
              HasSubstr("hetpar-encoder: --ready-file: creating '/nonexistent-hetpar-dir/ready': "
                        "No such file or directory"));
}

}  // namespace
}  // namespace hetpar
