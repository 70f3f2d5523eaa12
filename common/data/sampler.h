// The epoch sampler: which samples each global batch trains on, resumable from a cursor.
//
// Samples are positions 0 .. N-1 (for the coordinator, positions in DataIndex::records). Epoch e
// visits them in a permutation that depends only on (seed, e, N): a Fisher-Yates shuffle driven
// by splitmix64, defined here so it is the same on every platform and library version. A batch
// that reaches the end of an epoch continues with the next epoch's order, so every sample is
// trained exactly once per epoch whatever the batch size or the layouts.
//
// The cursor (epoch, offset into that epoch's order) is the only state; Take is a pure function
// of (cursor, count), so a step that aborts simply takes again from the same cursor, and a
// checkpoint that stores the committed cursor resumes with exactly the remaining samples.
#ifndef HETPAR_COMMON_DATA_SAMPLER_H_
#define HETPAR_COMMON_DATA_SAMPLER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace hetpar::data {

struct SamplerCursor {
  int64_t epoch = 0;
  int64_t offset = 0;  // samples of `epoch` already taken

  bool operator==(const SamplerCursor& o) const { return epoch == o.epoch && offset == o.offset; }
  // "epoch=3,offset=17"
  std::string ToString() const;
  // Parses ToString's form; InvalidArgument naming the text otherwise.
  static absl::StatusOr<SamplerCursor> Parse(std::string_view text);
};

struct SamplerBatch {
  std::vector<int64_t> samples;  // positions, in training order
  SamplerCursor next;            // the cursor after this batch (commit it with the step)
};

// Thread-safe; caches the most recent epoch's order.
class EpochSampler {
 public:
  // InvalidArgument unless num_samples >= 1.
  static absl::StatusOr<std::unique_ptr<EpochSampler>> Create(int64_t num_samples, uint64_t seed);
  EpochSampler(const EpochSampler&) = delete;
  EpochSampler& operator=(const EpochSampler&) = delete;

  int64_t num_samples() const { return num_samples_; }
  uint64_t seed() const { return seed_; }

  // The order of `epoch`: a permutation of 0 .. num_samples-1.
  std::vector<int64_t> EpochOrder(int64_t epoch) const;

  // The next `count` samples from `from` (crossing into following epochs as needed).
  // InvalidArgument for a negative count or a cursor that does not fit this sampler (negative
  // epoch, offset > num_samples: a cursor saved for a different data set).
  absl::StatusOr<SamplerBatch> Take(const SamplerCursor& from, int64_t count) const;

 private:
  EpochSampler(int64_t num_samples, uint64_t seed) : num_samples_(num_samples), seed_(seed) {}
  std::shared_ptr<const std::vector<int64_t>> Order(int64_t epoch) const;

  const int64_t num_samples_;
  const uint64_t seed_;
  mutable absl::Mutex mu_;
  mutable int64_t cached_epoch_ ABSL_GUARDED_BY(mu_) = -1;
  mutable std::shared_ptr<const std::vector<int64_t>> cached_order_ ABSL_GUARDED_BY(mu_);
};

// splitmix64: the mixing function every deterministic choice of the data pipeline derives from.
uint64_t SplitMix64(uint64_t x);

// A small deterministic generator (splitmix64 stream) with an unbiased bounded draw; identical
// on every platform, unlike the <random> distributions.
class DeterministicRng {
 public:
  explicit DeterministicRng(uint64_t seed) : state_(seed) {}
  uint64_t Next();
  // Uniform in [0, bound), bound >= 1 (Lemire's multiply-shift with rejection).
  uint64_t Below(uint64_t bound);
  // Uniform in [0, 1).
  double Uniform();

 private:
  uint64_t state_;
};

}  // namespace hetpar::data

#endif  // HETPAR_COMMON_DATA_SAMPLER_H_
