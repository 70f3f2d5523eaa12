#include "common/data/synth.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/atomic_file.h"
#include "common/config/config.h"
#include "common/data/file_util.h"
#include "common/data/index.h"
#include "common/data/loader.h"
#include "common/data/sampler.h"
#include "common/data/tokenizer.h"
#include "common/errno_status.h"
#include "common/logging.h"
#include "common/status.h"

namespace hetpar::data {
namespace {

namespace fs = std::filesystem;

constexpr std::array<const char*, 9> kNumberWords = {"zero", "one", "two",   "three", "four",
                                                     "five", "six", "seven", "eight"};
constexpr std::array<const char*, 3> kOrdinals = {"first", "second", "third"};
// Text positions a sample with images may need besides its image rows (bos, prompt, caption,
// eos); the longest generated caption is well under this.
constexpr int32_t kTextBudget = config::kSynthCaptionTokens;

uint64_t HashString(const std::string& s) {
  uint64_t h = 1469598103934665603ULL;  // FNV-1a
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ULL;
  }
  return h;
}

Scene MakeScene(DeterministicRng* rng, int count) {
  std::array<int, kCells> cells;
  for (int i = 0; i < kCells; ++i) cells[static_cast<size_t>(i)] = i;
  for (int i = 0; i < count; ++i) {
    const int j = i + static_cast<int>(rng->Below(static_cast<uint64_t>(kCells - i)));
    std::swap(cells[static_cast<size_t>(i)], cells[static_cast<size_t>(j)]);
  }
  Scene scene;
  for (int i = 0; i < count; ++i) {
    Shape shape;
    shape.cell = cells[static_cast<size_t>(i)];
    shape.kind = static_cast<ShapeKind>(rng->Below(kShapeKinds));
    shape.colour = static_cast<int>(rng->Below(kColours));
    shape.large = rng->Below(2) == 1;
    scene.shapes.push_back(shape);
  }
  std::sort(scene.shapes.begin(), scene.shapes.end(),
            [](const Shape& a, const Shape& b) { return a.cell < b.cell; });
  return scene;
}

// Is the point (dx, dy), relative to the shape's centre, inside a shape of half-size r?
bool Inside(ShapeKind kind, double dx, double dy, double r) {
  switch (kind) {
    case ShapeKind::kCircle:
      return dx * dx + dy * dy <= r * r;
    case ShapeKind::kSquare:
      return std::abs(dx) <= 0.8 * r && std::abs(dy) <= 0.8 * r;
    case ShapeKind::kTriangle:
      // Apex (0, -r), base from (-r, 0.8r) to (r, 0.8r).
      return dy >= -r && dy <= 0.8 * r && std::abs(dx) <= (dy + r) / 1.8;
  }
  return false;
}

// Sentences that hold every word and phrase the generator can write, so the tokenizer knows
// them all however few samples are generated.
std::vector<std::string> LexiconSentences() {
  std::vector<std::string> out;
  for (int c = 0; c < kColours; ++c) {
    for (int k = 0; k < kShapeKinds; ++k) {
      for (int s = 0; s < 2; ++s) {
        for (int cell = 0; cell < kCells; ++cell) {
          Scene scene;
          scene.shapes.push_back({static_cast<ShapeKind>(k), c, cell, s == 1});
          out.push_back(DescribeShapes(scene) + ".");
        }
      }
    }
  }
  for (int a = 0; a < 5; ++a) {
    for (int b = 0; b < 5; ++b) {
      out.push_back(absl::StrCat("what is ", kNumberWords[static_cast<size_t>(a)], " plus ",
                                 kNumberWords[static_cast<size_t>(b)], "? ",
                                 kNumberWords[static_cast<size_t>(a + b)], "."));
    }
  }
  out.push_back("describe the image. the image is empty.");
  out.push_back("compare the two images. compare the three images.");
  out.push_back("the first image has, the second image is empty and the third image has.");
  return out;
}

std::string PathFor(const std::string& manifest, const std::string& relative) {
  return (fs::path(manifest).parent_path() / relative).lexically_normal().string();
}

absl::Status CheckOptions(const SynthOptions& o) {
  std::vector<std::string> problems;
  if (o.train_manifest.empty()) problems.push_back("train manifest path is empty");
  if (o.tokenizer.empty()) problems.push_back("tokenizer path is empty");
  if (o.samples < 1) problems.push_back(absl::StrCat("samples=", o.samples, "; expected >= 1"));
  if (o.val_samples < 0) {
    problems.push_back(absl::StrCat("val_samples=", o.val_samples, "; expected >= 0"));
  }
  if (o.val_samples > 0 && o.val_manifest.empty()) {
    problems.push_back(absl::StrCat("val_samples=", o.val_samples, " but no val manifest path"));
  }
  if (o.image_size < config::kSynthMinImageSize || o.image_size > config::kSynthMaxImageSize) {
    problems.push_back(absl::StrCat("image_size=", o.image_size, "; expected ",
                                    config::kSynthMinImageSize, "..", config::kSynthMaxImageSize,
                                    " pixels"));
  }
  if (o.tokens_per_image < 1) {
    problems.push_back(absl::StrCat("tokens_per_image=", o.tokens_per_image, "; expected >= 1"));
  }
  if (o.seq_len < kTextBudget) {
    problems.push_back(absl::StrCat("seq_len=", o.seq_len, "; expected >= ", kTextBudget,
                                    " (a caption needs up to ", kTextBudget, " text tokens)"));
  } else if (o.seq_len < kTextBudget + o.tokens_per_image) {
    problems.push_back(
        absl::StrCat("seq_len=", o.seq_len, " cannot hold one image of ", o.tokens_per_image,
                     " tokens and a caption; expected >= ", kTextBudget + o.tokens_per_image));
  }
  if (o.vocab_size < config::kSynthMinVocab) {
    problems.push_back(absl::StrCat("vocab_size=", o.vocab_size,
                                    "; expected >= ", config::kSynthMinVocab,
                                    " (the captions' characters and pieces)"));
  }
  if (o.image_token.empty()) problems.push_back("image_token is empty");
  if (problems.empty()) return absl::OkStatus();
  std::string message = "synthetic data set options are invalid:";
  for (const std::string& p : problems) absl::StrAppend(&message, "\n  ", p);
  return absl::InvalidArgumentError(message);
}

// An flock on `.hetpar-synth.lock` beside the training manifest, held while the data set is
// generated (WaitedFileLock: without it where it cannot be had).
absl::StatusOr<WaitedFileLock> TakeSynthLock(const std::string& train_manifest,
                                             const std::atomic<bool>* cancel = nullptr) {
  // Generating a large data set takes long; a holder past this is taken as stuck.
  constexpr absl::Duration kSynthLockTimeout = absl::Hours(2);
  const fs::path dir = fs::absolute(fs::path(train_manifest)).parent_path();
  std::error_code ec;
  fs::create_directories(dir, ec);
  return WaitedFileLock::Take((dir / ".hetpar-synth.lock").string(),
                              absl::StrCat("generating the synthetic data set of ", train_manifest),
                              kSynthLockTimeout, cancel);
}

}  // namespace

