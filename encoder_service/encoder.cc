#include "encoder_service/encoder.h"

#include <ATen/ATen.h>

#include <cmath>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/nn/device_copy.h"
#include "common/nn/size_checks.h"
#include "common/nn/torch_status.h"
#include "common/status.h"

namespace hetpar::encoder {
namespace {

constexpr double kDefaultLayerNormEps = 1e-6;
constexpr double kInitStd = 0.02;
constexpr std::string_view kProjectorPrefix = "encoder.projector.";

using nn::CheckDivides;
using nn::CheckPositive;

}  // namespace

absl::StatusOr<EncoderOptions> EncoderOptionsFromSpec(const hetpar::v1::RunSpec& spec) {
  EncoderOptions options;
  HETPAR_ASSIGN_OR_RETURN(options.dtype, nn::TorchDtype(spec.run().dtype()));
  options.seed = spec.run().seed();
  options.sequence_parallel = spec.encoder().layout().sequence_parallel();
  options.frozen = spec.encoder().frozen();
  options.train_projector = spec.encoder().frozen() && spec.encoder().train_projector();
  return options;
}

VisionEncoder::VisionEncoder(const hetpar::v1::EncoderModel& model, const EncoderOptions& options,
                             nn::TensorParallel tp)
    : model_(model), options_(options), tp_(std::move(tp)), tokens_per_image_(0) {}

absl::StatusOr<std::unique_ptr<VisionEncoder>> VisionEncoder::Create(
    const hetpar::v1::EncoderModel& model, const EncoderOptions& options,
    const nn::Communicator& tp) {
  HETPAR_RETURN_IF_ERROR(CheckPositive("encoder.model.image_size", model.image_size()));
  HETPAR_RETURN_IF_ERROR(CheckPositive("encoder.model.patch", model.patch()));
  HETPAR_RETURN_IF_ERROR(CheckPositive("encoder.model.hidden", model.hidden()));
  HETPAR_RETURN_IF_ERROR(CheckPositive("encoder.model.layers", model.layers()));
  HETPAR_RETURN_IF_ERROR(CheckPositive("encoder.model.heads", model.heads()));
  HETPAR_RETURN_IF_ERROR(CheckPositive("encoder.model.mlp", model.mlp()));
  HETPAR_RETURN_IF_ERROR(CheckPositive("encoder.model.out_hidden", model.out_hidden()));
  HETPAR_RETURN_IF_ERROR(CheckPositive("encoder.model.channels", model.channels()));
  HETPAR_RETURN_IF_ERROR(CheckDivides("encoder.model.patch", model.patch(),
                                      "encoder.model.image_size", model.image_size()));
  HETPAR_RETURN_IF_ERROR(
      CheckDivides("encoder.model.heads", model.heads(), "encoder.model.hidden", model.hidden()));
  const int size = tp.size();
  HETPAR_RETURN_IF_ERROR(CheckDivides("encoder.layout.tp", size, "encoder.model.heads",
                                      model.heads(), "attention is split by heads"));
  HETPAR_RETURN_IF_ERROR(CheckDivides("encoder.layout.tp", size, "encoder.model.mlp", model.mlp()));
  HETPAR_RETURN_IF_ERROR(CheckDivides("encoder.layout.tp", size, "encoder.model.out_hidden",
                                      model.out_hidden(), "the projector is split by features"));
  hetpar::v1::EncoderModel m = model;
  if (m.activation().empty()) m.set_activation("gelu");
  if (m.norm_eps() == 0) m.set_norm_eps(kDefaultLayerNormEps);
  if (m.activation() != "gelu" && m.activation() != "gelu_tanh") {
    return absl::InvalidArgumentError(absl::StrCat("encoder.model.activation='", m.activation(),
                                                   "' is not one of: gelu, gelu_tanh"));
  }
  if (!(m.norm_eps() > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("encoder.model.norm_eps=", m.norm_eps(), " must be > 0"));
  }
  auto encoder = std::unique_ptr<VisionEncoder>(
      new VisionEncoder(m, options, nn::TensorParallel{tp.group(), options.sequence_parallel}));
  HETPAR_RETURN_IF_ERROR(encoder->Build());
  return encoder;
}

absl::Status VisionEncoder::Build() {
  const int64_t grid = model_.image_size() / model_.patch();
  tokens_per_image_ = grid * grid;
  const int64_t hidden = model_.hidden();
  const int64_t patch_features = model_.channels() * model_.patch() * model_.patch();
  const bool sp = options_.sequence_parallel;
  parameters_ = std::make_unique<nn::ParameterSet>(options_.seed, options_.dtype, tp_.rank(),
                                                   tp_.size(), options_.init_style);
  nn::ParameterSet& p = *parameters_;
  const nn::InitRule weight = nn::InitRule::Normal(kInitStd);
  const nn::InitRule output_weight =
      nn::InitRule::Normal(kInitStd / std::sqrt(2.0 * static_cast<double>(model_.layers())));
  HETPAR_ASSIGN_OR_RETURN(
      patch_weight_, p.Add("encoder.patch_embed.weight", {hidden, patch_features}, -1, weight));
  HETPAR_ASSIGN_OR_RETURN(patch_bias_,
                          p.Add("encoder.patch_embed.bias", {hidden}, -1, p.BiasInit()));
  HETPAR_ASSIGN_OR_RETURN(pos_embed_,
                          p.Add("encoder.pos_embed", {tokens_per_image_, hidden}, -1, weight));
  HETPAR_RETURN_IF_ERROR(p.MarkEmbedding("encoder.pos_embed"));
  for (int64_t i = 0; i < model_.layers(); ++i) {
    const std::string n = absl::StrCat("encoder.layers.", i, ".");
    Layer layer;
    HETPAR_ASSIGN_OR_RETURN(layer.norm1_weight,
                            p.Add(n + "norm1.weight", {hidden}, -1, p.NormScaleInit(), sp));
    HETPAR_ASSIGN_OR_RETURN(layer.norm1_bias,
                            p.Add(n + "norm1.bias", {hidden}, -1, p.BiasInit(), sp));
    HETPAR_ASSIGN_OR_RETURN(layer.qkv_weight,
                            p.Add(n + "attn.qkv.weight", {3 * hidden, hidden}, 0, weight));
    HETPAR_ASSIGN_OR_RETURN(layer.qkv_bias,
                            p.Add(n + "attn.qkv.bias", {3 * hidden}, 0, p.BiasInit()));
    HETPAR_ASSIGN_OR_RETURN(layer.proj_weight,
                            p.Add(n + "attn.proj.weight", {hidden, hidden}, 1, output_weight));
    HETPAR_ASSIGN_OR_RETURN(layer.proj_bias,
                            p.Add(n + "attn.proj.bias", {hidden}, -1, p.BiasInit(), sp));
    HETPAR_ASSIGN_OR_RETURN(layer.norm2_weight,
                            p.Add(n + "norm2.weight", {hidden}, -1, p.NormScaleInit(), sp));
    HETPAR_ASSIGN_OR_RETURN(layer.norm2_bias,
                            p.Add(n + "norm2.bias", {hidden}, -1, p.BiasInit(), sp));
    HETPAR_ASSIGN_OR_RETURN(layer.fc1_weight,
                            p.Add(n + "mlp.fc1.weight", {model_.mlp(), hidden}, 0, weight));
    HETPAR_ASSIGN_OR_RETURN(layer.fc1_bias,
                            p.Add(n + "mlp.fc1.bias", {model_.mlp()}, 0, p.BiasInit()));
    HETPAR_ASSIGN_OR_RETURN(layer.fc2_weight,
                            p.Add(n + "mlp.fc2.weight", {hidden, model_.mlp()}, 1, output_weight));
    HETPAR_ASSIGN_OR_RETURN(layer.fc2_bias,
                            p.Add(n + "mlp.fc2.bias", {hidden}, -1, p.BiasInit(), sp));
    layers_.push_back(std::move(layer));
  }
  if (!model_.no_final_norm()) {
    HETPAR_ASSIGN_OR_RETURN(norm_weight_,
                            p.Add("encoder.norm.weight", {hidden}, -1, p.NormScaleInit(), sp));
    HETPAR_ASSIGN_OR_RETURN(norm_bias_, p.Add("encoder.norm.bias", {hidden}, -1, p.BiasInit(), sp));
  }
  const int64_t out = model_.out_hidden();
  HETPAR_ASSIGN_OR_RETURN(proj1_weight_,
                          p.Add("encoder.projector.fc1.weight", {out, hidden}, 0, weight));
  HETPAR_ASSIGN_OR_RETURN(proj1_bias_, p.Add("encoder.projector.fc1.bias", {out}, 0, p.BiasInit()));
  HETPAR_ASSIGN_OR_RETURN(proj2_weight_,
                          p.Add("encoder.projector.fc2.weight", {out, out}, 1, weight));
  HETPAR_ASSIGN_OR_RETURN(proj2_bias_,
                          p.Add("encoder.projector.fc2.bias", {out}, -1, p.BiasInit()));
  if (options_.frozen) {
    std::vector<std::string> keep;
    if (options_.train_projector) keep.push_back(std::string(kProjectorPrefix));
    p.Freeze("encoder.", keep);
  }
  // Parameters are drawn on the host; the model computes on its device.
  return nn::RunTorch("moving the encoder's parameters to " + options_.device.str(),
                      [&] { p.MoveTo(options_.device); });
}

absl::Status VisionEncoder::CheckImages(const at::Tensor& images) const {
  const int64_t size = model_.image_size();
  if (!images.defined() || images.dim() != 4 || images.size(0) < 1 ||
      images.size(1) != model_.channels() || images.size(2) != size || images.size(3) != size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "encoder input: images have shape [",
        images.defined() ? absl::StrJoin(images.sizes(), ", ") : std::string("undefined"),
        "], expected [n >= 1, ", model_.channels(), ", ", size, ", ", size,
        "] (encoder.model.channels, image_size)"));
  }
  if (!at::isFloatingType(images.scalar_type())) {
    return absl::InvalidArgumentError(absl::StrCat("encoder input: images have dtype ",
                                                   nn::DtypeName(images.scalar_type()),
                                                   ", expected a floating dtype"));
  }
  return absl::OkStatus();
}

