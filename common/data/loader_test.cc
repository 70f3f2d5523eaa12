#include "common/data/loader.h"

#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>

#include "common/config/config.h"
#include "common/data/file_util.h"
#include "common/data/synth.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hetpar::data {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

constexpr int64_t kSamples = 48;
constexpr uint64_t kSeed = 11;

class LoaderTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string((fs::temp_directory_path() / "hetpar_loader_XXXXXX").string());
    ASSERT_NE(::mkdtemp(dir_->data()), nullptr);
    SynthOptions o = SynthOptionsForDirectory(*dir_);
    o.samples = kSamples;
    o.val_samples = 4;
    o.seed = kSeed;
    absl::StatusOr<SynthReport> report = GenerateSyntheticDataset(o);
    ASSERT_TRUE(report.ok()) << report.status();
  }
  static void TearDownTestSuite() {
    fs::remove_all(*dir_);
    delete dir_;
  }

  static LoaderOptions Options(const std::string& manifest = "") {
    LoaderOptions o;
    o.manifest = manifest.empty() ? *dir_ + "/train.jsonl" : manifest;
    o.tokenizer = *dir_ + "/tokenizer.model";
    o.image_size = 32;
    o.tokens_per_image = 16;
    o.seq_len = 128;
    o.max_vocab = 256;
    return o;
  }
  static std::unique_ptr<DataLoader> Make(const LoaderOptions& o) {
    absl::StatusOr<std::unique_ptr<DataLoader>> loader = DataLoader::Create(o);
    EXPECT_TRUE(loader.ok()) << loader.status();
    return loader.ok() ? std::move(*loader) : nullptr;
  }
  // A manifest of hand-written lines beside the generated data (so relative image paths work).
  static std::string WriteManifest(const std::string& name, const std::vector<std::string>& lines) {
    std::string text;
    for (const std::string& l : lines) text += l + "\n";
    const std::string path = *dir_ + "/" + name;
    EXPECT_TRUE(WriteFileAtomically(path, text).ok());
    return path;
  }
  static std::string GoodLine(int64_t i) {
    return ManifestRecordToJson(MakeSynthSample(kSeed, "train", i, 3).record);
  }

  static std::string* dir_;
};

std::string* LoaderTest::dir_ = nullptr;

TEST_F(LoaderTest, ImagesDecodeToTheGeneratedPixels) {
  std::unique_ptr<DataLoader> loader = Make(Options());
  ASSERT_NE(loader, nullptr);
  ASSERT_EQ(loader->size(), kSamples);
  int64_t images = 0;
  for (int64_t i = 0; i < kSamples; ++i) {
    const SynthSample expected = MakeSynthSample(kSeed, "train", i, 3);
    absl::StatusOr<LoadedSample> sample = loader->Load(i);
    ASSERT_TRUE(sample.ok()) << sample.status();
    EXPECT_EQ(sample->id, expected.record.id);
    ASSERT_EQ(sample->images.size(), expected.scenes.size()) << sample->id;
    for (size_t k = 0; k < expected.scenes.size(); ++k) {
      const std::vector<float> pixels =
          ToNormalizedChw(RenderScene(expected.scenes[k], 32), Normalization());
      const std::vector<float>& got = sample->images[k];
      ASSERT_EQ(got.size(), pixels.size());
      for (size_t e = 0; e < got.size(); ++e) {
        ASSERT_EQ(got[e], pixels[e]) << sample->id << " image " << k << " element " << e;
      }
      // One image alone decodes to the same pixels.
      absl::StatusOr<std::vector<float>> alone = loader->LoadImage(i, static_cast<int64_t>(k));
      ASSERT_TRUE(alone.ok()) << alone.status();
      EXPECT_EQ(*alone, pixels) << sample->id << " image " << k;
      ++images;
    }
  }
  EXPECT_GT(images, kSamples / 2);
}

