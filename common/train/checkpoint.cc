#include "common/train/checkpoint.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/atomic_file.h"
#include "common/checkpoint_pin.h"
#include "common/errno_status.h"
#include "common/logging.h"
#include "common/nn/export.h"
#include "common/nn/torch_status.h"
#include "common/status.h"

namespace hetpar::train {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr int kFormat = 1;
// A shard file's header (common/nn/export.h): its entries start after it.
constexpr int64_t kShardHeaderBytes = 32;
constexpr char kManifest[] = "manifest.json";
// Checksums read files this many bytes at a time.
constexpr size_t kChunkBytes = size_t{1} << 20;
// The most one pread of an entry asks for (Linux moves at most about 2 GiB per call).
constexpr int64_t kMaxReadBytes = int64_t{1} << 30;
// The tensor data of each entry is checksummed in blocks of this many bytes (the last one
// possibly short), recorded in the sidecar, so a load can read and check part of an entry.
constexpr int64_t kBlockBytes = nn::kDataBlockBytes;
// Read buffers place the first tensor byte they hold at this alignment.
constexpr int64_t kAlign = 64;

std::string JoinPath(const std::string& dir, const std::string& file) {
  return (fs::path(dir) / file).string();
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// Closes a file descriptor on every path out of a scope.
class FdCloser {
 public:
  explicit FdCloser(int fd) : fd_(fd) {}
  FdCloser(const FdCloser&) = delete;
  FdCloser& operator=(const FdCloser&) = delete;
  ~FdCloser() {
    if (fd_ >= 0) ::close(fd_);
  }

 private:
  int fd_;
};

absl::StatusOr<std::string> ReadWholeFile(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, absl::StrCat("opening ", path));
  FdCloser closer(fd);
  std::string contents;
  char buffer[1 << 16];
  while (true) {
    const ssize_t n = ::read(fd, buffer, sizeof(buffer));
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, absl::StrCat("reading ", path));
    }
    if (n == 0) return contents;
    contents.append(buffer, static_cast<size_t>(n));
  }
}

// The size and zlib CRC-32 of a whole file.
struct FileSum {
  int64_t bytes = 0;
  uint32_t crc32 = 0;
};

absl::StatusOr<FileSum> SumFile(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, absl::StrCat("opening ", path));
  FdCloser closer(fd);
  std::vector<char> buffer(kChunkBytes);
  FileSum sum;
  uLong crc = crc32_z(0, Z_NULL, 0);
  while (true) {
    const ssize_t n = ::read(fd, buffer.data(), buffer.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, absl::StrCat("reading ", path));
    }
    if (n == 0) break;
    crc = crc32_z(crc, reinterpret_cast<const Bytef*>(buffer.data()), static_cast<size_t>(n));
    sum.bytes += n;
  }
  sum.crc32 = static_cast<uint32_t>(crc);
  return sum;
}

// A JSON file of the checkpoint; `what` names it in errors ("checkpoint manifest"). NotFound
// when absent; DataLoss when it is not JSON.
absl::StatusOr<json> ReadJsonFile(const std::string& path, const std::string& what) {
  HETPAR_ASSIGN_OR_RETURN(std::string text, ReadWholeFile(path));
  json parsed = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (parsed.is_discarded()) {
    return absl::DataLossError(absl::StrCat(what, " ", path, " is not valid JSON"));
  }
  return parsed;
}

// A file name of the checkpoint directory as a sidecar or the manifest gives it: a plain name,
// so that a damaged file cannot send a reader outside the directory.
bool IsPlainFileName(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos;
}

// The CRC-32s of an entry's tensor data in fixed blocks (an entry range's "data_offset",
// "block_bytes", "block_crc32" and "dtype" in the sidecar): block i covers data bytes
// [i * block_bytes, min((i + 1) * block_bytes, data_bytes)), i.e. file bytes from data_offset on.
struct DataBlocks {
  int64_t data_offset = 0;  // the file offset of the entry's first data byte
  int64_t data_bytes = 0;   // from data_offset to the entry's trailing CRC-32
  int64_t block_bytes = 0;
  std::vector<uint32_t> crc32;
  // The entry's; Undefined when the sidecar does not say (the entry is then read whole).
  at::ScalarType dtype = at::ScalarType::Undefined;
};

// Where one entry lies in its shard file, and its data's block checksums (absent in sidecars
// written before they were recorded).
struct SavedEntry {
  nn::EntryRange range;
  std::optional<DataBlocks> blocks;
};

// Where a parameter's entries lie in its shard file (the sidecar's "entries").
struct SavedEntries {
  SavedEntry value;
  std::optional<SavedEntry> exp_avg;  // with "adam_step" only
  std::optional<SavedEntry> exp_avg_sq;
};

// What a sidecar says of one parameter's slice.
struct SavedParam {
  std::string name;
  std::vector<int64_t> full_shape;
  int split_dim = -1;
  int64_t offset = 0;
  int64_t length = 0;
  std::optional<int64_t> adam_step;
  std::optional<SavedEntries> entries;  // absent in sidecars written before they were recorded
};

struct Sidecar {
  ShardId id;
  int64_t step = 0;
  uint64_t write_id = 0;  // 0 in sidecars written before it was recorded
  std::string file;
  int64_t bytes = 0;
  uint32_t crc32 = 0;
  std::vector<SavedParam> params;
  // Every parameter's "entries" is recorded, so a load reads just the entries it needs; else
  // (an older sidecar) a load reads the shard whole.
  bool has_entries = false;
};

// The dtype a sidecar names ("float64", as nn::DtypeName writes it); false for another name.
bool DtypeOfName(const std::string& name, at::ScalarType* dtype) {
  for (uint8_t code = 1; code <= 4; ++code) {
    at::ScalarType candidate = at::kFloat;
    if (nn::DtypeOfCode(code, &candidate) && nn::DtypeName(candidate) == name) {
      *dtype = candidate;
      return true;
    }
  }
  return false;
}

// An entry range of the sidecar: where the entry of `tensor` lies in the shard file (`range`),
// where its tensor data starts, its dtype, and the CRC-32 of each kBlockBytes block of the data,
// which the writer summed as it wrote the entry (nn::EntryRange::block_crc32; the data is the
// row-major contiguous tensor, just before the entry's trailing CRC-32).
json EntryRangeJson(const nn::EntryRange& range, const at::Tensor& tensor) {
  const int64_t data_bytes = tensor.numel() * static_cast<int64_t>(tensor.element_size());
  json crcs = range.block_crc32;
  return json{{"offset", range.offset},
              {"bytes", range.bytes},
              {"data_offset", range.offset + range.bytes - 4 - data_bytes},
              {"dtype", nn::DtypeName(tensor.scalar_type())},
              {"block_bytes", kBlockBytes},
              {"block_crc32", std::move(crcs)}};
}

json SidecarJson(const ShardId& id, int64_t step, uint64_t write_id, const std::string& file,
                 const FileSum& sum, json params) {
  return json{{"format", kFormat},
              {"module", id.module},
              {"step", step},
              {"write_id", write_id},
              {"tp", id.tp},
              {"tp_size", id.tp_size},
              {"pp", id.pp},
              {"pp_size", id.pp_size},
              {"file", file},
              {"bytes", sum.bytes},
              {"crc32", sum.crc32},
              {"params", std::move(params)}};
}

// The one place where nlohmann's exceptions (a missing key, a wrong type) become a Status.
template <typename Fn>
absl::Status ParseJson(const std::string& what, const std::string& path, Fn&& fn) {
  try {
    return std::forward<Fn>(fn)();
  } catch (const json::exception& e) {
    return absl::DataLossError(absl::StrCat(what, " ", path, " is malformed: ", e.what()));
  }
}

absl::Status CheckFormat(const json& j, const std::string& what, const std::string& path) {
  const int format = j.at("format").get<int>();
  if (format != kFormat) {
    return absl::DataLossError(absl::StrCat(what, " ", path, " has format ", format,
                                            "; this build reads format ", kFormat));
  }
  return absl::OkStatus();
}

