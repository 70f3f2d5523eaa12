#include "common/nn/safetensors.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <set>
#include <string_view>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/atomic_file.h"
#include "common/errno_status.h"
#include "common/json_depth.h"
#include "common/nn/torch_status.h"
#include "common/status.h"
#include "nlohmann/json.hpp"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "safetensors stores a little-endian header length and little-endian tensor bytes, "
              "which this build copies as they are");

namespace hetpar::nn {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

constexpr int64_t kLengthBytes = 8;
// The reference implementation's limit on the JSON header.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
constexpr char kMetadataKey[] = "__metadata__";
constexpr char kSingleFile[] = "model.safetensors";
constexpr char kIndexFile[] = "model.safetensors.index.json";

struct DtypeSpelling {
  const char* name;
  at::ScalarType dtype;
};
constexpr DtypeSpelling kDtypes[] = {
    {"F32", at::kFloat}, {"F64", at::kDouble}, {"BF16", at::kBFloat16}, {"F16", at::kHalf},
    {"I64", at::kLong},  {"I32", at::kInt},    {"I16", at::kShort},     {"I8", at::kChar},
    {"U8", at::kByte},   {"BOOL", at::kBool},
};

bool DtypeOfName(std::string_view name, at::ScalarType* dtype) {
  for (const DtypeSpelling& d : kDtypes) {
    if (name == d.name) {
      *dtype = d.dtype;
      return true;
    }
  }
  return false;
}

const char* NameOfDtype(at::ScalarType dtype) {
  for (const DtypeSpelling& d : kDtypes) {
    if (dtype == d.dtype) return d.name;
  }
  return nullptr;
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// A whole file mapped read-only; unmapped and closed when destroyed. An empty file maps nothing.
class MappedFile {
 public:
  // `what` names the file in errors ("safetensors file x.safetensors").
  static absl::StatusOr<std::unique_ptr<MappedFile>> Open(const std::string& path,
                                                          const std::string& what) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return ErrnoStatus(errno, absl::StrCat("opening ", what));
    struct stat st;
    if (::fstat(fd, &st) != 0) {
      const int err = errno;
      ::close(fd);
      return ErrnoStatus(err, absl::StrCat("reading the size of ", what));
    }
    if (!S_ISREG(st.st_mode)) {
      ::close(fd);
      return absl::InvalidArgumentError(absl::StrCat(what, " is not a regular file"));
    }
    const size_t size = static_cast<size_t>(st.st_size);
    void* data = nullptr;
    if (size > 0) {
      data = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
      if (data == MAP_FAILED) {
        const int err = errno;
        ::close(fd);
        return ErrnoStatus(err, absl::StrCat("mapping ", what));
      }
    }
    // The mapping stays valid without the descriptor.
    ::close(fd);
    return std::unique_ptr<MappedFile>(new MappedFile(static_cast<const char*>(data), size));
  }

  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile() {
    if (size_ > 0) ::munmap(const_cast<char*>(data_), size_);
  }

  const char* data() const { return data_; }
  int64_t size() const { return static_cast<int64_t>(size_); }

 private:
  MappedFile(const char* data, size_t size) : data_(data), size_(size) {}

  const char* data_;
  size_t size_;
};

// One tensor's entry in the header.
struct Entry {
  std::string name;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
  int64_t begin = 0;  // relative to the data buffer
  int64_t end = 0;
};

// The JSON header, with a top-level key given twice reported in `repeated`, and *too_deep set
// when it nests past kMaxJsonDepth.
Json ParseHeader(const char* begin, const char* end, std::string* repeated, bool* too_deep) {
  std::set<std::string> keys;
  return Json::parse(
      begin, end,
      [&](int depth, Json::parse_event_t event, Json& parsed) {
        if (!WithinJsonDepth(depth, too_deep)) return false;
        if (depth == 1 && event == Json::parse_event_t::key && repeated->empty() &&
            !keys.insert(parsed.get<std::string>()).second) {
          *repeated = parsed.get<std::string>();
        }
        return true;
      },
      /*allow_exceptions=*/false);
}

// A JSON integer in [0, int64 max], else false.
bool NonNegativeInt(const Json& value, int64_t* out) {
  if (value.is_number_unsigned()) {
    const uint64_t v = value.get<uint64_t>();
    if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return false;
    *out = static_cast<int64_t>(v);
    return true;
  }
  if (value.is_number_integer()) {
    const int64_t v = value.get<int64_t>();
    if (v < 0) return false;
    *out = v;
    return true;
  }
  return false;
}

// One tensor's header entry, checked against itself (not yet against the buffer).
absl::StatusOr<Entry> ParseEntry(const std::string& path, const std::string& name,
                                 const Json& value) {
  const std::string where = absl::StrCat("safetensors file ", path, ": tensor '", name, "'");
  if (!value.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, " is described by ", value.type_name(), ", expected an object"));
  }
  Entry e;
  e.name = name;
  const auto dtype = value.find("dtype");
  if (dtype == value.end() || !dtype->is_string()) {
    return absl::InvalidArgumentError(absl::StrCat(where, " has no \"dtype\" string"));
  }
  if (!DtypeOfName(dtype->get<std::string>(), &e.dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, " has dtype \"", dtype->get<std::string>(),
                     "\"; this build reads F32, F64, BF16, F16, I64, I32, I16, I8, U8 and BOOL"));
  }
  const auto shape = value.find("shape");
  if (shape == value.end() || !shape->is_array()) {
    return absl::InvalidArgumentError(absl::StrCat(where, " has no \"shape\" array"));
  }
  for (const Json& d : *shape) {
    int64_t dim = 0;
    if (!NonNegativeInt(d, &dim)) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, " has shape ", shape->dump(), "; dims are integers >= 0"));
    }
    e.shape.push_back(dim);
  }
  const auto offsets = value.find("data_offsets");
  if (offsets == value.end() || !offsets->is_array() || offsets->size() != 2 ||
      !NonNegativeInt((*offsets)[0], &e.begin) || !NonNegativeInt((*offsets)[1], &e.end)) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, " has data_offsets ", offsets == value.end() ? "(none)" : offsets->dump(),
        "; expected [begin, end], integers >= 0"));
  }
  // elements x element size, refusing anything that cannot fit a file.
  const int64_t element_bytes = static_cast<int64_t>(c10::elementSize(e.dtype));
  int64_t bytes = element_bytes;
  for (int64_t d : e.shape) {
    if (d > 0 && bytes > (int64_t{1} << 62) / d) {
      return absl::DataLossError(
          absl::StrCat(where, " has shape ", ShapeString(e.shape), ", too large for any file"));
    }
    bytes *= d;
  }
  if (e.end < e.begin || e.end - e.begin != bytes) {
    return absl::DataLossError(absl::StrCat(where, " has data_offsets [", e.begin, ", ", e.end,
                                            "] (", e.end - e.begin, " bytes), but shape ",
                                            ShapeString(e.shape), " of ", dtype->get<std::string>(),
                                            " needs ", bytes, " bytes"));
  }
  return e;
}

