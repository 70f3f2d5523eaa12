#include "common/nn/parameters.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <numeric>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/nn/torch_status.h"

namespace hetpar::nn {
namespace {

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

uint64_t RowSeed(uint64_t parameter_seed, int64_t row) {
  return SplitMix64(parameter_seed ^ SplitMix64(static_cast<uint64_t>(row) + 1));
}

// One draw of `shape` elements from a generator seeded with `seed`, in float64.
at::Tensor Draw(at::Generator& generator, uint64_t seed, at::IntArrayRef shape,
                const InitRule& rule) {
  const auto options = at::TensorOptions().dtype(at::kDouble);
  if (rule.kind == InitRule::Kind::kConstant) return at::full(shape, rule.mean, options);
  {
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_current_seed(seed);
  }
  return at::normal(rule.mean, rule.std, shape, generator, options);
}

std::string ShapeText(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

}  // namespace

absl::StatusOr<at::ScalarType> TorchDtype(hetpar::v1::Dtype dtype) {
  // Proto enums carry sentinel values, so this is an if-chain rather than a switch.
  if (dtype == hetpar::v1::DTYPE_FLOAT32) return at::kFloat;
  if (dtype == hetpar::v1::DTYPE_FLOAT64) return at::kDouble;
  if (dtype == hetpar::v1::DTYPE_BFLOAT16) return at::kBFloat16;
  return absl::InvalidArgumentError(
      absl::StrCat("run.dtype=", static_cast<int>(dtype),
                   " is not usable; expected float32, float64 or bfloat16"));
}

std::string DtypeName(at::ScalarType dtype) {
  if (dtype == at::kFloat) return "float32";
  if (dtype == at::kDouble) return "float64";
  if (dtype == at::kBFloat16) return "bfloat16";
  return c10::toString(dtype);
}

uint64_t ParameterSeed(int64_t run_seed, std::string_view name) {
  uint64_t hash = 0xcbf29ce484222325ULL;  // FNV-1a over the name's bytes
  for (unsigned char c : name) {
    hash ^= c;
    hash *= 0x100000001b3ULL;
  }
  return SplitMix64(hash ^ SplitMix64(static_cast<uint64_t>(run_seed)));
}

at::Tensor InitSlice(int64_t run_seed, std::string_view name,
                     const std::vector<int64_t>& full_shape, const InitRule& rule, int split_dim,
                     int64_t offset, int64_t length, at::ScalarType dtype) {
  const int dims = static_cast<int>(full_shape.size());
  TORCH_CHECK(dims >= 1, "parameter ", std::string(name), " has no dimensions");
  TORCH_CHECK(split_dim >= -1 && split_dim < dims, "parameter ", std::string(name), ": split_dim ",
              split_dim, " out of range for ", dims, " dimensions");
  if (split_dim >= 0) {
    TORCH_CHECK(offset >= 0 && length >= 0 && offset + length <= full_shape[split_dim],
                "parameter ", std::string(name), ": slice [", offset, ", ", offset + length,
                ") outside dimension ", split_dim, " of size ", full_shape[split_dim]);
  }
  const uint64_t seed = ParameterSeed(run_seed, name);
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  if (dims == 1) {
    at::Tensor full = Draw(generator, seed, full_shape, rule);
    if (split_dim == 0) full = full.narrow(0, offset, length);
    return full.to(dtype).contiguous();
  }
  // Row by row along dim 0, drawing only the rows this slice needs.
  const std::vector<int64_t> row_shape(full_shape.begin() + 1, full_shape.end());
  int64_t row_begin = 0;
  int64_t row_end = full_shape[0];
  if (split_dim == 0) {
    row_begin = offset;
    row_end = offset + length;
  }
  std::vector<int64_t> local_shape = full_shape;
  local_shape[0] = row_end - row_begin;
  if (split_dim > 0) local_shape[split_dim] = length;
  at::Tensor local = at::empty(local_shape, at::TensorOptions().dtype(at::kDouble));
  for (int64_t row = row_begin; row < row_end; ++row) {
    at::Tensor values = Draw(generator, RowSeed(seed, row), row_shape, rule);
    if (split_dim > 0) values = values.narrow(split_dim - 1, offset, length);
    local[row - row_begin].copy_(values);
  }
  return local.to(dtype).contiguous();
}

absl::StatusOr<at::Tensor> ParameterSet::Add(const std::string& name,
                                             std::vector<int64_t> full_shape, int split_dim,
                                             const InitRule& rule,
                                             bool grad_partial_over_sequence) {
  if (Find(name) != nullptr) {
    return absl::AlreadyExistsError(absl::StrCat("parameter ", name, " is registered twice"));
  }
  for (int64_t extent : full_shape) {
    if (extent < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "parameter ", name, ": full shape ", ShapeText(full_shape), " has an empty dimension"));
    }
  }
  TpSlice slice;
  slice.split_dim = split_dim;
  if (split_dim >= 0) {
    if (split_dim >= static_cast<int>(full_shape.size())) {
      return absl::InvalidArgumentError(absl::StrCat("parameter ", name, ": split_dim ", split_dim,
                                                     " outside shape ", ShapeText(full_shape)));
    }
    if (full_shape[split_dim] % tp_size_ != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "parameter ", name, ": dimension ", split_dim, " of ", ShapeText(full_shape), " (",
          full_shape[split_dim], ") does not divide by the tensor-parallel size ", tp_size_));
    }
    slice.length = full_shape[split_dim] / tp_size_;
    slice.offset = slice.length * tp_rank_;
  }
  auto tensor = RunTorchOr(absl::StrCat("initialising parameter ", name), [&] {
    at::Tensor t =
        InitSlice(run_seed_, name, full_shape, rule, split_dim, slice.offset, slice.length, dtype_);
    t.requires_grad_(true);
    if (grad_dtype() != dtype_) t.set_grad_dtype(grad_dtype());
    return t;
  });
  if (!tensor.ok()) return tensor.status();
  NamedParameter param;
  param.name = name;
  param.tensor = *tensor;
  param.full_shape = std::move(full_shape);
  param.slice = slice;
  param.grad_partial_over_sequence = grad_partial_over_sequence;
  parameters_.push_back(std::move(param));
  return parameters_.back().tensor;
}

