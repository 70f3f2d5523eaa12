// A seeded synthetic global batch, for `hetpar plan` before a dataset index exists, for the
// benchmark and for tests. Each sample is a pure function of (seed, sample id), so any step's
// batch can be produced without the others.
#ifndef HETPAR_COMMON_PLAN_SYNTHETIC_BATCH_H_
#define HETPAR_COMMON_PLAN_SYNTHETIC_BATCH_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "common/plan/sample.h"

namespace hetpar::plan {

// SplitMix64 finaliser: a well-mixed 64-bit hash of `x`.
uint64_t Mix64(uint64_t x);
// Hash of several values in order (for seeded tie-breaking and generation).
uint64_t HashValues(uint64_t a, uint64_t b, uint64_t c = 0, uint64_t d = 0);

struct SyntheticBatchOptions {
  int64_t samples = 1;       // samples in the batch (the global batch)
  int64_t first_id = 0;      // id of the first sample; ids are consecutive...
  int64_t dataset_size = 0;  // ...modulo dataset_size when > 0 (an epoch wraps around)
  int64_t min_images = 0;    // images per sample, uniform in [min_images, max_images]
  int64_t max_images = 3;
  int64_t min_text_tokens = 8;  // text tokens, uniform in [min, max], cut to fit seq_len
  int64_t max_text_tokens = 64;
  int64_t tokens_per_image = 16;
  int64_t seq_len = 128;  // every sample fits in this many positions
  uint64_t seed = 7;
};

// Samples `first_id`, `first_id + 1`, ... Each has a uniform image count and text length; when
// images and text do not fit in seq_len the text is shortened (never below min_text_tokens) and
// then images are dropped. Images sit at random positions between text segments; loss tokens
// are uniform in [1, text_tokens] (0 with no text). InvalidArgument when the ranges are
// inverted or even min_text_tokens (plus one image when min_images > 0) does not fit.
absl::StatusOr<std::vector<SampleDescriptor>> SyntheticBatch(const SyntheticBatchOptions& options);

}  // namespace hetpar::plan

#endif  // HETPAR_COMMON_PLAN_SYNTHETIC_BATCH_H_
