#include "common/train/optimizer.h"

#include <ATen/ATen.h>
#include <torch/optim/adamw.h>

#include <algorithm>
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

}  // namespace

OwnedSums OwnedGradSums(const nn::ParameterSet& params) {
  OwnedSums sums;
  for (const auto& p : params.parameters()) {
    const at::Tensor& grad = p.tensor.grad();
    if (!Owned(p, params.tp_rank()) || !grad.defined()) continue;
    const at::Tensor g = grad.to(at::kDouble);
    sums.sum += g.sum().item<double>();
    sums.square_sum += g.square().sum().item<double>();
  }
  return sums;
}

OwnedSums OwnedParamSums(const nn::ParameterSet& params) {
  OwnedSums sums;
  for (const auto& p : params.parameters()) {
    if (!Owned(p, params.tp_rank())) continue;
    const at::Tensor v = p.tensor.detach().to(at::kDouble);
    sums.sum += v.sum().item<double>();
    sums.square_sum += v.square().sum().item<double>();
  }
  return sums;
}

absl::Status SumGradients(nn::ParameterSet& params, nn::Communicator& group) {
  if (group.size() == 1) return absl::OkStatus();
  std::vector<at::Tensor> flat;
  for (const auto& p : params.parameters()) {
    if (!p.trainable) continue;
    at::Tensor& grad = p.tensor.mutable_grad();
    if (!grad.defined()) grad = at::zeros_like(p.tensor);
    flat.push_back(grad.reshape({-1}));
  }
  if (flat.empty()) return absl::OkStatus();
  at::Tensor buffer = at::cat(flat);
  absl::Status status = group.AllReduce(buffer);
  if (!status.ok()) return status;
  int64_t offset = 0;
  for (const auto& p : params.parameters()) {
    if (!p.trainable) continue;
    at::Tensor& grad = p.tensor.mutable_grad();
    const int64_t n = grad.numel();
    grad.copy_(buffer.narrow(0, offset, n).view_as(grad));
    offset += n;
  }
  return absl::OkStatus();
}

double ClipCoefficient(double total_norm, double max_norm) {
  if (max_norm <= 0) return 1.0;
  const double coefficient = max_norm / (total_norm + 1e-6);
  return std::min(1.0, coefficient);
}

ModuleOptimizer::ModuleOptimizer(nn::ParameterSet* params, const hetpar::v1::Optimizer& options)
    : params_(params), options_(options) {}

ModuleOptimizer::~ModuleOptimizer() = default;

absl::StatusOr<std::unique_ptr<ModuleOptimizer>> ModuleOptimizer::Create(
    nn::ParameterSet* params, const hetpar::v1::Optimizer& options) {
  if (!(options.lr() > 0)) {
    return absl::InvalidArgumentError(absl::StrCat("optimizer lr=", options.lr(), " must be > 0"));
  }
  std::unique_ptr<ModuleOptimizer> optimizer(new ModuleOptimizer(params, options));
  // Frozen parameters get no AdamW state and are never updated (weight decay included).
  std::vector<at::Tensor> tensors;
  for (const auto& p : params->parameters()) {
    if (p.trainable) tensors.push_back(p.tensor);
  }
  if (tensors.empty()) return optimizer;
  torch::optim::AdamWOptions adamw(options.lr());
  adamw.betas({options.beta1(), options.beta2()});
  adamw.eps(options.eps());
  adamw.weight_decay(options.weight_decay());
  optimizer->adamw_ = std::make_unique<torch::optim::AdamW>(tensors, adamw);
  return optimizer;
}

double ModuleOptimizer::LearningRate(int64_t step) const {
  if (options_.warmup_steps() <= 0) return options_.lr();
  const double ramp = static_cast<double>(step + 1) / static_cast<double>(options_.warmup_steps());
  return options_.lr() * std::min(1.0, ramp);
}

