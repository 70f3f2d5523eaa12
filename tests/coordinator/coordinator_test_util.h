// Helpers for the coordinator's multi-process tests: a temporary directory, a `hetpar
// coordinator` child process whose chosen port is read from its log, and simulated workers.
#ifndef HETPAR_TESTS_COORDINATOR_COORDINATOR_TEST_UTIL_H_
#define HETPAR_TESTS_COORDINATOR_COORDINATOR_TEST_UTIL_H_

#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "tests/util/subprocess.h"

namespace hetpar::testing {

inline const std::string kHetparBin = HETPAR_BIN;
inline const std::string kSimWorkerBin = SIM_WORKER_BIN;
inline const std::string kSourceDir = HETPAR_SOURCE_DIR;

inline std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// A fresh directory under /tmp, removed at destruction.
class TempDir {
 public:
  TempDir() {
    char pattern[] = "/tmp/hetpar-coordinator-test-XXXXXX";
    path_ = mkdtemp(pattern);
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  const std::string& path() const { return path_; }
  std::string File(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// Polls `path` until `pattern` matches its text; returns the first capture group.
inline absl::StatusOr<std::string> AwaitInFile(const std::string& path, const std::string& pattern,
                                               absl::Duration timeout) {
  const std::regex re(pattern);
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    std::smatch match;
    const std::string text = ReadFile(path);
    if (std::regex_search(text, match, re))
      return match.size() > 1 ? match[1].str() : match[0].str();
    absl::SleepFor(absl::Milliseconds(20));
  }
  return absl::DeadlineExceededError(
      absl::StrCat("'", pattern, "' did not appear in ", path, ":\n", ReadFile(path)));
}

// `hetpar coordinator` on a free port; its output goes to `log`.
struct CoordinatorProcess {
  ChildProcess process;
  std::string address;
  std::string log;
};

inline absl::StatusOr<CoordinatorProcess> StartCoordinator(const std::vector<std::string>& args,
                                                           const std::string& log) {
  // The run directory beside the log.
  std::vector<std::string> argv = {kHetparBin,    "coordinator", "--listen",
                                   "127.0.0.1:0", "--out",       log + ".run"};
  argv.insert(argv.end(), args.begin(), args.end());
  absl::StatusOr<ChildProcess> child = ChildProcess::Start(argv, log);
  if (!child.ok()) return child.status();
  absl::StatusOr<std::string> port =
      AwaitInFile(log, "listening on 127\\.0\\.0\\.1:([0-9]+)", absl::Seconds(30));
  if (!port.ok()) return port.status();
  return CoordinatorProcess{*std::move(child), "127.0.0.1:" + *port, log};
}

inline absl::StatusOr<ChildProcess> StartSimWorker(const std::string& address,
                                                   const std::string& role, const std::string& host,
                                                   const std::string& log, int step_delay_ms = 0) {
  return ChildProcess::Start({kSimWorkerBin, "--coordinator", address, "--role", role, "--host",
                              host, "--step-delay-ms", std::to_string(step_delay_ms)},
                             log);
}

}  // namespace hetpar::testing

#endif  // HETPAR_TESTS_COORDINATOR_COORDINATOR_TEST_UTIL_H_
