#include "common/worker/module_state.h"

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
  HETPAR_ASSIGN_OR_RETURN(
      state.tp_, context.Group(absl::StrCat(state.name_, "/dp", coords->dp(), "/tp"), coords->tp(),
                               layout.tp()));
  HETPAR_ASSIGN_OR_RETURN(
      state.dp_, context.Group(absl::StrCat(state.name_, "/tp", coords->tp(), "/dp"), coords->dp(),
                               layout.dp()));
  return state;
}

absl::Status ModuleState::Train(nn::ParameterSet* params, const v1::Optimizer& optimizer) {
  params_ = params;
  HETPAR_ASSIGN_OR_RETURN(optimizer_, train::ModuleOptimizer::Create(params, optimizer));
  return absl::OkStatus();
}

std::vector<GradNormShare> ModuleState::GradNormShares() const {
  // The partials of DP replica 0 add up to the module's squared norm.
  if (coords_.dp() != 0) return {};
  return {{module_, train::OwnedGradSums(*params_).square_sum}};
}

absl::Status ModuleState::Apply(int64_t step, double clip_coefficient) {
  return optimizer_->Step(step, clip_coefficient);
}

void ModuleState::Discard() { params_->ZeroGrad(); }

absl::Status ModuleState::WriteOutputs(const std::string& out_dir, int64_t world_rank) const {
  return WriteModuleOutputs(out_dir, world_rank, name_, coords_.dp(), *params_, *tp_);
}

}  // namespace hetpar::worker
