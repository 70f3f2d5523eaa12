#include "common/nn/export.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/atomic_file.h"
#include "common/errno_status.h"
#include "common/nn/torch_status.h"
#include "common/status.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "the parameter file stores little-endian integers and tensor bytes");

namespace hetpar::nn {
namespace {

constexpr char kMagic[8] = {'H', 'E', 'T', 'P', 'A', 'R', 'A', 'M'};
constexpr uint32_t kVersion = 1;
constexpr int64_t kHeaderBytes = 32;
constexpr uint32_t kMaxNameBytes = 65536;
constexpr uint8_t kMaxDims = 16;
// Writes and reads move at most this many bytes per system call.
constexpr size_t kChunkBytes = size_t{1} << 26;

uint32_t Crc(uint32_t crc, const void* data, size_t bytes) {
  return static_cast<uint32_t>(crc32_z(crc, static_cast<const Bytef*>(data), bytes));
}

absl::StatusOr<uint8_t> DtypeCode(at::ScalarType dtype, const std::string& name) {
  switch (dtype) {
    case at::kFloat:
      return 1;
    case at::kDouble:
      return 2;
    case at::kBFloat16:
      return 3;
    case at::kHalf:
      return 4;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("parameter '", name, "' has dtype ", DtypeName(dtype),
                       "; a parameter file holds float32, float64, bfloat16 or float16"));
  }
}

template <typename T>
void Put(std::string* out, T value) {
  out->append(reinterpret_cast<const char*>(&value), sizeof(value));
}

template <typename T>
T Get(const char* bytes) {
  T value;
  std::memcpy(&value, bytes, sizeof(value));
  return value;
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// Random-access reads of a parameter file; reading past its end is DataLoss ("truncated").
class FileReader {
 public:
  static absl::StatusOr<std::unique_ptr<FileReader>> Open(const std::string& path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return ErrnoStatus(errno, absl::StrCat("opening parameter file ", path));
    struct stat st;
    if (::fstat(fd, &st) != 0) {
      const int err = errno;
      ::close(fd);
      return ErrnoStatus(err, absl::StrCat("reading the size of ", path));
    }
    if (!S_ISREG(st.st_mode)) {
      ::close(fd);
      return absl::InvalidArgumentError(absl::StrCat(path, " is not a regular file"));
    }
    return std::unique_ptr<FileReader>(new FileReader(path, fd, st.st_size));
  }

  FileReader(const FileReader&) = delete;
  FileReader& operator=(const FileReader&) = delete;
  ~FileReader() { ::close(fd_); }

  int64_t size() const { return size_; }
  const std::string& path() const { return path_; }

  // Reads [offset, offset + bytes) for `what` (e.g. "parameter 'x'").
  absl::Status Read(int64_t offset, void* dst, int64_t bytes, const std::string& what) const {
    if (offset < 0 || bytes < 0 || offset > size_ || bytes > size_ - offset) {
      return absl::DataLossError(absl::StrCat("parameter file ", path_, " is truncated: ", what,
                                              " needs bytes up to ", offset + bytes,
                                              ", the file has ", size_));
    }
    char* p = static_cast<char*>(dst);
    while (bytes > 0) {
      const ssize_t n = ::pread(fd_, p, std::min(static_cast<size_t>(bytes), kChunkBytes), offset);
      if (n < 0) {
        if (errno == EINTR) continue;
        return ErrnoStatus(errno, absl::StrCat("reading ", what, " from ", path_));
      }
      if (n == 0) {
        return absl::DataLossError(absl::StrCat("parameter file ", path_, " ended while reading ",
                                                what, " at byte ", offset));
      }
      p += n;
      offset += n;
      bytes -= n;
    }
    return absl::OkStatus();
  }

 private:
  FileReader(std::string path, int fd, int64_t size)
      : path_(std::move(path)), fd_(fd), size_(size) {}

  std::string path_;
  int fd_;
  int64_t size_;
};

// Where one entry lies in the file.
struct Entry {
  std::string name;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
  int64_t begin = 0;        // first byte of the entry
  int64_t data_offset = 0;  // first byte of the tensor
  int64_t data_bytes = 0;
  uint32_t crc = 0;  // stored checksum
};

absl::Status Malformed(const FileReader& file, const std::string& what, const std::string& why) {
  return absl::DataLossError(
      absl::StrCat("parameter file ", file.path(), " is malformed at ", what, ": ", why));
}

// Reads the header and every entry's description (not its tensor bytes).
absl::StatusOr<std::vector<Entry>> ReadIndex(const FileReader& file) {
  char header[kHeaderBytes];
  if (file.size() < kHeaderBytes) {
    return absl::DataLossError(
        absl::StrCat("parameter file ", file.path(), " is truncated: ", file.size(),
                     " bytes, shorter than its ", kHeaderBytes, "-byte header"));
  }
  HETPAR_RETURN_IF_ERROR(file.Read(0, header, kHeaderBytes, "the header"));
  if (std::memcmp(header, kMagic, sizeof(kMagic)) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        file.path(), " is not a hetpar parameter file (it does not start with \"HETPARAM\")"));
  }
  if (Get<uint32_t>(header + 24) != Crc(0, header, 24)) {
    return absl::DataLossError(
        absl::StrCat("parameter file ", file.path(), " has a corrupt header (checksum)"));
  }
  const uint32_t version = Get<uint32_t>(header + 8);
  if (version != kVersion) {
    return absl::InvalidArgumentError(absl::StrCat("parameter file ", file.path(), " has version ",
                                                   version, "; this build reads version ",
                                                   kVersion));
  }
  const uint64_t count = Get<uint64_t>(header + 16);
  std::vector<Entry> entries;
  int64_t offset = kHeaderBytes;
  for (uint64_t i = 0; i < count; ++i) {
    Entry e;
    e.begin = offset;
    const std::string where = absl::StrCat("entry #", i);
    uint32_t name_bytes = 0;
    HETPAR_RETURN_IF_ERROR(file.Read(offset, &name_bytes, 4, where));
    if (name_bytes == 0 || name_bytes > kMaxNameBytes) {
      return Malformed(file, where,
                       absl::StrCat("name length ", name_bytes, ", expected 1..", kMaxNameBytes));
    }
    e.name.resize(name_bytes);
    HETPAR_RETURN_IF_ERROR(file.Read(offset + 4, e.name.data(), name_bytes, where));
    offset += 4 + name_bytes;
    const std::string what = absl::StrCat("parameter '", e.name, "' (", where, ")");
    char dims_header[4];
    HETPAR_RETURN_IF_ERROR(file.Read(offset, dims_header, 4, what));
    if (!DtypeOfCode(static_cast<uint8_t>(dims_header[0]), &e.dtype)) {
      return Malformed(
          file, what,
          absl::StrCat("dtype code ", static_cast<int>(static_cast<uint8_t>(dims_header[0])),
                       ", expected 1..4"));
    }
    const uint8_t dims = static_cast<uint8_t>(dims_header[1]);
    if (dims > kMaxDims) {
      return Malformed(file, what, absl::StrCat(static_cast<int>(dims), " dims, expected <= 16"));
    }
    offset += 4;
    e.shape.resize(dims);
    HETPAR_RETURN_IF_ERROR(file.Read(offset, e.shape.data(), 8 * dims, what));
    offset += 8 * dims;
    const int64_t element_bytes = static_cast<int64_t>(c10::elementSize(e.dtype));
    int64_t elements = 1;
    for (int64_t d : e.shape) {
      if (d < 0 || (d > 0 && elements > (int64_t{1} << 56) / d)) {
        return Malformed(file, what, absl::StrCat("shape ", ShapeString(e.shape)));
      }
      elements *= d;
    }
    uint64_t data_bytes = 0;
    HETPAR_RETURN_IF_ERROR(file.Read(offset, &data_bytes, 8, what));
    offset += 8;
    if (data_bytes != static_cast<uint64_t>(elements * element_bytes)) {
      return Malformed(
          file, what,
          absl::StrCat(data_bytes, " data bytes for shape ", ShapeString(e.shape), " of ",
                       DtypeName(e.dtype), ", expected ", elements * element_bytes));
    }
    e.data_offset = offset;
    e.data_bytes = static_cast<int64_t>(data_bytes);
    HETPAR_RETURN_IF_ERROR(file.Read(offset + e.data_bytes, &e.crc, 4, what));
    offset += e.data_bytes + 4;
    entries.push_back(std::move(e));
  }
  if (offset != file.size()) {
    return absl::DataLossError(absl::StrCat("parameter file ", file.path(), " has ",
                                            file.size() - offset, " bytes after its ", count,
                                            " entries; expected none"));
  }
  return entries;
}