absl::StatusOr<Sidecar> ReadSidecar(const std::string& path) {
  const std::string what = "checkpoint sidecar";
  HETPAR_ASSIGN_OR_RETURN(json j, ReadJsonFile(path, what));
  Sidecar sidecar;
  HETPAR_RETURN_IF_ERROR(ParseJson(what, path, [&]() -> absl::Status {
    HETPAR_RETURN_IF_ERROR(CheckFormat(j, what, path));
    sidecar.id.module = j.at("module").get<std::string>();
    sidecar.id.tp = j.at("tp").get<int64_t>();
    sidecar.id.tp_size = j.at("tp_size").get<int64_t>();
    sidecar.id.pp = j.at("pp").get<int64_t>();
    sidecar.id.pp_size = j.at("pp_size").get<int64_t>();
    sidecar.step = j.at("step").get<int64_t>();
    sidecar.write_id = j.value("write_id", uint64_t{0});
    sidecar.file = j.at("file").get<std::string>();
    sidecar.bytes = j.at("bytes").get<int64_t>();
    sidecar.crc32 = j.at("crc32").get<uint32_t>();
    // An entry lies after the file's 32-byte header (common/nn/export.h) and within the file;
    // its data, when the block checksums say where, inside it, before its trailing CRC-32.
    const auto range = [&](const json& r, const std::string& entry) -> absl::StatusOr<SavedEntry> {
      SavedEntry got;
      got.range.offset = r.at("offset").get<int64_t>();
      got.range.bytes = r.at("bytes").get<int64_t>();
      const nn::EntryRange& e = got.range;
      if (e.offset < kShardHeaderBytes || e.bytes <= 0 || e.offset > sidecar.bytes ||
          e.bytes > sidecar.bytes - e.offset) {
        return absl::DataLossError(absl::StrCat(what, " ", path, " places entry '", entry,
                                                "' at bytes [", e.offset, ", ", e.offset + e.bytes,
                                                ") of a ", sidecar.bytes, "-byte shard file"));
      }
      if (!r.contains("block_crc32")) return got;
      DataBlocks blocks;
      blocks.data_offset = r.at("data_offset").get<int64_t>();
      blocks.block_bytes = r.at("block_bytes").get<int64_t>();
      blocks.crc32 = r.at("block_crc32").get<std::vector<uint32_t>>();
      const int64_t data_end = e.offset + e.bytes - 4;
      blocks.data_bytes = data_end - blocks.data_offset;
      const bool fits = blocks.block_bytes > 0 && blocks.data_offset >= e.offset &&
                        blocks.data_offset <= data_end &&
                        static_cast<int64_t>(blocks.crc32.size()) ==
                            blocks.data_bytes / blocks.block_bytes +
                                (blocks.data_bytes % blocks.block_bytes != 0 ? 1 : 0);
      if (!fits) {
        return absl::DataLossError(absl::StrCat(what, " ", path, " gives entry '", entry,
                                                "' (bytes [", e.offset, ", ", e.offset + e.bytes,
                                                ")) ", blocks.crc32.size(), " block CRC-32s of ",
                                                blocks.block_bytes, " bytes for data from byte ",
                                                blocks.data_offset, "; they do not fit the entry"));
      }
      if (r.contains("dtype")) {
        const std::string name = r.at("dtype").get<std::string>();
        at::ScalarType dtype = at::kFloat;
        if (!DtypeOfName(name, &dtype)) {
          return absl::DataLossError(
              absl::StrCat(what, " ", path, " gives entry '", entry, "' dtype '", name, "'"));
        }
        blocks.dtype = dtype;
      }
      got.blocks = std::move(blocks);
      return got;
    };
    size_t with_entries = 0;
    for (const json& p : j.at("params")) {
      SavedParam saved;
      saved.name = p.at("name").get<std::string>();
      saved.full_shape = p.at("full_shape").get<std::vector<int64_t>>();
      saved.split_dim = p.at("split_dim").get<int>();
      saved.offset = p.at("offset").get<int64_t>();
      saved.length = p.at("length").get<int64_t>();
      if (p.contains("adam_step")) saved.adam_step = p.at("adam_step").get<int64_t>();
      if (p.contains("entries")) {
        const json& e = p.at("entries");
        SavedEntries entries;
        HETPAR_ASSIGN_OR_RETURN(entries.value, range(e.at("value"), saved.name));
        if (saved.adam_step.has_value()) {
          HETPAR_ASSIGN_OR_RETURN(entries.exp_avg, range(e.at("exp_avg"), saved.name + "@exp_avg"));
          HETPAR_ASSIGN_OR_RETURN(entries.exp_avg_sq,
                                  range(e.at("exp_avg_sq"), saved.name + "@exp_avg_sq"));
        }
        saved.entries = std::move(entries);
        ++with_entries;
      }
      sidecar.params.push_back(std::move(saved));
    }
    if (with_entries != 0 && with_entries != sidecar.params.size()) {
      return absl::DataLossError(absl::StrCat(what, " ", path, " says where the entries of ",
                                              with_entries, " of its ", sidecar.params.size(),
                                              " parameters lie, not of all"));
    }
    sidecar.has_entries = with_entries == sidecar.params.size();
    return absl::OkStatus();
  }));
  if (!IsPlainFileName(sidecar.file)) {
    return absl::DataLossError(
        absl::StrCat(what, " ", path, " names shard file '", sidecar.file, "'"));
  }
  return sidecar;
}

struct ManifestShard {
  std::string name;
  std::string file;
  int64_t bytes = 0;
  uint32_t crc32 = 0;
};

struct Manifest {
  int64_t step = 0;
  std::vector<ManifestShard> shards;
  json extra;
};

absl::StatusOr<Manifest> ReadManifest(const std::string& dir) {
  const std::string path = JoinPath(dir, kManifest);
  const std::string what = "checkpoint manifest";
  absl::StatusOr<json> j = ReadJsonFile(path, what);
  if (absl::IsNotFound(j.status())) {
    return absl::NotFoundError(absl::StrCat("checkpoint directory ", dir, " has no ", kManifest,
                                            ": it is incomplete, or not a checkpoint"));
  }
  if (!j.ok()) return j.status();
  Manifest manifest;
  HETPAR_RETURN_IF_ERROR(ParseJson(what, path, [&]() -> absl::Status {
    HETPAR_RETURN_IF_ERROR(CheckFormat(*j, what, path));
    manifest.step = j->at("step").get<int64_t>();
    for (const json& s : j->at("shards")) {
      ManifestShard shard;
      shard.name = s.at("name").get<std::string>();
      shard.file = s.at("file").get<std::string>();
      shard.bytes = s.at("bytes").get<int64_t>();
      shard.crc32 = s.at("crc32").get<uint32_t>();
      if (!IsPlainFileName(shard.name) || !IsPlainFileName(shard.file)) {
        return absl::DataLossError(absl::StrCat(what, " ", path, " lists shard '", shard.name,
                                                "' with file '", shard.file, "'"));
      }
      manifest.shards.push_back(std::move(shard));
    }
    manifest.extra = j->at("extra");
    if (!manifest.extra.is_object()) {
      return absl::DataLossError(absl::StrCat(what, " ", path, ": \"extra\" is not an object"));
    }
    return absl::OkStatus();
  }));
  return manifest;
}

absl::Status CheckShardId(const ShardId& id) {
  const bool module_ok =
      !id.module.empty() && std::all_of(id.module.begin(), id.module.end(), [](char c) {
        return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.';
      });
  if (!module_ok || id.tp_size < 1 || id.tp < 0 || id.tp >= id.tp_size || id.pp_size < 1 ||
      id.pp < 0 || id.pp >= id.pp_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint shard module='", id.module, "' tp=", id.tp, "/", id.tp_size,
                     " pp=", id.pp, "/", id.pp_size,
                     ": expected a module name of letters, digits, '_' and '.', and "
                     "0 <= tp < tp_size, 0 <= pp < pp_size"));
  }
  return absl::OkStatus();
}

std::string SidecarPath(const std::string& dir, const ShardId& id) {
  return JoinPath(dir, ShardName(id) + ".json");
}

// Loading reads a shard by the byte ranges its sidecar records ("entries"): a rank reads only the
// entries of the saved slices that overlap its own, each once. Of a saved slice it keeps only
// part of (along the split dim), it reads just the blocks of the entry's data that hold that part
// and verifies each by its block CRC-32 from the sidecar; an entry it needs all of, or all of
// whose blocks it needs, it reads whole and verifies by the entry's own CRC-32. The shard's
// whole-file CRC-32 in the manifest is not recomputed (that would read every byte); only the
// file's size is checked, by a stat. A shard whose sidecar has no "entries" (written before they
// were recorded) is read whole the old way: summed against the manifest, then every entry parsed;
// an entry whose range has no block CRC-32s or dtype (written before they were recorded) is read
// whole.