TEST_F(LoaderTest, TokensHoldPromptPlaceholdersAndCaption) {
  std::unique_ptr<DataLoader> loader = Make(Options());
  ASSERT_NE(loader, nullptr);
  const Tokenizer& tok = loader->tokenizer();
  EXPECT_EQ(loader->image_token_id(), *tok.PieceId("<image>"));
  for (int64_t i = 0; i < kSamples; ++i) {
    const ManifestRecord& record = loader->manifest().records[static_cast<size_t>(i)];
    absl::StatusOr<LoadedSample> sample = loader->Load(i);
    ASSERT_TRUE(sample.ok()) << sample.status();
    const TokenSequence& t = sample->tokens;
    ASSERT_EQ(t.images(), static_cast<int32_t>(record.images.size()));
    ASSERT_EQ(t.input_ids.front(), tok.bos_id());
    ASSERT_EQ(t.input_ids.back(), tok.eos_id());
    // Placeholder rows exactly at the image offsets, nowhere else.
    std::vector<bool> placeholder(t.input_ids.size(), false);
    for (int32_t off : t.image_offsets) {
      for (int32_t r = 0; r < 16; ++r) placeholder[static_cast<size_t>(off + r)] = true;
    }
    for (size_t p = 0; p < t.input_ids.size(); ++p) {
      ASSERT_EQ(t.input_ids[p] == loader->image_token_id(), placeholder[p])
          << record.id << " " << p;
    }
    // The targets, in order, are the caption followed by eos.
    std::vector<int32_t> targets;
    for (size_t p = 0; p < t.labels.size(); ++p) {
      if (t.loss_mask[p]) {
        ASSERT_EQ(t.labels[p], t.input_ids[p + 1]);
        ASSERT_FALSE(placeholder[p + 1]);
        targets.push_back(t.labels[p]);
      } else {
        ASSERT_EQ(t.labels[p], kIgnoreLabel);
      }
    }
    ASSERT_EQ(static_cast<int32_t>(targets.size()), t.loss_tokens);
    ASSERT_EQ(targets.back(), tok.eos_id());
    targets.pop_back();
    EXPECT_EQ(*tok.Decode(targets), record.text) << record.id;
    EXPECT_EQ(*tok.Encode(record.text), targets) << record.id;
    EXPECT_EQ(t.text_tokens + 16 * t.images(), t.length());
  }
}

TEST_F(LoaderTest, LoadByIdMatchesLoadByOrdinal) {
  std::unique_ptr<DataLoader> loader = Make(Options());
  ASSERT_NE(loader, nullptr);
  absl::StatusOr<LoadedSample> a = loader->LoadById("train-000007");
  absl::StatusOr<LoadedSample> b = loader->Load(7);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->tokens.input_ids, b->tokens.input_ids);
  EXPECT_EQ(a->images, b->images);
  absl::StatusOr<LoadedSample> missing = loader->LoadById("train-999999");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(missing.status().message()), HasSubstr("train-999999"));
  EXPECT_EQ(loader->Load(kSamples).status().code(), absl::StatusCode::kOutOfRange);
}

// An encoder rank that encodes one image of a sample reads that image's file only: here the
// sample's second image is missing, and its first still loads.
TEST_F(LoaderTest, OneImageOfASampleLoadsWithoutTheOthers) {
  const SynthSample synth = MakeSynthSample(kSeed, "train", 0, 3);
  ASSERT_EQ(synth.record.images.size(), 3u);
  ManifestRecord record = synth.record;
  record.id = "half-there";
  record.images[1] = "nowhere/b.png";
  const std::string path = WriteManifest("half-there.jsonl", {ManifestRecordToJson(record)});
  std::unique_ptr<DataLoader> loader = Make(Options(path));
  ASSERT_NE(loader, nullptr);
  ASSERT_EQ(loader->Tokenize(0)->images(), 3);
  EXPECT_EQ(loader->Load(0).status().code(), absl::StatusCode::kNotFound);
  for (int64_t k : {0, 2}) {
    absl::StatusOr<std::vector<float>> image = loader->LoadImage(0, k);
    ASSERT_TRUE(image.ok()) << image.status();
    EXPECT_EQ(*image, ToNormalizedChw(RenderScene(synth.scenes[static_cast<size_t>(k)], 32),
                                      Normalization()));
  }
  absl::StatusOr<std::vector<float>> missing = loader->LoadImage(0, 1);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(missing.status().message()),
              HasSubstr("sample 'half-there' (" + path + ":1): image file not found: " + *dir_ +
                        "/nowhere/b.png"));
  EXPECT_EQ(loader->LoadImage(0, 3).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(loader->LoadImage(1, 0).status().code(), absl::StatusCode::kOutOfRange);
}

