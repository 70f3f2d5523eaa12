// Files that appear whole or not at all: written to a temporary file of a unique name beside the
// target ("<path>.tmp-XXXXXX", so several threads or processes may write the same path at once),
// fsynced, renamed over the target, and the directory fsynced. A reader sees the old file or the
// whole new one; a failed or abandoned write leaves no temporary file behind.
//
//   HETPAR_ASSIGN_OR_RETURN(auto file, AtomicFileWriter::Create(path));
//   HETPAR_RETURN_IF_ERROR(file->Append(data, bytes));
//   HETPAR_RETURN_IF_ERROR(file->Commit());
#ifndef HETPAR_COMMON_ATOMIC_FILE_H_
#define HETPAR_COMMON_ATOMIC_FILE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace hetpar {

// The size and zlib CRC-32 of a file, summed while it was written.
struct WrittenFile {
  uint64_t bytes = 0;
  uint32_t crc32 = 0;
};

// Append, then Commit. Destroyed without a successful Commit, it removes the temporary file.
// One thread uses a writer.
class AtomicFileWriter {
 public:
  // Creates missing parent directories and the temporary file.
  static absl::StatusOr<std::unique_ptr<AtomicFileWriter>> Create(const std::string& path);
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;
  ~AtomicFileWriter();

  absl::Status Append(const void* data, size_t bytes);
  // fsync, rename over the target, fsync of the directory.
  absl::Status Commit();
  // What was appended: the file's size and checksum once committed.
  WrittenFile written() const { return {bytes_, crc_}; }

 private:
  AtomicFileWriter(std::string path, std::string temp, int fd)
      : path_(std::move(path)), temp_(std::move(temp)), fd_(fd) {}

  std::string path_;
  std::string temp_;
  int fd_;
  bool committed_ = false;
  uint32_t crc_ = 0;
  uint64_t bytes_ = 0;
};

// fsync of the directory `dir`: the entries created, renamed or removed in it so far survive a
// crash.
absl::Status SyncDirectory(const std::string& dir);

// `contents` as the whole of `path`, through an AtomicFileWriter.
absl::Status WriteFileAtomically(const std::string& path, const std::string& contents);

}  // namespace hetpar

#endif  // HETPAR_COMMON_ATOMIC_FILE_H_
