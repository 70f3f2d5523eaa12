// MakeIndexBatchSource over hetpar_data (compiled when the build has the data pipeline).
#include <memory>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/data/index.h"
#include "common/data/loader.h"
#include "common/data/sampler.h"
#include "common/logging.h"
#include "coordinator/step_planner.h"

namespace hetpar::coordinator {
namespace {

class IndexBatchSource : public BatchSource {
 public:
  explicit IndexBatchSource(v1::RunSpec spec) : spec_(std::move(spec)) {}

  absl::StatusOr<std::vector<plan::SampleDescriptor>> Next(int64_t count) override {
    if (absl::Status s = Open(); !s.ok()) return s;
    absl::StatusOr<data::SamplerBatch> batch = sampler_->Take(committed_, count);
    if (!batch.ok()) return batch.status();
    std::vector<plan::SampleDescriptor> samples;
    samples.reserve(batch->samples.size());
    for (int64_t position : batch->samples) {
      const data::IndexRecord& record = index_->records[position];
      plan::SampleDescriptor sample;
      sample.id = record.ordinal;
      sample.text_tokens = record.text_tokens;
      sample.loss_tokens = record.loss_tokens;
      sample.tokens_per_image = record.tokens_per_image;
      sample.image_starts.assign(record.image_offsets.begin(), record.image_offsets.end());
      samples.push_back(std::move(sample));
    }
    pending_ = batch->next;
    return samples;
  }

  void Commit() override {
    if (pending_.has_value()) committed_ = *pending_;
    pending_.reset();
  }

  std::string Position() const override { return committed_.ToString(); }

 private:
  // Reads (or builds) the index once.
  absl::Status Open() {
    if (sampler_ != nullptr) return absl::OkStatus();
    absl::StatusOr<data::LoaderOptions> options =
        data::LoaderOptionsFromRunSpec(spec_, data::Split::kTrain);
    if (!options.ok()) return options.status();
    absl::StatusOr<std::unique_ptr<data::DataLoader>> loader = data::DataLoader::Create(*options);
    if (!loader.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("cannot open the training data (run `hetpar data synth` for a synthetic "
                       "data set, or pass --synthetic-batches): ",
                       std::string(loader.status().message())));
    }
    data::IndexBuildOptions build;
    build.verify_images = false;
    bool rebuilt = false;
    absl::StatusOr<data::DataIndex> index =
        data::LoadOrBuildIndex(**loader, spec_.data().index(), build, &rebuilt);
    if (!index.ok()) return index.status();
    if (index->records.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("the data index ", spec_.data().index(), " has no usable samples"));
    }
    HETPAR_LOG(INFO) << (rebuilt ? "built" : "read") << " data index " << spec_.data().index()
                     << ": " << index->records.size() << " samples";
    absl::StatusOr<std::unique_ptr<data::EpochSampler>> sampler = data::EpochSampler::Create(
        static_cast<int64_t>(index->records.size()), static_cast<uint64_t>(spec_.run().seed()));
    if (!sampler.ok()) return sampler.status();
    index_ = std::make_unique<data::DataIndex>(*std::move(index));
    sampler_ = *std::move(sampler);
    return absl::OkStatus();
  }

  v1::RunSpec spec_;
  std::unique_ptr<data::DataIndex> index_;
  std::unique_ptr<data::EpochSampler> sampler_;
  data::SamplerCursor committed_;
  std::optional<data::SamplerCursor> pending_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<BatchSource>> MakeIndexBatchSource(const v1::RunSpec& spec) {
  if (spec.data().manifest().empty()) {
    return absl::InvalidArgumentError(
        "data.manifest is not set: the coordinator plans steps from the training data index "
        "(or pass --synthetic-batches)");
  }
  return std::unique_ptr<BatchSource>(new IndexBatchSource(spec));
}

}  // namespace hetpar::coordinator