TEST_F(LoaderTest, BlankImagesAreZerosAndReadNoFile) {
  // A manifest whose image files do not exist still loads with blank images.
  ManifestRecord record = MakeSynthSample(kSeed, "train", 0, 3).record;
  record.id = "ghost";
  record.prompt = "<image><image>compare the two images.";
  record.images = {"nowhere/a.png", "nowhere/b.png"};
  const std::string path = WriteManifest("ghost.jsonl", {ManifestRecordToJson(record)});
  LoaderOptions o = Options(path);
  o.blank_images = true;
  std::unique_ptr<DataLoader> loader = Make(o);
  ASSERT_NE(loader, nullptr);
  absl::StatusOr<LoadedSample> sample = loader->Load(0);
  ASSERT_TRUE(sample.ok()) << sample.status();
  ASSERT_EQ(sample->images.size(), 2u);
  for (const std::vector<float>& image : sample->images) {
    ASSERT_EQ(image.size(), 3u * 32 * 32);
    for (float v : image) ASSERT_EQ(v, 0.0f);
  }
  // Same tokens as with images.
  o.blank_images = false;
  std::unique_ptr<DataLoader> real = Make(o);
  EXPECT_EQ(real->Tokenize(0)->input_ids, sample->tokens.input_ids);
}

TEST_F(LoaderTest, EachBadSampleGivesItsErrorAndLeavesTheOthersAlone) {
  // Corrupt copy of a real image.
  std::string png = *ReadFileToString(*dir_ + "/images/train/train-000001-0.png");
  const size_t idat = png.find("IDAT");
  png[idat + 12] = static_cast<char>(png[idat + 12] ^ 0xff);
  ASSERT_TRUE(WriteFileAtomically(*dir_ + "/corrupt.png", png).ok());

  auto with = [](const std::string& id, const std::string& prompt,
                 const std::vector<std::string>& images, const std::string& text) {
    ManifestRecord r;
    r.id = id;
    r.prompt = prompt;
    r.images = images;
    r.text = text;
    return ManifestRecordToJson(r);
  };
  std::string long_text;
  for (int i = 0; i < 30; ++i) long_text += "a small red circle at the top left and ";
  long_text += "nothing.";
  const std::string path = WriteManifest(
      "bad.jsonl",
      {GoodLine(0),
       with("missing", "<image>describe the image.", {"images/train/none.png"}, "empty."),
       GoodLine(2), with("corrupt", "<image>describe the image.", {"corrupt.png"}, "empty."),
       with("count", "<image>describe the image.",
            {"images/train/train-000001-0.png", "images/train/train-000001-0.png"}, "empty."),
       with("long", "<image>describe the image.", {"images/train/train-000001-0.png"}, long_text),
       GoodLine(3)});
  std::unique_ptr<DataLoader> loader = Make(Options(path));
  ASSERT_NE(loader, nullptr);
  const std::string where = path + ":";

  absl::StatusOr<LoadedSample> missing = loader->Load(1);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(missing.status().message()),
              HasSubstr("sample 'missing' (" + where + "2): image file not found: " + *dir_ +
                        "/images/train/none.png"));
  BadSample bad = loader->DescribeProblem(1, missing.status());
  EXPECT_EQ(bad.id, "missing");
  EXPECT_EQ(bad.line, 2);
  EXPECT_EQ(bad.path, *dir_ + "/images/train/none.png");
  EXPECT_EQ(bad.reason, "image file not found: " + *dir_ + "/images/train/none.png");

  absl::StatusOr<LoadedSample> corrupt = loader->Load(3);
  EXPECT_EQ(corrupt.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(
      std::string(corrupt.status().message()),
      HasSubstr("sample 'corrupt' (" + where + "4): corrupt PNG " + *dir_ + "/corrupt.png"));

  absl::StatusOr<LoadedSample> count = loader->Load(4);
  EXPECT_EQ(count.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(count.status().message()),
              HasSubstr("sample 'count' (" + where +
                        "5): prompt and text hold 1 '<image>' placeholder(s) but \"images\" "
                        "lists 2 file(s)"));

  absl::StatusOr<LoadedSample> overlong = loader->Load(5);
  EXPECT_EQ(overlong.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(overlong.status().message()),
              HasSubstr("sample 'long' (" + where + "6)"));
  EXPECT_THAT(std::string(overlong.status().message()), HasSubstr("> llm.model.seq_len=128"));

  // With truncate, the long sample fits in seq_len.
  LoaderOptions truncate = Options(path);
  truncate.overlong = OverlongPolicy::kTruncate;
  absl::StatusOr<LoadedSample> cut = Make(truncate)->Load(5);
  ASSERT_TRUE(cut.ok()) << cut.status();
  EXPECT_EQ(cut->tokens.length(), 128);
  EXPECT_TRUE(cut->tokens.truncated);
  EXPECT_EQ(cut->images.size(), 1u);

  // The good samples load exactly as from the clean manifest.
  std::unique_ptr<DataLoader> clean = Make(Options());
  for (auto [bad_ordinal, clean_ordinal] : {std::pair{0, 0}, std::pair{2, 2}, std::pair{6, 3}}) {
    absl::StatusOr<LoadedSample> a = loader->Load(bad_ordinal);
    absl::StatusOr<LoadedSample> b = clean->Load(clean_ordinal);
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(a->id, b->id);
    EXPECT_EQ(a->tokens.input_ids, b->tokens.input_ids);
    EXPECT_EQ(a->tokens.labels, b->tokens.labels);
    EXPECT_EQ(a->images, b->images);
  }
}