absl::Status ParameterSet::MarkEmbedding(std::string_view name) {
  for (auto& param : parameters_) {
    if (param.name == name) {
      param.embedding = true;
      return absl::OkStatus();
    }
  }
  return absl::NotFoundError(
      absl::StrCat("no parameter ", std::string(name), " to mark as an embedding"));
}

at::Tensor ParameterSet::ZeroGradient(const NamedParameter& param) const {
  return at::zeros(param.tensor.sizes(), param.tensor.options().dtype(grad_dtype()));
}

InitRule ParameterSet::BiasInit() const {
  return style_ == InitStyle::kAllRandom ? InitRule::Normal(0.02) : InitRule::Constant(0.0);
}

InitRule ParameterSet::NormScaleInit() const {
  return style_ == InitStyle::kAllRandom ? InitRule::Normal(0.1, 1.0) : InitRule::Constant(1.0);
}

const NamedParameter* ParameterSet::Find(std::string_view name) const {
  for (const auto& param : parameters_) {
    if (param.name == name) return &param;
  }
  return nullptr;
}

int64_t ParameterSet::LocalNumel() const {
  int64_t total = 0;
  for (const auto& param : parameters_) total += param.tensor.numel();
  return total;
}

int64_t ParameterSet::FullNumel() const {
  int64_t total = 0;
  for (const auto& param : parameters_) {
    total += std::accumulate(param.full_shape.begin(), param.full_shape.end(), int64_t{1},
                             std::multiplies<int64_t>());
  }
  return total;
}

int64_t ParameterSet::Freeze(std::string_view prefix, const std::vector<std::string>& except) {
  int64_t frozen = 0;
  for (auto& param : parameters_) {
    if (!absl::StartsWith(param.name, absl::string_view(prefix.data(), prefix.size()))) continue;
    bool excepted = false;
    for (const std::string& e : except) excepted |= absl::StartsWith(param.name, e);
    if (excepted || !param.trainable) continue;
    param.trainable = false;
    param.tensor.requires_grad_(false);
    param.tensor.mutable_grad() = at::Tensor();
    ++frozen;
  }
  return frozen;
}

int64_t ParameterSet::TrainableLocalNumel() const {
  int64_t n = 0;
  for (const auto& param : parameters_) {
    if (param.trainable) n += param.tensor.numel();
  }
  return n;
}

bool ParameterSet::AnyTrainable() const {
  for (const auto& param : parameters_) {
    if (param.trainable) return true;
  }
  return false;
}

void ParameterSet::ZeroGrad() {
  for (auto& param : parameters_) param.tensor.mutable_grad() = at::Tensor();
}

void ParameterSet::MoveTo(const c10::Device& device) {
  at::NoGradGuard no_grad;
  for (auto& param : parameters_) {
    param.tensor.mutable_grad() = at::Tensor();
    if (param.tensor.device() == device) continue;
    param.tensor.set_data(param.tensor.detach().to(device));
  }
}

absl::Status ParameterSet::ReducePartialGrads(const CommGroup& tp) {
  if (tp.size() == 1) return absl::OkStatus();
  return RunTorch("summing sequence-parallel partial gradients over the TP group", [&] {
    std::vector<at::Tensor> grads;
    for (auto& param : parameters_) {
      if (!param.grad_partial_over_sequence || !param.trainable) continue;
      if (!param.tensor.grad().defined()) {
        param.tensor.mutable_grad() = ZeroGradient(param);
      }
      grads.push_back(param.tensor.grad());
    }
    if (grads.empty()) return;
    std::vector<at::Tensor> flat;
    for (const auto& grad : grads) flat.push_back(grad.reshape({-1}));
    at::Tensor buffer = at::cat(flat);
    tp.AllReduce(buffer);
    int64_t at = 0;
    for (auto& grad : grads) {
      grad.copy_(buffer.narrow(0, at, grad.numel()).view(grad.sizes()));
      at += grad.numel();
    }
  });
}

absl::StatusOr<at::Tensor> GatherFullTensor(Communicator& tp, const NamedParameter& param,
                                            const at::Tensor& local) {
  if (param.slice.split_dim < 0 || tp.size() == 1) return local;
  return RunTorchOr(absl::StrCat("gathering parameter ", param.name), [&] {
    const int dim = param.slice.split_dim;
    at::Tensor moved = local.movedim(dim, 0).contiguous();
    at::Tensor gathered = tp.group()->AllGatherRows(moved);
    return gathered.movedim(0, dim).contiguous();
  });
}

}  // namespace hetpar::nn