// The shards of the module being loaded: each file as the manifest lists it, with its sidecar.
struct ModuleShard {
  std::string path;
  int64_t bytes = 0;   // the manifest's
  uint32_t crc32 = 0;  // the manifest's
  Sidecar sidecar;
};

// The sidecars of the shards of `module` listed in `manifest`, in manifest order. No shard file
// is opened.
absl::StatusOr<std::vector<ModuleShard>> ReadModuleSidecars(const std::string& dir,
                                                            const Manifest& manifest,
                                                            const std::string& module) {
  std::vector<ModuleShard> shards;
  for (const ManifestShard& shard : manifest.shards) {
    const std::string sidecar_path = JoinPath(dir, shard.name + ".json");
    absl::StatusOr<Sidecar> sidecar = ReadSidecar(sidecar_path);
    if (absl::IsNotFound(sidecar.status())) {
      return absl::DataLossError(absl::StrCat("checkpoint ", dir, " lists shard ", shard.name,
                                              " in its manifest, but ", sidecar_path,
                                              " is missing"));
    }
    if (!sidecar.ok()) return sidecar.status();
    if (sidecar->id.module != module) continue;
    shards.push_back({JoinPath(dir, shard.file), shard.bytes, shard.crc32, *std::move(sidecar)});
  }
  return shards;
}

// One saved slice of a parameter: the shard (an index into the ModuleShards) and what its
// sidecar says of it; its tensors once read (undefined when not needed): the part of the saved
// slice the rank needs along the split dim, which starts at index `begin` of the full tensor's
// split dim (the saved slice's offset when it is needed whole).
struct Piece {
  size_t shard = 0;
  const SavedParam* saved = nullptr;
  int64_t begin = 0;
  at::Tensor value;
  at::Tensor exp_avg;
  at::Tensor exp_avg_sq;
};

// How one parameter of the loading rank is loaded: the saved slices it reads, decided from the
// sidecars alone.
struct ParamLoad {
  const nn::NamedParameter* param = nullptr;
  // The saved slices that overlap this rank's slice, in offset order and tiling a range of
  // split_dim; one replicated copy when split_dim < 0.
  std::vector<Piece> used;
  int split_dim = -1;
  std::optional<int64_t> adam_step;
  bool with_state = false;  // the moments are read and set
};

// Decides which of the saved slices `pieces` (every one of parameter p.name in the module, in
// manifest order) p's slice needs, checking that the sidecars agree with one another (DataLoss)
// and with the model (InvalidArgument). A replicated copy is the whole tensor: the first is
// taken. Split slices must tile split_dim; of those, the ones overlapping the rank's part of
// split_dim are taken (all of them when the rank keeps the whole tensor, or splits another dim).
absl::StatusOr<ParamLoad> PlanParam(const nn::NamedParameter& p, const std::vector<Piece>& pieces,
                                    const std::string& dir, bool with_optimizer) {
  const auto corrupt = [&](const std::string& why) {
    return absl::DataLossError(
        absl::StrCat("checkpoint ", dir, ": the shards of parameter '", p.name, "' ", why));
  };
  const SavedParam& first = *pieces.front().saved;
  for (const Piece& piece : pieces) {
    if (piece.saved->full_shape != first.full_shape) {
      return corrupt(absl::StrCat("disagree on its full shape: ", ShapeString(first.full_shape),
                                  " and ", ShapeString(piece.saved->full_shape)));
    }
    if (piece.saved->adam_step != first.adam_step) {
      return corrupt("disagree on its AdamW step (or only some hold its state)");
    }
  }
  const std::vector<int64_t>& full_shape = first.full_shape;
  if (full_shape != p.full_shape) {
    return absl::InvalidArgumentError(
        absl::StrCat("parameter '", p.name, "' has shape ", ShapeString(full_shape),
                     " in checkpoint ", dir, "; the model expects ", ShapeString(p.full_shape)));
  }
  ParamLoad load;
  load.param = &p;
  load.adam_step = first.adam_step;
  load.with_state = with_optimizer && p.trainable && first.adam_step.has_value();
  auto replicated = std::find_if(pieces.begin(), pieces.end(),
                                 [](const Piece& piece) { return piece.saved->split_dim < 0; });
  if (replicated != pieces.end()) {
    load.used.push_back(*replicated);
    return load;
  }
  const int split_dim = first.split_dim;
  if (split_dim >= static_cast<int>(full_shape.size())) {
    return corrupt(
        absl::StrCat("split dim ", split_dim, " of a ", full_shape.size(), "-dim tensor"));
  }
  std::vector<const Piece*> sorted;
  for (const Piece& piece : pieces) {
    if (piece.saved->split_dim != split_dim) {
      return corrupt(
          absl::StrCat("disagree on its split dim: ", split_dim, " and ", piece.saved->split_dim));
    }
    sorted.push_back(&piece);
  }
  std::stable_sort(sorted.begin(), sorted.end(), [](const Piece* a, const Piece* b) {
    return a->saved->offset < b->saved->offset;
  });
  // The same slice saved twice (it should not be) is taken once.
  sorted.erase(std::unique(sorted.begin(), sorted.end(),
                           [](const Piece* a, const Piece* b) {
                             return a->saved->offset == b->saved->offset &&
                                    a->saved->length == b->saved->length;
                           }),
               sorted.end());
  int64_t next = 0;
  for (const Piece* piece : sorted) {
    if (piece->saved->offset != next || piece->saved->length <= 0) {
      return corrupt(absl::StrCat("do not tile dim ", split_dim, ": a slice at offset ",
                                  piece->saved->offset, " of length ", piece->saved->length,
                                  " where offset ", next, " was expected"));
    }
    next += piece->saved->length;
  }
  if (next != full_shape[split_dim]) {
    return corrupt(absl::StrCat("cover ", next, " of the ", full_shape[split_dim],
                                " entries of dim ", split_dim));
  }
  // The part of split_dim this rank keeps.
  int64_t need_begin = 0;
  int64_t need_end = full_shape[split_dim];
  if (p.slice.split_dim == split_dim) {
    need_begin = p.slice.offset;
    need_end = p.slice.offset + p.slice.length;
  }
  for (const Piece* piece : sorted) {
    const int64_t begin = piece->saved->offset;
    const int64_t end = begin + piece->saved->length;
    if (begin < need_end && end > need_begin) load.used.push_back(*piece);
  }
  // An empty or out-of-range slice overlaps nothing: the narrowing in LocalPart says why.
  if (load.used.empty()) load.used.push_back(*sorted.front());
  load.split_dim = split_dim;
  return load;
}

// One entry a load reads from a shard: its name, where it lies (null for a sidecar without
// entry ranges), the shape its sidecar says it has, the part of it the rank needs (indices
// [need_begin, need_end) of dim need_dim; need_dim -1: all of it) and where that part goes.
struct EntryRead {
  std::string name;
  const SavedEntry* entry = nullptr;
  std::vector<int64_t> shape;
  int need_dim = -1;
  int64_t need_begin = 0;
  int64_t need_end = 0;
  at::Tensor* out = nullptr;
};

// The part of an entry's data a partial read takes: data bytes [begin, end) hold every needed
// element (with the other rows of split_dim between them when dims before it have sizes above 1),
// and lie in blocks [first_block, end_block).
struct DataSpan {
  at::ScalarType dtype = at::kFloat;
  int64_t outer = 1;        // the product of the sizes of the dims before need_dim
  int64_t inner_bytes = 0;  // the bytes of one index of need_dim (the dims after it)
  int64_t begin = 0;
  int64_t end = 0;
  int64_t first_block = 0;
  int64_t end_block = 0;
};

// `a` * `b` into `out`; false on overflow or a negative factor.
bool MulChecked(int64_t a, int64_t b, int64_t* out) {
  return a >= 0 && b >= 0 && !__builtin_mul_overflow(a, b, out);
}