absl::StatusOr<SafetensorsFile> ReadMapped(const std::string& path, const MappedFile& file) {
  const std::string what = absl::StrCat("safetensors file ", path);
  if (file.size() < kLengthBytes) {
    return absl::DataLossError(absl::StrCat(what, " is truncated: ", file.size(),
                                            " bytes, shorter than its 8-byte header length"));
  }
  uint64_t header_bytes = 0;
  std::memcpy(&header_bytes, file.data(), sizeof(header_bytes));
  if (header_bytes > kMaxHeaderBytes) {
    return absl::DataLossError(absl::StrCat(what, " declares a ", header_bytes,
                                            "-byte header, above the limit of ", kMaxHeaderBytes,
                                            " bytes; the file is corrupt or not safetensors"));
  }
  if (static_cast<int64_t>(header_bytes) > file.size() - kLengthBytes) {
    return absl::DataLossError(absl::StrCat(what, " declares a ", header_bytes,
                                            "-byte header, but the file has only ", file.size(),
                                            " bytes; it is truncated or not safetensors"));
  }
  const char* header = file.data() + kLengthBytes;
  std::string repeated;
  bool too_deep = false;
  const Json json = ParseHeader(header, header + header_bytes, &repeated, &too_deep);
  if (too_deep) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": its header nests deeper than ", kMaxJsonDepth, " levels"));
  }
  if (json.is_discarded() || !json.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": its ", header_bytes,
                                                   "-byte header is not a JSON object",
                                                   json.is_discarded() ? " (not valid JSON)" : ""));
  }
  if (!repeated.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": its header names '", repeated, "' twice"));
  }

  SafetensorsFile out;
  std::vector<Entry> entries;
  for (const auto& [key, value] : json.items()) {
    if (key == kMetadataKey) {
      if (!value.is_object()) {
        return absl::InvalidArgumentError(absl::StrCat(what, ": \"__metadata__\" is ",
                                                       value.type_name(), ", expected an object"));
      }
      for (const auto& [meta_key, meta_value] : value.items()) {
        if (!meta_value.is_string()) {
          return absl::InvalidArgumentError(absl::StrCat(what, ": \"__metadata__\" key '", meta_key,
                                                         "' holds ", meta_value.dump(),
                                                         ", expected a string"));
        }
        out.metadata.emplace(meta_key, meta_value.get<std::string>());
      }
      continue;
    }
    HETPAR_ASSIGN_OR_RETURN(Entry e, ParseEntry(path, key, value));
    entries.push_back(std::move(e));
  }

  // The ranges, in offset order, must tile the buffer exactly.
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
  });
  const int64_t buffer_bytes = file.size() - kLengthBytes - static_cast<int64_t>(header_bytes);
  int64_t covered = 0;
  const Entry* previous = nullptr;
  for (const Entry& e : entries) {
    const std::string where = absl::StrCat(what, ": tensor '", e.name, "'");
    if (e.begin < covered) {
      return absl::DataLossError(absl::StrCat(where, " at data_offsets [", e.begin, ", ", e.end,
                                              "] overlaps tensor '", previous->name, "' at [",
                                              previous->begin, ", ", previous->end, "]"));
    }
    if (e.begin > covered) {
      return absl::DataLossError(
          absl::StrCat(where, " starts at data offset ", e.begin, ", leaving a hole of ",
                       e.begin - covered, " bytes after ",
                       previous == nullptr ? std::string("the start of the data")
                                           : absl::StrCat("tensor '", previous->name, "'")));
    }
    if (e.end > buffer_bytes) {
      return absl::DataLossError(absl::StrCat(where, " at data_offsets [", e.begin, ", ", e.end,
                                              "] ends past the data buffer (", buffer_bytes,
                                              " bytes after the header): the file is truncated"));
    }
    covered = e.end;
    previous = &e;
  }
  if (covered != buffer_bytes) {
    return absl::DataLossError(absl::StrCat(what, " has ", buffer_bytes - covered,
                                            " bytes after its last tensor's data; expected none"));
  }

  const char* buffer = header + header_bytes;
  for (const Entry& e : entries) {
    const std::string where = absl::StrCat("tensor '", e.name, "' of ", what);
    HETPAR_ASSIGN_OR_RETURN(at::Tensor tensor, RunTorchOr(absl::StrCat("allocating ", where), [&] {
                              return at::empty(e.shape, at::TensorOptions().dtype(e.dtype));
                            }));
    const char* data = buffer + e.begin;
    const size_t bytes = static_cast<size_t>(e.end - e.begin);
    if (e.dtype == at::kBool) {
      const char* bad = std::find_if(data, data + bytes, [](char c) { return c != 0 && c != 1; });
      if (bad != data + bytes) {
        return absl::DataLossError(absl::StrCat(where, " holds byte ",
                                                static_cast<int>(static_cast<uint8_t>(*bad)),
                                                " at element ", bad - data, "; BOOL is 0 or 1"));
      }
    }
    if (bytes > 0) std::memcpy(tensor.data_ptr(), data, bytes);
    out.tensors.push_back({e.name, std::move(tensor)});
  }
  return out;
}

