// `hetpar run` on a LLaVA-style .json manifest, as a user runs it: a synthetic data set from
// `hetpar data synth` supplies the images (and a sentencepiece tokenizer), the test writes
// two-turn conversations (one image, two images, text only) over them, trains 4 steps and checks
// the step lines against token counts it makes itself from the file and the tokenizer. Twice:
// the vicuna template with the synthetic tokenizer, and the llama3 template with a Hugging Face
// tokenizer.json.
#include <stdlib.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "common/data/chat_template.h"
#include "common/data/index.h"
#include "common/data/manifest.h"
#include "common/data/tokenizer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/util/subprocess.h"

namespace hetpar {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;
using testing::RunCommand;

const std::string kBin = HETPAR_BIN;
const std::string kSource = HETPAR_SOURCE_DIR;

constexpr int kTokensPerImage = 16;  // configs/tiny.yaml: (32 / 8)^2
constexpr int kSeqLen = 256;         // the vicuna system prompt is long in the synthetic vocabulary
constexpr int kGlobalBatch = 8;      // configs/tiny.yaml: every step trains all 8 samples
constexpr char kSystemPrompt[] =
    "A chat between a curious human and an artificial intelligence assistant. The assistant "
    "gives helpful, detailed, and polite answers to the human's questions.";

struct Turn {
  std::string from;  // human, gpt, system
  std::string value;
};

struct Sample {
  Json id;
  std::vector<std::string> images;
  std::vector<Turn> turns;
};

// What the vicuna template makes of `s`, counted from the literal strings with the tokenizer:
// <s> SYSTEM " USER: " U1 " ASSISTANT: " A1 </s> "USER: " U2 " ASSISTANT: " A2 </s>, each
// literal encoded on its own, each <image> 16 rows; loss on every A and its </s>.
struct Counts {
  int64_t length = 0;
  int64_t loss = 0;
  int64_t images = 0;
};

int64_t Encoded(const data::Tokenizer& tok, const std::string& text) {
  absl::StatusOr<std::vector<int32_t>> ids = tok.Encode(text);
  EXPECT_TRUE(ids.ok()) << ids.status();
  return ids.ok() ? static_cast<int64_t>(ids->size()) : 0;
}

Counts VicunaCounts(const data::Tokenizer& tok, const Sample& s) {
  Counts c;
  c.length = 1;  // <s>
  size_t first = 0;
  if (s.turns[0].from == "system") {
    c.length += Encoded(tok, s.turns[0].value);
    first = 1;
  } else {
    c.length += Encoded(tok, kSystemPrompt);
  }
  for (size_t i = first; i < s.turns.size(); ++i) {
    const std::string& value = s.turns[i].value;
    if (s.turns[i].from == "human") {
      c.length += Encoded(tok, i == first ? " USER: " : "USER: ");
      size_t start = 0;
      for (size_t at = value.find("<image>");; at = value.find("<image>", start)) {
        const std::string chunk = value.substr(start, at == std::string::npos ? at : at - start);
        if (!chunk.empty()) c.length += Encoded(tok, chunk);
        if (at == std::string::npos) break;
        c.length += kTokensPerImage;
        ++c.images;
        start = at + 7;
      }
    } else {
      const int64_t answer = Encoded(tok, value);
      c.length += Encoded(tok, " ASSISTANT: ") + answer + 1;  // + </s>
      c.loss += answer + 1;
    }
  }
  return c;
}

// What the llama3 template makes of `s` with a tokenizer that has its markers as special tokens
// (one id each): <|begin_of_text|>, then per turn <|start_header_id|> ROLE <|end_header_id|>
// "\n\n" TEXT <|eot_id|>; loss on every assistant TEXT and its <|eot_id|>.
Counts Llama3Counts(const data::Tokenizer& tok, const Sample& s) {
  Counts c;
  c.length = 1;  // <|begin_of_text|>
  for (const Turn& turn : s.turns) {
    const std::string role = turn.from == "human" ? "user"
                             : turn.from == "gpt" ? "assistant"
                                                  : turn.from;
    c.length += 1 + Encoded(tok, role) + 1 + Encoded(tok, "\n\n");  // header
    if (turn.from == "gpt") {
      const int64_t answer = Encoded(tok, turn.value);
      c.length += answer + 1;  // + <|eot_id|>
      c.loss += answer + 1;
      continue;
    }
    size_t start = 0;
    for (size_t at = turn.value.find("<image>");; at = turn.value.find("<image>", start)) {
      const std::string chunk = turn.value.substr(start, at == std::string::npos ? at : at - start);
      if (!chunk.empty()) c.length += Encoded(tok, chunk);
      if (at == std::string::npos) break;
      c.length += kTokensPerImage;
      ++c.images;
      start = at + 7;
    }
    c.length += 1;  // <|eot_id|>
  }
  return c;
}

class LlavaRunTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = (fs::temp_directory_path() / "hetpar_llava_run_XXXXXX").string();
    ASSERT_NE(::mkdtemp(dir_.data()), nullptr);
  }
  void TearDown() override {
    if (!HasFailure()) fs::remove_all(dir_);
  }

  // Generates the synthetic set under dir_/data and writes dir_/data/llava.json: eight
  // LLaVA-style samples (= the global batch) over its images. Sets data_, manifest_, samples_.
  void WriteLlavaData() {
    // The synthetic set: its images and its tokenizer.
    data_ = dir_ + "/data";
    absl::StatusOr<testing::CommandResult> synth =
        RunCommand({kBin, "data", "synth", "--out", data_, "--samples", "16", "--val-samples", "4",
                    "--seed", "7"},
                   120);
    ASSERT_TRUE(synth.ok()) << synth.status();
    ASSERT_EQ(synth->exit_code, 0) << synth->stderr_text;
    absl::StatusOr<data::Manifest> generated = data::ReadManifest(data_ + "/train.jsonl", false);
    ASSERT_TRUE(generated.ok()) << generated.status();
    std::vector<const data::ManifestRecord*> one_image, two_images;
    for (const data::ManifestRecord& r : generated->records) {
      if (r.images.size() == 1) one_image.push_back(&r);
      if (r.images.size() == 2) two_images.push_back(&r);
    }
    ASSERT_GE(one_image.size(), 3u);
    ASSERT_GE(two_images.size(), 2u);

    // Eight LLaVA-style samples (= the global batch): string and numeric ids, "image" and
    // "images", a system turn, text-only conversations; answers are the generated captions.
    for (int i = 0; i < 3; ++i) {
      const data::ManifestRecord& r = *one_image[static_cast<size_t>(i)];
      Sample s;
      s.id = i == 1 ? Json(1000 + i) : Json("one-" + std::to_string(i));
      s.images = r.images;
      s.turns = {{"human", "<image>\ndescribe the image."},
                 {"gpt", r.text},
                 {"human", "what is two plus three?"},
                 {"gpt", "five."}};
      if (i == 2) s.turns.insert(s.turns.begin(), Turn{"system", "describe shapes."});
      samples_.push_back(std::move(s));
    }
    for (int i = 0; i < 2; ++i) {
      const data::ManifestRecord& r = *two_images[static_cast<size_t>(i)];
      Sample s;
      s.id = "two-" + std::to_string(i);
      s.images = r.images;
      s.turns = {{"human", "<image>\n<image>\ncompare the two images."},
                 {"gpt", r.text},
                 {"human", "what is one plus one?"},
                 {"gpt", "two."}};
      samples_.push_back(std::move(s));
    }
    for (int i = 0; i < 3; ++i) {
      Sample s;
      s.id = "text-" + std::to_string(i);
      s.turns = {{"human", "what is two plus three?"}, {"gpt", "five."}};
      if (i > 0) {
        s.turns.push_back({"human", "and one plus one?"});
        s.turns.push_back({"gpt", "two."});
      }
      samples_.push_back(std::move(s));
    }
    ASSERT_EQ(samples_.size(), static_cast<size_t>(kGlobalBatch));
    Json file = Json::array();
    for (size_t i = 0; i < samples_.size(); ++i) {
      const Sample& s = samples_[i];
      Json j = {{"id", s.id}};
      // One image as "image" (LLaVA's way), except sample 0, which lists it in "images".
      if (s.images.size() == 1 && i != 0) {
        j["image"] = s.images[0];
      } else if (!s.images.empty()) {
        j["images"] = s.images;
      }
      Json turns = Json::array();
      for (const Turn& t : s.turns) turns.push_back({{"from", t.from}, {"value", t.value}});
      j["conversations"] = turns;
      file.push_back(j);
    }
    manifest_ = data_ + "/llava.json";
    std::ofstream(manifest_) << file.dump(2) << "\n";
  }

  std::string dir_;
  std::string data_;
  std::string manifest_;
  std::vector<Sample> samples_;
};

