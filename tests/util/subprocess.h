// Helpers for tests that start real processes: run a command to completion with a deadline and
// capture its output, or start one in the background and end it by pid.
#ifndef HETPAR_TESTS_UTIL_SUBPROCESS_H_
#define HETPAR_TESTS_UTIL_SUBPROCESS_H_

#include <sys/types.h>

#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace hetpar::testing {

struct CommandResult {
  int exit_code = -1;  // exit status, or 128 + signal when killed
  std::string stdout_text;
  std::string stderr_text;
};

// Runs argv[0] with arguments, waits at most `timeout_s` (then kill -9, DeadlineExceeded).
absl::StatusOr<CommandResult> RunCommand(const std::vector<std::string>& argv,
                                         double timeout_s = 60);

// A child process started in the background; killed with SIGKILL on destruction if alive.
class ChildProcess {
 public:
  static absl::StatusOr<ChildProcess> Start(const std::vector<std::string>& argv,
                                            const std::string& log_path = "");
  ChildProcess(ChildProcess&& other) noexcept;
  ChildProcess& operator=(ChildProcess&& other) noexcept;
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;
  ~ChildProcess();

  pid_t pid() const { return pid_; }
  // Sends `signal`; returns false if the process is already gone.
  bool Signal(int signal);
  // Waits up to `timeout_s` for exit; returns the exit code (128 + signal when killed), or
  // DeadlineExceeded.
  absl::StatusOr<int> Wait(double timeout_s);

 private:
  explicit ChildProcess(pid_t pid) : pid_(pid) {}
  pid_t pid_ = -1;
  bool reaped_ = false;
};

// The whole text of `path` ("" when it cannot be read).
std::string ReadTextFile(const std::string& path);

// How a test and the peer process it starts swap addresses: each writes its own file with
// hetpar::WriteFileAtomically (common/atomic_file.h: a reader never sees half of it) and waits
// for the other's. WaitForFile reads `path` into `bytes` once it exists, false if it did not
// appear within `timeout`.
bool WaitForFile(const std::string& path, absl::Duration timeout, std::string* bytes);

// Polls `done` (what another process does: a log line, a file) every 50 ms until it holds, at
// most `timeout`; returns whether it did.
bool PollUntil(const std::function<bool()>& done, absl::Duration timeout);

// Pids of the processes whose command line (arguments joined by spaces) contains every one of
// `needles`, other than this process.
std::vector<pid_t> ProcessesWith(const std::vector<std::string>& needles);

}  // namespace hetpar::testing

#endif  // HETPAR_TESTS_UTIL_SUBPROCESS_H_
