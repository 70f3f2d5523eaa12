#include "common/train/optimizer.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/nn/torch_status.h"
#include "common/status.h"

namespace hetpar::train {
namespace {

bool Owned(const nn::NamedParameter& p, int tp_rank) {
  return p.slice.split_dim >= 0 || tp_rank == 0;
}

// Each tensor's sum and sum of squares in float64 on its device: [2n], undefined without any.
at::Tensor SumPartsOf(const std::vector<at::Tensor>& tensors) {
  if (tensors.empty()) return at::Tensor();
  std::vector<at::Tensor> parts;
  for (const at::Tensor& t : tensors) {
    const at::Tensor d = t.detach().to(at::kDouble);
    parts.push_back(at::stack({d.sum(), d.square().sum()}));
  }
  return at::cat(parts);
}

// The owned sums of `tensors` with one transfer to the host, added in order here.
OwnedSums SumsOf(const std::vector<at::Tensor>& tensors) {
  const at::Tensor parts = SumPartsOf(tensors);
  if (!parts.defined()) return OwnedSums();
  const at::Tensor host = parts.cpu().contiguous();
  return AddSumParts(host.const_data_ptr<double>(), host.numel());
}

std::vector<at::Tensor> OwnedGrads(const nn::ParameterSet& params) {
  std::vector<at::Tensor> grads;
  for (const auto& p : params.parameters()) {
    const at::Tensor& grad = p.tensor.grad();
    if (Owned(p, params.tp_rank()) && grad.defined()) grads.push_back(grad);
  }
  return grads;
}

}  // namespace

OwnedSums AddSumParts(const double* parts, int64_t count) {
  OwnedSums sums;
  for (int64_t i = 0; i + 1 < count; i += 2) {
    sums.sum += parts[i];
    sums.square_sum += parts[i + 1];
  }
  return sums;
}

at::Tensor OwnedGradSumParts(const nn::ParameterSet& params) {
  return SumPartsOf(OwnedGrads(params));
}

OwnedSums OwnedGradSums(const nn::ParameterSet& params) { return SumsOf(OwnedGrads(params)); }

OwnedSums OwnedParamSums(const nn::ParameterSet& params) {
  std::vector<at::Tensor> values;
  for (const auto& p : params.parameters()) {
    if (Owned(p, params.tp_rank())) values.push_back(p.tensor);
  }
  return SumsOf(values);
}

double ClipCoefficient(double total_norm, double max_norm) {
  if (max_norm <= 0) return 1.0;
  const double coefficient = max_norm / (total_norm + 1e-6);
  return std::min(1.0, coefficient);
}

ModuleOptimizer::ModuleOptimizer(nn::ParameterSet* params, const hetpar::v1::Optimizer& options)
    : params_(params),
      options_(options),
      state_dtype_(nn::ParameterSet::GradDtypeOf(params->dtype())) {}

ModuleOptimizer::~ModuleOptimizer() = default;

bool ModuleOptimizer::Decays(const std::string& name) const {
  const Slot* slot = SlotOf(name);
  return slot != nullptr && Decays(*slot->param);
}

bool ModuleOptimizer::Decays(const nn::NamedParameter& p) const {
  if (p.full_shape.size() < 2) return false;  // norm scales, biases
  return !p.embedding || !options_.no_decay_embeddings();
}

absl::StatusOr<std::unique_ptr<ModuleOptimizer>> ModuleOptimizer::Create(
    nn::ParameterSet* params, const hetpar::v1::Optimizer& options) {
  if (!(options.lr() > 0)) {
    return absl::InvalidArgumentError(absl::StrCat("optimizer lr=", options.lr(), " must be > 0"));
  }
  std::unique_ptr<ModuleOptimizer> optimizer(new ModuleOptimizer(params, options));
  return nn::RunTorchOr("creating the optimizer", [&]() -> std::unique_ptr<ModuleOptimizer> {
    at::NoGradGuard no_grad;
    // Frozen parameters get no AdamW state and are never updated (weight decay included).
    for (const auto& p : params->parameters()) {
      if (!p.trainable) continue;
      Slot slot;
      slot.param = &p;
      slot.target = optimizer->HasMasters() ? p.tensor.detach().to(optimizer->state_dtype_, false,
                                                                   /*copy=*/true)
                                            : p.tensor;
      const Group group{optimizer->Decays(p), slot.target.device(), slot.target.scalar_type()};
      auto& groups = optimizer->groups_;
      slot.group = std::find_if(groups.begin(), groups.end(),
                                [&](const Group& g) {
                                  return g.decay == group.decay && g.device == group.device &&
                                         g.dtype == group.dtype;
                                }) -
                   groups.begin();
      if (slot.group == groups.size()) groups.push_back(group);
      optimizer->slots_.push_back(slot);
    }
    return std::move(optimizer);
  });
}

double ModuleOptimizer::LearningRate(int64_t step) const {
  if (options_.warmup_steps() <= 0) return options_.lr();
  const double ramp = static_cast<double>(step + 1) / static_cast<double>(options_.warmup_steps());
  return options_.lr() * std::min(1.0, ramp);
}

absl::Status ModuleOptimizer::Step(int64_t step, double clip_coefficient) {
  return nn::RunTorch("optimizer step", [&] {
    at::NoGradGuard no_grad;
    if (slots_.empty()) return;  // nothing trainable
    // The fused kernel's lists, one set per group.
    struct Lists {
      std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, steps;
    };
    std::vector<Lists> lists(groups_.size());
    // One multi-tensor kernel each for the clipping and for rounding the masters (a launch per
    // parameter adds up on a GPU).
    std::vector<at::Tensor> clipped;
    for (Slot& slot : slots_) {
      at::Tensor& grad = slot.param->tensor.mutable_grad();
      if (!grad.defined()) {
        grad = params_->ZeroGradient(*slot.param);
      } else if (clip_coefficient != 1.0) {
        clipped.push_back(grad);
      }
    }
    if (!clipped.empty()) at::_foreach_mul_(clipped, clip_coefficient);
    for (Slot& slot : slots_) {
      const at::Tensor& grad = slot.param->tensor.grad();
      if (!slot.exp_avg.defined()) {  // the first step starts from zero moments
        slot.exp_avg = at::zeros_like(slot.target, at::MemoryFormat::Preserve);
        slot.exp_avg_sq = at::zeros_like(slot.target, at::MemoryFormat::Preserve);
        slot.step = at::zeros({}, slot.target.options().dtype(at::kFloat));
        slot.steps = 0;
      }
      Lists& l = lists[slot.group];
      l.params.push_back(slot.target);
      // The parameter's gradient is already in the state dtype (ParameterSet::grad_dtype), so
      // this is the gradient itself.
      l.grads.push_back(grad.to(state_dtype_));
      l.exp_avgs.push_back(slot.exp_avg);
      l.exp_avg_sqs.push_back(slot.exp_avg_sq);
      l.steps.push_back(slot.step);
      ++slot.steps;
    }
    const double lr = LearningRate(step);
    for (size_t g = 0; g < groups_.size(); ++g) {
      Lists& l = lists[g];
      const double weight_decay = groups_[g].decay ? options_.weight_decay() : 0.0;
      // As PyTorch's fused AdamW: the step counts first, then the update, which reads them.
      at::_foreach_add_(l.steps, 1.0);
      at::_fused_adamw_(l.params, l.grads, l.exp_avgs, l.exp_avg_sqs, /*max_exp_avg_sqs=*/{},
                        l.steps, lr, options_.beta1(), options_.beta2(), weight_decay,
                        options_.eps(), /*amsgrad=*/false, /*maximize=*/false);
    }
    std::vector<at::Tensor> rounded, masters;
    for (const Slot& slot : slots_) {
      if (slot.target.is_same(slot.param->tensor)) continue;
      rounded.push_back(slot.param->tensor.detach());
      masters.push_back(slot.target);
    }
    if (!rounded.empty()) at::_foreach_copy_(rounded, masters);  // rounds each master once
    params_->ZeroGrad();
  });
}

const ModuleOptimizer::Slot* ModuleOptimizer::SlotOf(const std::string& name) const {
  for (const Slot& slot : slots_) {
    if (slot.param->name == name) return slot.param->trainable ? &slot : nullptr;
  }
  return nullptr;
}

ModuleOptimizer::Slot* ModuleOptimizer::SlotOf(const std::string& name) {
  return const_cast<Slot*>(std::as_const(*this).SlotOf(name));
}

std::optional<ModuleOptimizer::ParamState> ModuleOptimizer::StateOf(const std::string& name) const {
  const Slot* slot = SlotOf(name);
  if (slot == nullptr || !slot->exp_avg.defined()) return std::nullopt;
  ParamState state{slot->exp_avg, slot->exp_avg_sq, slot->steps, at::Tensor()};
  if (!slot->target.is_same(slot->param->tensor)) state.master = slot->target;
  return state;
}

absl::Status ModuleOptimizer::CheckState(const std::string& name, const ParamState& state) const {
  const nn::NamedParameter* p = params_->Find(name);
  if (p == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("optimizer state for unknown parameter '", name, "'"));
  }
  if (SlotOf(name) == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "optimizer state for parameter '", name, "', which the optimizer does not train (frozen)"));
  }
  if (state.step < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("optimizer state for parameter '", name, "' has step ", state.step));
  }
  const auto check_shape = [&](const char* what, const at::Tensor& tensor) {
    if (tensor.sizes() != p->tensor.sizes()) {
      return absl::InvalidArgumentError(
          absl::StrCat("optimizer state for parameter '", name, "': ", what, " has shape [",
                       absl::StrJoin(tensor.sizes(), ", "), "], the parameter [",
                       absl::StrJoin(p->tensor.sizes(), ", "), "]"));
    }
    return absl::OkStatus();
  };
  const auto check_moment = [&](const char* what, const at::Tensor& moment) {
    if (!moment.defined()) {
      return absl::InvalidArgumentError(
          absl::StrCat("optimizer state for parameter '", name, "' has no ", what));
    }
    return check_shape(what, moment);
  };
  HETPAR_RETURN_IF_ERROR(check_moment("exp_avg", state.exp_avg));
  HETPAR_RETURN_IF_ERROR(check_moment("exp_avg_sq", state.exp_avg_sq));
  if (state.master.defined()) return check_shape("master", state.master);
  return absl::OkStatus();
}

