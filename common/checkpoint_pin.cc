#include "common/checkpoint_pin.h"

#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <system_error>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/atomic_file.h"
#include "common/errno_status.h"
#include "common/status.h"

namespace hetpar {
namespace {

std::string PinPath(const std::string& dir) {
  return (std::filesystem::path(dir) / kCheckpointPinFile).string();
}

}  // namespace

std::string PrunedCheckpointOrigin(const std::string& name) {
  constexpr size_t kSuffix = 17;  // "-" and 16 hex digits
  const size_t prefix = sizeof(kPrunedCheckpointPrefix) - 1;
  if (name.rfind(kPrunedCheckpointPrefix, 0) != 0 || name.size() <= prefix + kSuffix ||
      name[name.size() - kSuffix] != '-') {
    return "";
  }
  const std::string origin = name.substr(prefix, name.size() - prefix - kSuffix);
  if (origin.rfind(kCheckpointDirPrefix, 0) != 0) return "";
  for (size_t i = name.size() - kSuffix + 1; i < name.size(); ++i) {
    if (!absl::ascii_isxdigit(name[i])) return "";
  }
  return origin;
}

absl::Status PinCheckpoint(const std::string& dir, const std::string& holder) {
  // Written in place, not through a temporary file and a rename, which would make the directory
  // again were it pruned meanwhile: only the pin's existence counts.
  const std::string path = PinPath(dir);
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoStatus(errno, absl::StrCat("pinning checkpoint ", dir));
  const std::string text = holder + "\n";
  const ssize_t wrote = ::write(fd, text.data(), text.size());
  const int write_error = errno;
  const int synced = ::fsync(fd);
  const int sync_error = errno;
  ::close(fd);
  if (wrote != static_cast<ssize_t>(text.size())) {
    return ErrnoStatus(wrote < 0 ? write_error : EIO, absl::StrCat("writing the pin ", path));
  }
  if (synced != 0) return ErrnoStatus(sync_error, absl::StrCat("writing the pin ", path));
  return Annotate(SyncDirectory(dir), absl::StrCat("pinning checkpoint ", dir));
}

PinState CheckpointPinState(const std::string& dir) {
  struct stat st;
  if (::stat(PinPath(dir).c_str(), &st) == 0) return PinState::kPinned;
  return errno == ENOENT || errno == ENOTDIR ? PinState::kNotPinned : PinState::kUnknown;
}

bool IsCheckpointPinned(const std::string& dir) {
  return CheckpointPinState(dir) != PinState::kNotPinned;
}

absl::Status PutBackCheckpoint(const std::string& taken, const std::string& origin) {
  int renamed = ::renameat2(AT_FDCWD, taken.c_str(), AT_FDCWD, origin.c_str(), RENAME_NOREPLACE);
  if (renamed != 0 && errno == EINVAL) {
    // A file system without RENAME_NOREPLACE: a plain rename, unless `origin` is there.
    struct stat st;
    if (::lstat(origin.c_str(), &st) == 0) return absl::OkStatus();
    renamed = ::rename(taken.c_str(), origin.c_str());
  }
  if (renamed == 0 || errno == ENOENT || errno == EEXIST || errno == ENOTEMPTY) {
    return absl::OkStatus();
  }
  return ErrnoStatus(errno,
                     absl::StrCat("putting back the checkpoint ", origin, " (now ", taken, ")"));
}

absl::StatusOr<bool> PutBackPinnedCheckpoint(const std::string& dir) {
  std::filesystem::path path = std::filesystem::path(dir).lexically_normal();
  if (!path.has_filename()) path = path.parent_path();  // "…/step-000006/"
  const std::filesystem::path parent = path.parent_path().empty() ? "." : path.parent_path();
  std::error_code error;
  for (std::filesystem::directory_iterator it(parent, error), end; !error && it != end;
       it.increment(error)) {
    // Pinned for sure: one whose pin cannot be told is left to the pruners.
    if (PrunedCheckpointOrigin(it->path().filename().string()) != path.filename().string() ||
        CheckpointPinState(it->path().string()) != PinState::kPinned) {
      continue;
    }
    HETPAR_RETURN_IF_ERROR(PutBackCheckpoint(it->path().string(), path.string()));
    std::error_code kind_error;
    if (std::filesystem::is_directory(path, kind_error)) break;
  }
  if (error) {
    return ErrnoStatus(error.value(), absl::StrCat("listing checkpoints in ", parent.string()));
  }
  return std::filesystem::is_directory(path, error);
}

absl::Status UnpinCheckpoints(const std::string& parent, const std::string& except) {
  std::filesystem::path except_dir = std::filesystem::path(except).lexically_normal();
  if (!except_dir.has_filename()) except_dir = except_dir.parent_path();  // "…/step-000006/"
  const std::string kept = except.empty() ? "" : except_dir.filename().string();
  std::error_code error;
  if (!std::filesystem::exists(parent, error)) {
    if (!error) return absl::OkStatus();
    return ErrnoStatus(error.value(), absl::StrCat("listing checkpoints in ", parent));
  }
  // Not a range-for: its increment throws on an error (a file system that stops answering).
  for (std::filesystem::directory_iterator it(parent, error), end; !error && it != end;
       it.increment(error)) {
    const std::string name = it->path().filename().string();
    const std::string origin = PrunedCheckpointOrigin(name);
    if (name == kept || (!origin.empty() && origin == kept) ||
        (name.rfind(kCheckpointDirPrefix, 0) != 0 && origin.empty())) {
      continue;
    }
    const std::string pin = PinPath(it->path().string());
    if (::unlink(pin.c_str()) != 0 && errno != ENOENT && errno != ENOTDIR) {
      return ErrnoStatus(errno, absl::StrCat("removing the pin ", pin));
    }
  }
  if (error) return ErrnoStatus(error.value(), absl::StrCat("listing checkpoints in ", parent));
  return absl::OkStatus();
}

}  // namespace hetpar
