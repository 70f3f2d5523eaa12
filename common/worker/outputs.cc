#include "common/worker/outputs.h"

#include <filesystem>
#include <fstream>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "common/nn/export.h"
#include "common/status.h"
#include "common/train/optimizer.h"
#include "nlohmann/json.hpp"

namespace hetpar::worker {
namespace {

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

absl::Status WriteModuleOutputs(const std::string& out_dir, int64_t world_rank,
                                const std::string& module, int64_t dp_rank,
                                const nn::ParameterSet& params, nn::Communicator& tp) {
  if (out_dir.empty()) return absl::OkStatus();
  HETPAR_RETURN_IF_ERROR(EnsureDirectory(out_dir + "/workers"));
  const train::OwnedSums sums = train::OwnedParamSums(params);
  const nlohmann::json j = {{"world_rank", world_rank},
                            {"module", module},
                            {"dp", dp_rank},
                            {"sum", sums.sum},
                            {"square_sum", sums.square_sum}};
  const std::string path =
      absl::StrCat(out_dir, "/workers/rank-", world_rank, "-", module, ".json");
  {
    std::ofstream out(path);
    out << j.dump() << "\n";
    out.flush();
    if (!out) return absl::DataLossError(absl::StrCat("cannot write '", path, "'"));
  }
  if (dp_rank != 0) return absl::OkStatus();
  return nn::SaveFullParameters(params, tp, absl::StrCat(out_dir, "/model/", module, ".hpar"));
}

}  // namespace hetpar::worker
