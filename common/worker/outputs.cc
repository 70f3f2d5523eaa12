#include "common/worker/outputs.h"

#include <filesystem>
#include <fstream>
#include <system_error>
#include <vector>

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
                                const nn::ParameterSet& params, nn::Communicator& tp,
                                nn::Communicator& pp) {
  if (out_dir.empty()) return absl::OkStatus();
  HETPAR_RETURN_IF_ERROR(EnsureDirectory(out_dir + "/workers"));
  const train::OwnedSums sums = train::OwnedParamSums(params);
  const nlohmann::json j = {{"world_rank", world_rank},
                            {"module", module},
                            {"dp", dp_rank},
                            {"sum", sums.sum},
                            {"square_sum", sums.square_sum}};
  {
    const std::string sums_path =
        absl::StrCat(out_dir, "/workers/rank-", world_rank, "-", module, ".json");
    std::ofstream out(sums_path);
    out << j.dump() << "\n";
    out.flush();
    if (!out) return absl::DataLossError(absl::StrCat("cannot write '", sums_path, "'"));
  }
  if (dp_rank != 0) return absl::OkStatus();
  const std::string path = absl::StrCat(out_dir, "/model/", module, ".hpar");
  if (pp.size() == 1) return nn::SaveFullParameters(params, tp, path);
  // Each stage saves its part; once all have (the barrier), the first stage's TP rank 0 joins
  // them, in stage order (the model's parameter order), into one file and removes the parts.
  auto part = [&](int64_t stage) { return absl::StrCat(path, ".stage-", stage); };
  const absl::Status saved = nn::SaveFullParameters(params, tp, part(pp.rank()));
  HETPAR_RETURN_IF_ERROR(pp.Barrier());
  HETPAR_RETURN_IF_ERROR(saved);
  if (pp.rank() != 0 || tp.rank() != 0) return absl::OkStatus();
  std::vector<nn::FullParameter> whole;
  for (int64_t stage = 0; stage < pp.size(); ++stage) {
    HETPAR_ASSIGN_OR_RETURN(std::vector<nn::FullParameter> stage_params,
                            nn::ReadFullParameters(part(stage)));
    for (nn::FullParameter& p : stage_params) whole.push_back(std::move(p));
  }
  HETPAR_RETURN_IF_ERROR(nn::WriteFullParameters(whole, path));
  for (int64_t stage = 0; stage < pp.size(); ++stage) {
    std::error_code ec;
    std::filesystem::remove(part(stage), ec);
  }
  return absl::OkStatus();
}

}  // namespace hetpar::worker
