// Model FLOPs: the floating-point operations of the matrix products the encoder and the LLM run
// for a step's samples, forward and backward, counted from the shapes as the models compute them
// (encoder_service/encoder.cc, llm_trainer/language_model.cc). A multiply-add is 2 FLOPs.
// Elementwise work (norms, activations, softmax, RoPE, the loss) is not counted; it is a few
// percent of the total for real shapes.
//
//   ViT + projector, per image of P = (image_size / patch)^2 patches, hidden h, MLP m, output o:
//     patch embedding  2 P (C patch^2) h
//     per layer        2 P h 3h (qkv) + 2 P^2 h (scores) + 2 P^2 h (weighted values)
//                      + 2 P h h (out proj) + 2 P h m + 2 P m h (MLP)
//     projector        2 P h o + 2 P o o
//   Decoder LLM, per sample of s positions and l loss tokens, hidden h, head size d = h / heads,
//   kv heads k, SwiGLU inner f, vocabulary V:
//     per layer        2 s h (h + 2 k d) (qkv) + 2 s^2 h (scores, every position pair as the
//                      model computes them) + 2 s^2 h (weighted values) + 2 s h h (out proj)
//                      + 3 x 2 s h f (gate, up, down)
//     output head      2 l h V (logits only where a label is)
//   Backward: twice the forward (input and weight gradients), except the patch embedding, whose
//   input (the pixels) needs no gradient: once. A frozen encoder (encoder.frozen) has no
//   backward; with encoder.train_projector only the projector's: its first layer's weight
//   gradient (its input needs none) and both gradients of its second layer.
#ifndef HETPAR_COMMON_PLAN_FLOPS_H_
#define HETPAR_COMMON_PLAN_FLOPS_H_

#include <cstdint>
#include <vector>

#include "common/plan/sample.h"
#include "hetpar/v1/run_spec.pb.h"

namespace hetpar::plan {

struct FlopCount {
  double forward = 0;
  double backward = 0;
  double total() const { return forward + backward; }
  FlopCount& operator+=(const FlopCount& other) {
    forward += other.forward;
    backward += other.backward;
    return *this;
  }
};

// Which of the encoder's parameters train (encoder.frozen, encoder.train_projector).
enum class EncoderTraining { kAll, kProjectorOnly, kNone };
EncoderTraining EncoderTrainingOf(const v1::EncoderSpec& encoder);

// One image through the ViT and the projector.
FlopCount EncoderImageFlops(const v1::EncoderModel& model,
                            EncoderTraining training = EncoderTraining::kAll);

// One sample of `positions` sequence positions (text and image placeholders) of which
// `loss_tokens` carry a label.
FlopCount LlmSampleFlops(const v1::LlmModel& model, int64_t positions, int64_t loss_tokens);

struct StepFlops {
  FlopCount encoder;
  FlopCount llm;
};

// A global batch: every image through the encoder, every sample through the LLM (the encoder's
// backward as encoder.frozen and train_projector say).
StepFlops BatchFlops(const v1::RunSpec& spec, const std::vector<SampleDescriptor>& samples);

// A module's achieved rate in a step: its model FLOPs over the step's duration (the rate the
// run trained at, waits included), in total and per rank, and the share of the ranks' peak.
struct FlopRate {
  double tflops = 0;
  double tflops_per_rank = 0;
  double utilization = -1;  // tflops_per_rank / peak; -1 when no peak is configured
};
FlopRate AchievedRate(double model_flops, double duration_s, int64_t ranks,
                      double peak_tflops_per_rank);

}  // namespace hetpar::plan

#endif  // HETPAR_COMMON_PLAN_FLOPS_H_