// The span of `read`'s data to read block by block, or nullopt to read the entry whole: when
// the rank needs all of it, when the sidecar has no block CRC-32s or dtype for it, when what the
// sidecar says of it does not add up (the whole read then checks the entry's header against the
// sidecar and says what is wrong), or when every block would be read anyway.
std::optional<DataSpan> PartialSpan(const EntryRead& read) {
  if (read.entry == nullptr || !read.entry->blocks.has_value() || read.need_dim < 0) {
    return std::nullopt;
  }
  const DataBlocks& blocks = *read.entry->blocks;
  const int dims = static_cast<int>(read.shape.size());
  if (blocks.dtype == at::ScalarType::Undefined || read.need_dim >= dims) return std::nullopt;
  DataSpan span;
  span.dtype = blocks.dtype;
  const int64_t length = read.shape[read.need_dim];
  if (read.need_begin < 0 || read.need_begin >= read.need_end || read.need_end > length) {
    return std::nullopt;
  }
  span.inner_bytes = static_cast<int64_t>(c10::elementSize(span.dtype));
  for (int d = 0; d < dims; ++d) {
    if (d == read.need_dim) continue;
    int64_t* product = d < read.need_dim ? &span.outer : &span.inner_bytes;
    if (!MulChecked(*product, read.shape[d], product)) return std::nullopt;
  }
  int64_t stride = 0;  // the bytes from one index of the outer dims to the next
  int64_t data_bytes = 0;
  if (!MulChecked(length, span.inner_bytes, &stride) ||
      !MulChecked(span.outer, stride, &data_bytes) || data_bytes != blocks.data_bytes ||
      data_bytes == 0) {
    return std::nullopt;
  }
  // The data follows the entry's name-length field, name, dtype, dims and data-bytes fields.
  const int64_t prefix = 4 + static_cast<int64_t>(read.name.size()) + 4 + 8 * dims + 8;
  if (blocks.data_offset != read.entry->range.offset + prefix) return std::nullopt;
  span.begin = read.need_begin * span.inner_bytes;
  span.end = (span.outer - 1) * stride + read.need_end * span.inner_bytes;
  span.first_block = span.begin / blocks.block_bytes;
  span.end_block = span.end / blocks.block_bytes + (span.end % blocks.block_bytes != 0 ? 1 : 0);
  if (span.first_block == 0 && span.end_block == static_cast<int64_t>(blocks.crc32.size())) {
    return std::nullopt;
  }
  return span;
}

// Reads [offset, offset + bytes) of `fd` (the file `path`) into `dst`.
absl::Status ReadRange(int fd, const std::string& path, int64_t offset, int64_t bytes, char* dst) {
  while (bytes > 0) {
    const ssize_t n =
        ::pread(fd, dst, static_cast<size_t>(std::min<int64_t>(bytes, kMaxReadBytes)), offset);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, absl::StrCat("reading ", path));
    }
    if (n == 0) {
      return absl::DataLossError(
          absl::StrCat("checkpoint shard ", path, " ended at byte ", offset, " while being read"));
    }
    dst += n;
    offset += n;
    bytes -= n;
  }
  return absl::OkStatus();
}

// The entry's tensor in its saved dtype, read from `fd` (the file `path`) with one pread of its
// byte range into the tensor's own memory (no copy), its CRC-32 verified, then checked to be
// what the sidecar says: its name and its shape. The entry is laid out as common/nn/export.h
// says: u32 name length, name, u8 dtype, u8 dims, u16 zero, i64 dims, u64 data bytes, data, u32
// CRC-32 of every byte before it.
absl::StatusOr<at::Tensor> ReadEntry(int fd, const std::string& path, const EntryRead& read) {
  const nn::EntryRange& range = read.entry->range;
  const std::string what =
      absl::StrCat("checkpoint shard ", path, ": entry '", read.name, "' (bytes [", range.offset,
                   ", ", range.offset + range.bytes, "))");
  const int64_t dims = static_cast<int64_t>(read.shape.size());
  // The bytes before the tensor's, when the entry is the one the sidecar says.
  const int64_t prefix = 4 + static_cast<int64_t>(read.name.size()) + 4 + 8 * dims + 8;
  if (range.bytes < prefix + 4) {
    return absl::DataLossError(absl::StrCat(what, ": ", range.bytes,
                                            " bytes are too few for its name and ", dims,
                                            " dims; the sidecar is corrupt"));
  }
  // A byte buffer over-allocated so that the tensor's bytes inside it are 64-byte aligned; the
  // tensor returned is a view of it.
  HETPAR_ASSIGN_OR_RETURN(at::Tensor buffer, nn::RunTorchOr(absl::StrCat("allocating ", what), [&] {
                            return at::empty({range.bytes + kAlign}, at::kByte);
                          }));
  char* const base = static_cast<char*>(buffer.data_ptr());
  const int64_t pad =
      (kAlign - static_cast<int64_t>((reinterpret_cast<uintptr_t>(base) + prefix) % kAlign)) %
      kAlign;
  char* const entry = base + pad;
  HETPAR_RETURN_IF_ERROR(ReadRange(fd, path, range.offset, range.bytes, entry));
  const int64_t summed = range.bytes - 4;
  const uint32_t computed = static_cast<uint32_t>(
      crc32_z(0, reinterpret_cast<const Bytef*>(entry), static_cast<size_t>(summed)));
  uint32_t stored = 0;
  std::memcpy(&stored, entry + summed, sizeof(stored));
  if (computed != stored) {
    return absl::DataLossError(absl::StrCat(what, " fails its CRC-32: computed ", computed,
                                            ", stored ", stored, "; the file is corrupt"));
  }
  // The bytes are what was written; they must also be the entry the sidecar says.
  uint32_t name_bytes = 0;
  std::memcpy(&name_bytes, entry, sizeof(name_bytes));
  if (name_bytes != read.name.size() ||
      std::memcmp(entry + 4, read.name.data(), read.name.size()) != 0) {
    const std::string name = name_bytes <= static_cast<uint64_t>(summed - 4)
                                 ? absl::StrCat("'", std::string(entry + 4, name_bytes), "'")
                                 : absl::StrCat("a name of ", name_bytes, " bytes");
    return absl::DataLossError(
        absl::StrCat(what, " holds entry ", name, " instead; the sidecar does not match the file"));
  }
  const char* const meta = entry + 4 + read.name.size();
  const uint8_t code = static_cast<uint8_t>(meta[0]);
  at::ScalarType dtype = at::kFloat;
  if (!nn::DtypeOfCode(code, &dtype)) {
    return absl::DataLossError(
        absl::StrCat(what, " has dtype code ", static_cast<int>(code), ", expected 1..4"));
  }
  std::vector<int64_t> shape(static_cast<size_t>(static_cast<uint8_t>(meta[1])));
  if (static_cast<int64_t>(shape.size()) == dims) {
    std::memcpy(shape.data(), meta + 4, static_cast<size_t>(8 * dims));
  }
  if (shape != read.shape) {
    return absl::DataLossError(absl::StrCat(
        what, " holds a ", shape.size(), "-dim tensor",
        shape.size() == read.shape.size() ? absl::StrCat(" of shape ", ShapeString(shape)) : "",
        " where the sidecar says ", ShapeString(read.shape)));
  }
  uint64_t data_bytes = 0;
  std::memcpy(&data_bytes, meta + 4 + 8 * dims, sizeof(data_bytes));
  int64_t expected = static_cast<int64_t>(c10::elementSize(dtype));
  for (int64_t d : shape) {
    if (d < 0 || __builtin_mul_overflow(expected, d, &expected)) expected = -1;
    if (expected < 0) break;
  }
  if (expected < 0 || data_bytes != static_cast<uint64_t>(expected) ||
      expected != range.bytes - prefix - 4) {
    return absl::DataLossError(absl::StrCat(
        what, " is malformed: ", data_bytes, " data bytes for shape ", ShapeString(shape), " of ",
        nn::DtypeName(dtype), " in an entry of ", range.bytes, " bytes"));
  }
  return nn::RunTorchOr(absl::StrCat("reading ", what), [&] {
    return buffer.narrow(0, pad + prefix, expected).view(dtype).view(shape);
  });
}

