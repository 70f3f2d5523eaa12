// MakeIndexBatchSource over the runs' shared batch source (common/data/batch_source.h), so the
// coordinator plans exactly the batches the reference trainer trains.
#include <atomic>
#include <memory>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/data/batch_source.h"
#include "common/data/sampler.h"
#include "common/logging.h"
#include "coordinator/step_planner.h"

namespace hetpar::coordinator {
namespace {

class IndexBatchSource : public BatchSource {
 public:
  IndexBatchSource(v1::RunSpec spec, std::unique_ptr<data::BatchSource> opened)
      : spec_(std::move(spec)), source_(std::move(opened)) {
    if (source_ != nullptr) digest_ = source_->index().IdDigest();
  }

  // A synthetic data set the RunSpec names is generated here, so the coordinator can start (and
  // admit workers) before the data set exists.
  absl::Status Open() override {
    if (source_ != nullptr) return absl::OkStatus();
    absl::StatusOr<std::unique_ptr<data::BatchSource>> source =
        data::BatchSource::Create(spec_, &open_cancelled_);
    if (absl::IsCancelled(source.status())) return source.status();
    if (!source.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("cannot open the training data (generate it with `hetpar data synth`, "
                       "or plan over synthetic batches with --synthetic-batches): ",
                       std::string(source.status().message())));
    }
    source_ = *std::move(source);
    digest_ = source_->index().IdDigest();
    const std::string& file = source_->index().file;
    HETPAR_LOG(INFO) << "data index "
                     << (file.empty() ? spec_.data().index() + " (not saved)" : file) << ": "
                     << source_->index().records.size() << " samples";
    return absl::OkStatus();
  }

  bool NeedsOpen() const override { return source_ == nullptr; }
  void CancelOpen() override { open_cancelled_.store(true, std::memory_order_release); }

  absl::StatusOr<std::vector<plan::SampleDescriptor>> Next(int64_t count) override {
    if (source_ == nullptr) {
      return absl::FailedPreconditionError("the training data was not opened before planning");
    }
    absl::StatusOr<data::GlobalBatch> batch = source_->Take(committed_, count);
    if (!batch.ok()) return batch.status();
    pending_ = batch->next;
    return std::move(batch->samples);
  }

  void Commit() override {
    if (pending_.has_value()) committed_ = *pending_;
    pending_.reset();
  }

  std::string Position() const override { return committed_.ToString(); }
  data::SamplerCursor CommittedCursor() const override { return committed_; }
  data::SamplerCursor PendingCursor() const override { return pending_.value_or(committed_); }
  int64_t IndexSamples() const override {
    return source_ == nullptr ? 0 : static_cast<int64_t>(source_->index().records.size());
  }
  uint32_t IndexDigest() const override { return digest_; }
  void Restore(const data::SamplerCursor& cursor) override {
    committed_ = cursor;
    pending_.reset();
  }

 private:
  v1::RunSpec spec_;
  std::unique_ptr<data::BatchSource> source_;
  uint32_t digest_ = 0;  // the index's IdDigest, taken when it is opened
  data::SamplerCursor committed_;
  std::optional<data::SamplerCursor> pending_;
  std::atomic<bool> open_cancelled_{false};  // CancelOpen, from another thread
};

}  // namespace

absl::StatusOr<std::unique_ptr<BatchSource>> MakeIndexBatchSource(
    const v1::RunSpec& spec, std::unique_ptr<data::BatchSource> opened) {
  if (spec.data().manifest().empty()) {
    return absl::InvalidArgumentError(
        "data.manifest is not set: the coordinator plans steps from the training data index "
        "(or pass --synthetic-batches)");
  }
  return std::unique_ptr<BatchSource>(new IndexBatchSource(spec, std::move(opened)));
}

}  // namespace hetpar::coordinator
