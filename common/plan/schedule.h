// Step scheduling: which LLM replica trains each sample in which wave, and which encoder
// replica encodes each image.
//
// LLM assignment. The global batch of B samples is split into microbatches of exactly
// micro_batch samples each, `waves` per replica (B = waves * replicas * micro_batch). Over fewer
// replicas than the layout's (some left the run) the microbatches may not divide evenly: the
// first replicas then take `waves` and the others one fewer, their last wave's microbatch left
// empty (every replica takes at least one). Samples go to replicas
// by longest-processing-time first on the LLM cost model (the most expensive sample goes to the
// replica with the least cost so far that still has room), then to waves within the replica so
// that every wave carries about the same encoder work (images) across all replicas. A
// microbatch's samples are in batch order; that order is the microbatch's sample order for the
// LLM and for the boundary buffers.
//
// Encoder assignment. For each wave, the images of that wave's samples (over all LLM replicas)
// are spread over the encoder replicas by longest-processing-time first on the encoder cost
// model: the most expensive image goes to the replica with the least work in this wave, ties to
// the one with the least work in the step so far. Images of one sample may land on different
// encoder replicas. By Graham's list-scheduling argument, in every wave
// max replica cost <= mean + largest image cost.
//
// Ties are broken by a hash of (seed, step, sample id[, image]) so the result is a pure
// function of (samples, sizes, cost models, seed, step).
#ifndef HETPAR_COMMON_PLAN_SCHEDULE_H_
#define HETPAR_COMMON_PLAN_SCHEDULE_H_

#include <cstdint>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "common/plan/cost_model.h"
#include "common/plan/sample.h"

namespace hetpar::plan {

// The samples one LLM replica trains in one wave.
struct LlmMicrobatch {
  int64_t replica = 0;
  int64_t wave = 0;
  std::vector<int64_t> samples;  // batch indices, increasing: the microbatch's sample order
  int64_t tokens = 0;            // sum of the samples' sequence lengths
  int64_t image_rows = 0;        // sum of the samples' image tokens
  int64_t loss_tokens = 0;
  double cost = 0;  // LLM cost model, summed over the samples
};

bool operator==(const LlmMicrobatch& a, const LlmMicrobatch& b);

struct LlmAssignment {
  int64_t replicas = 0;
  int64_t waves = 0;
  int64_t micro_batch = 0;
  // replicas * waves microbatches; index replica * waves + wave. Empty only in the last wave of
  // a replica taking one wave fewer.
  std::vector<LlmMicrobatch> microbatches;
  std::vector<int64_t> sample_replica;  // per batch index
  std::vector<int64_t> sample_wave;     // per batch index
  std::vector<double> replica_cost;     // per replica, over the step
  double imbalance = 1.0;               // max replica_cost / mean (1 when all are 0)

  const LlmMicrobatch& At(int64_t replica, int64_t wave) const {
    return microbatches[replica * waves + wave];
  }
};

bool operator==(const LlmAssignment& a, const LlmAssignment& b);

// InvalidArgument when a size is < 1 or samples.size() is not micro_batch x a count of
// microbatches that gives every replica `waves` of them, or one fewer (at least one).
absl::StatusOr<LlmAssignment> AssignLlm(const std::vector<SampleDescriptor>& samples,
                                        int64_t replicas, int64_t waves, int64_t micro_batch,
                                        const CostModel& llm_cost, const CostModel& encoder_cost,
                                        uint64_t seed, int64_t step);

// One image of the batch: image `image` of sample `sample` (a batch index).
struct ImageRef {
  int64_t sample = 0;
  int64_t image = 0;
};

bool operator==(const ImageRef& a, const ImageRef& b);

// The images one encoder replica encodes in one wave. Its output buffer holds the images'
// blocks back to back in `images` order: image i occupies rows
// [row_offsets[i], row_offsets[i] + tokens) of a rows x llm-hidden buffer.
struct EncoderJob {
  int64_t replica = 0;
  int64_t wave = 0;
  std::vector<ImageRef> images;      // sorted by (sample, image)
  std::vector<int64_t> row_offsets;  // per image
  int64_t rows = 0;
  double cost = 0;
};

bool operator==(const EncoderJob& a, const EncoderJob& b);

struct EncoderAssignment {
  int64_t replicas = 0;
  int64_t waves = 0;
  std::vector<EncoderJob> jobs;  // the non-empty jobs, sorted by (replica, wave)
  // Flat image numbering: image k of sample s is flat image image_base[s] + k.
  std::vector<int64_t> image_base;        // samples + 1 entries
  std::vector<int64_t> image_job;         // per flat image: index into jobs
  std::vector<int64_t> image_row_offset;  // per flat image: first row in its job's buffer
  std::vector<double> replica_cost;       // per replica, over the step
  double step_imbalance = 1.0;            // max replica_cost / mean
  double worst_wave_imbalance = 1.0;      // max over waves with images of (max / mean) per wave
  double mean_wave_imbalance = 1.0;       // average over waves with images of (max / mean)

  int64_t FlatImage(int64_t sample, int64_t image) const { return image_base[sample] + image; }
  int64_t total_images() const { return image_base.empty() ? 0 : image_base.back(); }
  // [begin, end) indices into jobs of one replica's jobs.
  std::pair<int64_t, int64_t> JobsOf(int64_t replica) const;
  // The job of (replica, wave), or nullptr when that replica encodes nothing in the wave.
  const EncoderJob* Find(int64_t replica, int64_t wave) const;
};

bool operator==(const EncoderAssignment& a, const EncoderAssignment& b);

// InvalidArgument when replicas < 1 or `llm` does not match `samples`.
absl::StatusOr<EncoderAssignment> AssignEncoder(const std::vector<SampleDescriptor>& samples,
                                                const LlmAssignment& llm, int64_t replicas,
                                                const CostModel& encoder_cost, uint64_t seed,
                                                int64_t step);

}  // namespace hetpar::plan

#endif  // HETPAR_COMMON_PLAN_SCHEDULE_H_
