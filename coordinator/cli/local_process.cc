#include "coordinator/cli/local_process.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "coordinator/cli/commands.h"

extern char** environ;

namespace hetpar::cli {

absl::StatusOr<std::unique_ptr<LocalProcess>> LocalProcess::Spawn(
    std::string name, const std::vector<std::string>& argv,
    const std::map<std::string, std::string>& env, const std::string& log_path) {
  return Spawn(std::move(name), argv, env, log_path, Options());
}

absl::StatusOr<std::unique_ptr<LocalProcess>> LocalProcess::Spawn(
    std::string name, const std::vector<std::string>& argv,
    const std::map<std::string, std::string>& env, const std::string& log_path,
    const Options& options) {
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry(*e);
    const std::string key = entry.substr(0, entry.find('='));
    if (options.drop_hetpar_env && key.rfind("HETPAR_", 0) == 0 && key != "HETPAR_LOG_LEVEL" &&
        key != "HETPAR_SENTENCEPIECE_MODULE") {
      continue;
    }
    if (env.count(key) == 0) env_strings.push_back(entry);
  }
  for (const auto& [key, value] : env) env_strings.push_back(key + "=" + value);
  std::vector<char*> envp, args;
  for (auto& e : env_strings) envp.push_back(e.data());
  envp.push_back(nullptr);
  std::vector<std::string> argv_copy = argv;
  for (auto& a : argv_copy) args.push_back(a.data());
  args.push_back(nullptr);

  const int log_fd = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (log_fd < 0) {
    return absl::PermissionDeniedError(
        absl::StrCat("cannot open log '", log_path, "': ", std::strerror(errno)));
  }
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) {
    ::close(log_fd);
    return absl::ResourceExhaustedError(absl::StrCat("fork: ", std::strerror(errno)));
  }
  if (pid == 0) {
    // A worker never outlives the run that started it, however that run ends (also when it
    // ended between the fork and the prctl).
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (::getppid() != parent) ::_exit(127);
    // A worker's group of its own: a terminal's Ctrl-C reaches the run that started it, which
    // stops the run through the coordinator, and not the worker, which would end at once and be
    // lost to the run (an LLM rank's loss fails it) before the stop is sent.
    if (options.own_group) ::setpgid(0, 0);
    ::dup2(log_fd, STDOUT_FILENO);
    ::dup2(log_fd, STDERR_FILENO);
    // Nothing else of the parent's: descriptors a library opened without O_CLOEXEC (the metrics
    // exporter's sockets) would keep them open, a port bound, in a child that outlives it.
    ::close_range(3, ~0U, 0);
    // Signals the parent blocked for its signal thread must reach the worker normally, and one
    // that comes before the exec ends it, as it would after, rather than run a handler of the
    // parent's (which would only set a flag of the parent's copy, lost at the exec).
    ::signal(SIGINT, SIG_DFL);
    ::signal(SIGTERM, SIG_DFL);
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    ::execve(args[0], args.data(), envp.data());
    const std::string message =
        absl::StrCat("cannot run ", args[0], ": ", std::strerror(errno), "\n");
    ssize_t unused = ::write(STDERR_FILENO, message.data(), message.size());
    (void)unused;
    ::_exit(127);
  }
  ::close(log_fd);
  return std::unique_ptr<LocalProcess>(new LocalProcess(std::move(name), pid, log_path));
}

LocalProcess::~LocalProcess() {
  if (!Poll().has_value()) {
    ::kill(pid_, SIGKILL);
    int status;
    ::waitpid(pid_, &status, 0);
  }
}

std::optional<int> LocalProcess::Poll() {
  if (exit_code_.has_value()) return exit_code_;
  int status = 0;
  const pid_t r = ::waitpid(pid_, &status, WNOHANG);
  if (r == pid_) {
    exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }
  return exit_code_;
}

void LocalProcess::Signal(int signal) {
  if (!Poll().has_value()) ::kill(pid_, signal);
}

int LocalProcess::WaitOrKill(absl::Duration timeout, const std::function<bool()>& interrupted) {
  absl::Time deadline = absl::Now() + timeout;
  bool signalled = false;
  while (!Poll().has_value() && absl::Now() < deadline) {
    if (!signalled && interrupted && interrupted()) {
      Signal(SIGINT);
      signalled = true;
      deadline = std::min(deadline, absl::Now() + absl::Seconds(10));
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  if (!Poll().has_value()) {
    ::kill(pid_, SIGKILL);
    int status;
    ::waitpid(pid_, &status, 0);
    exit_code_ = 128 + SIGKILL;
  }
  return *exit_code_;
}

std::string LocalProcess::LogTail(int lines) const {
  std::ifstream in(log_path_);
  std::deque<std::string> tail;
  std::string line;
  while (std::getline(in, line)) {
    tail.push_back(line);
    if (static_cast<int>(tail.size()) > lines) tail.pop_front();
  }
  std::string out;
  for (const auto& l : tail) absl::StrAppend(&out, "    ", l, "\n");
  return out;
}

std::string WorkerBinary(const std::string& name) {
  if (const char* dir = std::getenv("HETPAR_BIN_DIR"); dir != nullptr && *dir != '\0') {
    return (std::filesystem::path(dir) / name).string();
  }
  std::error_code ec;
  const auto self = std::filesystem::read_symlink("/proc/self/exe", ec);
  return (self.parent_path() / name).string();
}

int ExecWorkerBinary(const std::string& name, const std::vector<std::string>& args) {
  const std::string binary = WorkerBinary(name);
  std::vector<std::string> argv = {"hetpar"};
  argv.insert(argv.end(), args.begin(), args.end());
  std::vector<char*> pointers;
  for (std::string& arg : argv) pointers.push_back(arg.data());
  pointers.push_back(nullptr);
  execv(binary.c_str(), pointers.data());
  std::cerr << "hetpar: cannot run " << binary << ": " << std::strerror(errno)
            << " (it is built beside hetpar; set HETPAR_BIN_DIR to the directory holding it)\n";
  return 1;
}

void AddForwardedCommand(CLI::App& app, int* exit_code, const std::string& name,
                         const std::string& description) {
  CLI::App* command = app.add_subcommand(name, description);
  command->prefix_command();
  command->set_help_flag();  // --help goes through to hetpar-reference
  command->callback([command, exit_code, name] {
    std::vector<std::string> args = {name};
    const std::vector<std::string> rest = command->remaining();
    args.insert(args.end(), rest.begin(), rest.end());
    *exit_code = ExecWorkerBinary("hetpar-reference", args);
  });
}

}  // namespace hetpar::cli