// An image path that names a FIFO or a device is refused by Describe (the data index, `hetpar
// data check`) before it is opened: a FIFO with no writer would hang the check, /dev/zero would
// be read without end. A file past kMaxImageFileBytes is refused by Load after reading just past
// it.
TEST_F(LoaderTest, ImagePathsThatAreNotRegularFilesAreRefusedWithoutReadingThem) {
  ASSERT_EQ(::mkfifo((*dir_ + "/pipe.png").c_str(), 0600), 0);
  auto line = [](const std::string& id, const std::string& image) {
    ManifestRecord r;
    r.id = id;
    r.prompt = "<image>describe the image.";
    r.images = {image};
    r.text = "empty.";
    return ManifestRecordToJson(r);
  };
  const std::string path =
      WriteManifest("special.jsonl", {line("pipe", "pipe.png"), line("zero", "/dev/zero")});
  std::unique_ptr<DataLoader> loader = Make(Options(path));
  ASSERT_NE(loader, nullptr);
  for (int64_t ordinal : {0, 1}) {
    for (bool verify : {false, true}) {
      absl::StatusOr<IndexRecord> described = loader->Describe(ordinal, verify);
      EXPECT_EQ(described.status().code(), absl::StatusCode::kFailedPrecondition)
          << described.status();
      EXPECT_THAT(std::string(described.status().message()), HasSubstr("is not a regular file"));
    }
  }
  absl::StatusOr<LoadedSample> zero = loader->Load(1);
  EXPECT_EQ(zero.status().code(), absl::StatusCode::kResourceExhausted) << zero.status();
  EXPECT_THAT(std::string(zero.status().message()),
              HasSubstr("sample 'zero' (" + path + ":2): /dev/zero is longer than 545259520 bytes"));
  ::unlink((*dir_ + "/pipe.png").c_str());
}

