// recovery_bench: the cost of losing a worker of a DP replica in a running job, of replacing it,
// and of resizing the encoder pool.
//
// Cases, each --trials times, each a `hetpar run` that waits for --kill-after committed steps,
// then the event, then --steps-after committed steps after the run's last pool change (the
// replacement's join, the shrink) before the bench stops it (`hetpar stop`): a run as long as the
// event needs, however fast its steps:
//  * encoder_replica_killed (encoder dp 2) and llm_replica_killed (LLM dp 2 x tp 1): a worker is
//    killed with SIGKILL at whatever point of a step it is, and the run finishes over the
//    replicas left. From metrics.jsonl: the median step time before the kill (the same-run
//    baseline), the time from the kill to the coordinator's noticing it (detection_s), the time
//    from the kill to the next committed step (recovery_s: the aborted attempt, the groups formed
//    anew and the step trained again) and the median step time after it (fewer replicas).
//  * llm_replica_killed_uneven (LLM dp 3 x tp 1, a batch of 9 microbatches of 1): the same kill,
//    after which the 9 microbatches no longer divide over the 2 replicas left: one takes 5
//    waves, the other 4.
//  * encoder_replica_replaced (encoder dp 2) and llm_replica_replaced (LLM dp 2 x tp 1), with
//    --replace-workers 1: the same kill, and then the replacement `hetpar run` starts joins: join_s
//    from the kill to the join (a process started, registered, its replica joining at a step
//    boundary) and join_commit_s from the join to the next committed step (the state broadcast from
//    a live replica, the groups and the step).
//  * encoder_pool_resized (encoder dp 3, 2 initial replicas): `hetpar scale --encoders 3`, then
//    back to 2. grow_s: from the scale to the new replica's join; grow_commit_s: from the join to
//    the next commit; shrink_commit_s: from the shrink (at a step boundary) to the next commit.
// One JSON line per run, then a summary line; the figures are in docs/coordinator.md. Goal:
// detection within the heartbeat deadline, and from it to the next commit about the step trained
// again plus one step time (the groups formed anew); a join or a resize costs about one step more
// than the step it happens at. `--case NAME` (repeatable) runs only those cases.
#include <signal.h>
#include <sys/prctl.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
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

// The JSON lines of `metrics` (a line still being written is left out).
std::vector<nlohmann::json> ReadMetrics(const std::string& metrics) {
  std::vector<nlohmann::json> lines;
  std::istringstream in(ReadFile(metrics));
  std::string line;
  while (std::getline(in, line)) {
    nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    if (!j.is_discarded()) lines.push_back(std::move(j));
  }
  return lines;
}