// Whether `name` stays inside the directory it is relative to.
bool IsPlainRelative(const std::string& name) {
  const fs::path p(name);
  if (name.empty() || p.is_absolute()) return false;
  for (const fs::path& part : p) {
    if (part == "..") return false;
  }
  return true;
}

absl::StatusOr<std::map<std::string, at::Tensor>> ReadSharded(const std::string& dir,
                                                              const std::string& index_path) {
  HETPAR_ASSIGN_OR_RETURN(
      std::unique_ptr<MappedFile> index,
      MappedFile::Open(index_path, absl::StrCat("safetensors index ", index_path)));
  bool too_deep = false;
  const Json json =
      ParseJsonWithinDepth<Json>(&too_deep, index->data(), index->data() + index->size());
  index.reset();
  if (json.is_discarded() || !json.is_object() || too_deep) {
    return absl::InvalidArgumentError(absl::StrCat(
        "safetensors index ", index_path, " is not a JSON object", JsonDepthNote(too_deep)));
  }
  const auto weight_map = json.find("weight_map");
  if (weight_map == json.end() || !weight_map->is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat("safetensors index ", index_path, " has no \"weight_map\" object"));
  }
  // shard -> the names the index places in it.
  std::map<std::string, std::vector<std::string>> shards;
  for (const auto& [name, shard] : weight_map->items()) {
    if (!shard.is_string() || !IsPlainRelative(shard.get<std::string>())) {
      return absl::InvalidArgumentError(absl::StrCat("safetensors index ", index_path,
                                                     " maps tensor '", name, "' to ", shard.dump(),
                                                     "; expected the name of a file in ", dir));
    }
    shards[shard.get<std::string>()].push_back(name);
  }

  std::map<std::string, at::Tensor> out;
  std::map<std::string, std::string> shard_of;  // tensor name -> the shard it was read from
  for (const auto& [shard, names] : shards) {
    const std::string shard_path = (fs::path(dir) / shard).string();
    absl::StatusOr<SafetensorsFile> file = ReadSafetensors(shard_path);
    if (!file.ok()) {
      return Annotate(file.status(),
                      absl::StrCat("reading shard ", shard, " of safetensors index ", index_path));
    }
    for (SafetensorsTensor& t : file->tensors) {
      const auto [it, inserted] = shard_of.emplace(t.name, shard);
      if (!inserted) {
        return absl::DataLossError(
            absl::StrCat("tensor '", t.name, "' is in two shards of ", index_path, ": ",
                         (fs::path(dir) / it->second).string(), " and ", shard_path));
      }
      out.emplace(t.name, std::move(t.tensor));
    }
    for (const std::string& name : names) {
      const auto it = shard_of.find(name);
      if (it == shard_of.end() || it->second != shard) {
        return absl::DataLossError(absl::StrCat("safetensors index ", index_path,
                                                " places tensor '", name, "' in ", shard_path,
                                                ", which does not hold it"));
      }
    }
  }
  return out;
}

}  // namespace