TEST_F(LoaderTest, JpegAndLargerImagesAreResizedToTheEncoderSize) {
  RgbImage big(64, 48);
  for (int y = 0; y < 48; ++y) {
    for (int x = 0; x < 64; ++x) {
      big.at(y, x)[0] = static_cast<uint8_t>(x * 4);
      big.at(y, x)[1] = static_cast<uint8_t>(y * 5);
      big.at(y, x)[2] = 77;
    }
  }
  const std::string jpeg = *EncodeJpeg(big, 95);
  ASSERT_TRUE(WriteFileAtomically(*dir_ + "/big.jpg", jpeg).ok());
  ManifestRecord r;
  r.id = "jpeg";
  r.prompt = "<image>describe the image.";
  r.images = {"big.jpg"};
  r.text = "the image is empty.";
  std::unique_ptr<DataLoader> loader =
      Make(Options(WriteManifest("jpeg.jsonl", {ManifestRecordToJson(r)})));
  absl::StatusOr<LoadedSample> sample = loader->Load(0);
  ASSERT_TRUE(sample.ok()) << sample.status();
  ASSERT_EQ(sample->images.size(), 1u);
  EXPECT_EQ(sample->images[0],
            ToNormalizedChw(ResizeImage(*DecodeImage(jpeg, "big.jpg"), 32, 32), Normalization()));
}

TEST_F(LoaderTest, CreateChecksTheTokenizerAgainstTheConfig) {
  LoaderOptions small_vocab = Options();
  small_vocab.max_vocab = 100;
  absl::StatusOr<std::unique_ptr<DataLoader>> a = DataLoader::Create(small_vocab);
  EXPECT_EQ(a.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(a.status().message()), HasSubstr("> llm.model.vocab=100"));

  LoaderOptions token = Options();
  token.image_token = "<img>";
  absl::StatusOr<std::unique_ptr<DataLoader>> b = DataLoader::Create(token);
  EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(b.status().message()), HasSubstr("no piece for the image token '<img>'"));

  LoaderOptions missing = Options();
  missing.tokenizer = *dir_ + "/none.model";
  EXPECT_EQ(DataLoader::Create(missing).status().code(), absl::StatusCode::kNotFound);
}

TEST(LoaderOptionsTest, FromTheTinyConfig) {
  config::LoadOptions load;
  load.check_files = false;
  absl::StatusOr<config::LoadedRunSpec> loaded =
      config::LoadRunSpecFile(std::string(HETPAR_SOURCE_DIR) + "/configs/tiny.yaml", load);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  absl::StatusOr<LoaderOptions> train = LoaderOptionsFromRunSpec(loaded->spec, Split::kTrain);
  ASSERT_TRUE(train.ok()) << train.status();
  EXPECT_EQ(train->manifest, (fs::path(HETPAR_SOURCE_DIR) / "data/tiny/train.jsonl").string());
  EXPECT_EQ(train->tokenizer, (fs::path(HETPAR_SOURCE_DIR) / "data/tiny/tokenizer.model").string());
  EXPECT_EQ(train->image_size, 32);
  EXPECT_EQ(train->tokens_per_image, 16);
  EXPECT_EQ(train->seq_len, 128);
  EXPECT_EQ(train->max_vocab, 256);
  EXPECT_EQ(train->image_token, "<image>");
  EXPECT_EQ(train->overlong, OverlongPolicy::kReject);
  absl::StatusOr<LoaderOptions> val = LoaderOptionsFromRunSpec(loaded->spec, Split::kVal);
  ASSERT_TRUE(val.ok());
  EXPECT_EQ(val->manifest, (fs::path(HETPAR_SOURCE_DIR) / "data/tiny/val.jsonl").string());
}

