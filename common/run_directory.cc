#include "common/run_directory.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>

#include "absl/strings/str_cat.h"
#include "common/atomic_file.h"
#include "common/config/config.h"
#include "nlohmann/json.hpp"

namespace hetpar {

namespace {

// The step of a line of metrics.jsonl: a step line's, or (with `pool_changes`) the step at whose
// boundary a pool change line's replica left or joined; nullopt for any other line (end-of-run
// lines, a line cut short by a crash).
std::optional<int64_t> StepOfLine(const std::string& line, bool pool_changes = false) {
  const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
  if (!j.is_object()) return std::nullopt;
  const nlohmann::json* holder = &j;
  if (pool_changes && j.contains("pool_change")) holder = &j["pool_change"];
  if (!holder->is_object() || !holder->contains("step") || !(*holder)["step"].is_number_integer()) {
    return std::nullopt;
  }
  return (*holder)["step"].get<int64_t>();
}

absl::Status Prepare(const std::string& path, const hetpar::v1::RunSpec& spec) {
  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(path) / "log", ec);
  if (ec) {
    return absl::PermissionDeniedError(
        absl::StrCat("cannot create run directory '", path, "': ", ec.message()));
  }
  // Whole or not at all: a coordinator continuing the run reads it back, and a file cut short
  // by a crash or a full disk would not load.
  return WriteFileAtomically(path + "/config.yaml", config::RunSpecToYaml(spec));
}

}  // namespace

absl::StatusOr<std::unique_ptr<RunDirectory>> RunDirectory::Create(
    const std::string& path, const hetpar::v1::RunSpec& spec) {
  if (absl::Status s = Prepare(path, spec); !s.ok()) return s;
  std::FILE* metrics = std::fopen((path + "/metrics.jsonl").c_str(), "w");
  if (metrics == nullptr) {
    return absl::PermissionDeniedError(
        absl::StrCat("cannot write '", path, "/metrics.jsonl': ", std::strerror(errno)));
  }
  return std::unique_ptr<RunDirectory>(new RunDirectory(path, metrics));
}

absl::StatusOr<std::unique_ptr<RunDirectory>> RunDirectory::Continue(
    const std::string& path, const hetpar::v1::RunSpec& spec, int64_t first_step) {
  if (absl::Status s = Prepare(path, spec); !s.ok()) return s;
  std::string kept;
  {
    std::ifstream in(path + "/metrics.jsonl");
    for (std::string line; std::getline(in, line);) {
      const std::optional<int64_t> step = StepOfLine(line, /*pool_changes=*/true);
      if (step.has_value() && *step < first_step) kept += line + "\n";
    }
  }
  // Replaced whole (a crash here leaves the old file), then appended to.
  if (absl::Status s = WriteFileAtomically(path + "/metrics.jsonl", kept); !s.ok()) return s;
  std::FILE* metrics = std::fopen((path + "/metrics.jsonl").c_str(), "a");
  if (metrics == nullptr) {
    return absl::PermissionDeniedError(
        absl::StrCat("cannot append to '", path, "/metrics.jsonl': ", std::strerror(errno)));
  }
  return std::unique_ptr<RunDirectory>(new RunDirectory(path, metrics));
}

int64_t RunDirectory::StepAfterLastLine(const std::string& path, int64_t from) {
  int64_t after = from;
  std::ifstream in(path + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    if (const std::optional<int64_t> step = StepOfLine(line)) after = std::max(after, *step + 1);
  }
  return after;
}

RunDirectory::~RunDirectory() { std::fclose(metrics_); }

absl::Status RunDirectory::AppendMetrics(const std::string& json_line) {
  const std::string line = json_line + "\n";
  if (std::fwrite(line.data(), 1, line.size(), metrics_) != line.size() ||
      std::fflush(metrics_) != 0) {
    return absl::DataLossError(
        absl::StrCat("cannot append to '", path_, "/metrics.jsonl': ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

}  // namespace hetpar
