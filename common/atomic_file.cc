#include "common/atomic_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/errno_status.h"
#include "common/status.h"

namespace hetpar {
namespace {

// Bytes per write call.
constexpr size_t kChunkBytes = size_t{1} << 26;

}  // namespace

absl::StatusOr<std::unique_ptr<AtomicFileWriter>> AtomicFileWriter::Create(
    const std::string& path) {
  const std::filesystem::path target(path);
  if (target.has_parent_path()) {
    std::error_code error;
    std::filesystem::create_directories(target.parent_path(), error);
    if (error) {
      return ErrnoStatus(error.value(), absl::StrCat("creating the directory of ", path));
    }
  }
  std::string temp = absl::StrCat(path, ".tmp-XXXXXX");
  const int fd = ::mkostemp(temp.data(), O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, absl::StrCat("creating a temporary file for ", path));
  std::unique_ptr<AtomicFileWriter> writer(new AtomicFileWriter(path, std::move(temp), fd));
  // mkostemp creates it 0600; the target is an ordinary file.
  if (::fchmod(fd, 0644) != 0) {
    return ErrnoStatus(errno, absl::StrCat("setting the mode of ", writer->temp_));
  }
  return writer;
}

AtomicFileWriter::~AtomicFileWriter() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_) ::unlink(temp_.c_str());
}

absl::Status AtomicFileWriter::Append(const void* data, size_t bytes) {
  crc_ = static_cast<uint32_t>(crc32_z(crc_, static_cast<const Bytef*>(data), bytes));
  bytes_ += bytes;
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::write(fd_, p, std::min(bytes, kChunkBytes));
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, absl::StrCat("writing ", temp_));
    }
    p += n;
    bytes -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::Status AtomicFileWriter::Commit() {
  if (::fsync(fd_) != 0) return ErrnoStatus(errno, absl::StrCat("syncing ", temp_));
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) return ErrnoStatus(errno, absl::StrCat("closing ", temp_));
  if (::rename(temp_.c_str(), path_.c_str()) != 0) {
    return ErrnoStatus(errno, absl::StrCat("renaming ", temp_, " to ", path_));
  }
  committed_ = true;
  std::string dir = std::filesystem::path(path_).parent_path().string();
  return SyncDirectory(dir.empty() ? "." : dir);
}

absl::Status SyncDirectory(const std::string& dir) {
  const int dir_fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd < 0) return ErrnoStatus(errno, absl::StrCat("opening directory ", dir));
  const int synced = ::fsync(dir_fd);
  const int err = errno;
  ::close(dir_fd);
  if (synced != 0) return ErrnoStatus(err, absl::StrCat("syncing directory ", dir));
  return absl::OkStatus();
}

absl::Status WriteFileAtomically(const std::string& path, const std::string& contents) {
  HETPAR_ASSIGN_OR_RETURN(std::unique_ptr<AtomicFileWriter> file, AtomicFileWriter::Create(path));
  HETPAR_RETURN_IF_ERROR(file->Append(contents.data(), contents.size()));
  return file->Commit();
}

}  // namespace hetpar