// The part of the entry's tensor `read` needs, in its saved dtype, read as the blocks of `span`
// with one pread (into a buffer that places the first needed byte 64-byte aligned), each block
// verified by its CRC-32 from the sidecar. The entry's name, dtype and shape are the sidecar's:
// its header fields are not read. With split_dim 0 (or only size-1 dims before it) the needed
// bytes are contiguous and the tensor is a view of the buffer; else they are copied out of it.
absl::StatusOr<at::Tensor> ReadEntryPart(int fd, const std::string& path, const EntryRead& read,
                                         const DataSpan& span) {
  const DataBlocks& blocks = *read.entry->blocks;
  const int64_t read_begin = span.first_block * blocks.block_bytes;
  const int64_t read_end = std::min(span.end_block * blocks.block_bytes, blocks.data_bytes);
  const int64_t bytes = read_end - read_begin;
  const std::string what = absl::StrCat("checkpoint shard ", path, ": entry '", read.name,
                                        "' (bytes [", read.entry->range.offset, ", ",
                                        read.entry->range.offset + read.entry->range.bytes, "))");
  HETPAR_ASSIGN_OR_RETURN(at::Tensor buffer, nn::RunTorchOr(absl::StrCat("allocating ", what), [&] {
                            return at::empty({bytes + kAlign}, at::kByte);
                          }));
  char* const base = static_cast<char*>(buffer.data_ptr());
  const int64_t first = span.begin - read_begin;  // the first needed byte, in what is read
  const int64_t pad =
      (kAlign - static_cast<int64_t>((reinterpret_cast<uintptr_t>(base) + first) % kAlign)) %
      kAlign;
  char* const data = base + pad;
  HETPAR_RETURN_IF_ERROR(ReadRange(fd, path, blocks.data_offset + read_begin, bytes, data));
  for (int64_t block = span.first_block; block < span.end_block; ++block) {
    const int64_t begin = block * blocks.block_bytes;
    const int64_t end = std::min(begin + blocks.block_bytes, blocks.data_bytes);
    const uint32_t computed = static_cast<uint32_t>(
        crc32_z(0, reinterpret_cast<const Bytef*>(data + (begin - read_begin)),
                static_cast<size_t>(end - begin)));
    const uint32_t stored = blocks.crc32[static_cast<size_t>(block)];
    if (computed != stored) {
      return absl::DataLossError(absl::StrCat(
          what, ": block ", block, " of its data (file bytes [", blocks.data_offset + begin, ", ",
          blocks.data_offset + end, ")) fails its CRC-32: computed ", computed, ", stored ", stored,
          "; the file is corrupt"));
    }
  }
  std::vector<int64_t> shape = read.shape;
  const int64_t needed = read.need_end - read.need_begin;
  shape[read.need_dim] = needed;
  return nn::RunTorchOr(absl::StrCat("reading ", what), [&] {
    const int64_t stride = read.shape[read.need_dim] * span.inner_bytes;
    at::Tensor rows = buffer.as_strided({span.outer, needed, span.inner_bytes},
                                        {stride, span.inner_bytes, 1}, pad + first);
    // Size-1 dims aside, a view is contiguous only when outer is 1.
    return rows.contiguous().view(span.dtype).view(shape);
  });
}

// The part of a whole entry's tensor `t` that `read` needs (a view).
absl::StatusOr<at::Tensor> NeededPart(const at::Tensor& t, const EntryRead& read) {
  if (read.need_dim < 0) return t;
  return nn::RunTorchOr(absl::StrCat("slicing entry ", read.name), [&] {
    return t.narrow(read.need_dim, read.need_begin, read.need_end - read.need_begin);
  });
}

// The whole of a shard whose sidecar does not say where its entries lie: summed against the
// manifest's size and CRC-32, then every entry parsed (each with its own CRC-32).
absl::StatusOr<std::map<std::string, at::Tensor>> ReadWholeShard(const ModuleShard& shard) {
  absl::StatusOr<FileSum> sum = SumFile(shard.path);
  if (absl::IsNotFound(sum.status())) {
    return absl::DataLossError(
        absl::StrCat("checkpoint shard ", shard.path, " is missing; the manifest lists it"));
  }
  if (!sum.ok()) return sum.status();
  if (sum->bytes != shard.bytes || sum->crc32 != shard.crc32) {
    return absl::DataLossError(
        absl::StrCat("checkpoint shard ", shard.path, " does not match the manifest: ", sum->bytes,
                     " bytes with CRC-32 ", sum->crc32, ", the manifest says ", shard.bytes,
                     " bytes with CRC-32 ", shard.crc32, "; the file is corrupt"));
  }
  HETPAR_ASSIGN_OR_RETURN(std::vector<nn::FullParameter> entries,
                          nn::ReadFullParameters(shard.path));
  std::map<std::string, at::Tensor> by_name;
  for (nn::FullParameter& entry : entries) by_name[entry.name] = std::move(entry.tensor);
  return by_name;
}

// Reads the parts of `reads`, entries of `shard`, that they need into their tensors. With entry
// ranges, in file order, each entry once: only the blocks of its data that hold the part needed
// when that is less than all of them (PartialSpan), else the whole entry, with one pread each;
// the file's size must be the manifest's. Without them (an older sidecar), the shard is read
// whole.
absl::Status ReadShardEntries(const ModuleShard& shard, std::vector<EntryRead>& reads) {
  const auto check_shape = [&](const EntryRead& read, const at::Tensor& t) {
    if (t.sizes().vec() == read.shape) return absl::OkStatus();
    return absl::DataLossError(absl::StrCat(
        "checkpoint shard ", shard.path, ": entry '", read.name, "' holds a tensor of shape ",
        ShapeString(t.sizes().vec()), " where the sidecar says ", ShapeString(read.shape)));
  };
  if (!shard.sidecar.has_entries) {
    HETPAR_ASSIGN_OR_RETURN(auto by_name, ReadWholeShard(shard));
    for (EntryRead& read : reads) {
      auto it = by_name.find(read.name);
      if (it == by_name.end()) {
        return absl::DataLossError(absl::StrCat("checkpoint shard ", shard.path, " has no entry '",
                                                read.name, "'; its sidecar lists it"));
      }
      HETPAR_RETURN_IF_ERROR(check_shape(read, it->second));
      HETPAR_ASSIGN_OR_RETURN(*read.out, NeededPart(it->second, read));
    }
    return absl::OkStatus();
  }
  const int fd = ::open(shard.path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0 && errno == ENOENT) {
    return absl::DataLossError(
        absl::StrCat("checkpoint shard ", shard.path, " is missing; the manifest lists it"));
  }
  if (fd < 0) return ErrnoStatus(errno, absl::StrCat("opening ", shard.path));
  FdCloser closer(fd);
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    return ErrnoStatus(errno, absl::StrCat("reading the size of ", shard.path));
  }
  if (static_cast<int64_t>(st.st_size) != shard.bytes) {
    return absl::DataLossError(absl::StrCat(
        "checkpoint shard ", shard.path, " has ", static_cast<int64_t>(st.st_size),
        " bytes, the manifest says ", shard.bytes, "; the file is truncated or corrupt"));
  }
  for (const EntryRead& read : reads) {
    if (read.entry == nullptr) {
      return absl::DataLossError(absl::StrCat("checkpoint shard ", shard.path,
                                              ": its sidecar does not say where entry '", read.name,
                                              "' lies"));
    }
  }
  std::sort(reads.begin(), reads.end(), [](const EntryRead& a, const EntryRead& b) {
    return a.entry->range.offset < b.entry->range.offset;
  });
  for (EntryRead& read : reads) {
    const nn::EntryRange& range = read.entry->range;
    if (range.offset + range.bytes > shard.bytes) {
      return absl::DataLossError(
          absl::StrCat("checkpoint shard ", shard.path, ": its sidecar places entry '", read.name,
                       "' at bytes [", range.offset, ", ", range.offset + range.bytes,
                       "), past the end of the file (", shard.bytes, " bytes)"));
    }
    if (const std::optional<DataSpan> span = PartialSpan(read); span.has_value()) {
      HETPAR_ASSIGN_OR_RETURN(*read.out, ReadEntryPart(fd, shard.path, read, *span));
    } else {
      HETPAR_ASSIGN_OR_RETURN(at::Tensor whole, ReadEntry(fd, shard.path, read));
      HETPAR_ASSIGN_OR_RETURN(*read.out, NeededPart(whole, read));
    }
  }
  return absl::OkStatus();
}

// This rank's part of a parameter's tensor (the value, or a moment: `member`), joined from the
// pieces `load` read and converted to the optimizer's state dtype for the parameter (float32 for a
// bfloat16 parameter, whose value in the checkpoint is its float32 master; else its dtype).
at::Tensor LocalPart(const ParamLoad& load, at::Tensor Piece::*member) {
  const nn::NamedParameter& p = *load.param;
  at::Tensor joined;
  if (load.used.size() == 1) {
    joined = load.used.front().*member;
  } else {
    std::vector<at::Tensor> parts;
    for (const Piece& piece : load.used) parts.push_back(piece.*member);
    joined = at::cat(parts, load.split_dim);
  }
  at::Tensor part;
  if (load.split_dim >= 0 && p.slice.split_dim == load.split_dim) {
    // `joined` starts at the first piece's `begin` of split_dim.
    part = joined.narrow(load.split_dim, p.slice.offset - load.used.front().begin, p.slice.length);
  } else {
    // `joined` is the full tensor.
    part = p.slice.split_dim < 0 ? joined
                                 : joined.narrow(p.slice.split_dim, p.slice.offset, p.slice.length);
  }
  return part.to(nn::ParameterSet::GradDtypeOf(p.tensor.scalar_type())).contiguous();
}

