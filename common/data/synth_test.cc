#include "common/data/synth.h"

#include <fcntl.h>
#include <stdlib.h>
#include <sys/file.h>
#include <unistd.h>

#include <filesystem>
#include <set>
#include <thread>
#include <vector>

#include "absl/strings/str_format.h"
#include "common/config/config.h"
#include "common/data/file_util.h"
#include "common/data/index.h"
#include "common/data/manifest.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hetpar::data {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

std::string TempDir() {
  std::string dir = (fs::temp_directory_path() / "hetpar_synth_XXXXXX").string();
  EXPECT_NE(::mkdtemp(dir.data()), nullptr);
  return dir;
}

// configs/tiny.yaml with its data set in `dir`, and `overrides`.
absl::StatusOr<config::LoadedRunSpec> TinySpecIn(const std::string& dir,
                                                 const std::vector<std::string>& overrides) {
  config::LoadOptions load;
  load.check_files = false;
  load.overrides = {"data.manifest=" + dir + "/train.jsonl",
                    "data.val_manifest=" + dir + "/val.jsonl",
                    "data.tokenizer=" + dir + "/tokenizer.model"};
  load.overrides.insert(load.overrides.end(), overrides.begin(), overrides.end());
  return config::LoadRunSpecFile(std::string(HETPAR_SOURCE_DIR) + "/configs/tiny.yaml", load);
}

TEST(SynthTest, ScenesRenderWhereTheCaptionSays) {
  Scene scene;
  scene.shapes = {{ShapeKind::kSquare, 0, 0, true},     // large red square, top left
                  {ShapeKind::kCircle, 2, 4, false},    // small blue circle, center
                  {ShapeKind::kTriangle, 3, 8, true}};  // large yellow triangle, bottom right
  EXPECT_EQ(DescribeShapes(scene),
            "a large red square at the top left, a small blue circle at the center and a large "
            "yellow triangle at the bottom right");
  const RgbImage image = RenderScene(scene, 30);  // cells of 10 pixels
  auto pixel = [&](int y, int x) {
    const uint8_t* p = image.at(y, x);
    return std::array<uint8_t, 3>{p[0], p[1], p[2]};
  };
  EXPECT_EQ(pixel(5, 5), SynthColour(0));      // square centre
  EXPECT_EQ(pixel(2, 2), SynthColour(0));      // square corner region (half-side 3.36)
  EXPECT_EQ(pixel(15, 15), SynthColour(2));    // circle centre
  EXPECT_EQ(pixel(26, 25), SynthColour(3));    // triangle, lower middle
  EXPECT_EQ(pixel(21, 21), kSynthBackground);  // beside the triangle's apex
  EXPECT_EQ(pixel(5, 15), kSynthBackground);   // empty top cell
  EXPECT_EQ(pixel(25, 5), kSynthBackground);   // empty bottom-left cell
  // Every pixel is the background, a shape colour, or a blend on an edge; no pixel of the
  // empty cells is touched.
  for (int y = 0; y < 30; ++y) {
    for (int x = 0; x < 30; ++x) {
      const int cell = (y / 10) * 3 + x / 10;
      if (cell != 0 && cell != 4 && cell != 8) {
        ASSERT_EQ(pixel(y, x), kSynthBackground) << y << x;
      }
    }
  }
  EXPECT_EQ(DescribeShapes(Scene{}), "");
}

TEST(SynthTest, SamplesAreDeterministicAndIndependentOfTheTotal) {
  for (int64_t i = 0; i < 200; ++i) {
    const SynthSample a = MakeSynthSample(7, "train", i, 3);
    const SynthSample b = MakeSynthSample(7, "train", i, 3);
    EXPECT_EQ(ManifestRecordToJson(a.record), ManifestRecordToJson(b.record));
    EXPECT_EQ(a.record.id, absl::StrFormat("train-%06d", i));
  }
  EXPECT_NE(ManifestRecordToJson(MakeSynthSample(7, "train", 3, 3).record),
            ManifestRecordToJson(MakeSynthSample(8, "train", 3, 3).record));
  EXPECT_EQ(MakeSynthSample(7, "val", 3, 3).record.id, "val-000003");
}

