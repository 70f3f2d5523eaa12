// The sample loader the workers use: manifest + tokenizer + images -> token ids, labels, loss
// mask and normalised image buffers, by sample id. No libtorch: images are float CHW buffers and
// tokens are int32 vectors; the workers make tensors of them.
//
// Every sample-level problem (missing image, corrupt image, placeholder count different from the
// image count, sequence longer than seq_len under `reject`) is an error naming the sample id, the
// manifest line (JSONL) or array index (.json), the file and the reason. One bad sample never
// affects another: samples are addressed by id (or manifest ordinal), never by position in a
// filtered list.
#ifndef HETPAR_COMMON_DATA_LOADER_H_
#define HETPAR_COMMON_DATA_LOADER_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/data/chat_template.h"
#include "common/data/file_util.h"
#include "common/data/image.h"
#include "common/data/manifest.h"
#include "common/data/record.h"
#include "common/data/sequence.h"
#include "common/data/tokenizer.h"
#include "hetpar/v1/run_spec.pb.h"

namespace hetpar::data {

struct LoaderOptions {
  std::string manifest;                 // manifest path: .jsonl, or .json (manifest.h)
  std::string tokenizer;                // sentencepiece .model, or a Hugging Face tokenizer.json
  std::string image_token = "<image>";  // placeholder written in the text; a tokenizer piece
  int32_t image_size = 0;               // encoder input side, pixels
  int32_t tokens_per_image = 0;         // encoder output rows per image
  int32_t seq_len = 0;                  // LLM sequence length
  int32_t max_vocab = 0;                // > 0: the tokenizer must have at most this many pieces
  OverlongPolicy overlong = OverlongPolicy::kReject;
  // How LLaVA-style (conversations) samples become text; prompt/text samples are always plain.
  ChatTemplate chat_template = ChatTemplate::kPlain;
  bool skip_bad_samples = false;  // skip malformed manifest entries (logged); see index.h
  Normalization normalization;
  // Text-only baseline: every image is returned as zeros (the normalised value of mid-grey,
  // pixel 127.5 with the default normalisation) and no image file is read.
  bool blank_images = false;
};

enum class Split { kTrain, kVal };

// Options for the train or validation split of a RunSpec (with defaults applied): data paths,
// encoder.model.image_size, tokens per image from image_size and patch, llm.model.seq_len,
// llm.model.vocab as max_vocab, data.chat_template. InvalidArgument when the split has no
// manifest or the chat template is unknown.
absl::StatusOr<LoaderOptions> LoaderOptionsFromRunSpec(const hetpar::v1::RunSpec& spec,
                                                       Split split);

// Where a run keeps the training index when it cannot be written beside the manifest (a read-only
// data set; IndexBuildOptions::fallback_path): `<checkpoint.dir>/data-index/<manifest file
// name>-<CRC-32 of the manifest path, 8 hex digits>.index`, which every process of the run can
// write. Empty when the spec has no checkpoint.dir, or names data.index itself.
std::string IndexFallbackPath(const hetpar::v1::RunSpec& spec);

// One sample, ready for the workers.
struct LoadedSample {
  std::string id;
  int64_t ordinal = 0;
  TokenSequence tokens;
  // One buffer per image kept in the sequence, in placeholder order: 3 x image_size x
  // image_size floats, CHW, normalised.
  std::vector<std::vector<float>> images;
};

// Owns a parsed manifest and a tokenizer. Immutable after Create; Load/Describe are const and
// may be called from many threads at once.
// The size and modification time of the files a loader reads: the manifest, the tokenizer, and
// the tokenizer_config.json beside it (a Hugging Face tokenizer's bos and eos; {-1, -1}: none).
struct SourceStamps {
  FileStamp manifest;
  FileStamp tokenizer;
  FileStamp tokenizer_config{-1, -1};
};
// The stamps of `options`' files as they are now; the stat's error, naming the file, otherwise.
absl::StatusOr<SourceStamps> StampSources(const LoaderOptions& options);

class DataLoader {
 public:
  // Reads the manifest and the tokenizer and checks the options (the image token must be one
  // tokenizer piece; the vocabulary must fit max_vocab). `cancel`, once set (from another
  // thread), ends the manifest's read with Cancelled.
  static absl::StatusOr<std::unique_ptr<DataLoader>> Create(
      const LoaderOptions& options, const std::atomic<bool>* cancel = nullptr);
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;

  const LoaderOptions& options() const { return options_; }
  const Manifest& manifest() const { return manifest_; }
  // The stamps of its files taken before Create read them (an index built from this loader is
  // of those files as they were then: one edited since looks stale; one replaced while Create
  // read it gets a manifest stamp no file has); none when a stat failed.
  const std::optional<SourceStamps>& stamps() const { return stamps_; }
  const Tokenizer& tokenizer() const { return *tokenizer_; }
  int32_t image_token_id() const { return image_token_id_; }
  // Readable manifest records (ordinals are 0 .. size() - 1).
  int64_t size() const { return static_cast<int64_t>(manifest_.records.size()); }
  // Ordinal of a sample id; NotFound naming the id and the manifest.
  absl::StatusOr<int64_t> Ordinal(const std::string& id) const;

  // Tokenises the sample (a conversation through options().chat_template, a prompt/text sample
  // as plain) and builds its sequence; images are not read.
  absl::StatusOr<TokenSequence> Tokenize(int64_t ordinal) const;
  // The sample's index record. With verify_images every image the sequence keeps is read and
  // decoded (catches missing and corrupt files); otherwise only its existence is checked.
  absl::StatusOr<IndexRecord> Describe(int64_t ordinal, bool verify_images) const;
  // Tokens and decoded, resized, normalised images.
  absl::StatusOr<LoadedSample> Load(int64_t ordinal) const;
  // Image `k` of the sample alone (LoadedSample::images[k] of Load), decoded, resized and
  // normalised: an encoder rank that encodes some of a sample's images reads only those. `k` must
  // be below the images the sample's sequence keeps (TokenSequence::images() of Tokenize).
  absl::StatusOr<std::vector<float>> LoadImage(int64_t ordinal, int64_t k) const;
  absl::StatusOr<LoadedSample> LoadById(const std::string& id) const;

  // The bad-sample description of an error about `ordinal` (for skip logs and reports).
  BadSample DescribeProblem(int64_t ordinal, const absl::Status& status) const;

 private:
  DataLoader(LoaderOptions options, Manifest manifest, std::unique_ptr<Tokenizer> tokenizer,
             int32_t image_token_id);
  absl::Status CheckOrdinal(int64_t ordinal) const;
  absl::Status SampleError(const ManifestRecord& record, absl::StatusCode code,
                           const std::string& reason) const;
  absl::StatusOr<std::vector<float>> LoadImage(const ManifestRecord& record, size_t k) const;

  LoaderOptions options_;
  std::optional<SourceStamps> stamps_;
  Manifest manifest_;
  std::unique_ptr<Tokenizer> tokenizer_;
  int32_t image_token_id_;
};

}  // namespace hetpar::data

#endif  // HETPAR_COMMON_DATA_LOADER_H_