// The first generated sample with `images` images.
SynthSample SampleWithImages(size_t images) {
  for (int64_t i = 0; i < kSamples; ++i) {
    SynthSample s = MakeSynthSample(kSeed, "train", i, 3);
    if (s.record.images.size() == images) return s;
  }
  ADD_FAILURE() << "no generated sample with " << images << " images";
  return SynthSample();
}

// The assistant texts of the LLaVA-style samples below, in order.
const std::vector<std::vector<std::string>>& LlavaAnswers() {
  static const std::vector<std::vector<std::string>> answers = {
      {"a small red circle at the top left.", "red."},
      {"the first image has a large blue square.", "the second image is empty."},
      {"five."}};
  return answers;
}

// A LLaVA-style .json manifest beside the generated images: a two-turn conversation with one
// image ("image": a path), one with two images ("images"), a text-only sample (numeric id).
std::string WriteLlavaJson(const std::string& dir) {
  const SynthSample one = SampleWithImages(1);
  const SynthSample two = SampleWithImages(2);
  const auto& a = LlavaAnswers();
  std::string text = "[\n";
  text += R"({"id": "one", "image": ")" + one.record.images[0] +
          R"(", "conversations": [{"from": "human", "value": "<image>\ndescribe the image."}, )" +
          R"({"from": "gpt", "value": ")" + a[0][0] +
          R"("}, {"from": "human", "value": "what colour is it?"}, {"from": "gpt", "value": ")" +
          a[0][1] + "\"}]},\n";
  text +=
      R"({"id": "two", "images": [")" + two.record.images[0] + R"(", ")" + two.record.images[1] +
      R"("], "conversations": [{"from": "human", "value": "<image>\n<image>\ncompare the two images."}, )" +
      R"({"from": "gpt", "value": ")" + a[1][0] +
      R"("}, {"from": "human", "value": "and the second image?"}, {"from": "gpt", "value": ")" +
      a[1][1] + "\"}]},\n";
  text +=
      std::string(
          R"({"id": 3, "conversations": [{"from": "human", "value": "what is two plus three?"}, )") +
      R"({"from": "gpt", "value": ")" + a[2][0] + "\"}]}\n]\n";
  const std::string path = dir + "/llava.json";
  EXPECT_TRUE(WriteFileAtomically(path, text).ok());
  return path;
}

