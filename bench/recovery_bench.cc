// recovery_bench: the cost of losing a worker of a DP replica in a running job.
//
// Two cases, each --trials times: `hetpar run` with the encoder at dp 2 (an encoder worker is
// killed), and with the LLM at dp 2 x tp 1 (an LLM worker is killed). Each run waits for
// --kill-after committed steps, kills the worker with SIGKILL at whatever point of a step it is,
// and finishes over the replicas left. From the run's metrics.jsonl: the median step time before
// the kill (the same-run baseline), the time from the kill to the coordinator's noticing it
// (detection_s), the time from the kill to the next committed step (recovery_s: the aborted
// attempt, the groups formed anew and the step trained again) and the median step time after it
// (fewer replicas). One JSON line per run, then a summary line.
// Goal (docs/coordinator.md): detection within the heartbeat deadline, recovery within about
// one step time after it.
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "bench/hetpar_run_util.h"
#include "nlohmann/json.hpp"

namespace {

namespace fs = std::filesystem;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

int CountSteps(const std::string& metrics) {
  int n = 0;
  std::istringstream in(ReadFile(metrics));
  std::string line;
  while (std::getline(in, line)) {
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    n += !j.is_discarded() && j.contains("step") ? 1 : 0;
  }
  return n;
}

// Pids of `binary` processes whose command line names `out`.
std::vector<pid_t> Workers(const std::string& binary, const std::string& out) {
  std::vector<pid_t> pids;
  for (const auto& entry : fs::directory_iterator("/proc")) {
    const std::string name = entry.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::string cmdline = ReadFile(entry.path().string() + "/cmdline");
    for (char& c : cmdline) c = c == '\0' ? ' ' : c;
    if (cmdline.find(binary + " --coordinator") != std::string::npos &&
        cmdline.find(out) != std::string::npos) {
      pids.push_back(std::stoi(name));
    }
  }
  return pids;
}

double UnixNow() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

struct Case {
  std::string name;    // what is lost
  std::string binary;  // the process killed
  std::string flags;   // the layout that gives its module two replicas
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"recovery_bench: time from killing a replica's worker to the next committed step"};
  std::string config = std::string(HETPAR_SOURCE_DIR) + "/configs/tiny.yaml";
  int steps = 16;
  int kill_after = 6;
  int trials = 2;
  int threads = 1;
  std::string extra;
  app.add_option("--config", config, "Non-colocated RunSpec (each case sets its module's dp to 2)")
      ->capture_default_str();
  app.add_option("--steps", steps, "Steps per run")->capture_default_str();
  app.add_option("--kill-after", kill_after, "Committed steps before the kill")
      ->capture_default_str();
  app.add_option("--trials", trials, "Runs per case, each with one kill")->capture_default_str();
  app.add_option("--threads", threads, "--threads of hetpar run")->capture_default_str();
  app.add_option("--set", extra, "Extra `hetpar run` flags, as one string");
  CLI11_PARSE(app, argc, argv);
  if (kill_after < 3 || kill_after + 3 > steps) {
    std::fprintf(stderr, "--kill-after must be in [3, --steps - 3]\n");
    return 2;
  }
  const std::vector<Case> cases = {
      {"encoder_replica_killed", "hetpar-encoder", " --set encoder.layout.dp=2"},
      {"llm_replica_killed", "hetpar-llm", " --set llm.layout.dp=2 --set llm.layout.tp=1"},
  };

  const std::string dir =
      (fs::temp_directory_path() / ("hetpar_recovery_bench_" + std::to_string(::getpid())))
          .string();
  fs::create_directories(dir);
  std::vector<double> ratios;
  for (int trial = 0; trial < trials; ++trial) {
    for (const Case& c : cases) {
      const std::string out = dir + "/" + c.name + "-" + std::to_string(trial);
      const std::string command = std::string(HETPAR_BIN) + " run --config " +
                                  hetpar::bench::Quote(config) + " --steps " +
                                  std::to_string(steps) + " --threads " + std::to_string(threads) +
                                  c.flags + " " + extra + " --out " + hetpar::bench::Quote(out) +
                                  " > " + hetpar::bench::Quote(out + ".log") + " 2>&1";
      const pid_t child = ::fork();
      if (child == 0) {
        ::execl("/bin/sh", "sh", "-c", command.c_str(), static_cast<char*>(nullptr));
        std::_Exit(127);
      }
      // Wait for the committed steps (at most 10 minutes), then kill one worker.
      const std::string metrics = out + "/metrics.jsonl";
      const auto give_up = std::chrono::steady_clock::now() + std::chrono::minutes(10);
      while (CountSteps(metrics) < kill_after && std::chrono::steady_clock::now() < give_up) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
      const std::vector<pid_t> workers = Workers(c.binary, out);
      if (workers.size() < 2) {
        std::fprintf(stderr, "found %zu %s workers of %s (need 2); see %s.log\n", workers.size(),
                     c.binary.c_str(), out.c_str(), out.c_str());
        ::kill(child, SIGTERM);
        ::waitpid(child, nullptr, 0);
        return 1;
      }
      const double killed_at = UnixNow();
      ::kill(workers.back(), SIGKILL);
      int status = 0;
      ::waitpid(child, &status, 0);
      if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        std::fprintf(stderr, "the run did not finish after the kill; see %s.log\n", out.c_str());
        return 1;
      }
      std::vector<double> before;
      std::vector<double> after;
      nlohmann::json change;
      std::istringstream in(ReadFile(metrics));
      std::string line;
      while (std::getline(in, line)) {
        nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
        if (j.is_discarded()) continue;
        if (j.contains("pool_change")) change = j["pool_change"];
        if (!j.contains("step") || !j.contains("step_time_s")) continue;
        const int step = j["step"].get<int>();
        // The first two steps warm up; the step that recovered counts in neither median.
        if (step >= 2 && step < kill_after - 1) before.push_back(j["step_time_s"].get<double>());
        if (!change.is_null() && step > change["step"].get<int>()) {
          after.push_back(j["step_time_s"].get<double>());
        }
      }
      if (change.is_null()) {
        std::fprintf(stderr, "no pool_change line in %s\n", metrics.c_str());
        return 1;
      }
      const double step_s = hetpar::bench::Median(before);
      const double detection_s = change["unix_time"].get<double>() - killed_at;
      const double recovery_s = detection_s + change["recovery_s"].get<double>();
      ratios.push_back(recovery_s / step_s);
      nlohmann::json result = {{"bench", "recovery"},
                               {"case", c.name},
                               {"trial", trial},
                               {"step", change["step"]},
                               {"replicas_after", change["replicas"]},
                               {"detection_s", detection_s},
                               {"recovery_s", recovery_s},
                               {"step_s_before", step_s},
                               {"step_s_after", hetpar::bench::Median(after)},
                               {"recovery_over_step", recovery_s / step_s}};
      std::printf("%s\n", result.dump().c_str());
      std::fflush(stdout);
    }
  }
  nlohmann::json summary = {{"bench", "recovery"},
                            {"case", "summary"},
                            {"runs", static_cast<int>(ratios.size())},
                            {"median_recovery_over_step", hetpar::bench::Median(ratios)}};
  std::printf("%s\n", summary.dump().c_str());
  fs::remove_all(dir);
  return 0;
}