const std::array<const char*, kColours>& SynthColourNames() {
  static constexpr std::array<const char*, kColours> kNames = {"red",    "green",  "blue",
                                                               "yellow", "purple", "white"};
  return kNames;
}

const std::array<const char*, kShapeKinds>& SynthShapeNames() {
  static constexpr std::array<const char*, kShapeKinds> kNames = {"circle", "square", "triangle"};
  return kNames;
}

const std::array<const char*, kCells>& SynthCellNames() {
  static constexpr std::array<const char*, kCells> kNames = {
      "top left", "top",         "top right", "left",        "center",
      "right",    "bottom left", "bottom",    "bottom right"};
  return kNames;
}

const std::array<const char*, 2>& SynthSizeNames() {
  static constexpr std::array<const char*, 2> kNames = {"small", "large"};
  return kNames;
}

std::array<uint8_t, 3> SynthColour(int c) {
  static constexpr std::array<std::array<uint8_t, 3>, kColours> kRgb = {{
      {220, 40, 40},    // red
      {40, 180, 60},    // green
      {50, 90, 235},    // blue
      {235, 210, 40},   // yellow
      {160, 60, 210},   // purple
      {235, 235, 235},  // white
  }};
  return kRgb[static_cast<size_t>(c)];
}

RgbImage RenderScene(const Scene& scene, int size) {
  RgbImage image(size, size);
  for (int y = 0; y < size; ++y) {
    for (int x = 0; x < size; ++x)
      std::copy(kSynthBackground.begin(), kSynthBackground.end(), image.at(y, x));
  }
  const double cell = size / 3.0;
  constexpr int kSuper = 4;
  for (const Shape& shape : scene.shapes) {
    const double cx = (shape.cell % 3 + 0.5) * cell;
    const double cy = (shape.cell / 3 + 0.5) * cell;
    const double r = (shape.large ? 0.42 : 0.27) * cell;
    const std::array<uint8_t, 3> colour = SynthColour(shape.colour);
    const int x0 = std::max(0, static_cast<int>(std::floor(cx - r)) - 1);
    const int x1 = std::min(size - 1, static_cast<int>(std::ceil(cx + r)) + 1);
    const int y0 = std::max(0, static_cast<int>(std::floor(cy - r)) - 1);
    const int y1 = std::min(size - 1, static_cast<int>(std::ceil(cy + r)) + 1);
    for (int y = y0; y <= y1; ++y) {
      for (int x = x0; x <= x1; ++x) {
        int covered = 0;
        for (int sy = 0; sy < kSuper; ++sy) {
          for (int sx = 0; sx < kSuper; ++sx) {
            const double px = x + (sx + 0.5) / kSuper;
            const double py = y + (sy + 0.5) / kSuper;
            if (Inside(shape.kind, px - cx, py - cy, r)) ++covered;
          }
        }
        if (covered == 0) continue;
        uint8_t* p = image.at(y, x);
        for (int c = 0; c < 3; ++c) {
          const double v = p[c] + (colour[static_cast<size_t>(c)] - p[c]) *
                                      (static_cast<double>(covered) / (kSuper * kSuper));
          p[c] = static_cast<uint8_t>(std::lround(v));
        }
      }
    }
  }
  return image;
}