TEST_F(LoaderTest, LlavaJsonTrainsOnTheAssistantTurnsOnly) {
  const std::string path = WriteLlavaJson(*dir_);
  const SynthSample one = SampleWithImages(1);
  const SynthSample two = SampleWithImages(2);
  const std::vector<std::vector<Scene>> scenes = {one.scenes, two.scenes, {}};
  LoaderOptions o = Options(path);
  o.seq_len = 256;  // the vicuna system prompt is long in this small vocabulary
  o.chat_template = ChatTemplate::kVicuna;
  std::unique_ptr<DataLoader> loader = Make(o);
  ASSERT_NE(loader, nullptr);
  ASSERT_EQ(loader->size(), 3);
  const Tokenizer& tok = loader->tokenizer();
  const std::vector<std::string> ids = {"one", "two", "3"};
  for (int64_t i = 0; i < 3; ++i) {
    absl::StatusOr<LoadedSample> sample = loader->Load(i);
    ASSERT_TRUE(sample.ok()) << sample.status();
    EXPECT_EQ(sample->id, ids[static_cast<size_t>(i)]);
    const TokenSequence& t = sample->tokens;
    const std::vector<Scene>& want_scenes = scenes[static_cast<size_t>(i)];
    ASSERT_EQ(t.images(), static_cast<int32_t>(want_scenes.size()));
    ASSERT_EQ(sample->images.size(), want_scenes.size());
    for (size_t k = 0; k < want_scenes.size(); ++k) {
      EXPECT_EQ(sample->images[k],
                ToNormalizedChw(RenderScene(want_scenes[k], 32), Normalization()))
          << sample->id << " image " << k;
    }
    EXPECT_EQ(t.input_ids.front(), tok.bos_id());
    // Split the targets at eos: one run per assistant turn, each decoding to the answer.
    std::vector<std::string> answers;
    std::vector<int32_t> run;
    int32_t targets = 0;
    for (size_t p = 0; p < t.labels.size(); ++p) {
      if (!t.loss_mask[p]) {
        ASSERT_EQ(t.labels[p], kIgnoreLabel);
        continue;
      }
      ++targets;
      ASSERT_EQ(t.labels[p], t.input_ids[p + 1]);
      ASSERT_NE(t.labels[p], loader->image_token_id());
      if (t.labels[p] == tok.eos_id()) {
        answers.push_back(*tok.Decode(run));
        run.clear();
      } else {
        run.push_back(t.labels[p]);
      }
    }
    EXPECT_TRUE(run.empty()) << sample->id << ": targets after the last eos";
    EXPECT_EQ(answers, LlavaAnswers()[static_cast<size_t>(i)]) << sample->id;
    EXPECT_EQ(targets, t.loss_tokens);
    int32_t expected_targets = 0;
    for (const std::string& answer : LlavaAnswers()[static_cast<size_t>(i)]) {
      expected_targets += static_cast<int32_t>(tok.Encode(answer)->size()) + 1;
    }
    EXPECT_EQ(t.loss_tokens, expected_targets) << sample->id;
  }
}

TEST_F(LoaderTest, LlavaJsonUnderChatmlTargetsTheAnswersAndTheirEndMarkers) {
  LoaderOptions o = Options(WriteLlavaJson(*dir_));
  o.seq_len = 256;  // the markers are several pieces each in this vocabulary
  o.chat_template = ChatTemplate::kChatml;
  std::unique_ptr<DataLoader> loader = Make(o);
  ASSERT_NE(loader, nullptr);
  const Tokenizer& tok = loader->tokenizer();
  const std::vector<int32_t> im_end = *tok.Encode("<|im_end|>");
  for (int64_t i = 0; i < 3; ++i) {
    absl::StatusOr<TokenSequence> t = loader->Tokenize(i);
    ASSERT_TRUE(t.ok()) << t.status();
    std::vector<int32_t> targets, expected;
    for (size_t p = 0; p < t->labels.size(); ++p) {
      if (t->loss_mask[p]) targets.push_back(t->labels[p]);
    }
    for (const std::string& answer : LlavaAnswers()[static_cast<size_t>(i)]) {
      const std::vector<int32_t> ids = *tok.Encode(answer);
      expected.insert(expected.end(), ids.begin(), ids.end());
      expected.insert(expected.end(), im_end.begin(), im_end.end());
    }
    EXPECT_EQ(targets, expected) << i;
    EXPECT_NE(t->input_ids.front(), tok.bos_id());  // chatml has no bos
  }
}

