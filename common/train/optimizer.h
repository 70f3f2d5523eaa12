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
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/nn/parameters.h"
#include "hetpar/v1/run_spec.pb.h"

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

// OwnedGradSums in two halves, for a caller that brings other values to the host in the same
// copy (one host sync): each owned gradient's sum and sum of squares, [2n] float64 on the
// gradients' device (undefined without any), and the host side that adds those parts up in
// order (`parts`: the [2n] values on the host).
at::Tensor OwnedGradSumParts(const nn::ParameterSet& params);
OwnedSums AddSumParts(const double* parts, int64_t count);

// The factor gradients are scaled by: max_norm / (norm + 1e-6) when that is below 1, else 1
// (and 1 when max_norm is 0, clipping off).
double ClipCoefficient(double total_norm, double max_norm);

// AdamW with linear warm-up over one module's trainable parameters (frozen ones get no state and
// never change). Owns the optimizer state; keeps a reference to the ParameterSet, which must
// outlive it. One thread calls it.
//
// Precision: a parameter of a low-precision dtype (bfloat16, float16) gets a float32 master copy;
// AdamW runs on the masters with float32 moments and the float32 gradients the ParameterSet
// accumulates (ParameterSet::grad_dtype), and each step rounds the masters into the parameters
// once. float32 and float64 parameters are their own masters. Parameter groups: weight decay
// applies to parameters of two or more dimensions only (not to norm scales and biases), and to
// embedding tables unless options.no_decay_embeddings().
//
// Kernels: one fused multi-tensor AdamW (ATen's _fused_adamw_, PyTorch's `fused=True`) per
// group of parameters of one decay, device and dtype, on the CPU and on CUDA, with the step
// counts on the parameters' device: a step is a few kernels whatever the parameter count, and
// reads nothing back to the host.
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
    // The float32 master weights of a low-precision parameter (undefined for a parameter that is
    // its own master). SetState without it takes the master from the parameter's value.
    at::Tensor master;
  };
  // The dtype of the masters and moments of this set's parameters (float32 for bfloat16 and
  // float16 parameters, else the parameters' dtype).
  at::ScalarType StateDtype() const { return state_dtype_; }
  // Whether the parameters have master copies apart from them.
  bool HasMasters() const { return state_dtype_ != params_->dtype(); }
  // Whether parameter `name` decays (trainable, two or more dimensions, not an embedding table
  // unless embeddings decay). False for unknown names.
  bool Decays(const std::string& name) const;
  // The state of the parameter `name`; nullopt for a frozen or unknown parameter or before its
  // first step. The moments are the optimizer's own tensors, not copies: the next Step changes
  // them in place, so a caller that keeps them past it clones them.
  std::optional<ParamState> StateOf(const std::string& name) const;
  // What SetState checks, changing nothing: InvalidArgument naming the parameter for a frozen
  // or unknown name, undefined moments, moments of another shape than the parameter's, or a
  // negative step. Lets a caller validate a whole set of states before replacing any.
  absl::Status CheckState(const std::string& name, const ParamState& state) const;
  // Replaces the state of trainable parameter `name` (the moments are copied, converted to
  // StateDtype() and the parameter's device); the next Step continues from it exactly as from
  // the steps that produced it. A master in `state` replaces the parameter's master (and the
  // parameter takes its rounded value); without one the master is taken from the parameter.
  // Errors as CheckState, and then nothing changes.
  absl::Status SetState(const std::string& name, const ParamState& state);
  // Drops the state of `name` (its next Step starts from zero moments, as its first did) and
  // takes its master from the parameter's value. No-op for a frozen or an unknown parameter.
  void ClearState(const std::string& name);

 private:
  ModuleOptimizer(nn::ParameterSet* params, const hetpar::v1::Optimizer& options);
  bool Decays(const nn::NamedParameter& param) const;
  // One trainable parameter, the tensor AdamW updates for it and its state.
  struct Slot {
    const nn::NamedParameter* param = nullptr;
    at::Tensor target;  // the master, or the parameter's own tensor
    size_t group = 0;   // index into groups_
    // Undefined before the first step (or after ClearState): the first step starts from zeros.
    at::Tensor exp_avg;
    at::Tensor exp_avg_sq;
    at::Tensor step;    // float32 scalar on the target's device, as the fused kernel reads it
    int64_t steps = 0;  // the same count, kept on the host
  };
  // The slot of trainable parameter `name`; nullptr when frozen, unknown or not registered
  // (made trainable after Create).
  const Slot* SlotOf(const std::string& name) const;
  Slot* SlotOf(const std::string& name);

  nn::ParameterSet* params_;
  hetpar::v1::Optimizer options_;
  at::ScalarType state_dtype_;
  std::vector<Slot> slots_;
  // What one fused AdamW call takes: parameters of one decay, device and dtype (set by Create).
  struct Group {
    bool decay = false;
    c10::Device device = c10::kCPU;
    at::ScalarType dtype = at::kFloat;
  };
  std::vector<Group> groups_;
};

}  // namespace hetpar::train

#endif  // HETPAR_COMMON_TRAIN_OPTIMIZER_H_