std::string DescribeShapes(const Scene& scene) {
  std::vector<std::string> items;
  for (const Shape& s : scene.shapes) {
    items.push_back(absl::StrCat("a ", SynthSizeNames()[s.large ? 1 : 0], " ",
                                 SynthColourNames()[static_cast<size_t>(s.colour)], " ",
                                 SynthShapeNames()[static_cast<size_t>(s.kind)], " at the ",
                                 SynthCellNames()[static_cast<size_t>(s.cell)]));
  }
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) {
    if (i > 0) absl::StrAppend(&out, i + 1 == items.size() ? " and " : ", ");
    absl::StrAppend(&out, items[i]);
  }
  return out;
}

SynthSample MakeSynthSample(uint64_t seed, const std::string& split, int64_t index,
                            int max_images) {
  DeterministicRng rng(SplitMix64(SplitMix64(seed) ^ HashString(split)) +
                       static_cast<uint64_t>(index));
  rng = DeterministicRng(rng.Next());
  SynthSample sample;
  ManifestRecord& r = sample.record;
  r.id = absl::StrFormat("%s-%06d", split, index);
  const double u = rng.Uniform();
  int images = u < 0.10 ? 0 : u < 0.60 ? 1 : u < 0.85 ? 2 : 3;
  images = std::min(images, max_images);
  if (images == 0) {
    const int a = static_cast<int>(rng.Below(5));
    const int b = static_cast<int>(rng.Below(5));
    r.prompt = absl::StrCat("what is ", kNumberWords[static_cast<size_t>(a)], " plus ",
                            kNumberWords[static_cast<size_t>(b)], "?");
    r.text = absl::StrCat(kNumberWords[static_cast<size_t>(a + b)], ".");
    return sample;
  }
  for (int k = 0; k < images; ++k) {
    int count = 0;
    const double v = rng.Uniform();
    if (images == 1) {
      count = v < 0.10 ? 0 : 1 + static_cast<int>(rng.Below(3));  // 0..3 shapes
    } else if (images == 2) {
      count = v < 0.20 ? 0 : 1 + static_cast<int>(rng.Below(2));  // 0..2 shapes
    } else {
      count = v < 0.25 ? 0 : 1;  // 0..1 shape
    }
    sample.scenes.push_back(MakeScene(&rng, count));
    r.images.push_back(absl::StrFormat("images/%s/%s-%d.png", split, r.id, k));
  }
  std::string markers;
  for (int k = 0; k < images; ++k) markers += "<image>";
  if (images == 1) {
    r.prompt = markers + "describe the image.";
    const std::string shapes = DescribeShapes(sample.scenes[0]);
    r.text = shapes.empty() ? "the image is empty." : shapes + ".";
    return sample;
  }
  r.prompt = absl::StrCat(markers, "compare the ", images == 2 ? "two" : "three", " images.");
  for (int k = 0; k < images; ++k) {
    if (k > 0) absl::StrAppend(&r.text, k + 1 == images ? " and " : ", ");
    const std::string shapes = DescribeShapes(sample.scenes[static_cast<size_t>(k)]);
    absl::StrAppend(&r.text, "the ", kOrdinals[static_cast<size_t>(k)], " image ",
                    shapes.empty() ? "is empty" : "has " + shapes);
  }
  absl::StrAppend(&r.text, ".");
  return sample;
}