// Trains 4 steps of tiny.yaml on dir_/data/llava.json with `chat_template` and `tokenizer` and
// checks the step lines and the data index against `count` of every sample.
void TrainAndCheck(const std::string& dir, const std::string& chat_template,
                   data::ChatTemplate parsed_template, const std::string& tokenizer,
                   Counts (*count)(const data::Tokenizer&, const Sample&),
                   const std::vector<Sample>& samples, const std::vector<std::string>& extra) {
  const std::string data = dir + "/data";
  const std::string manifest = data + "/llava.json";
  // The expected counts, from the file's literal strings and the tokenizer.
  absl::StatusOr<std::unique_ptr<data::Tokenizer>> tok = data::Tokenizer::Load(tokenizer);
  ASSERT_TRUE(tok.ok()) << tok.status();
  std::map<std::string, Counts> expected;
  Counts total;
  for (const Sample& s : samples) {
    const Counts c = count(**tok, s);
    ASSERT_LE(c.length, kSeqLen) << s.id.dump();
    expected[s.id.is_string() ? s.id.get<std::string>() : s.id.dump()] = c;
    total.length += c.length;
    total.loss += c.loss;
    total.images += c.images;
  }
  EXPECT_EQ(total.images, 3 + 2 * 2);

  const std::string out = dir + "/run";
  std::vector<std::string> argv = {kBin,        "run",
                                   "--config",  kSource + "/configs/tiny.yaml",
                                   "--out",     out,
                                   "--steps",   "4",
                                   "--threads", "1",
                                   "--set",     "data.manifest=" + manifest,
                                   "--set",     "data.val_manifest=" + data + "/val.jsonl",
                                   "--set",     "data.tokenizer=" + tokenizer,
                                   "--set",     "data.chat_template=" + chat_template,
                                   "--set",     "data.synth.samples=16",
                                   "--set",     "data.synth.val_samples=4",
                                   "--set",     "llm.model.seq_len=" + std::to_string(kSeqLen)};
  argv.insert(argv.end(), extra.begin(), extra.end());
  absl::StatusOr<testing::CommandResult> run = RunCommand(argv, 540);
  ASSERT_TRUE(run.ok()) << run.status();
  ASSERT_EQ(run->exit_code, 0) << run->stderr_text;

  // Four step lines, each over all eight samples.
  std::ifstream metrics(out + "/metrics.jsonl");
  ASSERT_TRUE(metrics.good()) << out << "/metrics.jsonl";
  std::vector<Json> steps;
  for (std::string line; std::getline(metrics, line);) {
    if (line.empty()) continue;
    Json j = Json::parse(line);
    if (j.contains("step")) steps.push_back(std::move(j));
  }
  ASSERT_EQ(steps.size(), 4u);
  for (size_t i = 0; i < steps.size(); ++i) {
    const Json& s = steps[i];
    EXPECT_EQ(s.at("step").get<int64_t>(), static_cast<int64_t>(i)) << s.dump();  // 0-based
    const double loss = s.at("loss").get<double>();
    EXPECT_TRUE(std::isfinite(loss) && loss > 0) << s.dump();
    EXPECT_EQ(s.at("tokens").get<int64_t>(), total.length) << s.dump();
    EXPECT_EQ(s.at("images").get<int64_t>(), total.images) << s.dump();
    EXPECT_FALSE(s.contains("skipped")) << s.dump();
  }

  // The run's data index: per sample, the loss tokens (N_global's terms) and lengths counted
  // above, built with the template.
  absl::StatusOr<data::DataIndex> index = data::ReadIndex(manifest + ".index");
  ASSERT_TRUE(index.ok()) << index.status();
  EXPECT_EQ(index->source.chat_template, parsed_template);
  ASSERT_EQ(index->records.size(), expected.size());
  for (const data::IndexRecord& r : index->records) {
    ASSERT_EQ(expected.count(r.id), 1u) << r.id;
    const Counts& c = expected[r.id];
    EXPECT_EQ(r.loss_tokens, c.loss) << r.id;
    EXPECT_EQ(r.total_tokens(), c.length) << r.id;
    EXPECT_EQ(r.image_count, c.images) << r.id;
    EXPECT_EQ(r.line, r.ordinal) << r.id;  // a .json manifest: the array index
  }
  EXPECT_EQ(index->total_loss_tokens(), total.loss);
}