absl::StatusOr<SafetensorsFile> ReadSafetensors(const std::string& path) {
  HETPAR_ASSIGN_OR_RETURN(std::unique_ptr<MappedFile> file,
                          MappedFile::Open(path, absl::StrCat("safetensors file ", path)));
  return ReadMapped(path, *file);
}

absl::StatusOr<std::map<std::string, at::Tensor>> ReadSafetensorsDirectory(const std::string& dir) {
  const std::string single = (fs::path(dir) / kSingleFile).string();
  const std::string index = (fs::path(dir) / kIndexFile).string();
  absl::StatusOr<SafetensorsFile> file = ReadSafetensors(single);
  if (file.ok()) {
    std::map<std::string, at::Tensor> out;
    for (SafetensorsTensor& t : file->tensors) out.emplace(t.name, std::move(t.tensor));
    return out;
  }
  if (!absl::IsNotFound(file.status())) return file.status();
  std::error_code error;
  if (fs::exists(index, error)) return ReadSharded(dir, index);
  if (error && error != std::errc::no_such_file_or_directory) {
    return ErrnoStatus(error.value(), absl::StrCat("looking for ", index));
  }
  return absl::NotFoundError(absl::StrCat("checkpoint directory ", dir, " has neither ",
                                          kSingleFile, " nor ", kIndexFile));
}

absl::Status WriteSafetensors(const std::vector<SafetensorsTensor>& tensors,
                              const std::string& path,
                              const std::map<std::string, std::string>& metadata) {
  const std::string what = absl::StrCat("writing safetensors file ", path);
  Json header = Json::object();
  std::set<std::string> names;
  int64_t offset = 0;
  for (const SafetensorsTensor& t : tensors) {
    if (t.name.empty() || t.name == kMetadataKey || !names.insert(t.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": tensor name '", t.name, "' is empty, reserved or given twice"));
    }
    if (!t.tensor.defined()) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": tensor '", t.name, "' is undefined"));
    }
    const char* dtype = NameOfDtype(t.tensor.scalar_type());
    if (dtype == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": tensor '", t.name, "' has dtype ", c10::toString(t.tensor.scalar_type()),
          "; safetensors files hold F32, F64, BF16, F16, I64, I32, I16, I8, U8 and BOOL"));
    }
    const int64_t bytes = t.tensor.numel() * static_cast<int64_t>(t.tensor.element_size());
    header[t.name] = {{"dtype", dtype},
                      {"shape", t.tensor.sizes().vec()},
                      {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  if (!metadata.empty()) header[kMetadataKey] = metadata;
  std::string text;
  try {
    text = header.dump();
  } catch (const Json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": a tensor name or metadata string is not valid UTF-8 (", e.what(), ")"));
  }
  text.append((8 - text.size() % 8) % 8, ' ');
  const uint64_t header_bytes = text.size();

  HETPAR_ASSIGN_OR_RETURN(std::unique_ptr<AtomicFileWriter> file, AtomicFileWriter::Create(path));
  HETPAR_RETURN_IF_ERROR(file->Append(&header_bytes, sizeof(header_bytes)));
  HETPAR_RETURN_IF_ERROR(file->Append(text.data(), text.size()));
  for (const SafetensorsTensor& t : tensors) {
    // One tensor at a time, so that at most one contiguous copy is alive.
    HETPAR_ASSIGN_OR_RETURN(at::Tensor contiguous,
                            RunTorchOr(absl::StrCat(what, ": tensor '", t.name, "'"),
                                       [&] { return t.tensor.cpu().contiguous(); }));
    const size_t bytes = static_cast<size_t>(contiguous.numel()) * contiguous.element_size();
    if (bytes > 0) HETPAR_RETURN_IF_ERROR(file->Append(contiguous.data_ptr(), bytes));
  }
  return Annotate(file->Commit(), what);
}

}  // namespace hetpar::nn
