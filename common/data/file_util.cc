#include "common/data/file_util.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/atomic_file.h"
#include "common/logging.h"

namespace hetpar::data {
namespace {

namespace fs = std::filesystem;

absl::Status ErrnoStatus(int err, const std::string& what, const std::string& path) {
  std::string message = absl::StrCat(what, " ", path, ": ", std::strerror(err));
  switch (err) {
    case ENOENT:
    case ENOTDIR:
      return absl::NotFoundError(message);
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(message);
    case ENOSPC:
    case EDQUOT:
      return absl::ResourceExhaustedError(message);
    default:
      return absl::InternalError(message);
  }
}

}  // namespace

absl::StatusOr<FileStamp> StatFile(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return ErrnoStatus(errno, "cannot stat", path);
  if (!S_ISREG(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(path, " is not a regular file"));
  }
  FileStamp stamp;
  stamp.size = static_cast<int64_t>(st.st_size);
  stamp.mtime_ns = static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
  return stamp;
}

absl::StatusOr<std::string> ReadFileToString(const std::string& path, int64_t max_bytes) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, "cannot open", path);
  std::string contents;
  struct stat st;
  if (::fstat(fd, &st) == 0 && st.st_size > 0) {
    contents.reserve(static_cast<size_t>(std::min<int64_t>(st.st_size, max_bytes)));
  }
  char buffer[1 << 16];
  while (true) {
    if (static_cast<int64_t>(contents.size()) > max_bytes) {
      ::close(fd);
      return absl::ResourceExhaustedError(absl::StrCat(path, " is longer than ", max_bytes,
                                                       " bytes, the most it may be"));
    }
    // At most one byte past max_bytes.
    const int64_t left = max_bytes - static_cast<int64_t>(contents.size());
    const size_t want = left >= static_cast<int64_t>(sizeof(buffer))
                            ? sizeof(buffer)
                            : static_cast<size_t>(left) + 1;
    const ssize_t n = ::read(fd, buffer, want);
    if (n == 0) break;
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      ::close(fd);
      return ErrnoStatus(err, "cannot read", path);
    }
    contents.append(buffer, static_cast<size_t>(n));
  }
  ::close(fd);
  return contents;
}

absl::Status MakeDirectories(const std::string& path) {
  if (path.empty()) return absl::OkStatus();
  std::error_code ec;
  fs::create_directories(path, ec);
  if (ec) {
    return absl::InternalError(absl::StrCat("cannot create directory ", path, ": ", ec.message()));
  }
  return absl::OkStatus();
}

absl::Status SyncFileSystem(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, "cannot open", path);
  const int rc = ::syncfs(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) return ErrnoStatus(err, "cannot sync the file system of", path);
  return absl::OkStatus();
}

absl::StatusOr<WaitedFileLock> WaitedFileLock::Take(const std::string& path,
                                                    const std::string& doing,
                                                    absl::Duration timeout,
                                                    const std::atomic<bool>* cancel,
                                                    bool quiet_when_unlockable) {
  WaitedFileLock lock;
  const auto unlocked = [&](const char* what, int error) {
    if (!quiet_when_unlockable) {
      HETPAR_LOG(WARNING) << "cannot " << what << " " << path << " (" << std::strerror(error)
                          << "): nothing keeps another process from " << doing
                          << " at the same time";
    }
    if (lock.fd_ >= 0) ::close(std::exchange(lock.fd_, -1));
    return std::move(lock);
  };
  // Read-only is enough for flock, and opens another user's lock file.
  lock.fd_ = ::open(path.c_str(), O_RDONLY | O_CREAT | O_CLOEXEC, 0644);
  if (lock.fd_ < 0) return unlocked("open", errno);
  const absl::Time deadline = absl::Now() + timeout;
  bool said = false;
  while (::flock(lock.fd_, LOCK_EX | LOCK_NB) != 0) {
    const int error = errno;
    if (error == EINTR) continue;
    if (error != EWOULDBLOCK) return unlocked("lock", error);
    if (cancel != nullptr && cancel->load(std::memory_order_acquire)) {
      return absl::CancelledError(
          absl::StrCat("stopped waiting for another process ", doing, " (", path, ")"));
    }
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "another process has held ", path, " for ", absl::FormatDuration(timeout), " ", doing,
          " (a lock ends with its process: that one is alive, and may "
          "be stuck)"));
    }
    if (!said) {
      HETPAR_LOG(INFO) << "another process is " << doing << "; waiting for it (" << path << ")";
      said = true;
    }
    absl::SleepFor(absl::Milliseconds(100));
  }
  return lock;
}

WaitedFileLock::WaitedFileLock(WaitedFileLock&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)) {}

WaitedFileLock::~WaitedFileLock() {
  if (fd_ >= 0) ::close(fd_);  // releases the flock
}

}  // namespace hetpar::data