// The step numbers of the committed steps' lines, in file order.
std::vector<int> Steps(const std::vector<nlohmann::json>& lines) {
  std::vector<int> steps;
  for (const nlohmann::json& j : lines) {
    if (j.contains("step") && j["step"].is_number()) steps.push_back(j["step"].get<int>());
  }
  return steps;
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

enum class Event { kKill, kResize };

struct Case {
  std::string name;  // what happens
  Event event;
  std::string binary;  // the process killed (kKill)
  std::string flags;   // the layout that gives its module two (or three) replicas
};

// The pool_change lines of `kind` ("lost", "joined", "removed"), oldest first; all of them for "".
std::vector<nlohmann::json> PoolChanges(const std::vector<nlohmann::json>& lines,
                                        const std::string& kind) {
  std::vector<nlohmann::json> changes;
  for (const nlohmann::json& j : lines) {
    if (j.contains("pool_change") && (kind.empty() || j["pool_change"]["kind"] == kind)) {
      changes.push_back(j["pool_change"]);
    }
  }
  return changes;
}

// Polls `done` every 20 ms for at most 10 minutes.
bool WaitFor(const std::function<bool()>& done) {
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::minutes(10);
  while (!done()) {
    if (std::chrono::steady_clock::now() > give_up) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return true;
}

// `hetpar <command>` against the coordinator of the run whose log is `log`, e.g. "scale
// --encoders 3" or "stop"; whether it exited 0.
bool Control(const std::string& log, const std::string& command) {
  const std::string text = ReadFile(log);
  const size_t at = text.find("coordinator on ");
  if (at == std::string::npos) return false;
  const std::string address = text.substr(at + 15, text.find(',', at) - at - 15);
  const std::string line =
      std::string(HETPAR_BIN) + " " + command + " --coordinator " + address + " > /dev/null";
  return std::system(line.c_str()) == 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"recovery_bench: time from killing a replica's worker to the next committed step"};
  std::string config = std::string(HETPAR_SOURCE_DIR) + "/configs/tiny.yaml";
  int steps_after = 5;
  int kill_after = 6;
  int trials = 2;
  int threads = 1;
  std::string extra;
  std::vector<std::string> only;
  app.add_option("--config", config, "Non-colocated RunSpec (each case sets its module's dp to 2)")
      ->capture_default_str();
  app.add_option("--steps-after", steps_after,
                 "Committed steps after the last pool change before the run is stopped")
      ->capture_default_str();
  app.add_option("--kill-after", kill_after, "Committed steps before the kill")
      ->capture_default_str();
  app.add_option("--trials", trials, "Runs per case, each with one kill")->capture_default_str();
  app.add_option("--threads", threads, "--threads of hetpar run")->capture_default_str();
  app.add_option("--set", extra, "Extra `hetpar run` flags, as one string");
  app.add_option("--case", only, "Run only this case (repeatable; default: every case)");
  CLI11_PARSE(app, argc, argv);
  if (kill_after < 3 || steps_after < 3) {
    std::fprintf(stderr, "--kill-after and --steps-after must be at least 3\n");
    return 2;
  }
  std::vector<Case> cases = {
      {"encoder_replica_killed", Event::kKill, "hetpar-encoder", " --set encoder.layout.dp=2"},
      {"llm_replica_killed", Event::kKill, "hetpar-llm",
       " --set llm.layout.dp=2 --set llm.layout.tp=1"},
      {"llm_replica_killed_uneven", Event::kKill, "hetpar-llm",
       " --set llm.layout.dp=3 --set llm.layout.tp=1 --set run.global_batch=9"
       " --set run.micro_batch=1"},
      {"encoder_replica_replaced", Event::kKill, "hetpar-encoder",
       " --set encoder.layout.dp=2 --replace-workers 1"},
      {"llm_replica_replaced", Event::kKill, "hetpar-llm",
       " --set llm.layout.dp=2 --set llm.layout.tp=1 --replace-workers 1"},
      {"encoder_pool_resized", Event::kResize, "",
       " --set encoder.layout.dp=3 --set encoder.initial_replicas=2"},
  };

  if (!only.empty()) {
    for (const std::string& name : only) {
      if (std::none_of(cases.begin(), cases.end(), [&](const Case& c) { return c.name == name; })) {
        std::string names;
        for (const Case& c : cases) names += " " + c.name;
        std::fprintf(stderr, "--case %s: no such case; the cases are%s\n", name.c_str(),
                     names.c_str());
        return 2;
      }
    }
    cases.erase(std::remove_if(cases.begin(), cases.end(),
                               [&](const Case& c) {
                                 return std::find(only.begin(), only.end(), c.name) == only.end();
                               }),
                cases.end());
  }

  const std::string dir =
      (fs::temp_directory_path() / ("hetpar_recovery_bench_" + std::to_string(::getpid())))
          .string();
  fs::create_directories(dir);
  std::vector<double> ratios;
  for (int trial = 0; trial < trials; ++trial) {
    for (const Case& c : cases) {
      const std::string out = dir + "/" + c.name + "-" + std::to_string(trial);
      const std::string command = "exec " + std::string(HETPAR_BIN) + " run --config " +
                                  hetpar::bench::Quote(config) + " --steps 1000000 --threads " +
                                  std::to_string(threads) + c.flags + " " + extra + " --out " +
                                  hetpar::bench::Quote(out) + " > " +
                                  hetpar::bench::Quote(out + ".log") + " 2>&1";
      const pid_t bench = ::getpid();
      const pid_t child = ::fork();
      if (child == 0) {
        // A run of a million steps must not outlive a bench that died.
        ::prctl(PR_SET_PDEATHSIG, SIGTERM);
        if (::getppid() != bench) std::_Exit(127);
        ::execl("/bin/sh", "sh", "-c", command.c_str(), static_cast<char*>(nullptr));
        std::_Exit(127);
      }
      int status = 0;
      bool exited = false;
      const auto ended = [&] {
        exited = exited || ::waitpid(child, &status, WNOHANG) == child;
        return exited;
      };
      // Wait for the committed steps (at most 10 minutes), then the event.
      const std::string metrics = out + "/metrics.jsonl";
      bool happened =
          WaitFor([&] {
            return ended() || static_cast<int>(Steps(ReadMetrics(metrics)).size()) >= kill_after;
          }) &&
          !exited;
      double event_at = 0;
      double shrink_at = 0;
      if (!happened) {
        // The run is slow or failed before the event; the check below says which.
      } else if (c.event == Event::kKill) {
        const std::vector<pid_t> workers = Workers(c.binary, out);
        if (workers.size() < 2) {
          std::fprintf(stderr, "found %zu %s workers of %s (need 2); see %s.log\n", workers.size(),
                       c.binary.c_str(), out.c_str(), out.c_str());
          happened = false;
        } else {
          event_at = UnixNow();
          ::kill(workers.back(), SIGKILL);
        }
      } else {
        // Grow to 3; once the new replica joined and trained a step, shrink back to 2.
        event_at = UnixNow();
        happened = Control(out + ".log", "scale --encoders 3") &&
                   WaitFor([&] { return !PoolChanges(ReadMetrics(metrics), "joined").empty(); });
        shrink_at = UnixNow();
        happened = happened && Control(out + ".log", "scale --encoders 2");
      }
      // The pool changes the case makes, then --steps-after committed steps after the last.
      const bool replaced = c.flags.find("--replace-workers") != std::string::npos;
      happened = happened && WaitFor([&] {
                   if (ended()) return true;
                   const std::vector<nlohmann::json> lines = ReadMetrics(metrics);
                   const std::vector<nlohmann::json> changes = PoolChanges(lines, "");
                   const size_t wanted = c.event == Event::kResize ? 2 : replaced ? 2 : 1;
                   if (changes.size() < wanted) return false;
                   int last = 0;
                   for (const nlohmann::json& j : changes)
                     last = std::max(last, j["step"].get<int>());
                   const std::vector<int> steps = Steps(lines);
                   return !steps.empty() &&
                          *std::max_element(steps.begin(), steps.end()) >= last + steps_after;
                 });
      if (happened && !exited) happened = Control(out + ".log", "stop --reason recovery_bench");
      if (!happened) {
        if (exited) {
          std::fprintf(stderr, "%s: the run ended early (wait status %d); see %s.log\n",
                       c.name.c_str(), status, out.c_str());
        } else {
          std::fprintf(stderr,
                       "%s: the event, its pool changes or the %d steps after them did not happen "
                       "within 10 minutes; see %s.log\n",
                       c.name.c_str(), steps_after, out.c_str());
        }
        if (!exited) {
          ::kill(child, SIGTERM);
          ::waitpid(child, nullptr, 0);
        }
        return 1;
      }
      if (!WaitFor(ended)) {
        std::fprintf(stderr,
                     "%s: the run did not end within 10 minutes of hetpar stop; see %s.log\n",
                     c.name.c_str(), out.c_str());
        ::kill(child, SIGKILL);
        ::waitpid(child, nullptr, 0);
        return 1;
      }
      if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        std::fprintf(stderr, "the run did not end cleanly after the %s; see %s.log\n",
                     c.event == Event::kKill ? "kill" : "resize", out.c_str());
        return 1;
      }
      const std::vector<nlohmann::json> lines = ReadMetrics(metrics);
      const std::vector<nlohmann::json> lost = PoolChanges(lines, "lost");
      const std::vector<nlohmann::json> joined = PoolChanges(lines, "joined");
      const std::vector<nlohmann::json> removed = PoolChanges(lines, "removed");
      // The first pool change marks the end of the baseline.
      const nlohmann::json& first = c.event == Event::kKill
                                        ? (lost.empty() ? nlohmann::json() : lost[0])
                                        : (joined.empty() ? nlohmann::json() : joined[0]);
      if (first.is_null() || (replaced && joined.empty()) ||
          (c.event == Event::kResize && removed.empty())) {
        std::fprintf(stderr, "missing pool_change lines in %s\n", metrics.c_str());
        return 1;
      }
      std::vector<double> before;
      std::vector<double> after;
      for (const nlohmann::json& j : lines) {
        if (!j.contains("step") || !j.contains("step_time_s")) continue;
        const int step = j["step"].get<int>();
        // The first two steps warm up; the step that recovered counts in neither median.
        if (step >= 2 && step < kill_after - 1) before.push_back(j["step_time_s"].get<double>());
        if (step > first["step"].get<int>()) after.push_back(j["step_time_s"].get<double>());
      }
      const double step_s = hetpar::bench::Median(before);
      nlohmann::json result = {
          {"bench", "recovery"},     {"case", c.name},
          {"trial", trial},          {"step", first["step"]},
          {"step_s_before", step_s}, {"step_s_after", hetpar::bench::Median(after)}};
      if (c.event == Event::kKill) {
        const double detection_s = lost[0]["unix_time"].get<double>() - event_at;
        const double recovery_s = detection_s + lost[0]["recovery_s"].get<double>();
        ratios.push_back(recovery_s / step_s);
        result["replicas_after"] = lost[0]["replicas"];
        result["detection_s"] = detection_s;
        result["recovery_s"] = recovery_s;
        result["recovery_over_step"] = recovery_s / step_s;
        if (!joined.empty()) {
          result["join_s"] = joined[0]["unix_time"].get<double>() - event_at;
          result["join_commit_s"] = joined[0]["recovery_s"];
          result["join_commit_over_step"] = joined[0]["recovery_s"].get<double>() / step_s;
        }
      } else {
        result["grow_s"] = joined[0]["unix_time"].get<double>() - event_at;
        result["grow_commit_s"] = joined[0]["recovery_s"];
        result["grow_commit_over_step"] = joined[0]["recovery_s"].get<double>() / step_s;
        result["shrink_s"] = removed[0]["unix_time"].get<double>() - shrink_at;
        result["shrink_commit_s"] = removed[0]["recovery_s"];
        result["shrink_commit_over_step"] = removed[0]["recovery_s"].get<double>() / step_s;
      }
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