SynthOptions SynthOptionsForDirectory(const std::string& dir) {
  SynthOptions o;
  const fs::path d(dir);
  o.train_manifest = (d / "train.jsonl").string();
  o.val_manifest = (d / "val.jsonl").string();
  o.tokenizer = (d / "tokenizer.model").string();
  return o;
}

absl::StatusOr<SynthOptions> SynthOptionsFromRunSpec(const hetpar::v1::RunSpec& spec) {
  const hetpar::v1::DataSpec& data = spec.data();
  if (data.synth().samples() <= 0) {
    return absl::InvalidArgumentError(
        "data.synth.samples is 0: the config does not ask for a synthetic data set");
  }
  if (data.manifest().empty() || data.tokenizer().empty()) {
    return absl::InvalidArgumentError(
        "data.manifest and data.tokenizer must name where the synthetic data set goes");
  }
  SynthOptions o;
  o.train_manifest = data.manifest();
  o.val_manifest = data.val_manifest();
  o.tokenizer = data.tokenizer();
  o.train_index = data.index();
  o.samples = data.synth().samples();
  o.val_samples = data.val_manifest().empty() ? 0 : data.synth().val_samples();
  o.seed = static_cast<uint64_t>(data.synth().seed());
  o.image_size = static_cast<int32_t>(spec.encoder().model().image_size());
  o.tokens_per_image = static_cast<int32_t>(config::TokensPerImage(spec.encoder().model()));
  o.seq_len = static_cast<int32_t>(spec.llm().model().seq_len());
  o.vocab_size = static_cast<int32_t>(spec.llm().model().vocab());
  if (!data.image_token().empty()) o.image_token = data.image_token();
  return o;
}

