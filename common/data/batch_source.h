// The global batches of a run: the data set (generated first when the RunSpec asks for a
// synthetic one), its index, the epoch sampler, and for each step the planner's descriptors of
// the batch. No libtorch: the coordinator plans with it and the workers load by the same ids.
//
// A plan's sample id is the sample's position in the data index (DataIndex::records), so any
// process holding the same index maps an id back to its record and manifest ordinal.
#ifndef HETPAR_COMMON_DATA_BATCH_SOURCE_H_
#define HETPAR_COMMON_DATA_BATCH_SOURCE_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "common/data/index.h"
#include "common/data/loader.h"
#include "common/data/record.h"
#include "common/data/sampler.h"
#include "common/plan/sample.h"
#include "hetpar/v1/run_spec.pb.h"

namespace hetpar::data {

// The planner's view of an index record at `position` in the index.
plan::SampleDescriptor DescriptorOf(const data::IndexRecord& record, int64_t position);

struct GlobalBatch {
  std::vector<plan::SampleDescriptor> samples;  // in training order; id = index position
  data::SamplerCursor next;                     // the cursor once this batch is committed
};

class BatchSource {
 public:
  // Generates the synthetic data set when the spec names one that is absent, opens the training
  // split and loads (or builds) its index. `cancel`, once set (from another thread), ends the
  // wait for another process's generation or index build, an index build, and the reads of the
  // manifest and of the index, with Cancelled.
  static absl::StatusOr<std::unique_ptr<BatchSource>> Create(
      const hetpar::v1::RunSpec& spec, const std::atomic<bool>* cancel = nullptr);
  BatchSource(const BatchSource&) = delete;
  BatchSource& operator=(const BatchSource&) = delete;

  const data::DataLoader& loader() const { return *loader_; }
  const data::DataIndex& index() const { return index_; }
  const data::EpochSampler& sampler() const { return *sampler_; }

  // The `global_batch` samples that follow `cursor`.
  absl::StatusOr<GlobalBatch> Take(const data::SamplerCursor& cursor, int64_t global_batch) const;

  // The index record of plan sample id `id`; OutOfRange naming the id otherwise.
  absl::StatusOr<const data::IndexRecord*> Record(int64_t id) const;
  // Record(sample.id), checked against what the plan says of it (the coordinator's index): its
  // text and loss tokens and image positions. FailedPrecondition, naming both, when they differ:
  // this worker's data index is not the coordinator's (another manifest or tokenizer, or
  // data.skip_bad_samples dropping other samples here), and it would train other samples than
  // the plan's. Both errors are marked EndsRun: every attempt of the step would meet them.
  absl::StatusOr<const data::IndexRecord*> RecordFor(const plan::SampleDescriptor& sample) const;
  // The sample's tokens as loaded now (DataLoader::Tokenize or Load) against its index record.
  // FailedPrecondition naming the sample (its id, manifest and line) and both when they differ:
  // the index is stale (the manifest, the tokenizer or its tokenizer_config.json changed after it
  // was built, keeping its size and modification time), and the plan's shapes and loss divisor,
  // made from it, would not be the sample's. Marked EndsRun.
  absl::Status CheckTokens(const data::IndexRecord& record, const TokenSequence& tokens) const;

 private:
  BatchSource() = default;
  std::unique_ptr<data::DataLoader> loader_;
  data::DataIndex index_;
  std::unique_ptr<data::EpochSampler> sampler_;
};

}  // namespace hetpar::data

#endif  // HETPAR_COMMON_DATA_BATCH_SOURCE_H_
