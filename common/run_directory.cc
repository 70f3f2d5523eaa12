#include "common/run_directory.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/atomic_file.h"
#include "common/config/config.h"
#include "common/errno_status.h"
#include "common/logging.h"
#include "common/status.h"
#include "nlohmann/json.hpp"

namespace hetpar {

namespace {

// The step of a line of metrics.jsonl: a step line's, or (with `pool_changes`) the step at whose
// boundary a pool change line's replica left or joined; nullopt for any other line (end-of-run
// lines, a line cut short by a crash).
std::optional<int64_t> StepOfLine(const std::string& line, bool pool_changes = false) {
  const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
  if (!j.is_object()) return std::nullopt;
  const nlohmann::json* holder = &j;
  if (pool_changes && j.contains("pool_change")) holder = &j["pool_change"];
  if (!holder->is_object() || !holder->contains("step") || !(*holder)["step"].is_number_integer()) {
    return std::nullopt;
  }
  return (*holder)["step"].get<int64_t>();
}

// The directory and log/, locked (`path`/.lock), then config.yaml.
absl::StatusOr<std::unique_ptr<DirectoryLock>> Prepare(const std::string& path,
                                                       const hetpar::v1::RunSpec& spec) {
  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(path) / "log", ec);
  if (ec) {
    return absl::PermissionDeniedError(
        absl::StrCat("cannot create run directory '", path, "': ", ec.message()));
  }
  HETPAR_ASSIGN_OR_RETURN(
      std::unique_ptr<DirectoryLock> lock,
      DirectoryLock::Take(
          path, ".lock", "run directory",
          "wait for it to end, or give this run another directory (run.out_dir, --out)"));
  // Whole or not at all: a coordinator continuing the run reads it back, and a file cut short
  // by a crash or a full disk would not load.
  HETPAR_RETURN_IF_ERROR(WriteFileAtomically(path + "/config.yaml", config::RunSpecToYaml(spec)));
  return lock;
}

}  // namespace

absl::StatusOr<std::unique_ptr<DirectoryLock>> DirectoryLock::Take(const std::string& dir,
                                                                   const std::string& file,
                                                                   const std::string& what,
                                                                   const std::string& remedy,
                                                                   const std::string& holder) {
  const std::string lock = dir + "/" + file;
  const int fd = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoStatus(errno, absl::StrCat("cannot open ", lock));
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int error = errno;
    if (error != EWOULDBLOCK) {
      ::close(fd);
      HETPAR_LOG(WARNING) << "cannot lock " << lock << " (" << std::strerror(error)
                          << "): nothing keeps another process from using the " << what
                          << " at the same time";
      return std::unique_ptr<DirectoryLock>(new DirectoryLock(-1));
    }
    // The holder's first line: "pid N", and what else it wrote.
    char text[512] = {};
    const ssize_t n = ::pread(fd, text, sizeof(text) - 1, 0);
    ::close(fd);
    std::string who = n > 0 ? std::string(text, static_cast<size_t>(n)) : "";
    who = who.substr(0, who.find('\n'));
    who.erase(std::remove_if(who.begin(), who.end(),
                             [](char c) { return !std::isprint(static_cast<unsigned char>(c)); }),
              who.end());
    return absl::FailedPreconditionError(
        absl::StrCat(what, " ", dir, " is in use by another hetpar process",
                     who.empty() ? "" : " (" + who + ")", ": ", remedy));
  }
  const std::string line =
      absl::StrCat("pid ", ::getpid(), holder.empty() ? "" : ", ", holder, "\n");
  if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, line.data(), line.size(), 0) < 0) {
    HETPAR_LOG(WARNING) << "cannot write this process's pid into " << lock << ": "
                        << std::strerror(errno);
  }
  return std::unique_ptr<DirectoryLock>(new DirectoryLock(fd));
}

DirectoryLock::~DirectoryLock() {
  if (fd_ >= 0) ::close(fd_);  // releases the flock
}

absl::StatusOr<std::unique_ptr<RunDirectory>> RunDirectory::Create(
    const std::string& path, const hetpar::v1::RunSpec& spec) {
  HETPAR_ASSIGN_OR_RETURN(std::unique_ptr<DirectoryLock> lock, Prepare(path, spec));
  std::FILE* metrics = std::fopen((path + "/metrics.jsonl").c_str(), "we");
  if (metrics == nullptr) {
    return absl::PermissionDeniedError(
        absl::StrCat("cannot write '", path, "/metrics.jsonl': ", std::strerror(errno)));
  }
  return std::unique_ptr<RunDirectory>(new RunDirectory(path, metrics, std::move(lock)));
}

absl::StatusOr<std::unique_ptr<RunDirectory>> RunDirectory::Continue(
    const std::string& path, const hetpar::v1::RunSpec& spec, int64_t first_step) {
  HETPAR_ASSIGN_OR_RETURN(std::unique_ptr<DirectoryLock> lock, Prepare(path, spec));
  std::string kept;
  {
    std::ifstream in(path + "/metrics.jsonl");
    for (std::string line; std::getline(in, line);) {
      const std::optional<int64_t> step = StepOfLine(line, /*pool_changes=*/true);
      if (step.has_value() && *step < first_step) kept += line + "\n";
    }
  }
  // Replaced whole (a crash here leaves the old file), then appended to.
  if (absl::Status s = WriteFileAtomically(path + "/metrics.jsonl", kept); !s.ok()) return s;
  std::FILE* metrics = std::fopen((path + "/metrics.jsonl").c_str(), "ae");
  if (metrics == nullptr) {
    return absl::PermissionDeniedError(
        absl::StrCat("cannot append to '", path, "/metrics.jsonl': ", std::strerror(errno)));
  }
  return std::unique_ptr<RunDirectory>(new RunDirectory(path, metrics, std::move(lock)));
}

int64_t RunDirectory::StepAfterLastLine(const std::string& path, int64_t from) {
  int64_t after = from;
  std::ifstream in(path + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    if (const std::optional<int64_t> step = StepOfLine(line)) after = std::max(after, *step + 1);
  }
  return after;
}

RunDirectory::~RunDirectory() { std::fclose(metrics_); }

absl::Status RunDirectory::AppendMetrics(const std::string& json_line) {
  const std::string line = json_line + "\n";
  if (std::fwrite(line.data(), 1, line.size(), metrics_) != line.size() ||
      std::fflush(metrics_) != 0) {
    return absl::DataLossError(
        absl::StrCat("cannot append to '", path_, "/metrics.jsonl': ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

}  // namespace hetpar
