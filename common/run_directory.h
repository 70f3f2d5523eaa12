// A run's output directory, as `hetpar run` writes it and `hetpar compare` reads it:
//
//   config.yaml     the normalised RunSpec the run used
//   metrics.jsonl   one JSON object per line: one per committed step
//                   {"step", "loss", "grad_norm", "tokens", "images", "step_time_s", ...},
//                   and at the end {"final_params": {"encoder": {"sum", "l2"}, "llm": {...}}}
//                   and {"eval": {...}} lines
//   log/            the processes' logs (coordinator, workers)
//
// Lines are appended whole and flushed, so a reader never sees half a line of a live run.
#ifndef HETPAR_COMMON_RUN_DIRECTORY_H_
#define HETPAR_COMMON_RUN_DIRECTORY_H_

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "hetpar/v1/run_spec.pb.h"

namespace hetpar {

// An flock on a file in a directory, held while the object lives: one hetpar process at a time
// uses the directory (a run directory, a checkpoint.dir). The file holds the holder's "pid N" and
// what it adds, which a refused process's message names.
class DirectoryLock {
 public:
  // Takes `dir`/`file` (`dir` must exist). Another process holding it: FailedPrecondition,
  // "<what> <dir> is in use by another hetpar process (pid N, <holder>): <remedy>". A file
  // system without locks: a warning, and a lock that holds nothing.
  static absl::StatusOr<std::unique_ptr<DirectoryLock>> Take(const std::string& dir,
                                                             const std::string& file,
                                                             const std::string& what,
                                                             const std::string& remedy,
                                                             const std::string& holder = "");
  ~DirectoryLock();  // releases the lock
  DirectoryLock(const DirectoryLock&) = delete;
  DirectoryLock& operator=(const DirectoryLock&) = delete;

 private:
  explicit DirectoryLock(int fd) : fd_(fd) {}
  int fd_;
};

class RunDirectory {
 public:
  // Both hold `path`/.lock (flock) while the RunDirectory lives: another process's Create or
  // Continue on the same directory (a second coordinator, a run with the same out_dir) fails
  // with FailedPrecondition before it changes anything.
  //
  // Creates `path` (and log/) when absent, writes config.yaml and truncates metrics.jsonl.
  static absl::StatusOr<std::unique_ptr<RunDirectory>> Create(const std::string& path,
                                                              const hetpar::v1::RunSpec& spec);
  // A run continued from step `first_step` (a coordinator restarted on its journal): writes
  // config.yaml and keeps the lines of metrics.jsonl of the steps before `first_step` and of
  // the pool changes before them (later steps are trained again and their lines written again;
  // the end-of-run lines go), then appends.
  static absl::StatusOr<std::unique_ptr<RunDirectory>> Continue(const std::string& path,
                                                                const hetpar::v1::RunSpec& spec,
                                                                int64_t first_step);
  // The step after the newest step that has a line in `path`/metrics.jsonl, and at least
  // `from` (the run's first step): where the file's record of the run ends. A gap before it (an
  // earlier restart that could not fill one) does not count.
  static int64_t StepAfterLastLine(const std::string& path, int64_t from);
  ~RunDirectory();
  RunDirectory(const RunDirectory&) = delete;
  RunDirectory& operator=(const RunDirectory&) = delete;

  const std::string& path() const { return path_; }
  std::string LogPath(const std::string& name) const { return path_ + "/log/" + name + ".log"; }

  // Appends one line (a JSON object without the newline) to metrics.jsonl and flushes it.
  absl::Status AppendMetrics(const std::string& json_line);

 private:
  RunDirectory(std::string path, std::FILE* metrics, std::unique_ptr<DirectoryLock> lock)
      : path_(std::move(path)), metrics_(metrics), lock_(std::move(lock)) {}
  std::string path_;
  std::FILE* metrics_;
  std::unique_ptr<DirectoryLock> lock_;  // this process's hold on the directory (.lock)
};

}  // namespace hetpar

#endif  // HETPAR_COMMON_RUN_DIRECTORY_H_
