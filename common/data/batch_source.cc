#include "common/data/batch_source.h"

#include <zlib.h>

#include <algorithm>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/data/synth.h"
#include "common/logging.h"
#include "common/status.h"

namespace hetpar::data {

plan::SampleDescriptor DescriptorOf(const data::IndexRecord& record, int64_t position) {
  plan::SampleDescriptor d;
  d.id = position;
  d.text_tokens = record.text_tokens;
  d.loss_tokens = record.loss_tokens;
  d.tokens_per_image = record.image_count > 0 ? record.tokens_per_image : 0;
  d.image_starts.assign(record.image_offsets.begin(), record.image_offsets.end());
  d.id_checksum = static_cast<uint32_t>(::crc32(
      0, reinterpret_cast<const Bytef*>(record.id.data()), static_cast<uInt>(record.id.size())));
  d.token_checksum = record.token_checksum;
  return d;
}

absl::StatusOr<std::unique_ptr<BatchSource>> BatchSource::Create(const hetpar::v1::RunSpec& spec,
                                                                 const std::atomic<bool>* cancel) {
  data::SynthReport report;
  HETPAR_ASSIGN_OR_RETURN(bool generated, data::EnsureSyntheticDataset(spec, &report, cancel));
  if (generated) {
    HETPAR_LOG(INFO) << "generated the synthetic data set: " << report.train_samples
                     << " training and " << report.val_samples << " validation samples, "
                     << report.images << " images";
  }
  HETPAR_ASSIGN_OR_RETURN(data::LoaderOptions options,
                          data::LoaderOptionsFromRunSpec(spec, data::Split::kTrain));
  std::unique_ptr<BatchSource> source(new BatchSource());
  HETPAR_ASSIGN_OR_RETURN(source->loader_, data::DataLoader::Create(options, cancel));
  data::IndexBuildOptions build;
  build.verify_images = true;
  // A missing or stale index is built once, decoding every image: on every core (at most 16),
  // not one, as a run's processes wait for it (the result does not depend on the count).
  build.threads = static_cast<int>(std::clamp(std::thread::hardware_concurrency(), 1u, 16u));
  build.cancel = cancel;
  build.fallback_path = data::IndexFallbackPath(spec);
  // A data set with no usable sample fails here (LoadOrBuildIndex).
  HETPAR_ASSIGN_OR_RETURN(source->index_,
                          data::LoadOrBuildIndex(*source->loader_, spec.data().index(), build));
  HETPAR_ASSIGN_OR_RETURN(source->sampler_, data::EpochSampler::Create(
                                                static_cast<int64_t>(source->index_.records.size()),
                                                static_cast<uint64_t>(spec.run().seed())));
  return source;
}

absl::StatusOr<GlobalBatch> BatchSource::Take(const data::SamplerCursor& cursor,
                                              int64_t global_batch) const {
  HETPAR_ASSIGN_OR_RETURN(data::SamplerBatch taken, sampler_->Take(cursor, global_batch));
  GlobalBatch batch;
  batch.next = taken.next;
  batch.samples.reserve(taken.samples.size());
  for (int64_t position : taken.samples) {
    batch.samples.push_back(DescriptorOf(index_.records[position], position));
  }
  return batch;
}

absl::StatusOr<const data::IndexRecord*> BatchSource::RecordFor(
    const plan::SampleDescriptor& sample) const {
  absl::StatusOr<const data::IndexRecord*> found = Record(sample.id);
  // The plan names a sample this index does not hold: no attempt of the step would find it.
  if (!found.ok()) return EndsRun(found.status());
  const data::IndexRecord* record = *found;
  plan::SampleDescriptor mine = DescriptorOf(*record, sample.id);
  if (sample.id_checksum == 0) mine.id_checksum = 0;  // a plan without checksums: shapes only
  // Either index written before token checksums were: not compared.
  if (sample.token_checksum == 0 || mine.token_checksum == 0) {
    mine.token_checksum = sample.token_checksum;
  }
  if (mine == sample) return record;
  const auto describe = [](const plan::SampleDescriptor& d) {
    return absl::StrCat("id checksum ", absl::Hex(d.id_checksum, absl::kZeroPad8),
                        ", token checksum ", absl::Hex(d.token_checksum, absl::kZeroPad8), ", ",
                        d.text_tokens, " text tokens, ", d.loss_tokens, " loss tokens, images at [",
                        absl::StrJoin(d.image_starts, ", "), "]");
  };
  return EndsRun(absl::FailedPreconditionError(absl::StrCat(
      "data index position ", sample.id, " (sample '", record->id, "', ",
      loader_->manifest().Where(record->line), ") has ", describe(mine),
      " here; the coordinator's plan says ", describe(sample),
      ": this worker's data index differs from the coordinator's (another manifest or "
      "tokenizer, or data.skip_bad_samples dropping other samples here); give every process "
      "the same data set")));
}

absl::Status BatchSource::CheckTokens(const data::IndexRecord& record,
                                      const TokenSequence& tokens) const {
  const uint32_t checksum = tokens.Checksum();
  if (tokens.text_tokens == record.text_tokens && tokens.loss_tokens == record.loss_tokens &&
      tokens.image_offsets == record.image_offsets &&
      (record.token_checksum == 0 || record.token_checksum == checksum)) {
    return absl::OkStatus();
  }
  return EndsRun(absl::FailedPreconditionError(absl::StrCat(
      "sample '", record.id, "' (", loader_->manifest().Where(record.line), ") has ",
      tokens.text_tokens, " text tokens, ", tokens.loss_tokens, " loss tokens, images at [",
      absl::StrJoin(tokens.image_offsets, ", "), "], token checksum ",
      absl::Hex(checksum, absl::kZeroPad8), " as tokenized now, but the data index says ",
      record.text_tokens, ", ", record.loss_tokens, ", [",
      absl::StrJoin(record.image_offsets, ", "), "], ",
      absl::Hex(record.token_checksum, absl::kZeroPad8),
      ": the index is stale (the manifest, the tokenizer or its tokenizer_config.json changed "
      "after it was built, keeping its size and modification time); rebuild it (`hetpar data "
      "index --rebuild`) and start the run again")));
}

absl::StatusOr<const data::IndexRecord*> BatchSource::Record(int64_t id) const {
  if (id < 0 || id >= static_cast<int64_t>(index_.records.size())) {
    return absl::OutOfRangeError(absl::StrCat("sample id ", id, " is outside the data index of ",
                                              index_.records.size(), " samples"));
  }
  return &index_.records[id];
}

}  // namespace hetpar::data