absl::StatusOr<SynthReport> GenerateSyntheticDataset(const SynthOptions& options) {
  HETPAR_RETURN_IF_ERROR(CheckOptions(options));
  SynthReport report;
  report.max_images = static_cast<int>(
      std::min<int64_t>(3, (options.seq_len - kTextBudget) / options.tokens_per_image));

  struct Split {
    std::string name;
    std::string manifest;
    std::string index;
    int64_t count;
    std::vector<SynthSample> samples;
  };
  std::vector<Split> splits;
  splits.push_back(
      {"train",
       options.train_manifest,
       options.train_index.empty() ? options.train_manifest + ".index" : options.train_index,
       options.samples,
       {}});
  if (!options.val_manifest.empty() && options.val_samples > 0) {
    splits.push_back(
        {"val",
         options.val_manifest,
         options.val_index.empty() ? options.val_manifest + ".index" : options.val_index,
         options.val_samples,
         {}});
  }

  // A data set being replaced (--force, or one found incomplete) has no manifest from here until
  // the new one is whole: one cut short (Ctrl-C, a crash) is taken for missing and generated
  // again, never used with the old captions naming the new images.
  for (const Split& split : splits) {
    bool removed = false;
    for (const std::string& path : {split.manifest, split.index}) {
      std::error_code ec;
      removed = fs::remove(path, ec) || removed;
      if (ec) {
        return absl::PermissionDeniedError(
            absl::StrCat("cannot remove '", path, "' to replace it: ", ec.message()));
      }
    }
    if (removed) {
      HETPAR_RETURN_IF_ERROR(
          SyncDirectory(fs::absolute(fs::path(split.manifest)).parent_path().string()));
    }
  }

  // Samples and their images.
  for (Split& split : splits) {
    std::error_code ec;
    fs::remove_all(PathFor(split.manifest, "images/" + split.name), ec);
    split.samples.reserve(static_cast<size_t>(split.count));
    for (int64_t i = 0; i < split.count; ++i) {
      SynthSample sample = MakeSynthSample(options.seed, split.name, i, report.max_images);
      for (size_t k = 0; k < sample.scenes.size(); ++k) {
        HETPAR_ASSIGN_OR_RETURN(std::string png,
                                EncodePng(RenderScene(sample.scenes[k], options.image_size)));
        HETPAR_RETURN_IF_ERROR(WriteFileAtomically(PathFor(split.manifest, sample.record.images[k]),
                                                   png,
                                                   AtomicFileOptions{0644, /*durable=*/false}));
        ++report.images;
      }
      if (split.name == "train") ++report.train_samples_by_images[sample.scenes.size()];
      split.samples.push_back(std::move(sample));
    }
  }
  report.train_samples = options.samples;
  report.val_samples = splits.size() > 1 ? options.val_samples : 0;

  // The tokenizer, trained on the lexicon and the training text.
  std::vector<std::string> corpus = LexiconSentences();
  for (const SynthSample& s : splits[0].samples) {
    if (!s.record.prompt.empty()) {
      corpus.push_back(absl::StrReplaceAll(s.record.prompt, {{options.image_token, " "}}));
    }
    corpus.push_back(s.record.text);
  }
  TokenizerTrainOptions train;
  train.vocab_size = options.vocab_size;
  train.user_symbols = {options.image_token};
  HETPAR_ASSIGN_OR_RETURN(std::string model, TrainTokenizer(corpus, train));
  HETPAR_RETURN_IF_ERROR(WriteFileAtomically(options.tokenizer, model));
  HETPAR_ASSIGN_OR_RETURN(std::unique_ptr<Tokenizer> tokenizer,
                          Tokenizer::FromSerialized(model, options.tokenizer));
  report.vocab_size = tokenizer->vocab_size();

  // The images must be on disk before a manifest names them.
  HETPAR_RETURN_IF_ERROR(SyncFileSystem(fs::path(options.train_manifest).parent_path().string()));
  for (const Split& split : splits) {
    std::string text;
    for (const SynthSample& s : split.samples) {
      text += ManifestRecordToJson(s.record);
      text.push_back('\n');
    }
    HETPAR_RETURN_IF_ERROR(WriteFileAtomically(split.manifest, text));
  }

  // Indexes, built by the loader that training uses: every sample is read back, every image
  // decoded, every sequence checked against seq_len.
  for (const Split& split : splits) {
    LoaderOptions loader_options;
    loader_options.manifest = split.manifest;
    loader_options.tokenizer = options.tokenizer;
    loader_options.image_token = options.image_token;
    loader_options.image_size = options.image_size;
    loader_options.tokens_per_image = options.tokens_per_image;
    loader_options.seq_len = options.seq_len;
    loader_options.max_vocab = options.vocab_size;
    absl::StatusOr<DataIndex> index;
    absl::StatusOr<std::unique_ptr<DataLoader>> loader = DataLoader::Create(loader_options);
    if (loader.ok()) {
      IndexBuildOptions build;
      build.threads = options.index_threads;
      index = BuildIndex(**loader, build);
    }
    absl::Status status = loader.ok() ? index.status() : loader.status();
    if (status.ok()) status = WriteIndex(*index, split.index);
    if (!status.ok()) {
      // No manifest for an unusable data set, so the runtime does not take it as complete.
      std::error_code ec;
      for (const Split& s : splits) fs::remove(s.manifest, ec);
      return absl::InternalError(absl::StrCat("the generated ", split.name,
                                              " split does not load back: ", status.message()));
    }
    for (const IndexRecord& r : index->records) {
      report.max_total_tokens = std::max(report.max_total_tokens, r.total_tokens());
    }
  }
  return report;
}