absl::StatusOr<at::Tensor> VisionEncoder::Forward(const at::Tensor& images) {
  HETPAR_RETURN_IF_ERROR(CheckImages(images));
  return nn::RunTorchOr(absl::StrCat("encoder forward on TP rank ", tp_.rank(), " of ", tp_.size()),
                        [&] { return ForwardUnchecked(images); });
}

absl::StatusOr<at::Tensor> VisionEncoder::TowerFeatures(const at::Tensor& images) {
  HETPAR_RETURN_IF_ERROR(CheckImages(images));
  return nn::RunTorchOr(
      absl::StrCat("encoder tower features on TP rank ", tp_.rank(), " of ", tp_.size()), [&] {
        const at::NoGradGuard no_grad;
        const int64_t rows = images.size(0) * tokens_per_image_;
        return nn::EnterTensorParallel(Tower(images), rows, tp_);
      });
}

at::Tensor VisionEncoder::ForwardUnchecked(const at::Tensor& images) {
  const int64_t rows = images.size(0) * tokens_per_image_;
  const bool grad_enabled = at::GradMode::is_enabled();
  at::Tensor x = Tower(images);
  const at::AutoGradMode projector_mode(grad_enabled &&
                                        (!options_.frozen || options_.train_projector));

  // Projector: the last layer's partial sums are all-reduced (not reduce-scattered) so that every
  // rank holds the whole boundary tensor.
  at::Tensor h = nn::EnterTensorParallel(x, rows, tp_);
  at::Tensor inner = at::gelu(nn::ColumnParallelLinear(h, proj1_weight_, proj1_bias_));
  return nn::ReduceFromTensorParallel(at::linear(inner, proj2_weight_), tp_.group) + proj2_bias_;
}