// A step directory of a checkpoint parent.
struct StepDir {
  int64_t step = 0;
  fs::path path;
  bool complete = false;
};

}  // namespace

std::string ShardName(const ShardId& id) {
  return absl::StrCat(id.module, "-pp", id.pp, "-tp", id.tp);
}

std::string CheckpointDirName(int64_t step) {
  return absl::StrFormat("%s%06d", kCheckpointDirPrefix, step);
}

int64_t ShardSnapshot::bytes() const {
  int64_t total = 0;
  for (const nn::FullParameter& e : entries) {
    total += e.tensor.numel() * static_cast<int64_t>(e.tensor.element_size());
  }
  return total;
}

absl::StatusOr<ShardSnapshot> SnapshotShard(const ShardId& id, int64_t step,
                                            const nn::ParameterSet& params,
                                            const ModuleOptimizer* optimizer) {
  HETPAR_RETURN_IF_ERROR(CheckShardId(id));
  if (params.tp_rank() != id.tp || params.tp_size() != id.tp_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "checkpoint shard ", ShardName(id), " (tp ", id.tp, " of ", id.tp_size,
        ") for a parameter set of TP rank ", params.tp_rank(), " of ", params.tp_size()));
  }
  if (step < 0) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint of step ", step));
  }
  ShardSnapshot snapshot;
  snapshot.id = id;
  snapshot.step = step;
  snapshot.params = json::array();
  HETPAR_RETURN_IF_ERROR(nn::RunTorch("copying the checkpoint shard", [&] {
    // Copies: the optimizer's next step changes the parameters and its moments in place.
    for (const nn::NamedParameter& p : params.parameters()) {
      std::optional<ModuleOptimizer::ParamState> state;
      if (optimizer != nullptr) state = optimizer->StateOf(p.name);
      // A low-precision parameter's value is its float32 master (the parameter is its rounding).
      const bool master = state.has_value() && state->master.defined();
      snapshot.entries.push_back(
          {p.name, (master ? state->master : p.tensor).detach().to(at::kCPU).clone()});
      json entry{{"name", p.name},
                 {"full_shape", p.full_shape},
                 {"split_dim", p.slice.split_dim},
                 {"offset", p.slice.offset},
                 {"length", p.slice.length}};
      if (state.has_value()) {
        snapshot.entries.push_back(
            {p.name + "@exp_avg", state->exp_avg.detach().to(at::kCPU).clone()});
        snapshot.entries.push_back(
            {p.name + "@exp_avg_sq", state->exp_avg_sq.detach().to(at::kCPU).clone()});
        entry["adam_step"] = state->step;
      }
      snapshot.params.push_back(std::move(entry));
    }
  }));
  return snapshot;
}

absl::Status WriteShardSnapshot(const std::string& dir, const ShardSnapshot& snapshot) {
  const ShardId& id = snapshot.id;
  const std::string name = ShardName(id);
  const std::string file = name + ".hpar";
  const std::string shard_path = JoinPath(dir, file);
  const std::string sidecar_path = SidecarPath(dir, id);
  std::error_code error;
  if (fs::create_directories(dir, error)) {
    // The new step directory's entry in checkpoint.dir, before anything is written in it.
    HETPAR_RETURN_IF_ERROR(SyncDirectory(fs::path(dir).parent_path().string()));
  }
  if (error) return ErrnoStatus(error.value(), absl::StrCat("creating checkpoint directory ", dir));
  // The manifest of another write of this step (an earlier run trained it too) would go on
  // calling the directory complete while its shards are replaced: it goes first, durably.
  const std::string manifest_path = JoinPath(dir, kManifest);
  absl::StatusOr<json> manifest = ReadJsonFile(manifest_path, "checkpoint manifest");
  if (manifest.ok() || !absl::IsNotFound(manifest.status())) {
    const bool same_write = manifest.ok() && manifest->is_object() &&
                            manifest->value("write_id", uint64_t{0}) == snapshot.write_id;
    if (!same_write) {
      fs::remove(manifest_path, error);
      if (error) {
        return ErrnoStatus(error.value(), absl::StrCat("removing the stale ", manifest_path));
      }
      HETPAR_RETURN_IF_ERROR(SyncDirectory(dir));
    }
  }
  // A sidecar left by an earlier attempt would describe the old shard once the new one replaces
  // it; without it, the shard is simply not written yet.
  fs::remove(sidecar_path, error);
  if (error) return ErrnoStatus(error.value(), absl::StrCat("removing stale ", sidecar_path));
  // The file's checksum is summed while it is written: no second pass over the bytes.
  WrittenFile written;
  std::vector<nn::EntryRange> ranges;
  HETPAR_RETURN_IF_ERROR(nn::WriteFullParameters(snapshot.entries, shard_path, &written, &ranges));
  const FileSum sum{static_cast<int64_t>(written.bytes), written.crc32};
  // Where each parameter's entries lie, so that a load reads just the ones it needs, and the
  // block checksums of their data, so that it can read just the part of an entry it needs.
  std::map<std::string, size_t> where;
  for (size_t i = 0; i < ranges.size(); ++i) where[snapshot.entries[i].name] = i;
  json params = snapshot.params;
  for (json& p : params) {
    const auto range = [&](const std::string& suffix) -> absl::StatusOr<json> {
      const auto name = p.find("name");
      auto it = where.end();
      if (name != p.end() && name->is_string()) {
        it = where.find(name->get<std::string>() + suffix);
      }
      if (it == where.end()) {
        return absl::InvalidArgumentError(
            absl::StrCat("checkpoint shard ", shard_path, ": the snapshot's parameter ", p.dump(),
                         " has no entry", suffix.empty() ? "" : " ", suffix));
      }
      const nn::FullParameter& entry = snapshot.entries[it->second];
      return nn::RunTorchOr(absl::StrCat("checksumming checkpoint entry ", entry.name),
                            [&]() -> absl::StatusOr<json> {
                              return EntryRangeJson(ranges[it->second], entry.tensor);
                            });
    };
    json entries;
    HETPAR_ASSIGN_OR_RETURN(entries["value"], range(""));
    if (p.contains("adam_step")) {
      HETPAR_ASSIGN_OR_RETURN(entries["exp_avg"], range("@exp_avg"));
      HETPAR_ASSIGN_OR_RETURN(entries["exp_avg_sq"], range("@exp_avg_sq"));
    }
    p["entries"] = std::move(entries);
  }
  const json sidecar =
      SidecarJson(id, snapshot.step, snapshot.write_id, file, sum, std::move(params));
  return Annotate(WriteFileAtomically(sidecar_path, sidecar.dump(2) + "\n"),
                  absl::StrCat("writing checkpoint sidecar ", sidecar_path));
}

absl::Status WriteShard(const std::string& dir, const ShardId& id, int64_t step,
                        const nn::ParameterSet& params, const ModuleOptimizer* optimizer) {
  HETPAR_ASSIGN_OR_RETURN(ShardSnapshot snapshot, SnapshotShard(id, step, params, optimizer));
  return WriteShardSnapshot(dir, snapshot);
}