absl::StatusOr<bool> SyntheticDatasetPresent(const hetpar::v1::RunSpec& spec) {
  HETPAR_ASSIGN_OR_RETURN(SynthOptions options, SynthOptionsFromRunSpec(spec));
  std::error_code ec;
  return fs::exists(options.train_manifest, ec) && fs::exists(options.tokenizer, ec) &&
         (options.val_manifest.empty() || fs::exists(options.val_manifest, ec));
}

absl::StatusOr<SynthReport> GenerateSyntheticDatasetExclusively(const SynthOptions& options) {
  HETPAR_ASSIGN_OR_RETURN(WaitedFileLock lock, TakeSynthLock(options.train_manifest));
  return GenerateSyntheticDataset(options);
}

absl::StatusOr<bool> EnsureSyntheticDataset(const hetpar::v1::RunSpec& spec, SynthReport* report,
                                            const std::atomic<bool>* cancel) {
  if (spec.data().synth().samples() <= 0) return false;
  HETPAR_ASSIGN_OR_RETURN(SynthOptions options, SynthOptionsFromRunSpec(spec));
  HETPAR_ASSIGN_OR_RETURN(bool present, SyntheticDatasetPresent(spec));
  if (present) return false;
  // Processes started on one config (a coordinator and its workers, each opening the data set;
  // runs or jobs on a shared file system) can find the data set missing at once: one generates
  // it, the others wait for it and then use it. Two generating at once would remove each other's
  // images.
  HETPAR_ASSIGN_OR_RETURN(WaitedFileLock lock, TakeSynthLock(options.train_manifest, cancel));
  HETPAR_ASSIGN_OR_RETURN(present, SyntheticDatasetPresent(spec));
  if (present) return false;
  HETPAR_LOG(INFO) << "generating the synthetic data set " << options.train_manifest << " ("
                   << options.samples << " training samples"
                   << (options.val_manifest.empty() || options.val_samples <= 0
                           ? std::string()
                           : absl::StrCat(", ", options.val_samples, " validation samples"))
                   << ")";
  HETPAR_ASSIGN_OR_RETURN(SynthReport generated, GenerateSyntheticDataset(options));
  if (report != nullptr) *report = generated;
  return true;
}

}  // namespace hetpar::data