absl::Status ModuleOptimizer::SetState(const std::string& name, const ParamState& state) {
  HETPAR_RETURN_IF_ERROR(CheckState(name, state));
  Slot* slot = SlotOf(name);
  return nn::RunTorch(absl::StrCat("setting the optimizer state of ", name), [&] {
    at::NoGradGuard no_grad;
    const at::Tensor& param = slot->param->tensor;
    if (!slot->target.is_same(param)) {
      if (state.master.defined()) {
        slot->target.copy_(state.master);
        param.detach().copy_(slot->target);
      } else {
        slot->target.copy_(param);
      }
    }
    // Fresh tensors laid out like the updated tensor (as the first step's zeros), so that the
    // state never aliases the caller's tensors.
    slot->exp_avg = at::empty_like(slot->target, at::MemoryFormat::Preserve).copy_(state.exp_avg);
    slot->exp_avg_sq =
        at::empty_like(slot->target, at::MemoryFormat::Preserve).copy_(state.exp_avg_sq);
    slot->step =
        at::full({}, static_cast<double>(state.step), slot->target.options().dtype(at::kFloat));
    slot->steps = state.step;
  });
}

void ModuleOptimizer::ClearState(const std::string& name) {
  Slot* slot = SlotOf(name);
  if (slot == nullptr) return;
  slot->exp_avg = at::Tensor();
  slot->exp_avg_sq = at::Tensor();
  slot->step = at::Tensor();
  slot->steps = 0;
  if (!slot->target.is_same(slot->param->tensor)) {
    at::NoGradGuard no_grad;
    slot->target.copy_(slot->param->tensor.detach());
  }
}

}  // namespace hetpar::train
