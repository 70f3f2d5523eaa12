// What the planner knows about one training sample.
//
// A sample is a token sequence of `sequence_length()` positions: `text_tokens` text tokens and,
// for each image k, `tokens_per_image` consecutive image placeholder positions starting at
// `image_starts[k]`. Image starts are increasing and the images do not overlap, so image order
// is sequence order. Every other position in [0, sequence_length()) is a text token. The LLM
// splices the embedding rows of image k (its "block": tokens_per_image rows x llm hidden) into
// positions [image_starts[k], image_starts[k] + tokens_per_image), row r at position
// image_starts[k] + r. The sequence is padded to llm.model.seq_len for sharding (see
// sequence_sharding.h).
//
// `loss_tokens` counts the positions that carry a loss term (at most text_tokens); the sum over
// the global batch is N_global, the divisor of every microbatch's summed loss.
#ifndef HETPAR_COMMON_PLAN_SAMPLE_H_
#define HETPAR_COMMON_PLAN_SAMPLE_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"

namespace hetpar::plan {

struct SampleDescriptor {
  int64_t id = 0;  // dataset sample id (may repeat in a batch that crosses an epoch's end)
  int64_t text_tokens = 0;
  int64_t loss_tokens = 0;
  int64_t tokens_per_image = 0;
  std::vector<int64_t> image_starts;  // first placeholder position of each image
  // CRC-32 of the sample's manifest id (0: not given, e.g. samples no data index named): a worker
  // checks that its index holds the same sample at `id` (data::BatchSource::RecordFor).
  uint32_t id_checksum = 0;
  // data::TokenSequence::Checksum of the sample's token ids and loss mask in the coordinator's
  // index (0: not given): a worker checks that its index tokenized the sample alike.
  uint32_t token_checksum = 0;

  int64_t image_count() const { return static_cast<int64_t>(image_starts.size()); }
  int64_t image_tokens() const { return image_count() * tokens_per_image; }
  int64_t sequence_length() const { return text_tokens + image_tokens(); }
};

bool operator==(const SampleDescriptor& a, const SampleDescriptor& b);

// A sample whose images come first, back to back (positions 0, T, 2T, ...), then its text:
// the usual "<image><image>question" layout.
SampleDescriptor MakeSample(int64_t id, int64_t image_count, int64_t tokens_per_image,
                            int64_t text_tokens, int64_t loss_tokens);

// Checks one sample (index `index` in its batch) against a sequence of `seq_len` positions:
// non-negative counts, loss_tokens <= text_tokens, tokens_per_image >= 1 when there are images,
// increasing non-overlapping image starts inside the sequence, sequence_length() <= seq_len.
absl::Status ValidateSample(const SampleDescriptor& sample, int64_t index, int64_t seq_len);

// ValidateSample for each sample (a sample id may repeat: a batch across an epoch end).
absl::Status ValidateBatch(const std::vector<SampleDescriptor>& samples, int64_t seq_len);

}  // namespace hetpar::plan

#endif  // HETPAR_COMMON_PLAN_SAMPLE_H_
