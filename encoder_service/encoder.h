// The image encoder: a ViT plus a projector MLP, tensor-parallel over a TP group.
//
//   images [n, channels, size, size]
//     -> patches [n * T, channels * patch^2]            T = (size / patch)^2 tokens per image
//     -> patch embedding (linear) + learned position embedding
//     -> `layers` pre-norm blocks: x += Attn(LN(x)); x += MLP(LN(x))
//        (GELU MLP, exact or tanh-approximated: encoder.model.activation; LN epsilon norm_eps)
//     -> final LayerNorm, unless encoder.model.no_final_norm (TowerFeatures ends here)
//     -> projector: Linear(hidden, out_hidden), GELU, Linear(out_hidden, out_hidden)
//   output [n * T, out_hidden]: rows [i * T, (i + 1) * T) are image i's block, in input order.
//
// Attention is split by heads over the TP group (column-parallel QKV, row-parallel output
// projection), the MLPs are column- then row-parallel, and the projector's last layer is
// row-parallel with an all-reduce, so the output is the same full tensor on every TP rank: the
// boundary tensor the LLM consumes. With sequence parallelism the rows outside TP regions (norms,
// residuals) are sharded over the TP ranks; the output is still replicated.
//
// Parameter names (stable; init seeds and checkpoints use them), d = hidden / heads:
//   encoder.patch_embed.weight [hidden, channels*patch*patch]  (the conv kernel flattened C,y,x)
//   encoder.patch_embed.bias [hidden]      encoder.pos_embed [T, hidden]
//   encoder.layers.<i>.norm1.{weight,bias} [hidden]
//   encoder.layers.<i>.attn.qkv.{weight [3*hidden, hidden], bias [3*hidden]}  split on dim 0;
//       rows grouped by head: head h owns rows [3*d*h, 3*d*(h+1)) = its q, k and v rows
//   encoder.layers.<i>.attn.proj.{weight [hidden, hidden] split on dim 1, bias [hidden]}
//   encoder.layers.<i>.norm2.{weight,bias}
//   encoder.layers.<i>.mlp.fc1.{weight [mlp, hidden], bias [mlp]}  split on dim 0
//   encoder.layers.<i>.mlp.fc2.{weight [hidden, mlp] split on dim 1, bias [hidden]}
//   encoder.norm.{weight,bias}   (not with encoder.model.no_final_norm)
//   encoder.projector.fc1.{weight [out_hidden, hidden], bias [out_hidden]}  split on dim 0
//   encoder.projector.fc2.{weight [out_hidden, out_hidden] split on dim 1, bias [out_hidden]}
//
// Threading: one thread drives a VisionEncoder (its collectives follow the TP group's order).
// Several forwards may be alive at once (each output holds its graph until its Backward).
#ifndef HETPAR_ENCODER_SERVICE_ENCODER_H_
#define HETPAR_ENCODER_SERVICE_ENCODER_H_

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/nn/communicator.h"
#include "common/nn/parameters.h"
#include "common/nn/tp_ops.h"
#include "hetpar/v1/run_spec.pb.h"

namespace hetpar::encoder {

struct EncoderOptions {
  at::ScalarType dtype = at::kFloat;  // parameters and activations
  // Where the parameters live and the model computes (nn::ExecutionContext::device); images on
  // the host are moved there, and the output is there.
  c10::Device device = c10::kCPU;
  int64_t seed = 1234;  // run seed; parameter seeds derive from it and their names
  bool sequence_parallel = false;
  nn::InitStyle init_style = nn::InitStyle::kTraining;
  // The vision tower (everything before the projector) is frozen: no gradients, no updates, and
  // its forward keeps no autograd graph.
  bool frozen = false;
  // With frozen: the projector stays trainable (else it is frozen too).
  bool train_projector = false;
};

// Options of a RunSpec: run.dtype, run.seed, encoder.layout.sequence_parallel, encoder.frozen and
// encoder.train_projector.
absl::StatusOr<EncoderOptions> EncoderOptionsFromSpec(const hetpar::v1::RunSpec& spec);

class VisionEncoder {
 public:
  // Builds and initialises this rank's part of the model. `tp` is this replica's TP group; the
  // encoder keeps a reference to its group (not to `tp` itself). Sizes that do not split over
  // the group are InvalidArgument naming the field.
  static absl::StatusOr<std::unique_ptr<VisionEncoder>> Create(
      const hetpar::v1::EncoderModel& model, const EncoderOptions& options,
      const nn::Communicator& tp);