at::Tensor VisionEncoder::Tower(const at::Tensor& images) {
  const int64_t n = images.size(0);
  const int64_t channels = model_.channels();
  const int64_t patch = model_.patch();
  const int64_t grid = model_.image_size() / patch;
  const int64_t tokens = tokens_per_image_;
  const int64_t rows = n * tokens;
  const int64_t hidden = model_.hidden();
  const int64_t local_heads = model_.heads() / tp_.size();
  const int64_t head_dim = hidden / model_.heads();
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
  const at::ScalarType dtype = options_.dtype;
  const double eps = model_.norm_eps();
  const c10::string_view approximate = model_.activation() == "gelu_tanh" ? "tanh" : "none";

  // A frozen tower keeps no graph (its parameters need no gradient and neither do the images).
  const bool grad_enabled = at::GradMode::is_enabled();
  const at::AutoGradMode tower_mode(grad_enabled && !options_.frozen);
  // [n, C, gy, py, gx, px] -> [n, gy, gx, C, py, px]: one row per patch, features in conv order.
  at::Tensor patches = nn::ToDevice(images, options_.device)
                           .to(dtype)
                           .reshape({n, channels, grid, patch, grid, patch})
                           .permute({0, 2, 4, 1, 3, 5})
                           .reshape({rows, channels * patch * patch});
  at::Tensor x = at::linear(patches, patch_weight_, patch_bias_) +
                 pos_embed_.unsqueeze(0).expand({n, tokens, hidden}).reshape({rows, hidden});
  x = nn::ToSequenceLayout(x, tp_);

  for (const Layer& layer : layers_) {
    at::Tensor h = nn::EnterTensorParallel(
        nn::LayerNorm(x, layer.norm1_weight, layer.norm1_bias, eps), rows, tp_);
    at::Tensor qkv = nn::ColumnParallelLinear(h, layer.qkv_weight, layer.qkv_bias)
                         .view({n, tokens, local_heads, 3, head_dim});
    at::Tensor q = qkv.select(3, 0).permute({0, 2, 1, 3});  // [n, heads, tokens, d]
    at::Tensor k = qkv.select(3, 1).permute({0, 2, 1, 3});
    at::Tensor v = qkv.select(3, 2).permute({0, 2, 1, 3});
    // Every patch attends to every patch of its image (no mask). On the CPU, ATen's flash kernel:
    // the softmax accumulates in float32 for bfloat16, in the dtype otherwise.
    at::Tensor attended =
        at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/std::nullopt, /*dropout_p=*/0.0,
                                         /*is_causal=*/false, scale)
            .permute({0, 2, 1, 3})
            .reshape({rows, local_heads * head_dim});
    x = x + nn::RowParallelLinear(attended, layer.proj_weight, layer.proj_bias, tp_);

    h = nn::EnterTensorParallel(nn::LayerNorm(x, layer.norm2_weight, layer.norm2_bias, eps), rows,
                                tp_);
    at::Tensor inner =
        at::gelu(nn::ColumnParallelLinear(h, layer.fc1_weight, layer.fc1_bias), approximate);
    x = x + nn::RowParallelLinear(inner, layer.fc2_weight, layer.fc2_bias, tp_);
  }
  // Without the final norm (encoder.model.no_final_norm), the last layer's states as they are.
  return model_.no_final_norm() ? x : nn::LayerNorm(x, norm_weight_, norm_bias_, eps);
}

