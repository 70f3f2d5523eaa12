// The LLM's inputs from the data pipeline.
#ifndef HETPAR_LLM_TRAINER_LLM_INPUTS_H_
#define HETPAR_LLM_TRAINER_LLM_INPUTS_H_

#include <cstdint>

#include "common/data/loader.h"
#include "llm_trainer/language_model.h"

namespace hetpar::llm {

// The LLM's view of a loaded sample: int64 tokens and labels, the loss mask, and every image
// placeholder position (image k's rows at image_offsets[k] + r, r < tokens_per_image). Labels
// outside the loss mask are 0 (the model reads labels only under the mask).
LlmSample LlmSampleOf(const data::LoadedSample& sample, int64_t tokens_per_image);

}  // namespace hetpar::llm

#endif  // HETPAR_LLM_TRAINER_LLM_INPUTS_H_