  VisionEncoder(const VisionEncoder&) = delete;
  VisionEncoder& operator=(const VisionEncoder&) = delete;

  // Encodes one job: images [n, channels, image_size, image_size] of any floating dtype
  // (converted to the model dtype), n >= 1. Returns [n * tokens_per_image(), out_hidden] in the
  // model dtype, identical on every TP rank, attached to the autograd graph unless every
  // parameter is frozen (TakesGradients() false). A frozen vision tower runs without autograd.
  absl::StatusOr<at::Tensor> Forward(const at::Tensor& images);

  // The vision tower's output for `images` (as Forward takes them): the final LayerNorm's
  // [n * tokens_per_image(), hidden], before the projector, identical on every TP rank, without
  // autograd. What a Hugging Face vision model calls its last hidden state; with
  // encoder.model.no_final_norm, the last layer's output, its hidden_states[-1].
  absl::StatusOr<at::Tensor> TowerFeatures(const at::Tensor& images);

  // Backpropagates grad_output (the gradient of the loss with respect to `output`, same shape)
  // through the graph of the Forward that returned `output`, accumulating parameter gradients.
  // Every TP rank passes the same full grad_output.
  absl::Status Backward(const at::Tensor& output, const at::Tensor& grad_output);

  // Once per step, after the last Backward: sums over the TP group the gradients that sequence
  // parallelism leaves partial (norms, biases after a reduce-scatter). No-op without SP.
  absl::Status FinishGradients();

  // Whether the output needs its gradient back (some parameter is trainable).
  bool TakesGradients() const { return parameters_->AnyTrainable(); }

  nn::ParameterSet& parameters() { return *parameters_; }
  const nn::ParameterSet& parameters() const { return *parameters_; }
  const hetpar::v1::EncoderModel& model() const { return model_; }
  const EncoderOptions& options() const { return options_; }
  int64_t tokens_per_image() const { return tokens_per_image_; }

 private:
  struct Layer {
    at::Tensor norm1_weight, norm1_bias, qkv_weight, qkv_bias, proj_weight, proj_bias;
    at::Tensor norm2_weight, norm2_bias, fc1_weight, fc1_bias, fc2_weight, fc2_bias;
  };

  VisionEncoder(const hetpar::v1::EncoderModel& model, const EncoderOptions& options,
                nn::TensorParallel tp);
  absl::Status Build();
  absl::Status CheckImages(const at::Tensor& images) const;
  at::Tensor ForwardUnchecked(const at::Tensor& images);
  // Patch embedding through the final LayerNorm, or the last layer without it (the sequence
  // layout under SP).
  at::Tensor Tower(const at::Tensor& images);

  hetpar::v1::EncoderModel model_;
  EncoderOptions options_;
  nn::TensorParallel tp_;
  int64_t tokens_per_image_;
  std::unique_ptr<nn::ParameterSet> parameters_;
  at::Tensor patch_weight_, patch_bias_, pos_embed_;
  std::vector<Layer> layers_;
  at::Tensor norm_weight_, norm_bias_;
  at::Tensor proj1_weight_, proj1_bias_, proj2_weight_, proj2_bias_;
};

}  // namespace hetpar::encoder

#endif  // HETPAR_ENCODER_SERVICE_ENCODER_H_