TEST(SynthTest, CaptionsFollowTheScenes) {
  std::array<int, 4> by_images = {0, 0, 0, 0};
  for (int64_t i = 0; i < 400; ++i) {
    const SynthSample s = MakeSynthSample(1, "train", i, 3);
    const ManifestRecord& r = s.record;
    ASSERT_EQ(r.images.size(), s.scenes.size());
    ++by_images[s.scenes.size()];
    int markers = 0;
    for (size_t p = r.prompt.find("<image>"); p != std::string::npos;
         p = r.prompt.find("<image>", p + 1)) {
      ++markers;
    }
    EXPECT_EQ(markers, static_cast<int>(s.scenes.size())) << r.id;
    for (const Scene& scene : s.scenes) {
      std::set<int> cells;
      for (const Shape& shape : scene.shapes) cells.insert(shape.cell);
      EXPECT_EQ(cells.size(), scene.shapes.size()) << "shapes share a cell in " << r.id;
      const std::string described = DescribeShapes(scene);
      if (!described.empty()) {
        EXPECT_THAT(r.text, HasSubstr(described)) << r.id;
      }
    }
    switch (s.scenes.size()) {
      case 0:
        EXPECT_THAT(r.prompt, HasSubstr(" plus "));
        break;
      case 1:
        EXPECT_LE(s.scenes[0].shapes.size(), 3u);
        EXPECT_EQ(r.prompt, "<image>describe the image.");
        break;
      case 2:
        EXPECT_THAT(r.text, HasSubstr("the second image"));
        EXPECT_LE(s.scenes[1].shapes.size(), 2u);
        break;
      case 3:
        EXPECT_THAT(r.text, HasSubstr("the third image"));
        break;
    }
  }
  for (int k = 0; k < 4; ++k) EXPECT_GT(by_images[static_cast<size_t>(k)], 20) << k;
  // A limit on images per sample is honoured.
  for (int64_t i = 0; i < 100; ++i) EXPECT_LE(MakeSynthSample(1, "train", i, 1).scenes.size(), 1u);
}

TEST(SynthTest, GeneratesALoadableDataSetDeterministically) {
  const std::string a = TempDir();
  const std::string b = TempDir();
  for (const std::string& dir : {a, b}) {
    SynthOptions o = SynthOptionsForDirectory(dir);
    o.samples = 64;
    o.val_samples = 8;
    o.seed = 5;
    absl::StatusOr<SynthReport> report = GenerateSyntheticDataset(o);
    ASSERT_TRUE(report.ok()) << report.status();
    EXPECT_EQ(report->train_samples, 64);
    EXPECT_EQ(report->val_samples, 8);
    EXPECT_LE(report->vocab_size, 256);
    EXPECT_LE(report->max_total_tokens, 128);
    EXPECT_EQ(report->max_images, 3);
    EXPECT_EQ(report->train_samples_by_images[0] + report->train_samples_by_images[1] +
                  report->train_samples_by_images[2] + report->train_samples_by_images[3],
              64);
  }
  // Same seed: byte-identical manifests, tokenizer and images.
  for (const char* file :
       {"/train.jsonl", "/val.jsonl", "/tokenizer.model", "/images/train/train-000000-0.png"}) {
    absl::StatusOr<std::string> x = ReadFileToString(a + file);
    absl::StatusOr<std::string> y = ReadFileToString(b + file);
    ASSERT_TRUE(x.ok() && y.ok()) << file;
    EXPECT_EQ(*x, *y) << file;
  }
  // The indexes are there and current; every image file a manifest names exists.
  for (const char* split : {"train", "val"}) {
    absl::StatusOr<Manifest> m = ReadManifest(a + "/" + split + ".jsonl", false);
    ASSERT_TRUE(m.ok());
    EXPECT_EQ(m->records.size(), std::string(split) == "train" ? 64u : 8u);
    for (const ManifestRecord& r : m->records) {
      for (const std::string& image : r.images) EXPECT_TRUE(fs::exists(m->ResolveImagePath(image)));
    }
    absl::StatusOr<DataIndex> index = ReadIndex(a + "/" + split + ".jsonl.index");
    ASSERT_TRUE(index.ok()) << index.status();
    EXPECT_EQ(index->records.size(), m->records.size());
  }
  fs::remove_all(a);
  fs::remove_all(b);
}

// A regeneration cut short (here: its tokenizer cannot be written, after the new images were)
// leaves no manifest behind: the next start generates the data set again instead of training the
// old captions against the new images.
TEST(SynthTest, ARegenerationCutShortLeavesNoManifestOfTheOldDataSet) {
  const std::string dir = TempDir();
  SynthOptions o = SynthOptionsForDirectory(dir);
  o.samples = 16;
  o.val_samples = 4;
  o.seed = 5;
  ASSERT_TRUE(GenerateSyntheticDataset(o).ok());
  ASSERT_TRUE(fs::exists(dir + "/train.jsonl"));
  o.seed = 8;                                      // other scenes in the same image files
  fs::create_directories(dir + "/tokenizer-dir");  // a directory: the rename over it fails
  o.tokenizer = dir + "/tokenizer-dir";
  const absl::StatusOr<SynthReport> cut = GenerateSyntheticDataset(o);
  ASSERT_FALSE(cut.ok());
  for (const char* file :
       {"/train.jsonl", "/train.jsonl.index", "/val.jsonl", "/val.jsonl.index"}) {
    EXPECT_FALSE(fs::exists(dir + file)) << file;
  }
  fs::remove_all(dir);
}