// The entry's full tensor, its checksum verified.
absl::StatusOr<at::Tensor> ReadTensor(const FileReader& file, const Entry& e) {
  const std::string what = absl::StrCat("parameter '", e.name, "'");
  std::string meta(static_cast<size_t>(e.data_offset - e.begin), '\0');
  HETPAR_RETURN_IF_ERROR(file.Read(e.begin, meta.data(), static_cast<int64_t>(meta.size()), what));
  HETPAR_ASSIGN_OR_RETURN(at::Tensor tensor, RunTorchOr(absl::StrCat("allocating ", what), [&] {
                            return at::empty(e.shape, at::TensorOptions().dtype(e.dtype));
                          }));
  HETPAR_RETURN_IF_ERROR(file.Read(e.data_offset, tensor.data_ptr(), e.data_bytes, what));
  uint32_t crc = Crc(0, meta.data(), meta.size());
  crc = Crc(crc, tensor.data_ptr(), static_cast<size_t>(e.data_bytes));
  if (crc != e.crc) {
    return absl::DataLossError(absl::StrCat("parameter file ", file.path(), ": ", what,
                                            " fails its checksum (stored ", e.crc, ", computed ",
                                            crc, "); the file is corrupt"));
  }
  return tensor;
}

// One entry: the bytes before the tensor, the tensor's bytes, the checksum.
// `blocks`, when given, receives the CRC-32 of each kDataBlockBytes block of the tensor data, from
// the same pass that sums the entry's CRC-32 (combined with crc32_combine).
absl::Status WriteEntry(AtomicFileWriter& file, const std::string& name, const at::Tensor& full,
                        std::vector<uint32_t>* blocks = nullptr) {
  HETPAR_ASSIGN_OR_RETURN(uint8_t code, DtypeCode(full.scalar_type(), name));
  std::string meta;
  Put<uint32_t>(&meta, static_cast<uint32_t>(name.size()));
  meta += name;
  Put<uint8_t>(&meta, code);
  Put<uint8_t>(&meta, static_cast<uint8_t>(full.dim()));
  Put<uint16_t>(&meta, 0);
  for (int64_t d : full.sizes()) Put<int64_t>(&meta, d);
  const size_t data_bytes = full.numel() * full.element_size();
  Put<uint64_t>(&meta, data_bytes);
  uint32_t crc = Crc(0, meta.data(), meta.size());
  if (blocks == nullptr) {
    crc = Crc(crc, full.data_ptr(), data_bytes);
  } else {
    blocks->clear();
    const auto* data = static_cast<const char*>(full.data_ptr());
    for (size_t begin = 0; begin < data_bytes; begin += kDataBlockBytes) {
      const size_t n = std::min<size_t>(kDataBlockBytes, data_bytes - begin);
      const uint32_t block = Crc(0, data + begin, n);
      blocks->push_back(block);
      crc = static_cast<uint32_t>(crc32_combine(crc, block, static_cast<z_off_t>(n)));
    }
  }
  HETPAR_RETURN_IF_ERROR(file.Append(meta.data(), meta.size()));
  HETPAR_RETURN_IF_ERROR(file.Append(full.data_ptr(), data_bytes));
  return file.Append(&crc, sizeof(crc));
}