absl::StatusOr<bool> CompleteIfAllWritten(const std::string& dir,
                                          const std::vector<ShardId>& expected, int64_t step,
                                          const json& extra, uint64_t write_id) {
  if (expected.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("completing checkpoint ", dir, ": no shards expected"));
  }
  if (!extra.is_null() && !extra.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "completing checkpoint ", dir, ": extra must be a JSON object, not ", extra.type_name()));
  }
  std::set<std::string> names;
  for (const ShardId& id : expected) {
    HETPAR_RETURN_IF_ERROR(CheckShardId(id));
    if (!names.insert(ShardName(id)).second) {
      return absl::InvalidArgumentError(absl::StrCat("completing checkpoint ", dir, ": shard ",
                                                     ShardName(id), " is expected twice"));
    }
  }
  json shards = json::array();
  for (const ShardId& id : expected) {
    const std::string path = SidecarPath(dir, id);
    absl::StatusOr<Sidecar> sidecar = ReadSidecar(path);
    if (absl::IsNotFound(sidecar.status())) return false;  // not written yet
    if (!sidecar.ok()) return sidecar.status();
    if (sidecar->write_id != write_id) return false;  // another write's: this one's is to come
    const ShardId& got = sidecar->id;
    if (sidecar->step != step || got.module != id.module || got.tp != id.tp ||
        got.tp_size != id.tp_size || got.pp != id.pp || got.pp_size != id.pp_size) {
      return absl::FailedPreconditionError(
          absl::StrCat("checkpoint sidecar ", path, " is of step ", sidecar->step, ", tp ", got.tp,
                       " of ", got.tp_size, ", pp ", got.pp, " of ", got.pp_size,
                       "; expected step ", step, ", tp ", id.tp, " of ", id.tp_size, ", pp ", id.pp,
                       " of ", id.pp_size, " (a leftover of another run in the same directory?)"));
    }
    const std::string shard_path = JoinPath(dir, sidecar->file);
    std::error_code error;
    const uintmax_t bytes = fs::file_size(shard_path, error);
    if (error || static_cast<int64_t>(bytes) != sidecar->bytes) {
      return absl::DataLossError(
          absl::StrCat("checkpoint shard ", shard_path, " ",
                       error ? absl::StrCat("cannot be read: ", error.message())
                             : absl::StrCat("has ", bytes, " bytes"),
                       "; its sidecar says ", sidecar->bytes));
    }
    shards.push_back(json{{"name", ShardName(id)},
                          {"file", sidecar->file},
                          {"bytes", sidecar->bytes},
                          {"crc32", sidecar->crc32}});
  }
  const json manifest{{"format", kFormat},
                      {"step", step},
                      {"write_id", write_id},
                      {"shards", std::move(shards)},
                      {"extra", extra.is_null() ? json::object() : extra}};
  const std::string path = JoinPath(dir, kManifest);
  HETPAR_RETURN_IF_ERROR(Annotate(WriteFileAtomically(path, manifest.dump(2) + "\n"),
                                  absl::StrCat("writing checkpoint manifest ", path)));
  return true;
}

absl::StatusOr<CheckpointInfo> ReadCheckpointInfo(const std::string& dir) {
  HETPAR_ASSIGN_OR_RETURN(Manifest manifest, ReadManifest(dir));
  return CheckpointInfo{manifest.step, std::move(manifest.extra)};
}

absl::Status LoadModuleState(const std::string& dir, const std::string& module,
                             nn::ParameterSet& params, ModuleOptimizer* optimizer) {
  HETPAR_ASSIGN_OR_RETURN(Manifest manifest, ReadManifest(dir));
  HETPAR_ASSIGN_OR_RETURN(std::vector<ModuleShard> shards,
                          ReadModuleSidecars(dir, manifest, module));

  // From the sidecars alone: which saved slices each parameter needs.
  std::map<std::string, std::vector<Piece>> saved;
  for (size_t i = 0; i < shards.size(); ++i) {
    for (const SavedParam& param : shards[i].sidecar.params) {
      Piece piece;
      piece.shard = i;
      piece.saved = &param;
      piece.begin = param.offset;
      saved[param.name].push_back(std::move(piece));
    }
  }
  std::vector<ParamLoad> loads;
  for (const nn::NamedParameter& p : params.parameters()) {
    auto it = saved.find(p.name);
    if (it == saved.end()) {
      return absl::NotFoundError(absl::StrCat("parameter '", p.name, "' is in no shard of module '",
                                              module, "' in checkpoint ", dir));
    }
    HETPAR_ASSIGN_OR_RETURN(ParamLoad load, PlanParam(p, it->second, dir, optimizer != nullptr));
    loads.push_back(std::move(load));
  }

  // Then the entries those slices lie in, each read once, shard by shard, and of each only the
  // blocks holding the part of split_dim this rank keeps when that is less than the whole;
  // nothing else of the shard files is read.
  std::vector<std::vector<EntryRead>> reads(shards.size());
  for (ParamLoad& load : loads) {
    const nn::NamedParameter& p = *load.param;
    for (Piece& piece : load.used) {
      const SavedParam& s = *piece.saved;
      std::vector<int64_t> shape = s.full_shape;
      if (s.split_dim >= 0) shape[s.split_dim] = s.length;
      // The part of the saved slice's split_dim this rank keeps, when it is less than all of it.
      int need_dim = -1;
      int64_t need_begin = 0;
      int64_t need_end = 0;
      if (load.split_dim >= 0 && p.slice.split_dim == load.split_dim) {
        need_begin = std::clamp<int64_t>(p.slice.offset - s.offset, 0, s.length);
        need_end = std::clamp<int64_t>(p.slice.offset + p.slice.length - s.offset, 0, s.length);
        if (need_begin < need_end && (need_begin > 0 || need_end < s.length)) {
          need_dim = load.split_dim;
          piece.begin = s.offset + need_begin;
        }
      }
      // `entry` points into the sidecar (null without entry ranges), which outlives the reads.
      const auto read = [&](const std::string& name, const SavedEntry* entry, at::Tensor* out) {
        reads[piece.shard].push_back(
            EntryRead{name, entry, shape, need_dim, need_begin, need_end, out});
      };
      const auto moment = [&](const std::optional<SavedEntry> SavedEntries::*member) {
        return s.entries.has_value() && (*s.entries.*member).has_value() ? &*(*s.entries.*member)
                                                                         : nullptr;
      };
      read(s.name, s.entries.has_value() ? &s.entries->value : nullptr, &piece.value);
      if (load.with_state) {
        read(s.name + "@exp_avg", moment(&SavedEntries::exp_avg), &piece.exp_avg);
        read(s.name + "@exp_avg_sq", moment(&SavedEntries::exp_avg_sq), &piece.exp_avg_sq);
      }
    }
  }
  for (size_t i = 0; i < shards.size(); ++i) {
    if (!reads[i].empty()) HETPAR_RETURN_IF_ERROR(ReadShardEntries(shards[i], reads[i]));
  }

  // Everything is read, sliced and checked before the first parameter changes.
  struct Planned {
    const nn::NamedParameter* param;
    at::Tensor value;
    std::optional<ModuleOptimizer::ParamState> state;
  };
  std::vector<Planned> plan;
  for (const ParamLoad& load : loads) {
    const nn::NamedParameter& p = *load.param;
    Planned planned{&p, {}, std::nullopt};
    HETPAR_ASSIGN_OR_RETURN(planned.value,
                            nn::RunTorchOr(absl::StrCat("slicing parameter ", p.name),
                                           [&] { return LocalPart(load, &Piece::value); }));
    if (planned.value.sizes() != p.tensor.sizes()) {
      return absl::InvalidArgumentError(
          absl::StrCat("parameter '", p.name, "': its slice of checkpoint ", dir, " has shape ",
                       ShapeString(planned.value.sizes().vec()), ", this rank's tensor ",
                       ShapeString(p.tensor.sizes().vec())));
    }
    if (load.with_state) {
      ModuleOptimizer::ParamState state;
      state.step = *load.adam_step;
      HETPAR_ASSIGN_OR_RETURN(state.exp_avg,
                              nn::RunTorchOr(absl::StrCat("slicing the moments of ", p.name),
                                             [&] { return LocalPart(load, &Piece::exp_avg); }));
      HETPAR_ASSIGN_OR_RETURN(state.exp_avg_sq,
                              nn::RunTorchOr(absl::StrCat("slicing the moments of ", p.name),
                                             [&] { return LocalPart(load, &Piece::exp_avg_sq); }));
      // The saved value is the master of a low-precision parameter (SnapshotShard).
      if (optimizer->HasMasters()) state.master = planned.value;
      HETPAR_RETURN_IF_ERROR(
          Annotate(optimizer->CheckState(p.name, state), absl::StrCat("loading checkpoint ", dir)));
      planned.state = std::move(state);
    }
    plan.push_back(std::move(planned));
  }

  HETPAR_RETURN_IF_ERROR(nn::RunTorch(absl::StrCat("loading checkpoint ", dir), [&] {
    at::NoGradGuard no_grad;
    for (const Planned& planned : plan) planned.param->tensor.copy_(planned.value);
  }));
  if (optimizer == nullptr) return absl::OkStatus();
  for (const Planned& planned : plan) {
    if (planned.state.has_value()) {
      HETPAR_RETURN_IF_ERROR(Annotate(optimizer->SetState(planned.param->name, *planned.state),
                                      absl::StrCat("loading checkpoint ", dir)));
    } else {
      optimizer->ClearState(planned.param->name);
    }
  }
  return absl::OkStatus();
}

