// Files that appear whole or not at all: written to a temporary file beside the target, fsynced,
// renamed over the target, and the directory fsynced. A reader sees the old file or the whole new
// one; several threads or processes may write the same path at once (the last rename wins).
//
// Where the file system has O_TMPFILE (ext4, XFS, btrfs, tmpfs) the temporary file has no name
// until it is complete: a process killed while it writes leaves nothing behind, and the file is
// given a name, "<path>" + ".tmp-" + six random characters, only for the moment between its link
// and its rename. On a file system without O_TMPFILE (NFS), or in a process without /proc (through
// which the unnamed file gets its name), the temporary file is named so from the start, and a
// killed writer leaves it. A write that fails or is abandoned removes its temporary file either
// way.
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

struct AtomicFileOptions {
  // Permission bits of the new file, less the umask; the file is never more open than that, not
  // even while it is written (0600 for a file holding a secret).
  int mode = 0644;
  // false: no fsync of the file or the directory, for many small files made durable at once
  // (data::SyncFileSystem); a reader still never sees a part of the file.
  bool durable = true;
  // false: a named temporary file from the start, as on a file system without O_TMPFILE.
  bool unnamed_temporary = true;
};

// Append, then Commit. Destroyed without a successful Commit, it removes the temporary file.
// One thread uses a writer.
class AtomicFileWriter {
 public:
  // Creates missing parent directories and the temporary file.
  static absl::StatusOr<std::unique_ptr<AtomicFileWriter>> Create(
      const std::string& path, const AtomicFileOptions& options = {});
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;
  ~AtomicFileWriter();

  absl::Status Append(const void* data, size_t bytes);
  // fsync, rename over the target, fsync of the directory (without the fsyncs when not
  // options.durable).
  absl::Status Commit();
  // What was appended: the file's size and checksum once committed.
  WrittenFile written() const { return {bytes_, crc_}; }

 private:
  AtomicFileWriter(std::string path, std::string temp, int fd, bool durable)
      : path_(std::move(path)), temp_(std::move(temp)), fd_(fd), durable_(durable) {}

  // The temporary file, for messages.
  std::string TemporaryName() const;

  std::string path_;
  std::string temp_;  // empty while the temporary file has no name (O_TMPFILE)
  int fd_;
  bool durable_;
  bool committed_ = false;
  uint32_t crc_ = 0;
  uint64_t bytes_ = 0;
};

// fsync of the directory `dir`: the entries created, renamed or removed in it so far survive a
// crash.
absl::Status SyncDirectory(const std::string& dir);

// `contents` as the whole of `path`, through an AtomicFileWriter.
absl::Status WriteFileAtomically(const std::string& path, const std::string& contents,
                                 const AtomicFileOptions& options = {});

}  // namespace hetpar

#endif  // HETPAR_COMMON_ATOMIC_FILE_H_