TEST_F(LlavaRunTest, VicunaConversationsTrainFourSteps) {
  ASSERT_NO_FATAL_FAILURE(WriteLlavaData());
  TrainAndCheck(dir_, "vicuna", data::ChatTemplate::kVicuna, data_ + "/tokenizer.model",
                VicunaCounts, samples_, {});
}

// The same conversations with a Hugging Face tokenizer.json (byte-level BPE with the Llama 3
// special tokens and <image>, trained by the `tokenizers` library: tests/data/bpe_oracle.py) and
// the llama3 template, whose markers that tokenizer knows as single tokens.
TEST_F(LlavaRunTest, Llama3TemplateWithAHuggingFaceTokenizerTrains) {
  ASSERT_NO_FATAL_FAILURE(WriteLlavaData());
  const std::string oracle = dir_ + "/bpe";
  absl::StatusOr<testing::CommandResult> made =
      RunCommand({HETPAR_PYTHON, kSource + "/tests/data/bpe_oracle.py", oracle}, 300);
  ASSERT_TRUE(made.ok()) << made.status();
  ASSERT_EQ(made->exit_code, 0) << made->stderr_text;
  const std::string tokenizer = oracle + "/llama3/tokenizer.json";
  absl::StatusOr<std::unique_ptr<data::Tokenizer>> tok = data::Tokenizer::Load(tokenizer);
  ASSERT_TRUE(tok.ok()) << tok.status();
  for (const char* marker :
       {"<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<image>"}) {
    ASSERT_TRUE((*tok)->PieceId(marker).has_value()) << marker;
  }
  // The LLM's vocabulary holds the tokenizer's and splits over tiny.yaml's tp 2.
  const int32_t vocab = ((*tok)->vocab_size() + 1) / 2 * 2;
  TrainAndCheck(dir_, "llama3", data::ChatTemplate::kLlama3, tokenizer, Llama3Counts, samples_,
                {"--set", "llm.model.vocab=" + std::to_string(vocab)});
}

}  // namespace
}  // namespace hetpar
