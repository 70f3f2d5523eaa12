#include "llm_trainer/llm_inputs.h"

namespace hetpar::llm {

LlmSample LlmSampleOf(const data::LoadedSample& sample, int64_t tokens_per_image) {
  LlmSample out;
  out.id = sample.id;
  const data::TokenSequence& seq = sample.tokens;
  out.tokens.assign(seq.input_ids.begin(), seq.input_ids.end());
  out.labels.reserve(seq.labels.size());
  for (size_t i = 0; i < seq.labels.size(); ++i) {
    // Positions without loss carry the ignore label; the model only reads labels under the mask.
    out.labels.push_back(seq.loss_mask[i] ? seq.labels[i] : 0);
  }
  out.loss_mask = seq.loss_mask;
  for (int32_t start : seq.image_offsets) {
    for (int64_t r = 0; r < tokens_per_image; ++r) out.image_positions.push_back(start + r);
  }
  out.image_rows = static_cast<int64_t>(seq.image_offsets.size()) * tokens_per_image;
  return out;
}

}  // namespace hetpar::llm
