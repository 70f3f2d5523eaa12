// The step end of one module: gradient norm partials, clipping and AdamW over a ParameterSet.
//
// Layout independence: AdamW is element-wise, so a TP slice of a parameter takes exactly the
// steps the full parameter takes in one process. The global gradient norm runs over both
// modules; each rank contributes the part of the squared norm that it alone accounts for
// (OwnedSquareSum), the partials of one DP replica of each module add up to the total, and every
// rank then scales its gradients by the same ClipCoefficient.
#ifndef HETPAR_COMMON_TRAIN_OPTIMIZER_H_
#define HETPAR_COMMON_TRAIN_OPTIMIZER_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/nn/parameters.h"
#include "hetpar/v1/run_spec.pb.h"

namespace torch::optim {
class AdamW;
}

namespace hetpar::train {

// Sums over the elements this rank owns: every element of a TP-split parameter, and the elements
// of replicated parameters on TP rank 0 only. Summed over a replica's TP ranks these give the
// replica's totals. `sum` is the plain sum, `square_sum` the sum of squares (float64).
struct OwnedSums {
  double sum = 0;
  double square_sum = 0;
};
// Of the gradients (a parameter without a gradient counts as zero).
OwnedSums OwnedGradSums(const nn::ParameterSet& params);
// Of the parameter values.
OwnedSums OwnedParamSums(const nn::ParameterSet& params);

// Sums every trainable parameter's gradient over `group` (the module's DP group), in one flat
// all-reduce. A parameter without a gradient contributes zeros and gets the sum. No-op for a
// group of one.
absl::Status SumGradients(nn::ParameterSet& params, nn::Communicator& group);

// The factor gradients are scaled by: max_norm / (norm + 1e-6) when that is below 1, else 1
// (and 1 when max_norm is 0, clipping off).
double ClipCoefficient(double total_norm, double max_norm);

// AdamW with linear warm-up over one module's trainable parameters (frozen ones get no state and
// never change). Owns the optimizer state; keeps a
// reference to the ParameterSet, which must outlive it. One thread calls it.
class ModuleOptimizer {
 public:
  static absl::StatusOr<std::unique_ptr<ModuleOptimizer>> Create(
      nn::ParameterSet* params, const hetpar::v1::Optimizer& options);
  ~ModuleOptimizer();
  ModuleOptimizer(const ModuleOptimizer&) = delete;
  ModuleOptimizer& operator=(const ModuleOptimizer&) = delete;

  // Learning rate of 0-based step `step`: lr x min(1, (step + 1) / warmup_steps).
  double LearningRate(int64_t step) const;

  // Scales every gradient by clip_coefficient, takes one AdamW step at LearningRate(step) and
  // drops the gradients. A trainable parameter without a gradient steps with a zero gradient (so
  // every layout updates every parameter the same way). No-op when nothing is trainable.
  absl::Status Step(int64_t step, double clip_coefficient);

  // AdamW's state of one parameter: its moments (this rank's slice) and how many steps it took.
  struct ParamState {
    at::Tensor exp_avg;
    at::Tensor exp_avg_sq;
    int64_t step = 0;
  };
  // The state of the parameter `name`; nullopt for a frozen or unknown parameter or before its
  // first step. The moments are the optimizer's own tensors, not copies: the next Step changes
  // them in place, so a caller that keeps them past it clones them.
  std::optional<ParamState> StateOf(const std::string& name) const;
  // What SetState checks, changing nothing: InvalidArgument naming the parameter for a frozen
  // or unknown name, undefined moments, moments of another shape than the parameter's, or a
  // negative step. Lets a caller validate a whole set of states before replacing any.
  absl::Status CheckState(const std::string& name, const ParamState& state) const;
  // Replaces the state of trainable parameter `name` (the moments are copied, converted to the
  // parameter's dtype and device); the next Step continues from it exactly as from the steps
  // that produced it. Errors as CheckState, and then nothing changes.
  absl::Status SetState(const std::string& name, const ParamState& state);
  // Drops the state of `name` (its next Step starts from zero moments, as its first did). No-op
  // for a parameter without state, a frozen or an unknown one.
  void ClearState(const std::string& name);

 private:
  ModuleOptimizer(nn::ParameterSet* params, const hetpar::v1::Optimizer& options);
  // The trainable parameter `name` that AdamW updates; nullptr when frozen, unknown or not
  // registered with AdamW (nothing trainable, or made trainable after Create).
  const nn::NamedParameter* TrainableParameter(const std::string& name) const;

  nn::ParameterSet* params_;
  hetpar::v1::Optimizer options_;
  std::unique_ptr<torch::optim::AdamW> adamw_;
};

}  // namespace hetpar::train

#endif  // HETPAR_COMMON_TRAIN_OPTIMIZER_H_
