#include "coordinator/output_sink.h"

#include <zlib.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <system_error>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/errno_status.h"
#include "common/logging.h"
#include "common/status.h"

namespace hetpar::coordinator {
namespace {

// The parameter file header (common/nn/export.h, version 1).
constexpr char kMagic[8] = {'H', 'E', 'T', 'P', 'A', 'R', 'A', 'M'};
constexpr uint32_t kVersion = 1;
constexpr size_t kHeaderBytes = 32;
constexpr const char* kStageInfix = ".hpar.stage-";

template <typename T>
T GetLe(const char* bytes) {
  T value = 0;
  for (size_t i = 0; i < sizeof(T); ++i) {
    value |= static_cast<T>(static_cast<uint8_t>(bytes[i])) << (8 * i);
  }
  return value;
}

template <typename T>
void PutLe(std::string* out, T value) {
  for (size_t i = 0; i < sizeof(T); ++i) out->push_back(static_cast<char>(value >> (8 * i)));
}

uint32_t Crc32(const void* data, size_t bytes) {
  return static_cast<uint32_t>(
      crc32_z(crc32_z(0, Z_NULL, 0), static_cast<const Bytef*>(data), bytes));
}

bool IsModule(absl::string_view module) { return module == "encoder" || module == "llm"; }

bool IsNumber(absl::string_view text, int64_t* value) {
  if (text.empty() || text.size() > 9) return false;
  for (char c : text) {
    if (!absl::ascii_isdigit(static_cast<unsigned char>(c))) return false;
  }
  return absl::SimpleAtoi(text, value);
}

// What an output name says: a sums file, a model file, or a stage's part of one.
struct OutputName {
  std::string module;
  int64_t stage = -1;  // a stage part: its stage
};

absl::StatusOr<OutputName> ParseName(const std::string& name) {
  const auto invalid = [&] {
    return absl::InvalidArgumentError(
        absl::StrCat("output name '", name.substr(0, 200),
                     "' is not one a worker sends (workers/rank-<world rank>-<encoder|llm>.json, "
                     "model/<encoder|llm>.hpar or model/<encoder|llm>.hpar.stage-<s>)"));
  };
  absl::string_view rest = name;
  if (absl::ConsumePrefix(&rest, "workers/rank-")) {
    if (!absl::ConsumeSuffix(&rest, ".json")) return invalid();
    const size_t dash = rest.find('-');
    int64_t rank = 0;
    if (dash == absl::string_view::npos || !IsNumber(rest.substr(0, dash), &rank) ||
        !IsModule(rest.substr(dash + 1))) {
      return invalid();
    }
    return OutputName{std::string(rest.substr(dash + 1)), -1};
  }
  if (absl::ConsumePrefix(&rest, "model/")) {
    const size_t stage_at = rest.find(kStageInfix);
    if (stage_at != absl::string_view::npos) {
      int64_t stage = 0;
      const absl::string_view module = rest.substr(0, stage_at);
      if (!IsModule(module) || !IsNumber(rest.substr(stage_at + strlen(kStageInfix)), &stage)) {
        return invalid();
      }
      return OutputName{std::string(module), stage};
    }
    if (!absl::ConsumeSuffix(&rest, ".hpar") || !IsModule(rest)) return invalid();
    return OutputName{std::string(rest), -1};
  }
  return invalid();
}

std::string StagePart(const std::string& run_dir, const std::string& module, int64_t stage) {
  return absl::StrCat(run_dir, "/model/", module, kStageInfix, stage);
}

}  // namespace

absl::Status JoinParameterFiles(const std::vector<std::string>& parts, const std::string& path) {
  uint64_t entries = 0;
  std::vector<uint64_t> sizes;
  for (const std::string& part : parts) {
    std::ifstream in(part, std::ios::binary);
    if (!in) return ErrnoStatus(errno, absl::StrCat("opening ", part));
    char header[kHeaderBytes];
    if (!in.read(header, kHeaderBytes)) {
      return absl::DataLossError(
          absl::StrCat(part, " is shorter than a parameter file's ", kHeaderBytes, "-byte header"));
    }
    if (std::memcmp(header, kMagic, sizeof(kMagic)) != 0 ||
        GetLe<uint32_t>(header + 8) != kVersion ||
        GetLe<uint32_t>(header + 24) != Crc32(header, 24)) {
      return absl::DataLossError(absl::StrCat(part, " does not start with a version-", kVersion,
                                              " parameter file header"));
    }
    entries += GetLe<uint64_t>(header + 16);
    std::error_code ec;
    sizes.push_back(std::filesystem::file_size(part, ec));
    if (ec) return ErrnoStatus(ec.value(), absl::StrCat("reading the size of ", part));
  }
  HETPAR_ASSIGN_OR_RETURN(std::unique_ptr<AtomicFileWriter> out, AtomicFileWriter::Create(path));
  std::string header(kMagic, sizeof(kMagic));
  PutLe<uint32_t>(&header, kVersion);
  PutLe<uint32_t>(&header, 0);
  PutLe<uint64_t>(&header, entries);
  PutLe<uint32_t>(&header, Crc32(header.data(), header.size()));
  PutLe<uint32_t>(&header, 0);
  HETPAR_RETURN_IF_ERROR(out->Append(header.data(), header.size()));
  std::vector<char> buffer(size_t{4} << 20);
  for (size_t i = 0; i < parts.size(); ++i) {
    std::ifstream in(parts[i], std::ios::binary);
    in.seekg(kHeaderBytes);
    uint64_t left = sizes[i] - kHeaderBytes;
    while (left > 0) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(left, buffer.size()));
      if (!in.read(buffer.data(), static_cast<std::streamsize>(n))) {
        return absl::DataLossError(absl::StrCat("reading ", parts[i], ": it shrank while joined"));
      }
      HETPAR_RETURN_IF_ERROR(out->Append(buffer.data(), n));
      left -= n;
    }
  }
  return out->Commit();
}

