// Small file helpers for the data pipeline: whole-file reads (atomic writes are
// common/atomic_file.h's), and the
// (size, modification time) stamp that data index files are validated against.
#ifndef HETPAR_COMMON_DATA_FILE_UTIL_H_
#define HETPAR_COMMON_DATA_FILE_UTIL_H_

#include <atomic>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/atomic_file.h"  // WriteFileAtomically, for the data files written

namespace hetpar::data {

// Whether `cancel` (set from another thread to end a long read or build) has turned true; never
// when it is null.
inline bool IsCancelled(const std::atomic<bool>* cancel) {
  return cancel != nullptr && cancel->load(std::memory_order_acquire);
}

// Size and modification time of a file, as stat(2) reports them.
struct FileStamp {
  int64_t size = 0;
  int64_t mtime_ns = 0;
  bool operator==(const FileStamp& other) const {
    return size == other.size && mtime_ns == other.mtime_ns;
  }
  bool operator!=(const FileStamp& other) const { return !(*this == other); }
};

// NotFound when `path` does not exist; FailedPrecondition when it is not a regular file.
absl::StatusOr<FileStamp> StatFile(const std::string& path);

// The whole file; NotFound / PermissionDenied / DataLoss name the path.
// Refuses (ResourceExhausted) a file longer than `max_bytes`, reading no more than one byte past
// it: a path naming /dev/zero or a huge file costs no more memory than that.
absl::StatusOr<std::string> ReadFileToString(const std::string& path,
                                             int64_t max_bytes = INT64_MAX);

// Flushes the file system that holds `path` (syncfs(2)).
absl::Status SyncFileSystem(const std::string& path);

// Creates `path` and its parents if missing.
absl::Status MakeDirectories(const std::string& path);

// An flock on the file `path` (created when missing), held while the object lives: of the
// processes that would make the same files (a synthetic data set, a data index), one does while
// the others wait for it and then use what it made. Where the lock file cannot be opened (a
// read-only data set, another user's directory) or the file system has no locks, the work goes
// on without it: a warning, unless `quiet_when_unlockable`, and a lock that holds nothing.
class WaitedFileLock {
 public:
  // Waits for another holder, logging once that it does; `doing` is what a holder does
  // ("generating the synthetic data set of data/train.jsonl"). Cancelled as soon as *cancel
  // turns true; DeadlineExceeded, naming the lock, after `timeout`.
  static absl::StatusOr<WaitedFileLock> Take(const std::string& path, const std::string& doing,
                                             absl::Duration timeout,
                                             const std::atomic<bool>* cancel = nullptr,
                                             bool quiet_when_unlockable = false);
  WaitedFileLock(WaitedFileLock&& other) noexcept;
  WaitedFileLock& operator=(WaitedFileLock&&) = delete;
  ~WaitedFileLock();  // releases the lock

  bool held() const { return fd_ >= 0; }

 private:
  WaitedFileLock() = default;
  int fd_ = -1;
};

}  // namespace hetpar::data

#endif  // HETPAR_COMMON_DATA_FILE_UTIL_H_
