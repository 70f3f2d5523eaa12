#include "common/worker/module_state.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "common/worker/outputs.h"

namespace hetpar::worker {

absl::StatusOr<ModuleState> ModuleState::Form(WorkerContext& context, v1::Module module) {
  ModuleState state;
  state.module_ = module;
  state.name_ = module == v1::MODULE_ENCODER ? "encoder" : "llm";
  const v1::RankCoordinates* coords = context.Coordinates(module);
  if (coords == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("world rank ", context.world_rank(), " holds no ", state.name_, " rank"));
  }
  state.coords_ = *coords;
  const v1::Layout& layout = module == v1::MODULE_ENCODER ? context.spec().encoder().layout()
                                                          : context.spec().llm().layout();
  const int64_t cp = std::max<int64_t>(1, layout.cp());
  const int64_t pp = std::max<int64_t>(1, layout.pp());
  const std::string cp_part = cp > 1 ? absl::StrCat("/cp", coords->cp()) : "";
  // Every pipeline stage has groups of its own.
  const std::string pp_part = pp > 1 ? absl::StrCat("/pp", coords->pp()) : "";
  HETPAR_ASSIGN_OR_RETURN(state.tp_, context.Group(absl::StrCat(state.name_, pp_part, "/dp",
                                                                coords->dp(), cp_part, "/tp"),
                                                   coords->tp(), layout.tp()));
  state.gradient_rank_ = coords->dp() * cp + coords->cp();
  HETPAR_ASSIGN_OR_RETURN(
      state.dp_, context.Group(absl::StrCat(state.name_, pp_part, "/tp", coords->tp(), "/dp"),
                               state.gradient_rank_, layout.dp() * cp));
  HETPAR_ASSIGN_OR_RETURN(
      state.cp_, context.Group(absl::StrCat(state.name_, pp_part, "/dp", coords->dp(), "/tp",
                                            coords->tp(), "/cp"),
                               coords->cp(), cp));
  HETPAR_ASSIGN_OR_RETURN(
      state.pp_, context.Group(absl::StrCat(state.name_, "/dp", coords->dp(), cp_part, "/tp",
                                            coords->tp(), "/pp"),
                               coords->pp(), pp));
  return state;
}

absl::Status ModuleState::Train(nn::ParameterSet* params, const v1::Optimizer& optimizer) {
  params_ = params;
  HETPAR_ASSIGN_OR_RETURN(optimizer_, train::ModuleOptimizer::Create(params, optimizer));
  return absl::OkStatus();
}

std::vector<GradNormShare> ModuleState::GradNormShares() const {
  // The partials of DP replica 0 (CP rank 0) add up to the module's squared norm.
  if (gradient_rank_ != 0) return {};
  return {{module_, train::OwnedGradSums(*params_).square_sum}};
}

absl::Status ModuleState::Apply(int64_t step, double clip_coefficient) {
  return optimizer_->Step(step, clip_coefficient);
}

void ModuleState::Discard() { params_->ZeroGrad(); }

absl::Status ModuleState::WriteOutputs(const std::string& out_dir, int64_t world_rank) const {
  return WriteModuleOutputs(out_dir, world_rank, name_, gradient_rank_, *params_, *tp_, *pp_);
}

}  // namespace hetpar::worker