TEST_F(LoaderTest, APromptTextLineAndItsOneTurnConversationGiveTheSameSequence) {
  const SynthSample s = SampleWithImages(2);
  ManifestRecord conversation = s.record;
  conversation.id = "as-conversation";
  conversation.prompt.clear();
  conversation.text.clear();
  conversation.conversation = {{ChatRole::kUser, s.record.prompt},
                               {ChatRole::kAssistant, s.record.text}};
  const std::string path = WriteManifest(
      "pair.jsonl", {ManifestRecordToJson(s.record), ManifestRecordToJson(conversation)});
  std::unique_ptr<DataLoader> loader = Make(Options(path));  // plain, the default
  ASSERT_NE(loader, nullptr);
  absl::StatusOr<LoadedSample> a = loader->Load(0);
  absl::StatusOr<LoadedSample> b = loader->Load(1);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(a->tokens.input_ids, b->tokens.input_ids);
  EXPECT_EQ(a->tokens.labels, b->tokens.labels);
  EXPECT_EQ(a->tokens.loss_mask, b->tokens.loss_mask);
  EXPECT_EQ(a->tokens.image_offsets, b->tokens.image_offsets);
  EXPECT_EQ(a->images, b->images);
  // The chat template applies to conversations only: the prompt/text line is the same under
  // vicuna.
  LoaderOptions vicuna = Options(path);
  vicuna.chat_template = ChatTemplate::kVicuna;
  vicuna.seq_len = 256;
  std::unique_ptr<DataLoader> v = Make(vicuna);
  ASSERT_NE(v, nullptr);
  EXPECT_EQ(v->Tokenize(0)->input_ids, a->tokens.input_ids);
  EXPECT_NE(v->Tokenize(1)->input_ids, a->tokens.input_ids);
}

TEST_F(LoaderTest, ConversationPlaceholderCountNamesTheArrayIndex) {
  const std::string path = *dir_ + "/count.json";
  ASSERT_TRUE(
      WriteFileAtomically(
          path,
          R"([{"id": "x", "images": ["a.png", "b.png"], "conversations": [)"
          R"({"from": "human", "value": "<image>what?"}, {"from": "gpt", "value": "red."}]}])")
          .ok());
  std::unique_ptr<DataLoader> loader = Make(Options(path));
  ASSERT_NE(loader, nullptr);
  absl::StatusOr<TokenSequence> t = loader->Tokenize(0);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(
      std::string(t.status().message()),
      HasSubstr("sample 'x' (" + path +
                "[0]): conversations hold 1 '<image>' placeholder(s) but the sample names 2 "
                "image file(s)"));
  BadSample bad = loader->DescribeProblem(0, t.status());
  EXPECT_EQ(bad.line, 0);
  EXPECT_EQ(bad.where, path + "[0]");
}

TEST(LoaderOptionsTest, ChatTemplateFromTheRunSpec) {
  hetpar::v1::RunSpec spec;
  spec.mutable_data()->set_manifest("m.json");
  absl::StatusOr<LoaderOptions> o = LoaderOptionsFromRunSpec(spec, Split::kTrain);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->chat_template, ChatTemplate::kPlain);
  spec.mutable_data()->set_chat_template("llama3");
  EXPECT_EQ(LoaderOptionsFromRunSpec(spec, Split::kTrain)->chat_template, ChatTemplate::kLlama3);
  spec.mutable_data()->set_chat_template("alpaca");
  EXPECT_EQ(LoaderOptionsFromRunSpec(spec, Split::kTrain).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// A read-only data set's training index goes under checkpoint.dir, named by the manifest's file
// name and the CRC-32 of its path (two manifests of one name in other directories differ), and
// only when data.index is the default one beside the manifest.
TEST(LoaderOptionsTest, TheIndexFallbackIsUnderTheCheckpointDirectory) {
  hetpar::v1::RunSpec spec;
  spec.mutable_data()->set_manifest("/data/set/train.jsonl");
  spec.mutable_data()->set_index("/data/set/train.jsonl.index");
  EXPECT_EQ(IndexFallbackPath(spec), "") << "without checkpoint.dir";
  spec.mutable_checkpoint()->set_dir("/ckpt");
  // 6f922097: zlib.crc32(b"/data/set/train.jsonl") in Python.
  EXPECT_EQ(IndexFallbackPath(spec), "/ckpt/data-index/train.jsonl-6f922097.index");
  spec.mutable_data()->set_index("/elsewhere/train.index");
  EXPECT_EQ(IndexFallbackPath(spec), "") << "data.index named by the config";
}

}  // namespace
}  // namespace hetpar::data
