// Worker processes that `hetpar run` starts on this machine and ends by pid.
#ifndef HETPAR_COORDINATOR_CLI_LOCAL_PROCESS_H_
#define HETPAR_COORDINATOR_CLI_LOCAL_PROCESS_H_

#include <sys/types.h>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace hetpar::cli {

// A child process with its output in a log file. Killed (SIGKILL) and reaped on destruction if
// it is still running.
class LocalProcess {
 public:
  struct Options {
    // In a process group of its own, which a terminal's Ctrl-C does not reach (a run's workers,
    // which the run stops through its coordinator); otherwise in the parent's.
    bool own_group = false;
    // Without the parent's HETPAR_* settings (but its log level and the tokenizer module's
    // path): a run's workers get theirs from the run, and the user's shell may hold a cluster's
    // (HETPAR_TOKEN_FILE, HETPAR_TLS_CA, HETPAR_LINGER, HETPAR_RANK, ...), which would override
    // them.
    bool drop_hetpar_env = false;
  };
  // Starts argv with the parent's environment plus `env`, stdout and stderr to `log_path`.
  static absl::StatusOr<std::unique_ptr<LocalProcess>> Spawn(
      std::string name, const std::vector<std::string>& argv,
      const std::map<std::string, std::string>& env, const std::string& log_path);
  static absl::StatusOr<std::unique_ptr<LocalProcess>> Spawn(
      std::string name, const std::vector<std::string>& argv,
      const std::map<std::string, std::string>& env, const std::string& log_path,
      const Options& options);
  ~LocalProcess();
  LocalProcess(const LocalProcess&) = delete;
  LocalProcess& operator=(const LocalProcess&) = delete;

  const std::string& name() const { return name_; }
  const std::string& log_path() const { return log_path_; }
  pid_t pid() const { return pid_; }
  // The exit code once it has exited (128 + signal when killed); nullopt while running.
  std::optional<int> Poll();
  void Signal(int signal);
  // Waits up to `timeout`; then SIGKILL. Returns the exit code. `interrupted` (optional), polled
  // meanwhile: once it holds, the process is sent SIGINT and waited for 10 s more at most.
  int WaitOrKill(absl::Duration timeout, const std::function<bool()>& interrupted = {});
  // The last `lines` lines of its log.
  std::string LogTail(int lines) const;

 private:
  LocalProcess(std::string name, pid_t pid, std::string log_path)
      : name_(std::move(name)), pid_(pid), log_path_(std::move(log_path)) {}
  std::string name_;
  pid_t pid_;
  std::string log_path_;
  std::optional<int> exit_code_;
};

// The path of a worker binary `name` ("hetpar-encoder", "hetpar-llm", "hetpar-reference"): in
// $HETPAR_BIN_DIR when set, else beside this executable.
std::string WorkerBinary(const std::string& name);

// Replaces this process with WorkerBinary(name) run with `args`: the `hetpar` subcommands whose
// work needs libtorch (convert, score), which `hetpar` itself never links. Returns only when the
// exec fails, with the exit code to use after printing why. Its argv[0] is "hetpar": the help and
// usage it prints name the command the user typed (`hetpar convert from-hf`), not the binary.
int ExecWorkerBinary(const std::string& name, const std::vector<std::string>& args);

}  // namespace hetpar::cli

#endif  // HETPAR_COORDINATOR_CLI_LOCAL_PROCESS_H_
