#include "common/atomic_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <functional>
#include <random>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/errno_status.h"
#include "common/status.h"

namespace hetpar {
namespace {

// Bytes per write call.
constexpr size_t kChunkBytes = size_t{1} << 26;

// "<path>.tmp-" and six random letters or digits.
std::string RandomTemporaryName(const std::string& path) {
  static constexpr char kChars[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
  thread_local std::mt19937_64 rng(std::random_device{}() ^
                                   (static_cast<uint64_t>(::getpid()) << 32) ^
                                   std::hash<std::thread::id>{}(std::this_thread::get_id()));
  std::string name = absl::StrCat(path, ".tmp-");
  for (int i = 0; i < 6; ++i) name.push_back(kChars[rng() % (sizeof(kChars) - 1)]);
  return name;
}

// Gives the unnamed (O_TMPFILE) file open as `fd` a name beside `path`, to be renamed over it:
// linkat cannot replace a file.
absl::StatusOr<std::string> LinkUnnamed(int fd, const std::string& path) {
  const std::string self = absl::StrCat("/proc/self/fd/", fd);
  for (int attempt = 0; attempt < 100; ++attempt) {
    std::string temp = RandomTemporaryName(path);
    if (::linkat(AT_FDCWD, self.c_str(), AT_FDCWD, temp.c_str(), AT_SYMLINK_FOLLOW) == 0) {
      return temp;
    }
    const int err = errno;
    if (err == EEXIST) continue;
    // Without /proc: linking by the descriptor itself, which needs CAP_DAC_READ_SEARCH.
    if (::linkat(fd, "", AT_FDCWD, temp.c_str(), AT_EMPTY_PATH) == 0) return temp;
    if (errno == EEXIST) continue;
    return ErrnoStatus(err, absl::StrCat("naming the temporary file of ", path, " ", temp));
  }
  return absl::AlreadyExistsError(
      absl::StrCat("naming the temporary file of ", path, ": 100 random names were all taken"));
}

}  // namespace

absl::StatusOr<std::unique_ptr<AtomicFileWriter>> AtomicFileWriter::Create(
    const std::string& path, const AtomicFileOptions& options) {
  const std::filesystem::path target(path);
  if (target.has_parent_path()) {
    std::error_code error;
    std::filesystem::create_directories(target.parent_path(), error);
    if (error) {
      return ErrnoStatus(error.value(), absl::StrCat("creating the directory of ", path));
    }
  }
  const std::string dir = target.has_parent_path() ? target.parent_path().string() : ".";
  // An unnamed file is named through /proc/self/fd once it is whole (LinkUnnamed): without /proc
  // (or with it hidden) only a process with CAP_DAC_READ_SEARCH could, so it is named from the
  // start.
  static const bool can_link = ::access("/proc/self/fd", X_OK) == 0;
  int fd = options.unnamed_temporary && can_link
               ? ::open(dir.c_str(), O_TMPFILE | O_WRONLY | O_CLOEXEC, options.mode)
               : -1;
  if (fd >= 0) {
    return std::unique_ptr<AtomicFileWriter>(new AtomicFileWriter(path, "", fd, options.durable));
  }
  // No O_TMPFILE on this file system (or no /proc): a named temporary file, which a killed
  // process leaves.
  for (int attempt = 0; attempt < 100; ++attempt) {
    std::string temp = RandomTemporaryName(path);
    fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, options.mode);
    if (fd >= 0) {
      return std::unique_ptr<AtomicFileWriter>(
          new AtomicFileWriter(path, std::move(temp), fd, options.durable));
    }
    if (errno != EEXIST) {
      const int err = errno;
      return ErrnoStatus(err, absl::StrCat("creating a temporary file for ", path));
    }
  }
  return absl::AlreadyExistsError(
      absl::StrCat("creating a temporary file for ", path, ": 100 random names were all taken"));
}

AtomicFileWriter::~AtomicFileWriter() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_ && !temp_.empty()) ::unlink(temp_.c_str());
}

std::string AtomicFileWriter::TemporaryName() const {
  return temp_.empty() ? absl::StrCat(path_, " (its unnamed temporary file)") : temp_;
}

absl::Status AtomicFileWriter::Append(const void* data, size_t bytes) {
  crc_ = static_cast<uint32_t>(crc32_z(crc_, static_cast<const Bytef*>(data), bytes));
  bytes_ += bytes;
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::write(fd_, p, std::min(bytes, kChunkBytes));
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      return ErrnoStatus(err, absl::StrCat("writing ", TemporaryName()));
    }
    p += n;
    bytes -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::Status AtomicFileWriter::Commit() {
  if (durable_ && ::fsync(fd_) != 0) {
    const int err = errno;
    return ErrnoStatus(err, absl::StrCat("syncing ", TemporaryName()));
  }
  if (temp_.empty()) {
    HETPAR_ASSIGN_OR_RETURN(temp_, LinkUnnamed(fd_, path_));
  }
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) {
    const int err = errno;
    return ErrnoStatus(err, absl::StrCat("closing ", temp_));
  }
  if (::rename(temp_.c_str(), path_.c_str()) != 0) {
    const int err = errno;
    return ErrnoStatus(err, absl::StrCat("renaming ", temp_, " to ", path_));
  }
  committed_ = true;
  if (!durable_) return absl::OkStatus();
  std::string dir = std::filesystem::path(path_).parent_path().string();
  return SyncDirectory(dir.empty() ? "." : dir);
}

absl::Status SyncDirectory(const std::string& dir) {
  const int dir_fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd < 0) {
    const int err = errno;
    return ErrnoStatus(err, absl::StrCat("opening directory ", dir));
  }
  const int synced = ::fsync(dir_fd);
  const int err = errno;
  ::close(dir_fd);
  if (synced != 0) return ErrnoStatus(err, absl::StrCat("syncing directory ", dir));
  return absl::OkStatus();
}

absl::Status WriteFileAtomically(const std::string& path, const std::string& contents,
                                 const AtomicFileOptions& options) {
  HETPAR_ASSIGN_OR_RETURN(std::unique_ptr<AtomicFileWriter> file,
                          AtomicFileWriter::Create(path, options));
  HETPAR_RETURN_IF_ERROR(file->Append(contents.data(), contents.size()));
  return file->Commit();
}

}  // namespace hetpar
