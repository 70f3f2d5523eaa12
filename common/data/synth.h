// The synthetic image-caption data set: a caption that cannot be guessed without the images.
//
// Each image is a dark canvas with 0-3 shapes (circle, square, triangle) in one of six colours,
// two sizes and nine positions (a 3x3 grid: top left ... bottom right); its caption lists them in
// reading order ("a small red circle at the top left and a large blue square at the center.").
// Samples carry 0, 1, 2 or 3 images: text-only samples ask a question about nothing visual
// ("what is two plus three?" -> "five."), single-image samples describe their image,
// multi-image samples describe each in turn ("the first image has ..., the second image is
// empty."). Written as PNG files, a JSONL manifest per split (manifest.h), a sentencepiece
// tokenizer trained on the training text with `<image>` as a user-defined piece, and a data
// index per split (index.h).
//
// Everything is a function of the seed: sample i of a split depends only on (seed, split, i),
// so the first N samples are the same whatever the total; the tokenizer model bytes are the
// same for the same options.
#ifndef HETPAR_COMMON_DATA_SYNTH_H_
#define HETPAR_COMMON_DATA_SYNTH_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/data/image.h"
#include "common/data/manifest.h"
#include "hetpar/v1/run_spec.pb.h"

namespace hetpar::data {

// ---- scenes ----

enum class ShapeKind { kCircle = 0, kSquare = 1, kTriangle = 2 };
inline constexpr int kShapeKinds = 3;
inline constexpr int kColours = 6;
inline constexpr int kCells = 9;  // 3x3 grid, row-major from the top left

struct Shape {
  ShapeKind kind = ShapeKind::kCircle;
  int colour = 0;  // index into SynthColourNames()
  int cell = 0;    // 0..8, row-major
  bool large = false;
};

// Shapes of one image, in distinct cells, sorted by cell.
struct Scene {
  std::vector<Shape> shapes;
};

// The words the captions use for each attribute (the evaluation's lexicon).
const std::array<const char*, kColours>& SynthColourNames();
const std::array<const char*, kShapeKinds>& SynthShapeNames();
const std::array<const char*, kCells>& SynthCellNames();  // "top left", ..., "center", ...
const std::array<const char*, 2>& SynthSizeNames();       // "small", "large"

// The RGB value of colour `c` and of the canvas.
std::array<uint8_t, 3> SynthColour(int c);
inline constexpr std::array<uint8_t, 3> kSynthBackground = {32, 32, 32};

// Draws `scene` on a size x size canvas (4x4 supersampled edges). Pure and deterministic.
RgbImage RenderScene(const Scene& scene, int size);

// "a small red circle at the top left and a large blue square at the center" (no final stop);
// "" for an empty scene.
std::string DescribeShapes(const Scene& scene);

// ---- samples ----

struct SynthSample {
  ManifestRecord record;      // id, image paths, prompt, text
  std::vector<Scene> scenes;  // one per image
};

// Sample `index` of a split ("train" or "val"), with at most `max_images` images; image paths are
// "images/<split>/<id>-<k>.png". Pure: depends only on its arguments.
SynthSample MakeSynthSample(uint64_t seed, const std::string& split, int64_t index, int max_images);

// ---- the data set on disk ----

struct SynthOptions {
  std::string train_manifest;  // e.g. DIR/train.jsonl; images go to DIR/images/
  std::string val_manifest;    // e.g. DIR/val.jsonl (empty: no validation split)
  std::string tokenizer;       // e.g. DIR/tokenizer.model
  std::string train_index;     // default <train_manifest>.index
  std::string val_index;       // default <val_manifest>.index
  int64_t samples = 0;         // training samples, >= 1
  int64_t val_samples = 0;     // validation samples, >= 0
  uint64_t seed = 7;
  int32_t image_size = 32;        // pixels (square)
  int32_t tokens_per_image = 16;  // placeholder rows per image (encoder output)
  int32_t seq_len = 128;          // every sample must fit
  int32_t vocab_size = 256;       // tokenizer vocabulary upper bound (<= llm.model.vocab)
  std::string image_token = "<image>";
  int index_threads = 1;
};

// Options that write DIR/train.jsonl, DIR/val.jsonl, DIR/tokenizer.model and DIR/images/.
SynthOptions SynthOptionsForDirectory(const std::string& dir);

// Options for a RunSpec with defaults applied (data.* paths, data.synth.*,
// encoder.model.image_size and patch, llm.model.seq_len and vocab). InvalidArgument when
// data.synth.samples is 0 or a path is missing.
absl::StatusOr<SynthOptions> SynthOptionsFromRunSpec(const hetpar::v1::RunSpec& spec);

struct SynthReport {
  int64_t train_samples = 0;
  int64_t val_samples = 0;
  int64_t images = 0;
  std::array<int64_t, 4> train_samples_by_images = {0, 0, 0, 0};
  int32_t vocab_size = 0;        // pieces in the trained tokenizer
  int32_t max_total_tokens = 0;  // longest sequence over both splits
  int max_images = 0;            // images per sample allowed by seq_len
};

// Writes the whole data set (images, tokenizer, manifests, indexes). The manifests are written
// last, atomically, after the images and the tokenizer are durable: a manifest exists only for a
// complete data set. Every sample is checked to fit seq_len with the trained tokenizer.
absl::StatusOr<SynthReport> GenerateSyntheticDataset(const SynthOptions& options);

// GenerateSyntheticDataset holding the data set's lock (`.hetpar-synth.lock` beside the training
// manifest, which EnsureSyntheticDataset also takes): waits while another process generates it.
absl::StatusOr<SynthReport> GenerateSyntheticDatasetExclusively(const SynthOptions& options);

// Whether the synthetic data set the RunSpec names is on disk (its manifests and tokenizer):
// EnsureSyntheticDataset then uses it as it is.
absl::StatusOr<bool> SyntheticDatasetPresent(const hetpar::v1::RunSpec& spec);

// The training runtime's entry point: when data.synth.samples > 0 and the manifest, the
// validation manifest or the tokenizer is missing, generates the data set the RunSpec names.
// Returns whether it generated (false: the files were all present, nothing was touched).
// `cancel`, when given, ends a wait for another process's generation with Cancelled once it is
// set (a coordinator shutting down does not wait for it).
absl::StatusOr<bool> EnsureSyntheticDataset(const hetpar::v1::RunSpec& spec,
                                            SynthReport* report = nullptr,
                                            const std::atomic<bool>* cancel = nullptr);

}  // namespace hetpar::data

#endif  // HETPAR_COMMON_DATA_SYNTH_H_
