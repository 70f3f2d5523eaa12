#include "common/plan/flops.h"

namespace hetpar::plan {

EncoderTraining EncoderTrainingOf(const v1::EncoderSpec& encoder) {
  if (!encoder.frozen()) return EncoderTraining::kAll;
  return encoder.train_projector() ? EncoderTraining::kProjectorOnly : EncoderTraining::kNone;
}

FlopCount EncoderImageFlops(const v1::EncoderModel& m, EncoderTraining training) {
  const double grid = static_cast<double>(m.image_size() / m.patch());
  const double p = grid * grid;
  const double h = static_cast<double>(m.hidden());
  const double mlp = static_cast<double>(m.mlp());
  const double o = static_cast<double>(m.out_hidden());
  const double patch_in = static_cast<double>(m.channels() * m.patch() * m.patch());
  const double embed = 2 * p * patch_in * h;
  const double layer = 2 * p * h * 3 * h + 2 * p * p * h + 2 * p * p * h + 2 * p * h * h +
                       2 * p * h * mlp + 2 * p * mlp * h;
  const double projector1 = 2 * p * h * o;
  const double projector2 = 2 * p * o * o;
  const double rest = static_cast<double>(m.layers()) * layer + projector1 + projector2;
  FlopCount flops;
  flops.forward = embed + rest;
  switch (training) {
    case EncoderTraining::kAll:
      flops.backward = embed + 2 * rest;
      break;
    case EncoderTraining::kProjectorOnly:
      flops.backward = projector1 + 2 * projector2;
      break;
    case EncoderTraining::kNone:
      flops.backward = 0;
      break;
  }
  return flops;
}

FlopCount LlmSampleFlops(const v1::LlmModel& m, int64_t positions, int64_t loss_tokens) {
  const double s = static_cast<double>(positions);
  const double h = static_cast<double>(m.hidden());
  const double d = h / static_cast<double>(m.heads());
  const double kv = static_cast<double>(m.kv_heads() > 0 ? m.kv_heads() : m.heads());
  const double f = static_cast<double>(m.ffn());
  const double layer = 2 * s * h * (h + 2 * kv * d) + 2 * s * s * h + 2 * s * s * h +
                       2 * s * h * h + 3 * 2 * s * h * f;
  const double head = 2 * static_cast<double>(loss_tokens) * h * static_cast<double>(m.vocab());
  FlopCount flops;
  flops.forward = static_cast<double>(m.layers()) * layer + head;
  flops.backward = 2 * flops.forward;
  return flops;
}

StepFlops BatchFlops(const v1::RunSpec& spec, const std::vector<SampleDescriptor>& samples) {
  const FlopCount image =
      EncoderImageFlops(spec.encoder().model(), EncoderTrainingOf(spec.encoder()));
  StepFlops flops;
  for (const SampleDescriptor& sample : samples) {
    for (int64_t i = 0; i < sample.image_count(); ++i) flops.encoder += image;
    flops.llm += LlmSampleFlops(spec.llm().model(), sample.sequence_length(), sample.loss_tokens);
  }
  return flops;
}

FlopRate AchievedRate(double model_flops, double duration_s, int64_t ranks,
                      double peak_tflops_per_rank) {
  FlopRate rate;
  if (!(duration_s > 0)) return rate;
  rate.tflops = model_flops / duration_s / 1e12;
  rate.tflops_per_rank = ranks > 0 ? rate.tflops / static_cast<double>(ranks) : 0;
  if (peak_tflops_per_rank > 0) rate.utilization = rate.tflops_per_rank / peak_tflops_per_rank;
  return rate;
}

}  // namespace hetpar::plan
