#include "common/worker/outputs.h"

#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <fstream>
#include <set>
#include <system_error>
#include <vector>

#include "absl/base/const_init.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/atomic_file.h"
#include "common/errno_status.h"
#include "common/nn/export.h"
#include "common/status.h"
#include "common/train/optimizer.h"
#include "nlohmann/json.hpp"

namespace hetpar::worker {
namespace {

constexpr char kScratchPrefix[] = "hetpar-";
constexpr char kScratchMarker[] = "-outputs-";  // hetpar-<module>-outputs-<pid>.XXXXXX

// The scratch directories that exist now, for RemoveOutputScratch (never destroyed: a signal's
// thread may use it as the process exits).
absl::Mutex g_scratch_mu(absl::kConstInit);
std::set<std::string>* Scratch() ABSL_EXCLUSIVE_LOCKS_REQUIRED(g_scratch_mu) {
  static auto* paths = new std::set<std::string>();
  return paths;
}

// A directory of its own under $TMPDIR, removed with everything in it when destroyed (or by
// RemoveOutputScratch before an exit that destroys nothing).
class ScratchDirectory {
 public:
  static absl::StatusOr<ScratchDirectory> Create(const std::string& what) {
    std::error_code ec;
    const std::filesystem::path base = std::filesystem::temp_directory_path(ec);
    if (ec) return ErrnoStatus(ec.value(), "finding the temporary directory ($TMPDIR)");
    std::string pattern =
        (base / absl::StrCat(kScratchPrefix, what, kScratchMarker, ::getpid(), ".XXXXXX")).string();
    absl::MutexLock lock(&g_scratch_mu);
    if (::mkdtemp(pattern.data()) == nullptr) {
      return ErrnoStatus(errno, absl::StrCat("creating a scratch directory like ", pattern));
    }
    Scratch()->insert(pattern);
    return ScratchDirectory(pattern);
  }
  ScratchDirectory(ScratchDirectory&& other) noexcept : path_(std::move(other.path_)) {
    other.path_.clear();
  }
  ScratchDirectory(const ScratchDirectory&) = delete;
  ScratchDirectory& operator=(const ScratchDirectory&) = delete;
  ScratchDirectory& operator=(ScratchDirectory&&) = delete;
  ~ScratchDirectory() {
    if (path_.empty()) return;
    absl::MutexLock lock(&g_scratch_mu);
    Scratch()->erase(path_);
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  explicit ScratchDirectory(std::string path) : path_(std::move(path)) {}
  std::string path_;
};

absl::Status EnsureDirectory(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return absl::PermissionDeniedError(
        absl::StrCat("cannot create directory '", dir, "': ", ec.message()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status AppendStepTimings(const std::string& out_dir, int64_t world_rank, int64_t step,
                               const ModuleTimings& timings) {
  if (out_dir.empty()) return absl::OkStatus();
  HETPAR_RETURN_IF_ERROR(EnsureDirectory(out_dir + "/workers"));
  nlohmann::json line = {{"step", step}, {"module", timings.module}};
  for (const auto& [key, value] : timings.values) line[key] = value;
  const std::string path = absl::StrCat(out_dir, "/workers/rank-", world_rank, ".steps.jsonl");
  std::ofstream out(path, std::ios::app);
  out << line.dump() << "\n";
  out.flush();
  if (!out) return absl::DataLossError(absl::StrCat("cannot append to '", path, "'"));
  return absl::OkStatus();
}

void AddBridgeStats(const train::BoundaryCommunicator& boundary, plan::Direction direction,
                    ModuleTimings* timings) {
  const train::BridgeStats bridge = boundary.Stats(direction);
  timings->values["bridge_messages"] = static_cast<double>(bridge.messages);
  timings->values["bridge_bytes"] = static_cast<double>(bridge.bytes);
  timings->values["bridge_transfer_s"] = bridge.transfer_s;
  timings->values["bridge_transfer_sum_s"] = bridge.sum_transfer_s;
}

absl::Status WriteModuleOutputs(const OutputSender& send, int64_t world_rank,
                                const std::string& module, int64_t dp_rank,
                                const nn::ParameterSet& params, nn::Communicator& tp,
                                nn::Communicator& pp) {
  HETPAR_ASSIGN_OR_RETURN(ScratchDirectory scratch, ScratchDirectory::Create(module));
  const train::OwnedSums sums = train::OwnedParamSums(params);
  const nlohmann::json j = {{"world_rank", world_rank},
                            {"module", module},
                            {"dp", dp_rank},
                            {"sum", sums.sum},
                            {"square_sum", sums.square_sum}};
  const std::string sums_file = scratch.path() + "/sums.json";
  HETPAR_RETURN_IF_ERROR(WriteFileAtomically(sums_file, j.dump() + "\n"));
  HETPAR_RETURN_IF_ERROR(
      send(absl::StrCat("workers/rank-", world_rank, "-", module, ".json"), sums_file));
  if (dp_rank != 0) return absl::OkStatus();
  const std::string model_file = scratch.path() + "/model.hpar";
  HETPAR_RETURN_IF_ERROR(nn::SaveFullParameters(params, tp, model_file));
  if (tp.rank() != 0) return absl::OkStatus();
  const std::string name = pp.size() == 1
                               ? absl::StrCat("model/", module, ".hpar")
                               : absl::StrCat("model/", module, ".hpar.stage-", pp.rank());
  return send(name, model_file);
}

void RemoveOutputScratch() {
  absl::MutexLock lock(&g_scratch_mu);
  for (const std::string& path : *Scratch()) {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  Scratch()->clear();
}

int SweepStaleOutputScratch() {
  std::error_code ec;
  const std::filesystem::path base = std::filesystem::temp_directory_path(ec);
  if (ec) return 0;
  int removed = 0;
  for (std::filesystem::directory_iterator it(base, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    const size_t marker = name.find(kScratchMarker);
    if (!absl::StartsWith(name, kScratchPrefix) || marker == std::string::npos) continue;
    const size_t digits = marker + sizeof(kScratchMarker) - 1;
    const size_t dot = name.find('.', digits);
    int64_t pid = 0;
    if (dot == std::string::npos || !absl::SimpleAtoi(name.substr(digits, dot - digits), &pid) ||
        pid <= 0) {
      continue;
    }
    // This process's own (from before a restart, which keeps the pid) or a process's that is gone.
    const bool stale =
        pid == ::getpid() || (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH);
    std::error_code kind_error;
    if (!stale || !it->is_directory(kind_error)) continue;
    std::error_code remove_error;
    std::filesystem::remove_all(it->path(), remove_error);
    if (!remove_error) ++removed;
  }
  return removed;
}

}  // namespace hetpar::worker