absl::Status VisionEncoder::Backward(const at::Tensor& output, const at::Tensor& grad_output) {
  if (!TakesGradients()) {
    return absl::FailedPreconditionError(
        "encoder backward: the encoder is frozen (encoder.frozen without train_projector); it "
        "takes no gradients");
  }
  if (!output.defined() || !output.requires_grad()) {
    return absl::FailedPreconditionError(
        "encoder backward: the output is not attached to an autograd graph (was it produced by "
        "Forward with gradients enabled, and not already backpropagated?)");
  }
  if (!grad_output.defined() || grad_output.sizes() != output.sizes()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "encoder backward: gradient has shape [",
        grad_output.defined() ? absl::StrJoin(grad_output.sizes(), ", ") : std::string("undefined"),
        "], expected the output's [", absl::StrJoin(output.sizes(), ", "), "]"));
  }
  return nn::RunTorch(
      absl::StrCat("encoder backward on TP rank ", tp_.rank(), " of ", tp_.size()),
      [&] { output.backward(grad_output.to(output.device(), output.scalar_type())); });
}

absl::Status VisionEncoder::FinishGradients() {
  if (!tp_.sharded()) return absl::OkStatus();
  return parameters_->ReducePartialGrads(*tp_.group);
}

}  // namespace hetpar::encoder
