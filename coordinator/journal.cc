#include "coordinator/journal.h"

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "common/atomic_file.h"
#include "common/checkpoint_pin.h"
#include "common/config/config.h"
#include "common/logging.h"
#include "coordinator/run_controller.h"
#include "nlohmann/json.hpp"

namespace hetpar::coordinator {
namespace {

constexpr int kFormat = 1;

std::optional<v1::RunState> StateFromName(const std::string& name) {
  for (v1::RunState state : {v1::RUN_STATE_WAITING, v1::RUN_STATE_RUNNING, v1::RUN_STATE_STOPPING,
                             v1::RUN_STATE_DONE, v1::RUN_STATE_FAILED}) {
    if (name == RunStateName(state)) return state;
  }
  return std::nullopt;
}

}  // namespace

bool Journal::operator==(const Journal& o) const {
  return run == o.run && state == o.state && generation == o.generation &&
         committed_steps == o.committed_steps && total_steps == o.total_steps &&
         checkpoint_dir == o.checkpoint_dir && last_checkpoint == o.last_checkpoint &&
         last_checkpoint_step == o.last_checkpoint_step && restarts == o.restarts &&
         foreign_checkpoints == o.foreign_checkpoints && first_step == o.first_step;
}

std::string JournalPath(const std::string& run_dir) { return run_dir + "/journal.json"; }

absl::Status WriteJournal(const std::string& run_dir, const Journal& journal) {
  nlohmann::json j = {{"format", kFormat},
                      {"run", journal.run},
                      {"state", RunStateName(journal.state)},
                      {"generation", journal.generation},
                      {"committed_steps", journal.committed_steps},
                      {"total_steps", journal.total_steps},
                      {"checkpoint_dir", journal.checkpoint_dir},
                      {"last_checkpoint", journal.last_checkpoint},
                      {"last_checkpoint_step", journal.last_checkpoint_step},
                      {"restarts", journal.restarts}};
  if (journal.first_step >= 0) j["first_step"] = journal.first_step;
  if (!journal.foreign_checkpoints.empty()) {
    nlohmann::json& foreign = j["foreign_checkpoints"] = nlohmann::json::array();
    for (const CheckpointWrite& c : journal.foreign_checkpoints) {
      foreign.push_back({{"step", c.step}, {"write_id", c.write_id}});
    }
  }
  return WriteFileAtomically(JournalPath(run_dir), j.dump(2) + "\n");
}

absl::StatusOr<std::optional<Journal>> ReadJournal(const std::string& run_dir) {
  const std::string path = JournalPath(run_dir);
  std::ifstream in(path);
  if (!in) {
    std::error_code ec;
    if (!std::filesystem::exists(path, ec)) return std::optional<Journal>();
    return absl::PermissionDeniedError(absl::StrCat("cannot read the journal ", path));
  }
  std::stringstream text;
  text << in.rdbuf();
  const nlohmann::json j = nlohmann::json::parse(text.str(), nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::DataLossError(absl::StrCat("the journal ", path, " is not a JSON object"));
  }
  Journal journal;
  std::string bad;  // the first malformed field
  auto integer = [&](const char* field, int64_t min, int64_t* out) {
    if (!bad.empty()) return;
    if (!j.contains(field) || !j[field].is_number_integer() || j[field].get<int64_t>() < min ||
        (j[field].is_number_unsigned() && j[field].get<uint64_t>() > INT64_MAX)) {
      bad = field;
      return;
    }
    *out = j[field].get<int64_t>();
  };
  auto string = [&](const char* field, std::string* out) {
    if (!bad.empty()) return;
    if (!j.contains(field) || !j[field].is_string()) {
      bad = field;
      return;
    }
    *out = j[field].get<std::string>();
  };
  int64_t format = 0;
  integer("format", 0, &format);
  if (bad.empty() && format != kFormat) {
    return absl::DataLossError(
        absl::StrCat("the journal ", path, " has format ", format, "; this build reads ", kFormat));
  }
  string("run", &journal.run);
  std::string state;
  string("state", &state);
  if (bad.empty()) {
    std::optional<v1::RunState> parsed = StateFromName(state);
    if (parsed.has_value()) {
      journal.state = *parsed;
    } else {
      bad = "state";
    }
  }
  integer("generation", 1, &journal.generation);
  integer("committed_steps", 0, &journal.committed_steps);
  integer("total_steps", 0, &journal.total_steps);
  string("checkpoint_dir", &journal.checkpoint_dir);
  string("last_checkpoint", &journal.last_checkpoint);
  integer("last_checkpoint_step", -1, &journal.last_checkpoint_step);
  integer("restarts", 0, &journal.restarts);
  // Optional: a journal written before it was recorded has none.
  if (bad.empty() && j.contains("first_step")) integer("first_step", 0, &journal.first_step);
  // Optional: a journal of a run that found no other run's checkpoints has none.
  if (bad.empty() && j.contains("foreign_checkpoints")) {
    const nlohmann::json& foreign = j["foreign_checkpoints"];
    if (!foreign.is_array()) bad = "foreign_checkpoints";
    for (size_t i = 0; bad.empty() && i < foreign.size(); ++i) {
      const nlohmann::json& c = foreign[i];
      if (!c.is_object() || !c.contains("step") || !c["step"].is_number_integer() ||
          c["step"].get<int64_t>() < 0 || !c.contains("write_id") ||
          !c["write_id"].is_number_unsigned()) {
        bad = "foreign_checkpoints";
        break;
      }
      journal.foreign_checkpoints.push_back(
          {c["step"].get<int64_t>(), c["write_id"].get<uint64_t>()});
    }
  }
  if (!bad.empty()) {
    return absl::DataLossError(absl::StrCat("the journal ", path, " has a missing or malformed \"",
                                            bad, "\"",
                                            j.contains(bad) ? ": " + j[bad].dump() : ""));
  }
  return std::optional<Journal>(std::move(journal));
}

absl::StatusOr<std::unique_ptr<DirectoryLock>> ClaimCheckpointDir(const v1::RunSpec& spec,
                                                                  bool create) {
  const std::string& dir = spec.checkpoint().dir();
  if (dir.empty()) return nullptr;
  std::error_code error;
  if (!create) {
    if (!std::filesystem::is_directory(dir, error)) return nullptr;
  } else if (std::filesystem::create_directories(dir, error); error) {
    return absl::PermissionDeniedError(
        absl::StrCat("cannot create checkpoint.dir '", dir, "': ", error.message()));
  }
  return DirectoryLock::Take(
      dir, ".hetpar-checkpoint.lock", "checkpoint.dir",
      "two runs writing one checkpoint.dir would overwrite and prune each other's checkpoints; "
      "wait for that run to end, or give this run another checkpoint.dir",
      absl::StrCat("run directory ", spec.run().out_dir()));
}

absl::Status CheckCheckpointDirForNewRun(const v1::RunSpec& spec) {
  const std::string& dir = spec.checkpoint().dir();
  const std::optional<FoundCheckpoint> newest = NewestCompleteCheckpoint(dir);
  if (!newest.has_value()) return absl::OkStatus();
  if (const std::string& from = spec.checkpoint().resume_from(); !from.empty()) {
    // The step directory's parent, however either path is written (a trailing slash, a link).
    std::error_code error;
    const std::filesystem::path step = std::filesystem::weakly_canonical(from, error);
    if (!error && std::filesystem::equivalent(step.parent_path(), dir, error) && !error) {
      return absl::OkStatus();
    }
  }
  const std::string of_run =
      newest->run.empty() ? std::string() : absl::StrCat(", written by run '", newest->run, "'");
  return absl::FailedPreconditionError(absl::StrCat(
      "checkpoint.dir '", dir, "' already holds checkpoints (the newest: ", newest->path,
      ", step ", newest->step, of_run,
      "); a new run there would overwrite them step by step and prune them. Resume from it "
      "(checkpoint.resume_from, or hetpar run --resume ",
      newest->path, "), or give this run another checkpoint.dir"));
}

std::optional<FoundCheckpoint> NewestCompleteCheckpoint(
    const std::string& checkpoint_dir, int64_t at_most, const std::string& run,
    const std::vector<CheckpointWrite>& foreign) {
  std::optional<FoundCheckpoint> newest;
  std::error_code ec;
  if (checkpoint_dir.empty()) return newest;
  // Not a range-for: its increment throws on an error (a file system that stops answering).
  for (std::filesystem::directory_iterator it(checkpoint_dir, ec), end; !ec && it != end;
       it.increment(ec)) {
    const std::filesystem::directory_entry& entry = *it;
    const std::string name = entry.path().filename().string();
    if (name.rfind(kCheckpointDirPrefix, 0) != 0) continue;
    absl::StatusOr<config::CheckpointSummary> summary =
        config::ReadCheckpointSummary(entry.path().string());
    if (!summary.ok()) {
      // Incomplete, or not a checkpoint; one that cannot be read is passed over, saying so.
      if (!absl::IsNotFound(summary.status()) && !absl::IsDataLoss(summary.status())) {
        HETPAR_LOG(WARNING) << "passing over " << entry.path().string() << ": "
                            << summary.status().message();
      }
      continue;
    }
    if (summary->step > at_most) continue;
    if (!run.empty() && !summary->run.empty() && summary->run != run) continue;
    if (std::find(foreign.begin(), foreign.end(),
                  CheckpointWrite{summary->step, summary->write_id}) != foreign.end()) {
      continue;
    }
    if (!newest.has_value() || summary->step > newest->step) {
      newest =
          FoundCheckpoint{entry.path().string(), summary->step, summary->run, summary->write_id};
    }
  }
  return newest;
}

std::vector<CheckpointWrite> CompleteCheckpointsAfter(const std::string& checkpoint_dir,
                                                      int64_t after) {
  std::vector<CheckpointWrite> found;
  std::error_code ec;
  if (checkpoint_dir.empty()) return found;
  for (std::filesystem::directory_iterator it(checkpoint_dir, ec), end; !ec && it != end;
       it.increment(ec)) {
    if (it->path().filename().string().rfind(kCheckpointDirPrefix, 0) != 0) continue;
    absl::StatusOr<config::CheckpointSummary> summary =
        config::ReadCheckpointSummary(it->path().string());
    if (summary.ok() && summary->step > after) found.push_back({summary->step, summary->write_id});
  }
  std::sort(found.begin(), found.end(),
            [](const CheckpointWrite& a, const CheckpointWrite& b) { return a.step < b.step; });
  return found;
}

}  // namespace hetpar::coordinator