absl::Status CheckNames(const ParameterSet& params) {
  for (const NamedParameter& p : params.parameters()) {
    if (p.name.empty() || p.name.size() > kMaxNameBytes) {
      return absl::InvalidArgumentError(absl::StrCat("parameter name '", p.name, "' has ",
                                                     p.name.size(), " bytes; expected 1..",
                                                     kMaxNameBytes));
    }
    if (p.full_shape.size() > kMaxDims) {
      return absl::InvalidArgumentError(absl::StrCat("parameter '", p.name, "' has ",
                                                     p.full_shape.size(),
                                                     " dims; a parameter file holds <= 16"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status SaveFullParameters(const ParameterSet& params, Communicator& tp,
                                const std::string& path) {
  HETPAR_RETURN_IF_ERROR(CheckNames(params));
  const bool writer = tp.rank() == 0;
  std::unique_ptr<AtomicFileWriter> file;
  absl::Status written;
  if (writer) {
    absl::StatusOr<std::unique_ptr<AtomicFileWriter>> created = AtomicFileWriter::Create(path);
    if (created.ok()) {
      file = *std::move(created);
      std::string header(kMagic, sizeof(kMagic));
      Put<uint32_t>(&header, kVersion);
      Put<uint32_t>(&header, 0);
      Put<uint64_t>(&header, params.parameters().size());
      Put<uint32_t>(&header, Crc(0, header.data(), header.size()));
      Put<uint32_t>(&header, 0);
      written = file->Append(header.data(), header.size());
    } else {
      written = created.status();
    }
  }
  // Every rank takes part in every gather even after rank 0 fails to write, so that no rank
  // waits on a collective the others skipped.
  for (const NamedParameter& p : params.parameters()) {
    HETPAR_ASSIGN_OR_RETURN(at::Tensor full, GatherFullTensor(tp, p, p.tensor.detach()));
    if (writer && written.ok()) {
      absl::StatusOr<at::Tensor> contiguous =
          RunTorchOr(absl::StrCat("exporting parameter ", p.name),
                     [&] { return full.to(at::kCPU).contiguous(); });
      written = contiguous.ok() ? WriteEntry(*file, p.name, *contiguous) : contiguous.status();
    }
  }
  if (writer && written.ok()) written = file->Commit();
  at::Tensor failed = at::full({1}, written.ok() ? 0.0 : 1.0, at::kDouble);
  HETPAR_RETURN_IF_ERROR(tp.Broadcast(failed, 0));
  if (writer) return Annotate(written, absl::StrCat("saving parameters to ", path));
  if (failed.item<double>() != 0) {
    return absl::FailedPreconditionError(absl::StrCat("TP rank 0 of group '", tp.prefix(),
                                                      "' could not write the parameter file ", path,
                                                      " (its own error says why)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<FullParameter>> ReadFullParameters(const std::string& path) {
  HETPAR_ASSIGN_OR_RETURN(std::unique_ptr<FileReader> file, FileReader::Open(path));
  HETPAR_ASSIGN_OR_RETURN(std::vector<Entry> entries, ReadIndex(*file));
  std::vector<FullParameter> out;
  for (const Entry& e : entries) {
    HETPAR_ASSIGN_OR_RETURN(at::Tensor tensor, ReadTensor(*file, e));
    out.push_back({e.name, std::move(tensor)});
  }
  return out;
}

absl::Status WriteFullParameters(const std::vector<FullParameter>& params, const std::string& path,
                                 WrittenFile* written, std::vector<EntryRange>* entries) {
  std::set<std::string> names;
  for (const FullParameter& p : params) {
    if (p.name.empty() || p.name.size() > kMaxNameBytes || !names.insert(p.name).second) {
      return absl::InvalidArgumentError(absl::StrCat("writing ", path, ": parameter name '", p.name,
                                                     "' is empty, longer than ", kMaxNameBytes,
                                                     " bytes or given twice"));
    }
  }
  HETPAR_ASSIGN_OR_RETURN(std::unique_ptr<AtomicFileWriter> file, AtomicFileWriter::Create(path));
  std::string header(kMagic, sizeof(kMagic));
  Put<uint32_t>(&header, kVersion);
  Put<uint32_t>(&header, 0);
  Put<uint64_t>(&header, params.size());
  Put<uint32_t>(&header, Crc(0, header.data(), header.size()));
  Put<uint32_t>(&header, 0);
  HETPAR_RETURN_IF_ERROR(file->Append(header.data(), header.size()));
  std::vector<EntryRange> ranges;
  for (const FullParameter& p : params) {
    HETPAR_ASSIGN_OR_RETURN(at::Tensor contiguous,
                            RunTorchOr(absl::StrCat("exporting parameter ", p.name),
                                       [&] { return p.tensor.to(at::kCPU).contiguous(); }));
    const int64_t begin = static_cast<int64_t>(file->written().bytes);
    EntryRange range;
    HETPAR_RETURN_IF_ERROR(
        WriteEntry(*file, p.name, contiguous, entries != nullptr ? &range.block_crc32 : nullptr));
    range.offset = begin;
    range.bytes = static_cast<int64_t>(file->written().bytes) - begin;
    ranges.push_back(std::move(range));
  }
  HETPAR_RETURN_IF_ERROR(Annotate(file->Commit(), absl::StrCat("saving parameters to ", path)));
  if (written != nullptr) *written = file->written();
  if (entries != nullptr) *entries = std::move(ranges);
  return absl::OkStatus();
}

bool DtypeOfCode(uint8_t code, at::ScalarType* dtype) {
  switch (code) {
    case 1:
      *dtype = at::kFloat;
      return true;
    case 2:
      *dtype = at::kDouble;
      return true;
    case 3:
      *dtype = at::kBFloat16;
      return true;
    case 4:
      *dtype = at::kHalf;
      return true;
    default:
      return false;
  }
}

absl::Status LoadFullParameters(ParameterSet& params, const std::string& path) {
  return LoadFullParameters(params, path, FileScope::kWholeModel);
}

absl::Status LoadFullParameters(ParameterSet& params, const std::string& path, FileScope scope,
                                const WholeModelHas& whole_model_has) {
  HETPAR_ASSIGN_OR_RETURN(std::unique_ptr<FileReader> file, FileReader::Open(path));
  HETPAR_ASSIGN_OR_RETURN(std::vector<Entry> entries, ReadIndex(*file));
  std::map<std::string, const Entry*> by_name;
  for (const Entry& e : entries) {
    if (!by_name.emplace(e.name, &e).second) {
      return absl::DataLossError(
          absl::StrCat("parameter file ", path, " holds parameter '", e.name, "' twice"));
    }
    if (params.Find(e.name) != nullptr) continue;
    if (scope == FileScope::kWholeModel) {
      // A corrupt name is corruption, not a model mismatch.
      HETPAR_RETURN_IF_ERROR(ReadTensor(*file, e).status());
      return absl::InvalidArgumentError(
          absl::StrCat("parameter file ", path, " holds parameter '", e.name,
                       "', which the model does not have (the model has ",
                       params.parameters().size(), " parameters, the file ", entries.size(), ")"));
    }
    if (whole_model_has != nullptr && !whole_model_has(e.name)) {
      HETPAR_RETURN_IF_ERROR(ReadTensor(*file, e).status());
      return absl::InvalidArgumentError(
          absl::StrCat("parameter file ", path, " holds parameter '", e.name,
                       "', which no part of the model has (a file of another or larger model: "
                       "every part would load what it has and leave the rest)"));
    }
  }
  for (const NamedParameter& p : params.parameters()) {
    auto it = by_name.find(p.name);
    if (it == by_name.end()) {
      return absl::NotFoundError(
          absl::StrCat("parameter file ", path, " has no parameter '", p.name, "' (it holds ",
                       entries.size(), " parameters, the model ", params.parameters().size(), ")"));
    }
    if (it->second->shape != p.full_shape) {
      HETPAR_RETURN_IF_ERROR(ReadTensor(*file, *it->second).status());
      return absl::InvalidArgumentError(
          absl::StrCat("parameter '", p.name, "' has shape ", ShapeString(it->second->shape),
                       " in ", path, "; the model expects ", ShapeString(p.full_shape)));
    }
  }
  // Read and verify everything before touching the model, so that a failure leaves it as it was.
  std::vector<at::Tensor> slices;
  for (const NamedParameter& p : params.parameters()) {
    HETPAR_ASSIGN_OR_RETURN(at::Tensor full, ReadTensor(*file, *by_name.at(p.name)));
    HETPAR_ASSIGN_OR_RETURN(
        at::Tensor slice,
        RunTorchOr(absl::StrCat("slicing parameter ", p.name, " from ", path), [&] {
          at::Tensor s = p.slice.split_dim < 0
                             ? full
                             : full.narrow(p.slice.split_dim, p.slice.offset, p.slice.length);
          return s.to(p.tensor.scalar_type()).contiguous();
        }));
    if (slice.sizes() != p.tensor.sizes()) {
      return absl::InvalidArgumentError(
          absl::StrCat("parameter '", p.name, "': the slice of ", path, " has shape ",
                       ShapeString(slice.sizes().vec()), ", this rank's tensor ",
                       ShapeString(p.tensor.sizes().vec())));
    }
    slices.push_back(std::move(slice));
  }
  return RunTorch(absl::StrCat("loading parameters from ", path), [&] {
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < slices.size(); ++i) params.parameters()[i].tensor.copy_(slices[i]);
  });
}

absl::Status LoadInitialParameters(ParameterSet& params, const std::string& field,
                                   const std::string& path, FileScope scope,
                                   const WholeModelHas& whole_model_has) {
  absl::Status status = LoadFullParameters(params, path, scope, whole_model_has);
  if (status.ok()) return status;
  return absl::Status(status.code(), absl::StrCat(field, ": ", status.message()));
}

}  // namespace hetpar::nn