namespace {

// The name a .pruned-* directory `taken` is removed under: .removing-step-NNNNNN-<hex>.
fs::path RemovingName(const fs::path& taken) {
  return taken.parent_path() /
         absl::StrCat(kRemovedCheckpointPrefix,
                      taken.filename().string().substr(sizeof(kPrunedCheckpointPrefix) - 1));
}

// What a pruning cut short left in `parent` (the process killed, a file that cannot be unlinked)
// goes: a .removing-* directory, and a .pruned-* one that is not pinned, after a rename to its
// .removing-* name (the one process that renames it removes it; no other puts it back). A pinned
// one goes back (PutBackCheckpoint); one whose pin cannot be told stays. What cannot be done is
// logged: it does not stop the pruning of the step directories.
void ClearPrunedCheckpoints(const std::string& parent) {
  std::vector<fs::path> taken;
  std::vector<fs::path> removing;
  std::error_code error;
  for (fs::directory_iterator it(parent, error), end; !error && it != end; it.increment(error)) {
    const std::string name = it->path().filename().string();
    std::error_code kind_error;
    if (!it->is_directory(kind_error)) continue;
    if (!PrunedCheckpointOrigin(name).empty()) taken.push_back(it->path());
    if (name.rfind(absl::StrCat(kRemovedCheckpointPrefix, kCheckpointDirPrefix), 0) == 0) {
      removing.push_back(it->path());
    }
  }
  if (error) {
    HETPAR_LOG(WARNING) << "listing checkpoints in " << parent << ": " << error.message();
    return;
  }
  for (const fs::path& dir : taken) {
    const fs::path origin = dir.parent_path() / PrunedCheckpointOrigin(dir.filename().string());
    switch (CheckpointPinState(dir.string())) {
      case PinState::kPinned:
        if (absl::Status s = PutBackCheckpoint(dir.string(), origin.string()); !s.ok()) {
          HETPAR_LOG(WARNING) << s.message();
        }
        break;
      case PinState::kUnknown:
        HETPAR_LOG(WARNING) << "leaving " << dir.string()
                            << ": whether a restart pinned it cannot be told";
        break;
      case PinState::kNotPinned: {
        const fs::path to = RemovingName(dir);
        // ENOENT: its pruner, or another, put it back or removes it.
        if (::rename(dir.c_str(), to.c_str()) != 0) {
          if (errno != ENOENT) {
            HETPAR_LOG(WARNING) << "removing " << dir.string() << ": " << std::strerror(errno);
          }
          break;
        }
        removing.push_back(to);
        break;
      }
    }
  }
  for (const fs::path& dir : removing) {
    HETPAR_LOG(INFO) << "removing " << dir.string() << ", a checkpoint whose pruning was cut short";
    fs::remove_all(dir, error);
    // Its pruner, or another writer's pruning, removes it at the same time.
    if (error && error != std::errc::no_such_file_or_directory) {
      HETPAR_LOG(WARNING) << "removing " << dir.string() << ": " << error.message();
    }
    error.clear();
  }
}

}  // namespace

absl::Status PruneCheckpoints(const std::string& parent, int64_t keep, int64_t newest_step) {
  if (keep < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("pruning checkpoints of ", parent, ": keep=", keep, " must be >= 1"));
  }
  std::error_code error;
  if (!fs::exists(parent, error)) return absl::OkStatus();
  ClearPrunedCheckpoints(parent);
  std::vector<StepDir> steps;
  for (fs::directory_iterator it(parent, error), end; !error && it != end; it.increment(error)) {
    const std::string name = it->path().filename().string();
    const std::string digits = name.rfind(kCheckpointDirPrefix, 0) == 0
                                   ? name.substr(sizeof(kCheckpointDirPrefix) - 1)
                                   : "";
    StepDir dir;
    std::error_code kind_error;  // the throwing is_directory() would end the writer's thread
    if (digits.empty() || !std::all_of(digits.begin(), digits.end(), absl::ascii_isdigit) ||
        !absl::SimpleAtoi(digits, &dir.step) || !it->is_directory(kind_error) ||
        dir.step > newest_step) {
      continue;
    }
    dir.path = it->path();
    absl::StatusOr<CheckpointInfo> info = ReadCheckpointInfo(dir.path.string());
    // A missing or malformed manifest makes an incomplete checkpoint; anything else (a manifest
    // that cannot be read) stops the pruning rather than risk removing a good checkpoint.
    if (!info.ok() && !absl::IsNotFound(info.status()) && !absl::IsDataLoss(info.status())) {
      return Annotate(info.status(), absl::StrCat("pruning checkpoints of ", parent));
    }
    dir.complete = info.ok();
    steps.push_back(std::move(dir));
  }
  if (error) return ErrnoStatus(error.value(), absl::StrCat("listing checkpoints in ", parent));
  std::sort(steps.begin(), steps.end(),
            [](const StepDir& a, const StepDir& b) { return a.step > b.step; });
  std::optional<int64_t> newest_complete;
  int64_t kept = 0;
  for (const StepDir& dir : steps) {
    bool remove = false;
    if (dir.complete) {
      if (!newest_complete.has_value()) newest_complete = dir.step;
      // A restarted coordinator resumes from it: neither removed nor counted (and looked at
      // again before a removal, below).
      if (IsCheckpointPinned(dir.path.string())) continue;
      remove = kept >= keep;
      if (!remove) ++kept;
    } else {
      // Incomplete: a failed attempt when older than a complete one, else possibly being written.
      remove = newest_complete.has_value() && dir.step < *newest_complete;
    }
    if (!remove) continue;
    fs::path doomed = dir.path;
    if (dir.complete) {
      // Out of sight first (a name no reader takes for a checkpoint), then the pin looked at
      // again: a restart pins before it reads the checkpoint once more, so either its pin is
      // seen here and the checkpoint goes back, or its pin or its read finds no checkpoint.
      // Its own name: the checkpoint's writers on other hosts may prune at the same time.
      const fs::path taken = dir.path.parent_path() /
                             absl::StrCat(kPrunedCheckpointPrefix, dir.path.filename().string(),
                                          "-", absl::Hex(std::random_device()(), absl::kZeroPad8),
                                          absl::Hex(std::random_device()(), absl::kZeroPad8));
      if (::rename(dir.path.c_str(), taken.c_str()) != 0) {
        // ENOENT: another writer of the same checkpoint prunes too, and got there first.
        if (errno == ENOENT) continue;
        return ErrnoStatus(errno, absl::StrCat("removing checkpoint ", dir.path.string()));
      }
      if (IsCheckpointPinned(taken.string())) {
        HETPAR_RETURN_IF_ERROR(PutBackCheckpoint(taken.string(), dir.path.string()));
        continue;
      }
      // Then under a name that is never put back, before its files go: only a .removing-*
      // directory is ever removed in part (ClearPrunedCheckpoints may put a .pruned-* one back).
      doomed = RemovingName(taken);
      if (::rename(taken.c_str(), doomed.c_str()) != 0) {
        // ENOENT: another pruner's ClearPrunedCheckpoints took it first, to put it back or remove.
        if (errno == ENOENT) continue;
        return ErrnoStatus(errno, absl::StrCat("removing checkpoint ", dir.path.string()));
      }
      // Durably out of sight before its files go: a removal cut short (the process killed, a
      // file that cannot be unlinked) leaves a .removing-* directory, never a step directory
      // that looks complete without its shards.
      if (absl::Status synced = SyncDirectory(parent); !synced.ok()) {
        return Annotate(synced, absl::StrCat("removing checkpoint ", dir.path.string()));
      }
    }
    fs::remove_all(doomed, error);
    // Another writer that completed the same checkpoint may be pruning an incomplete one too:
    // what it removed first is simply gone.
    if (error == std::errc::no_such_file_or_directory) error.clear();
    if (error) {
      return ErrnoStatus(error.value(), absl::StrCat("removing checkpoint ", dir.path.string()));
    }
  }
  return absl::OkStatus();
}

}  // namespace hetpar::train
