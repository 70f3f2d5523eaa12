// `hetpar run` as a user pipes it into a log: one progress line every run.log_every steps (or
// --log-every-seconds) and the last one, with the step, loss, token and FLOP rates.
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <string>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/util/subprocess.h"

namespace hetpar {
namespace {

using ::testing::HasSubstr;
using testing::RunCommand;

const std::string kBin = HETPAR_BIN;
const std::string kSource = HETPAR_SOURCE_DIR;

// The steps whose progress line a piped `hetpar run` of 5 steps printed, with `extra` flags.
std::vector<std::string> ProgressSteps(const std::vector<std::string>& extra) {
  char pattern[] = "/tmp/hetpar-run-cli-XXXXXX";
  const std::string dir = ::mkdtemp(pattern);
  std::vector<std::string> argv = {kBin,        "run",
                                   "--config",  kSource + "/configs/tiny.yaml",
                                   "--out",     dir + "/run",
                                   "--steps",   "5",
                                   "--threads", "1",
                                   "--set",     "data.manifest=" + dir + "/data/train.jsonl",
                                   "--set",     "data.val_manifest=" + dir + "/data/val.jsonl",
                                   "--set",     "data.tokenizer=" + dir + "/data/tokenizer.model",
                                   "--set",     "data.synth.samples=64",
                                   "--set",     "data.synth.val_samples=4"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  auto r = RunCommand(argv, 300);
  std::vector<std::string> shown;
  EXPECT_TRUE(r.ok()) << r.status();
  if (!r.ok()) return shown;
  EXPECT_EQ(r->exit_code, 0) << r->stderr_text;
  // Tokens and model FLOPs per second over the recent steps; both positive.
  const std::regex progress(
      R"(step (\d+)/5 \[[#.]+\] loss [0-9.]+  [1-9][0-9]* tok/s  [0-9.]+ (GFLOP/s|TFLOPS)  ETA)");
  for (auto it = std::sregex_iterator(r->stderr_text.begin(), r->stderr_text.end(), progress);
       it != std::sregex_iterator(); ++it) {
    shown.push_back((*it)[1]);
    EXPECT_THAT((*it).str(), ::testing::Not(HasSubstr(" 0.0 GFLOP/s"))) << (*it).str();
  }
  EXPECT_THAT(r->stdout_text, HasSubstr("5 steps"));
  // The run's coordinator listens on a port picked for it, and says which.
  EXPECT_TRUE(std::regex_search(r->stderr_text,
                                std::regex(R"(coordinator at 127\.0\.0\.1:[1-9][0-9]* )")))
      << r->stderr_text;
  std::filesystem::remove_all(dir);
  return shown;
}

// A number out of range or not a number is refused naming the flag, the value and what it must
// be (not CLI11's "Value 0 not in range 0.000000 to 1797...").
TEST(CliRunTest, ANumberFlagOutOfRangeSaysWhatItMustBe) {
  const std::string tiny = kSource + "/configs/tiny.yaml";
  for (const auto& [value, message] :
       std::vector<std::pair<std::string, std::string>>{
           {"0", "--steps: 0 is not a number > 0"},
           {"ten", "--steps: 'ten' is not a number (expected a number > 0)"}}) {
    auto r = RunCommand({kBin, "run", "--config", tiny, "--steps", value});
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->exit_code, 2);
    EXPECT_THAT(r->stderr_text, ::testing::HasSubstr(message));
  }
}

TEST(CliRunTest, AReferenceRunWithoutOutGoesBesideTheRunItChecks) {
  char pattern[] = "/tmp/hetpar-run-cli-XXXXXX";
  const std::string dir = ::mkdtemp(pattern);
  auto r = RunCommand({kBin, "run", "--config", kSource + "/configs/tiny.yaml", "--reference",
                       "--steps", "1", "--threads", "1", "--set", "run.out_dir=" + dir + "/run",
                       "--set", "data.manifest=" + dir + "/data/train.jsonl", "--set",
                       "data.val_manifest=" + dir + "/data/val.jsonl", "--set",
                       "data.tokenizer=" + dir + "/data/tokenizer.model", "--set",
                       "data.synth.samples=16", "--set", "data.synth.val_samples=2"},
                      300);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->exit_code, 0) << r->stderr_text;
  EXPECT_TRUE(std::filesystem::exists(dir + "/run-reference/metrics.jsonl"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/run"));
  EXPECT_THAT(r->stdout_text, HasSubstr("run directory " + dir + "/run-reference"));
  std::filesystem::remove_all(dir);
}

TEST(CliRunTest, APipedRunPrintsAProgressLineEveryLogEverySteps) {
  // Steps 2 and 4 (every 2nd), and 5 (the last); no others.
  EXPECT_THAT(ProgressSteps({"--set", "run.log_every=2"}), ::testing::ElementsAre("2", "4", "5"));
}

TEST(CliRunTest, LogEverySecondsAddsALineWhenTheTimeHasPassed) {
  // Every step takes longer than a microsecond, so each one is past the interval.
  EXPECT_THAT(ProgressSteps({"--set", "run.log_every=100", "--log-every-seconds", "0.000001"}),
              ::testing::ElementsAre("1", "2", "3", "4", "5"));
}

// `hetpar run` of 2 steps of configs/tiny.yaml with run.device cuda, two GPUs visible
// (CUDA_VISIBLE_DEVICES=0,1), its data and outputs under `dir`, and `extra` flags.
std::vector<std::string> CudaRun(const std::string& dir, const std::vector<std::string>& extra) {
  std::vector<std::string> argv = {
      "/usr/bin/env", "CUDA_VISIBLE_DEVICES=0,1",
      kBin,           "run",
      "--config",     kSource + "/configs/tiny.yaml",
      "--out",        dir + "/run",
      "--steps",      "2",
      "--threads",    "1",
      "--set",        "run.device=cuda",
      "--set",        "data.manifest=" + dir + "/data/train.jsonl",
      "--set",        "data.val_manifest=" + dir + "/data/val.jsonl",
      "--set",        "data.tokenizer=" + dir + "/data/tokenizer.model",
      "--set",        "data.synth.samples=64",
      "--set",        "data.synth.val_samples=4"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  return argv;
}

// run.device cuda on a machine without a GPU: every worker fails as it registers, naming the
// field, and the run stops with the worker's reason instead of waiting. On a GPU machine this
// would train, so the test needs a machine without the NVIDIA driver.
// A shell set up for a cluster (docs/deploy.md's HETPAR_* settings) does not reach the workers
// `hetpar run` starts: they take the run's token, plaintext loopback and their ranks from the
// run, and do not linger after it.
TEST(CliRunTest, TheShellsHetparSettingsDoNotReachTheRunsWorkers) {
  char pattern[] = "/tmp/hetpar-run-env-XXXXXX";
  const std::string dir = ::mkdtemp(pattern);
  std::ofstream(dir + "/other-token") << "not-this-runs-token\n";
  std::vector<std::string> argv = {"env",
                                   "HETPAR_TOKEN_FILE=" + dir + "/other-token",
                                   "HETPAR_TLS_CA=" + dir + "/no-such-ca.pem",
                                   "HETPAR_LINGER=1",
                                   "HETPAR_RANK=3",
                                   kBin,
                                   "run",
                                   "--config",
                                   kSource + "/configs/tiny.yaml",
                                   "--out",
                                   dir + "/run",
                                   "--steps",
                                   "2",
                                   "--threads",
                                   "1",
                                   "--set",
                                   "data.manifest=" + dir + "/data/train.jsonl",
                                   "--set",
                                   "data.val_manifest=\"\"",
                                   "--set",
                                   "data.tokenizer=" + dir + "/data/tokenizer.model",
                                   "--set",
                                   "data.synth.samples=64"};
  auto r = RunCommand(argv, 300);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->exit_code, 0) << r->stderr_text;
  EXPECT_THAT(r->stdout_text, HasSubstr("2 steps"));
  std::filesystem::remove_all(dir);
}

// Preparing the data set runs to its end before any worker starts: a first signal says so, and a
// second ends `hetpar run` at once, leaving no manifest of the unfinished set and no run.
TEST(CliRunTest, ASecondSignalWhileTheDataSetIsGeneratedEndsTheRunAtOnce) {
  char pattern[] = "/tmp/hetpar-run-prepare-XXXXXX";
  const std::string dir = ::mkdtemp(pattern);
  const std::string log = dir + "/hetpar-run.log";
  // Far more samples than the test lets it generate: all of them would take minutes.
  auto run = testing::ChildProcess::Start(
      {kBin, "run", "--config", kSource + "/configs/tiny.yaml", "--out", dir + "/run", "--steps",
       "2", "--threads", "1", "--set", "data.manifest=" + dir + "/data/train.jsonl", "--set",
       "data.val_manifest=\"\"", "--set", "data.tokenizer=" + dir + "/data/tokenizer.model",
       "--set", "data.synth.samples=500000"},
      log);
  ASSERT_TRUE(run.ok()) << run.status();
  const auto logged = [&](const std::string& text) {
    return testing::PollUntil(
        [&] { return testing::ReadTextFile(log).find(text) != std::string::npos; },
        absl::Seconds(120));
  };
  ASSERT_TRUE(logged("generating the synthetic data set " + dir + "/data/train.jsonl"))
      << testing::ReadTextFile(log);
  ASSERT_TRUE(run->Signal(SIGINT));
  ASSERT_TRUE(logged("signalled while the data set is prepared")) << testing::ReadTextFile(log);
  ASSERT_TRUE(run->Signal(SIGINT));
  const absl::StatusOr<int> code = run->Wait(60);
  ASSERT_TRUE(code.ok()) << code.status() << "\n" << testing::ReadTextFile(log);
  EXPECT_EQ(*code, 130);
  EXPECT_THAT(testing::ReadTextFile(log),
              HasSubstr("signalled again while the data set is prepared: ended at once"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/data/train.jsonl"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/run/metrics.jsonl"));
  std::filesystem::remove_all(dir);
}

// A manifest edited in place after its index was built, its size and modification time kept
// (a copy that preserves times, a word for a word of the same length): coordinator and workers
// take the index as fresh, and the workers tokenize other captions than it records. The first
// worker that meets it fails the run, naming the sample and the fix, without retrying the step:
// every attempt would meet it.
TEST(CliRunTest, AStaleIndexFailsTheRunAtItsFirstStepWithoutRetrying) {
  char pattern[] = "/tmp/hetpar-run-stale-XXXXXX";
  const std::string dir = ::mkdtemp(pattern);
  const std::string manifest = dir + "/data/train.jsonl";
  const std::vector<std::string> settings = {
      "--set", "data.manifest=" + manifest,
      "--set", "data.val_manifest=\"\"",
      "--set", "data.tokenizer=" + dir + "/data/tokenizer.model",
      "--set", "data.synth.samples=64"};
  std::vector<std::string> synth = {kBin, "data", "synth", "--config",
                                    kSource + "/configs/tiny.yaml"};
  synth.insert(synth.end(), settings.begin(), settings.end());
  auto made = RunCommand(synth, 300);
  ASSERT_TRUE(made.ok()) << made.status();
  ASSERT_EQ(made->exit_code, 0) << made->stderr_text;
  ASSERT_TRUE(std::filesystem::exists(manifest + ".index"));

  struct stat before {};
  ASSERT_EQ(::stat(manifest.c_str(), &before), 0);
  std::string text = testing::ReadTextFile(manifest);
  int swapped = 0;
  for (size_t at = 0; (at = text.find("small", at)) != std::string::npos; at += 5, ++swapped) {
    text.replace(at, 5, "large");
  }
  ASSERT_GT(swapped, 0) << text;
  std::ofstream(manifest, std::ios::trunc) << text;
  const struct timespec times[2] = {before.st_atim, before.st_mtim};
  ASSERT_EQ(::utimensat(AT_FDCWD, manifest.c_str(), times, 0), 0);
  struct stat after {};
  ASSERT_EQ(::stat(manifest.c_str(), &after), 0);
  ASSERT_EQ(after.st_size, before.st_size);

  std::vector<std::string> run = {
      kBin,        "run",        "--config", kSource + "/configs/tiny.yaml",
      "--out",     dir + "/run", "--steps",  "4",
      "--threads", "1"};
  run.insert(run.end(), settings.begin(), settings.end());
  auto r = RunCommand(run, 300);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_NE(r->exit_code, 0) << r->stderr_text;
  EXPECT_THAT(r->stderr_text, HasSubstr("failed step 0: sample '"));
  EXPECT_THAT(r->stderr_text,
              HasSubstr("the index is stale (the manifest, the tokenizer or its "
                        "tokenizer_config.json changed after it was built, keeping its size and "
                        "modification time); rebuild it (`hetpar data index --rebuild`)"));
  EXPECT_THAT(r->stderr_text,
              HasSubstr("so the run stops; fix the cause and start the run again (it writes no "
                        "checkpoints: checkpoint.dir)"));
  EXPECT_THAT(r->stderr_text,
              HasSubstr("every attempt of the step would fail the same way, so the run stops"));
  // One attempt: no retry was planned.
  EXPECT_THAT(r->stderr_text, ::testing::Not(HasSubstr("aborted (attempt")));
  EXPECT_THAT(r->stderr_text, ::testing::Not(HasSubstr("times in a row")));
  std::filesystem::remove_all(dir);
}

// Flags that a run of this kind would not honour are refused naming them, not ignored.
TEST(CliRunTest, FlagsARunWouldNotHonourAreRefused) {
  const std::string tiny = kSource + "/configs/tiny.yaml";
  auto reference = RunCommand({kBin, "run", "--config", tiny, "--reference", "--trace", "0:1",
                               "--listen", "127.0.0.1:0", "--out", "/tmp/hetpar-never-written"});
  ASSERT_TRUE(reference.ok()) << reference.status();
  EXPECT_EQ(reference->exit_code, 2) << reference->stderr_text;
  EXPECT_THAT(reference->stderr_text,
              HasSubstr("--trace, --listen are for a distributed run, and --reference trains in "
                        "one process"));
  auto colocated = RunCommand({kBin, "run", "--config", kSource + "/configs/tiny-colocated.yaml",
                               "--replace-workers", "1", "--out", "/tmp/hetpar-never-written"});
  ASSERT_TRUE(colocated.ok()) << colocated.status();
  EXPECT_EQ(colocated->exit_code, 2) << colocated->stderr_text;
  EXPECT_THAT(colocated->stderr_text,
              HasSubstr("--replace-workers 1: a colocated run has no replica to refill"));
  EXPECT_FALSE(std::filesystem::exists("/tmp/hetpar-never-written"));
}

TEST(CliRunTest, ACudaRunWithoutAGpuStopsNamingRunDevice) {
  if (std::filesystem::exists("/proc/driver/nvidia/gpus")) {
    GTEST_SKIP() << "this machine has an NVIDIA driver (/proc/driver/nvidia/gpus)";
  }
  char pattern[] = "/tmp/hetpar-run-cuda-XXXXXX";
  const std::string dir = ::mkdtemp(pattern);
  // Two visible GPUs named by CUDA_VISIBLE_DEVICES: the workers are spread over both.
  auto r = RunCommand(CudaRun(dir, {}), 300);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->exit_code, 1) << r->stderr_text;
  EXPECT_THAT(r->stderr_text, HasSubstr("4 workers on 2 GPU(s), worker i on GPU i mod 2"));
  EXPECT_THAT(r->stderr_text, HasSubstr("failed after 0 committed steps"));
  EXPECT_THAT(r->stderr_text,
              HasSubstr("run.device=\"cuda\", but this worker sees no CUDA device"));
  std::filesystem::remove_all(dir);
}

// transport: nccl with fewer visible GPUs than worker processes: refused before any worker
// starts (NCCL would refuse two ranks on one GPU at the first boundary connection), naming the
// field and the way out. Holds on any machine: CUDA_VISIBLE_DEVICES decides the count.
TEST(CliRunTest, NcclWithFewerGpusThanWorkersIsRefusedBeforeAnyWorkerStarts) {
  char pattern[] = "/tmp/hetpar-run-nccl-XXXXXX";
  const std::string dir = ::mkdtemp(pattern);
  auto r = RunCommand(CudaRun(dir, {"--set", "transport=nccl"}), 300);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->exit_code, 2) << r->stderr_text;
  EXPECT_THAT(r->stderr_text,
              HasSubstr("transport: nccl needs a GPU per worker process, and this run starts 4 "
                        "workers on 2 visible GPU(s)"));
  EXPECT_THAT(r->stderr_text, HasSubstr("use transport: ucx"));
  // No worker ran: the run directory holds no worker log.
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(dir + "/run/log", error)) {
    ADD_FAILURE() << "a worker started: " << entry.path();
  }
  std::filesystem::remove_all(dir);
}