absl::Status OutputSink::Upload::Append(std::string_view data) {
  if (file_->written().bytes + data.size() > total_bytes_) {
    return absl::DataLossError(absl::StrCat("output ", name_, ": more than the announced ",
                                            total_bytes_, " bytes arrived"));
  }
  return file_->Append(data.data(), data.size());
}

absl::Status OutputSink::Upload::Finish(uint32_t crc32) {
  const WrittenFile got = file_->written();
  if (got.bytes != total_bytes_ || got.crc32 != crc32) {
    return absl::DataLossError(absl::StrCat(
        "output ", name_, " arrived damaged: ", got.bytes, " bytes with CRC-32 ", got.crc32,
        ", the sender said ", total_bytes_, " bytes with CRC-32 ", crc32, "; not written"));
  }
  HETPAR_RETURN_IF_ERROR(file_->Commit());
  HETPAR_ASSIGN_OR_RETURN(OutputName parsed, ParseName(name_));
  if (parsed.stage >= 0) return sink_->MaybeJoinStages(parsed.module);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<OutputSink::Upload>> OutputSink::Begin(const std::string& name,
                                                                      uint64_t total_bytes) {
  HETPAR_ASSIGN_OR_RETURN(OutputName parsed, ParseName(name));
  if (parsed.stage >= 0) {
    const int64_t stages = parsed.module == "llm" ? llm_stages_ : 1;
    if (stages < 2 || parsed.stage >= stages) {
      return absl::InvalidArgumentError(absl::StrCat("output ", name, ": the ", parsed.module,
                                                     " has ", stages, " pipeline stage(s); no ",
                                                     "stage ", parsed.stage, " part is expected"));
    }
  }
  HETPAR_ASSIGN_OR_RETURN(std::unique_ptr<AtomicFileWriter> file,
                          AtomicFileWriter::Create(absl::StrCat(run_dir_, "/", name)));
  return std::unique_ptr<Upload>(new Upload(this, name, total_bytes, std::move(file)));
}

absl::Status OutputSink::MaybeJoinStages(const std::string& module) {
  absl::MutexLock lock(&join_mu_);
  const int64_t stages = module == "llm" ? llm_stages_ : 1;
  std::vector<std::string> parts;
  for (int64_t stage = 0; stage < stages; ++stage) {
    parts.push_back(StagePart(run_dir_, module, stage));
    std::error_code ec;
    if (!std::filesystem::exists(parts.back(), ec)) return absl::OkStatus();  // more to come
  }
  const std::string path = absl::StrCat(run_dir_, "/model/", module, ".hpar");
  HETPAR_RETURN_IF_ERROR(JoinParameterFiles(parts, path));
  for (const std::string& part : parts) {
    std::error_code ec;
    std::filesystem::remove(part, ec);
  }
  HETPAR_LOG(INFO) << "joined the " << stages << " pipeline stages' parts into " << path;
  return absl::OkStatus();
}

}  // namespace hetpar::coordinator
