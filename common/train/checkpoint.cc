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
#include <set>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/errno_status.h"
#include "common/atomic_file.h"
#include "common/nn/export.h"
#include "common/nn/torch_status.h"
#include "common/status.h"

namespace hetpar::train {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr int kFormat = 1;
constexpr char kManifest[] = "manifest.json";
constexpr char kStepPrefix[] = "step-";
// Checksums read files this many bytes at a time.
constexpr size_t kChunkBytes = size_t{1} << 20;

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

// What a sidecar says of one parameter's slice.
struct SavedParam {
  std::string name;
  std::vector<int64_t> full_shape;
  int split_dim = -1;
  int64_t offset = 0;
  int64_t length = 0;
  std::optional<int64_t> adam_step;
};

struct Sidecar {
  ShardId id;
  int64_t step = 0;
  std::string file;
  int64_t bytes = 0;
  uint32_t crc32 = 0;
  std::vector<SavedParam> params;
};

json SidecarJson(const ShardId& id, int64_t step, const std::string& file, const FileSum& sum,
                 json params) {
  return json{{"format", kFormat},
              {"module", id.module},
              {"step", step},
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
    sidecar.file = j.at("file").get<std::string>();
    sidecar.bytes = j.at("bytes").get<int64_t>();
    sidecar.crc32 = j.at("crc32").get<uint32_t>();
    for (const json& p : j.at("params")) {
      SavedParam saved;
      saved.name = p.at("name").get<std::string>();
      saved.full_shape = p.at("full_shape").get<std::vector<int64_t>>();
      saved.split_dim = p.at("split_dim").get<int>();
      saved.offset = p.at("offset").get<int64_t>();
      saved.length = p.at("length").get<int64_t>();
      if (p.contains("adam_step")) saved.adam_step = p.at("adam_step").get<int64_t>();
      sidecar.params.push_back(std::move(saved));
    }
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

// One shard's slice of a parameter, read and verified.
struct Piece {
  SavedParam saved;
  at::Tensor value;
  at::Tensor exp_avg;     // undefined without state
  at::Tensor exp_avg_sq;  // undefined without state
};

// A parameter's full tensor and, when saved, its full moments.
struct Assembled {
  at::Tensor value;
  std::optional<int64_t> adam_step;
  at::Tensor exp_avg;
  at::Tensor exp_avg_sq;
};

// Joins the pieces of parameter `name` from the shards of a module (in manifest order) into its
// full tensors. A replicated piece is the whole tensor; split pieces must tile split_dim.
absl::StatusOr<Assembled> Assemble(const std::string& name, const std::vector<Piece>& pieces,
                                   const std::string& dir) {
  const auto corrupt = [&](const std::string& why) {
    return absl::DataLossError(
        absl::StrCat("checkpoint ", dir, ": the shards of parameter '", name, "' ", why));
  };
  const SavedParam& first = pieces.front().saved;
  for (const Piece& piece : pieces) {
    if (piece.saved.full_shape != first.full_shape) {
      return corrupt(absl::StrCat("disagree on its full shape: ", ShapeString(first.full_shape),
                                  " and ", ShapeString(piece.saved.full_shape)));
    }
    if (piece.saved.adam_step != first.adam_step) {
      return corrupt("disagree on its AdamW step (or only some hold its state)");
    }
  }
  const std::vector<int64_t>& full_shape = first.full_shape;
  std::vector<const Piece*> used;
  auto replicated = std::find_if(pieces.begin(), pieces.end(),
                                 [](const Piece& piece) { return piece.saved.split_dim < 0; });
  int split_dim = -1;
  if (replicated != pieces.end()) {
    used.push_back(&*replicated);
  } else {
    split_dim = first.split_dim;
    if (split_dim >= static_cast<int>(full_shape.size())) {
      return corrupt(
          absl::StrCat("split dim ", split_dim, " of a ", full_shape.size(), "-dim tensor"));
    }
    for (const Piece& piece : pieces) {
      if (piece.saved.split_dim != split_dim) {
        return corrupt(
            absl::StrCat("disagree on its split dim: ", split_dim, " and ", piece.saved.split_dim));
      }
      used.push_back(&piece);
    }
    std::stable_sort(used.begin(), used.end(), [](const Piece* a, const Piece* b) {
      return a->saved.offset < b->saved.offset;
    });
    // The same slice saved twice (it should not be) is taken once.
    used.erase(std::unique(used.begin(), used.end(),
                           [](const Piece* a, const Piece* b) {
                             return a->saved.offset == b->saved.offset &&
                                    a->saved.length == b->saved.length;
                           }),
               used.end());
    int64_t next = 0;
    for (const Piece* piece : used) {
      if (piece->saved.offset != next || piece->saved.length <= 0) {
        return corrupt(absl::StrCat("do not tile dim ", split_dim, ": a slice at offset ",
                                    piece->saved.offset, " of length ", piece->saved.length,
                                    " where offset ", next, " was expected"));
      }
      next += piece->saved.length;
    }
    if (next != full_shape[split_dim]) {
      return corrupt(absl::StrCat("cover ", next, " of the ", full_shape[split_dim],
                                  " entries of dim ", split_dim));
    }
  }
  for (const Piece* piece : used) {
    std::vector<int64_t> expected = full_shape;
    if (split_dim >= 0) expected[split_dim] = piece->saved.length;
    for (const at::Tensor* t : {&piece->value, &piece->exp_avg, &piece->exp_avg_sq}) {
      if (t->defined() && t->sizes().vec() != expected) {
        return corrupt(absl::StrCat("hold a slice of shape ", ShapeString(t->sizes().vec()),
                                    " where the sidecar says ", ShapeString(expected)));
      }
    }
  }
  return nn::RunTorchOr(absl::StrCat("assembling parameter ", name), [&] {
    const auto join = [&](at::Tensor Piece::*member) {
      if (used.size() == 1) return used.front()->*member;
      std::vector<at::Tensor> parts;
      for (const Piece* piece : used) parts.push_back(piece->*member);
      return at::cat(parts, split_dim);
    };
    Assembled full;
    full.value = join(&Piece::value);
    full.adam_step = first.adam_step;
    if (first.adam_step.has_value()) {
      full.exp_avg = join(&Piece::exp_avg);
      full.exp_avg_sq = join(&Piece::exp_avg_sq);
    }
    return full;
  });
}

at::Tensor LocalSlice(const at::Tensor& full, const nn::NamedParameter& p) {
  const at::Tensor slice =
      p.slice.split_dim < 0 ? full : full.narrow(p.slice.split_dim, p.slice.offset, p.slice.length);
  return slice.to(p.tensor.scalar_type()).contiguous();
}

// Every piece held by the shards of `module` listed in `manifest`, by parameter name. Each shard
// is checked against the manifest before it is parsed.
//
// A rank reads every shard of its module whole (ReadFullParameters), however little of it it
// keeps: reading only the byte ranges of its slices is not implemented.
absl::StatusOr<std::map<std::string, std::vector<Piece>>> ReadModulePieces(
    const std::string& dir, const Manifest& manifest, const std::string& module) {
  std::map<std::string, std::vector<Piece>> pieces;
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
    const std::string path = JoinPath(dir, shard.file);
    absl::StatusOr<FileSum> sum = SumFile(path);
    if (absl::IsNotFound(sum.status())) {
      return absl::DataLossError(
          absl::StrCat("checkpoint shard ", path, " is missing; the manifest lists it"));
    }
    if (!sum.ok()) return sum.status();
    if (sum->bytes != shard.bytes || sum->crc32 != shard.crc32) {
      return absl::DataLossError(
          absl::StrCat("checkpoint shard ", path, " does not match the manifest: ", sum->bytes,
                       " bytes with CRC-32 ", sum->crc32, ", the manifest says ", shard.bytes,
                       " bytes with CRC-32 ", shard.crc32, "; the file is corrupt"));
    }
    HETPAR_ASSIGN_OR_RETURN(std::vector<nn::FullParameter> entries, nn::ReadFullParameters(path));
    std::map<std::string, at::Tensor> by_name;
    for (nn::FullParameter& entry : entries) by_name[entry.name] = std::move(entry.tensor);
    const auto entry = [&](const std::string& name) -> absl::StatusOr<at::Tensor> {
      auto it = by_name.find(name);
      if (it == by_name.end()) {
        return absl::DataLossError(absl::StrCat("checkpoint shard ", path, " has no entry '", name,
                                                "'; its sidecar lists it"));
      }
      return it->second;
    };
    for (const SavedParam& saved : sidecar->params) {
      Piece piece;
      piece.saved = saved;
      HETPAR_ASSIGN_OR_RETURN(piece.value, entry(saved.name));
      if (saved.adam_step.has_value()) {
        HETPAR_ASSIGN_OR_RETURN(piece.exp_avg, entry(saved.name + "@exp_avg"));
        HETPAR_ASSIGN_OR_RETURN(piece.exp_avg_sq, entry(saved.name + "@exp_avg_sq"));
      }
      pieces[saved.name].push_back(std::move(piece));
    }
  }
  return pieces;
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

std::string CheckpointDirName(int64_t step) { return absl::StrFormat("%s%06d", kStepPrefix, step); }

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
      snapshot.entries.push_back({p.name, p.tensor.detach().clone()});
      json entry{{"name", p.name},
                 {"full_shape", p.full_shape},
                 {"split_dim", p.slice.split_dim},
                 {"offset", p.slice.offset},
                 {"length", p.slice.length}};
      std::optional<ModuleOptimizer::ParamState> state;
      if (optimizer != nullptr) state = optimizer->StateOf(p.name);
      if (state.has_value()) {
        snapshot.entries.push_back({p.name + "@exp_avg", state->exp_avg.detach().clone()});
        snapshot.entries.push_back({p.name + "@exp_avg_sq", state->exp_avg_sq.detach().clone()});
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
  fs::create_directories(dir, error);
  if (error) return ErrnoStatus(error.value(), absl::StrCat("creating checkpoint directory ", dir));
  // A sidecar left by an earlier attempt would describe the old shard once the new one replaces
  // it; without it, the shard is simply not written yet.
  fs::remove(sidecar_path, error);
  if (error) return ErrnoStatus(error.value(), absl::StrCat("removing stale ", sidecar_path));
  // The file's checksum is summed while it is written: no second pass over the bytes.
  WrittenFile written;
  HETPAR_RETURN_IF_ERROR(nn::WriteFullParameters(snapshot.entries, shard_path, &written));
  const FileSum sum{static_cast<int64_t>(written.bytes), written.crc32};
  const json sidecar = SidecarJson(id, snapshot.step, file, sum, snapshot.params);
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
                                          const json& extra) {
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
  HETPAR_ASSIGN_OR_RETURN(auto pieces, ReadModulePieces(dir, manifest, module));

  // Everything is read, assembled and checked before the first parameter changes.
  struct Planned {
    const nn::NamedParameter* param;
    at::Tensor value;
    std::optional<ModuleOptimizer::ParamState> state;
  };
  std::vector<Planned> plan;
  for (const nn::NamedParameter& p : params.parameters()) {
    auto it = pieces.find(p.name);
    if (it == pieces.end()) {
      return absl::NotFoundError(absl::StrCat("parameter '", p.name, "' is in no shard of module '",
                                              module, "' in checkpoint ", dir));
    }
    HETPAR_ASSIGN_OR_RETURN(Assembled full, Assemble(p.name, it->second, dir));
    if (full.value.sizes().vec() != p.full_shape) {
      return absl::InvalidArgumentError(
          absl::StrCat("parameter '", p.name, "' has shape ", ShapeString(full.value.sizes().vec()),
                       " in checkpoint ", dir, "; the model expects ", ShapeString(p.full_shape)));
    }
    Planned planned{&p, {}, std::nullopt};
    HETPAR_ASSIGN_OR_RETURN(planned.value,
                            nn::RunTorchOr(absl::StrCat("slicing parameter ", p.name),
                                           [&] { return LocalSlice(full.value, p); }));
    if (planned.value.sizes() != p.tensor.sizes()) {
      return absl::InvalidArgumentError(
          absl::StrCat("parameter '", p.name, "': its slice of checkpoint ", dir, " has shape ",
                       ShapeString(planned.value.sizes().vec()), ", this rank's tensor ",
                       ShapeString(p.tensor.sizes().vec())));
    }
    if (optimizer != nullptr && p.trainable && full.adam_step.has_value()) {
      ModuleOptimizer::ParamState state;
      state.step = *full.adam_step;
      HETPAR_ASSIGN_OR_RETURN(state.exp_avg,
                              nn::RunTorchOr(absl::StrCat("slicing the moments of ", p.name),
                                             [&] { return LocalSlice(full.exp_avg, p); }));
      HETPAR_ASSIGN_OR_RETURN(state.exp_avg_sq,
                              nn::RunTorchOr(absl::StrCat("slicing the moments of ", p.name),
                                             [&] { return LocalSlice(full.exp_avg_sq, p); }));
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

absl::Status PruneCheckpoints(const std::string& parent, int64_t keep) {
  if (keep < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("pruning checkpoints of ", parent, ": keep=", keep, " must be >= 1"));
  }
  std::error_code error;
  if (!fs::exists(parent, error)) return absl::OkStatus();
  std::vector<StepDir> steps;
  for (fs::directory_iterator it(parent, error), end; !error && it != end; it.increment(error)) {
    const std::string name = it->path().filename().string();
    const std::string digits = name.substr(0, sizeof(kStepPrefix) - 1) == kStepPrefix
                                   ? name.substr(sizeof(kStepPrefix) - 1)
                                   : "";
    StepDir dir;
    if (digits.empty() || !std::all_of(digits.begin(), digits.end(), absl::ascii_isdigit) ||
        !absl::SimpleAtoi(digits, &dir.step) || !it->is_directory()) {
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
      remove = kept >= keep;
      if (!remove) ++kept;
    } else {
      // Incomplete: a failed attempt when older than a complete one, else possibly being written.
      remove = newest_complete.has_value() && dir.step < *newest_complete;
    }
    if (!remove) continue;
    fs::remove_all(dir.path, error);
    // Another writer that completed the same checkpoint may be pruning too: what it removed
    // first is simply gone.
    if (error == std::errc::no_such_file_or_directory) error.clear();
    if (error) {
      return ErrnoStatus(error.value(), absl::StrCat("removing checkpoint ", dir.path.string()));
    }
  }
  return absl::OkStatus();
}

}  // namespace hetpar::train