// A run whose checkpoint.dir another live run writes (a sweep of one config over several run
// directories) is refused before it starts, naming the other; `hetpar coordinator` too.
TEST(CliRunTest, ACheckpointDirThatAnotherRunWritesIsRefused) {
  char pattern[] = "/tmp/hetpar-run-claim-XXXXXX";
  const std::string dir = ::mkdtemp(pattern);
  std::filesystem::create_directories(dir + "/ckpt");
  // The other run: its claim held here, as its process holds it.
  const int fd =
      ::open((dir + "/ckpt/.hetpar-checkpoint.lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX | LOCK_NB), 0);
  const std::string holder = "pid 4242, run directory /runs/lr-1e-4\n";
  ASSERT_EQ(::write(fd, holder.data(), holder.size()), static_cast<ssize_t>(holder.size()));
  const std::vector<std::string> settings = {
      "--set", "checkpoint.dir=" + dir + "/ckpt",
      "--set", "data.manifest=" + dir + "/data/train.jsonl",
      "--set", "data.val_manifest=" + dir + "/data/val.jsonl",
      "--set", "data.tokenizer=" + dir + "/data/tokenizer.model"};
  std::vector<std::string> run = {kBin,    "run",       "--config", kSource + "/configs/tiny.yaml",
                                  "--out", dir + "/run"};
  std::vector<std::string> coordinator = {
      kBin,    "coordinator", "--config", kSource + "/configs/tiny.yaml",
      "--out", dir + "/run2", "--listen", "127.0.0.1:0"};
  for (std::vector<std::string>* argv : {&run, &coordinator}) {
    argv->insert(argv->end(), settings.begin(), settings.end());
    auto r = RunCommand(*argv, 120);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->exit_code, 2) << (*argv)[1] << ": " << r->stderr_text;
    EXPECT_THAT(r->stderr_text,
                HasSubstr("checkpoint.dir " + dir +
                          "/ckpt is in use by another hetpar process "
                          "(pid 4242, run directory /runs/lr-1e-4): two runs writing one "
                          "checkpoint.dir would overwrite and prune each other's checkpoints"))
        << (*argv)[1];
    EXPECT_FALSE(std::filesystem::exists(dir + "/data/train.jsonl")) << (*argv)[1];
  }
  ::close(fd);
  std::filesystem::remove_all(dir);
}

// --nccl-host-per-worker (each worker an NCCL host of its own, so that ranks of one group may
// share a GPU) does something only for NCCL groups on CUDA: refused, naming why, on a CPU run and
// with transport nccl (whose boundary pairs NCCL would still refuse on one GPU), before any worker
// starts.
TEST(CliRunTest, NcclHostPerWorkerIsRefusedWhereNoNcclGroupWouldShareAGpu) {
  char pattern[] = "/tmp/hetpar-run-ncclhost-XXXXXX";
  const std::string dir = ::mkdtemp(pattern);
  auto cpu = RunCommand(CudaRun(dir, {"--set", "run.device=cpu", "--nccl-host-per-worker"}), 300);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  EXPECT_EQ(cpu->exit_code, 2) << cpu->stderr_text;
  EXPECT_THAT(cpu->stderr_text, HasSubstr("--nccl-host-per-worker is for the NCCL groups"));
  EXPECT_THAT(cpu->stderr_text, HasSubstr("run.device 'cpu'"));
  auto nccl = RunCommand(CudaRun(dir, {"--set", "transport=nccl", "--nccl-host-per-worker"}), 300);
  ASSERT_TRUE(nccl.ok()) << nccl.status();
  EXPECT_EQ(nccl->exit_code, 2) << nccl->stderr_text;
  EXPECT_THAT(nccl->stderr_text, HasSubstr("run.device 'cuda' and transport nccl"));
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(dir + "/run/log", error)) {
    ADD_FAILURE() << "a worker started: " << entry.path();
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace hetpar