absl::Status ModuleOptimizer::Step(int64_t step, double clip_coefficient) {
  return nn::RunTorch("optimizer step", [&] {
    at::NoGradGuard no_grad;
    if (adamw_ == nullptr) return;  // nothing trainable
    for (const auto& p : params_->parameters()) {
      if (!p.trainable) continue;
      at::Tensor& grad = p.tensor.mutable_grad();
      if (!grad.defined()) {
        grad = at::zeros_like(p.tensor);
      } else if (clip_coefficient != 1.0) {
        grad.mul_(clip_coefficient);
      }
    }
    const double lr = LearningRate(step);
    for (auto& group : adamw_->param_groups()) {
      static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);
    }
    adamw_->step();
    params_->ZeroGrad();
  });
}

const nn::NamedParameter* ModuleOptimizer::TrainableParameter(const std::string& name) const {
  const nn::NamedParameter* p = params_->Find(name);
  if (p == nullptr || !p->trainable || adamw_ == nullptr) return nullptr;
  for (const auto& group : adamw_->param_groups()) {
    for (const at::Tensor& t : group.params()) {
      if (t.is_same(p->tensor)) return p;
    }
  }
  return nullptr;
}

// AdamW keys its state by the address of the parameter's TensorImpl, as libtorch's own
// optimizers and their serialisation do.
std::optional<ModuleOptimizer::ParamState> ModuleOptimizer::StateOf(const std::string& name) const {
  const nn::NamedParameter* p = TrainableParameter(name);
  if (p == nullptr) return std::nullopt;
  const auto& states = adamw_->state();
  auto it = states.find(c10::guts::to_string(p->tensor.unsafeGetTensorImpl()));
  if (it == states.end()) return std::nullopt;
  const auto& adam = static_cast<const torch::optim::AdamWParamState&>(*it->second);
  return ParamState{adam.exp_avg(), adam.exp_avg_sq(), adam.step()};
}

absl::Status ModuleOptimizer::CheckState(const std::string& name, const ParamState& state) const {
  const nn::NamedParameter* p = params_->Find(name);
  if (p == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("optimizer state for unknown parameter '", name, "'"));
  }
  if (TrainableParameter(name) == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "optimizer state for parameter '", name, "', which the optimizer does not train (frozen)"));
  }
  if (state.step < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("optimizer state for parameter '", name, "' has step ", state.step));
  }
  const auto check_moment = [&](const char* what, const at::Tensor& moment) {
    if (!moment.defined()) {
      return absl::InvalidArgumentError(
          absl::StrCat("optimizer state for parameter '", name, "' has no ", what));
    }
    if (moment.sizes() != p->tensor.sizes()) {
      return absl::InvalidArgumentError(
          absl::StrCat("optimizer state for parameter '", name, "': ", what, " has shape [",
                       absl::StrJoin(moment.sizes(), ", "), "], the parameter [",
                       absl::StrJoin(p->tensor.sizes(), ", "), "]"));
    }
    return absl::OkStatus();
  };
  HETPAR_RETURN_IF_ERROR(check_moment("exp_avg", state.exp_avg));
  return check_moment("exp_avg_sq", state.exp_avg_sq);
}

absl::Status ModuleOptimizer::SetState(const std::string& name, const ParamState& state) {
  HETPAR_RETURN_IF_ERROR(CheckState(name, state));
  const nn::NamedParameter* p = TrainableParameter(name);
  return nn::RunTorch(absl::StrCat("setting the optimizer state of ", name), [&] {
    at::NoGradGuard no_grad;
    // Fresh tensors laid out like the parameter (AdamW's own init uses zeros_like), so that the
    // state never aliases the caller's tensors.
    auto adam = std::make_unique<torch::optim::AdamWParamState>();
    adam->step(state.step);
    adam->exp_avg(at::empty_like(p->tensor, at::MemoryFormat::Preserve).copy_(state.exp_avg));
    adam->exp_avg_sq(at::empty_like(p->tensor, at::MemoryFormat::Preserve).copy_(state.exp_avg_sq));
    adamw_->state()[c10::guts::to_string(p->tensor.unsafeGetTensorImpl())] = std::move(adam);
  });
}

void ModuleOptimizer::ClearState(const std::string& name) {
  const nn::NamedParameter* p = TrainableParameter(name);
  if (p == nullptr) return;
  adamw_->state().erase(c10::guts::to_string(p->tensor.unsafeGetTensorImpl()));
}

}  // namespace hetpar::train
