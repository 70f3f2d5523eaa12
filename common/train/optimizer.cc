#include "common/train/optimizer.h"

#include <ATen/ATen.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/nn/torch_status.h"

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

}  // namespace hetpar::train