TEST(SynthTest, InvalidOptionsAreListed) {
  SynthOptions o = SynthOptionsForDirectory(TempDir());
  o.samples = 0;
  o.seq_len = 50;
  o.tokens_per_image = 16;
  o.vocab_size = 10;
  absl::StatusOr<SynthReport> r = GenerateSyntheticDataset(o);
  ASSERT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  const std::string message(r.status().message());
  EXPECT_THAT(message, HasSubstr("samples=0; expected >= 1"));
  EXPECT_THAT(message, HasSubstr("seq_len=50 cannot hold one image of 16 tokens"));
  EXPECT_THAT(message, HasSubstr("vocab_size=10"));
  fs::remove_all(fs::path(o.train_manifest).parent_path());
}

TEST(SynthTest, TheTinyConfigGetsExactlyItsDataSet) {
  const std::string dir = TempDir();
  absl::StatusOr<config::LoadedRunSpec> loaded = TinySpecIn(dir, {});
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  SynthReport report;
  absl::StatusOr<bool> generated = EnsureSyntheticDataset(loaded->spec, &report);
  ASSERT_TRUE(generated.ok()) << generated.status();
  EXPECT_TRUE(*generated);
  EXPECT_EQ(report.train_samples, 1024);
  EXPECT_EQ(report.val_samples, 128);
  EXPECT_LE(report.vocab_size, 256);
  EXPECT_LE(report.max_total_tokens, 128);
  EXPECT_EQ(ReadManifest(dir + "/train.jsonl", false)->records.size(), 1024u);
  EXPECT_EQ(ReadManifest(dir + "/val.jsonl", false)->records.size(), 128u);
  // The index sits where the config says (data.index defaults to <manifest>.index).
  EXPECT_EQ(loaded->spec.data().index(), dir + "/train.jsonl.index");
  EXPECT_EQ(ReadIndex(loaded->spec.data().index())->records.size(), 1024u);
  // Present: nothing is regenerated.
  const FileStamp before = *StatFile(dir + "/train.jsonl");
  absl::StatusOr<bool> again = EnsureSyntheticDataset(loaded->spec);
  ASSERT_TRUE(again.ok());
  EXPECT_FALSE(*again);
  EXPECT_EQ(*StatFile(dir + "/train.jsonl"), before);
  fs::remove_all(dir);
}

// Two processes that find the data set missing at once: the one that finds another generating it
// waits for that one and uses what it wrote, instead of generating over it.
TEST(SynthTest, AProcessFindingTheDataSetBeingGeneratedWaitsAndUsesIt) {
  const std::string dir = TempDir();
  absl::StatusOr<config::LoadedRunSpec> loaded =
      TinySpecIn(dir, {"data.synth.samples=64", "data.synth.val_samples=8"});
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  absl::StatusOr<SynthOptions> options = SynthOptionsFromRunSpec(loaded->spec);
  ASSERT_TRUE(options.ok()) << options.status();
  // This test is the other process: it holds the data set's lock while it generates.
  const int fd = ::open((dir + "/.hetpar-synth.lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX | LOCK_NB), 0);
  absl::StatusOr<bool> waited = absl::UnknownError("not run");
  std::thread waiting([&] { waited = EnsureSyntheticDataset(loaded->spec); });
  const absl::StatusOr<SynthReport> generated = GenerateSyntheticDataset(*options);
  const absl::StatusOr<FileStamp> written = StatFile(dir + "/train.jsonl");
  ::close(fd);
  waiting.join();
  ASSERT_TRUE(generated.ok()) << generated.status();
  ASSERT_TRUE(written.ok()) << written.status();
  ASSERT_TRUE(waited.ok()) << waited.status();
  EXPECT_FALSE(*waited);  // it found the data set complete once it held the lock
  EXPECT_EQ(*StatFile(dir + "/train.jsonl"), *written);
  EXPECT_EQ(ReadManifest(dir + "/train.jsonl", false)->records.size(), 64u);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace hetpar::data
