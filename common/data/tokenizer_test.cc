#include "common/data/tokenizer.h"

#include <stdlib.h>

#include <filesystem>

#include "common/data/file_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hetpar::data {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

std::vector<std::string> Corpus() {
  std::vector<std::string> out;
  const char* colours[] = {"red", "green", "blue", "yellow"};
  const char* shapes[] = {"circle", "square", "triangle"};
  const char* places[] = {"top left", "center", "bottom right"};
  for (const char* c : colours) {
    for (const char* s : shapes) {
      for (const char* p : places) {
        out.push_back(std::string("a small ") + c + " " + s + " at the " + p + ".");
      }
    }
  }
  out.push_back("describe the image. what is two plus three? five.");
  return out;
}

TokenizerTrainOptions Options(int vocab) {
  TokenizerTrainOptions options;
  options.vocab_size = vocab;
  options.user_symbols = {"<image>"};
  return options;
}

TEST(TokenizerTest, TrainingIsDeterministicToTheByte) {
  absl::StatusOr<std::string> a = TrainTokenizer(Corpus(), Options(96));
  absl::StatusOr<std::string> b = TrainTokenizer(Corpus(), Options(96));
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(*a, *b);
  // A different corpus gives a different model.
  std::vector<std::string> other = Corpus();
  other.push_back("purple purple purple octagon octagon");
  absl::StatusOr<std::string> c = TrainTokenizer(other, Options(96));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_NE(*a, *c);
}

TEST(TokenizerTest, ReservedIdsUserSymbolAndVocabularyBound) {
  absl::StatusOr<std::string> model = TrainTokenizer(Corpus(), Options(96));
  ASSERT_TRUE(model.ok()) << model.status();
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = Tokenizer::FromSerialized(*model, "mem");
  ASSERT_TRUE(tok.ok()) << tok.status();
  const Tokenizer& t = **tok;
  EXPECT_LE(t.vocab_size(), 96);
  EXPECT_GT(t.vocab_size(), 30);
  EXPECT_EQ(t.unk_id(), 0);
  EXPECT_EQ(t.bos_id(), 1);
  EXPECT_EQ(t.eos_id(), 2);
  EXPECT_EQ(t.pad_id(), 3);
  EXPECT_EQ(t.PieceId("<image>"), std::optional<int32_t>(4));
  EXPECT_EQ(t.Piece(4), "<image>");
  EXPECT_EQ(t.PieceId("definitely-not-a-piece"), std::nullopt);
  // `<image>` inside text is always one piece.
  absl::StatusOr<std::vector<int32_t>> ids = t.Encode("a<image>b <image>");
  ASSERT_TRUE(ids.ok());
  int images = 0;
  for (int32_t id : *ids) images += id == 4;
  EXPECT_EQ(images, 2);
  for (int32_t id : *ids) {
    EXPECT_GE(id, 0);
    EXPECT_LT(id, t.vocab_size());
  }
}

TEST(TokenizerTest, EncodeDecodeRoundTripsEverySentence) {
  absl::StatusOr<std::string> model = TrainTokenizer(Corpus(), Options(128));
  ASSERT_TRUE(model.ok()) << model.status();
  std::unique_ptr<Tokenizer> t = *Tokenizer::FromSerialized(*model, "mem");
  for (const std::string& sentence : Corpus()) {
    absl::StatusOr<std::vector<int32_t>> ids = t->Encode(sentence);
    ASSERT_TRUE(ids.ok()) << ids.status();
    ASSERT_FALSE(ids->empty());
    for (int32_t id : *ids) ASSERT_NE(id, t->unk_id()) << sentence;
    absl::StatusOr<std::string> text = t->Decode(*ids);
    ASSERT_TRUE(text.ok()) << text.status();
    EXPECT_EQ(*text, sentence);
  }
  // With a vocabulary this large, frequent words are single pieces.
  absl::StatusOr<std::vector<int32_t>> ids = t->Encode("a small red circle");
  ASSERT_TRUE(ids.ok());
  ASSERT_EQ(ids->size(), 4u);
  EXPECT_EQ(t->Piece((*ids)[2]), "\xe2\x96\x81red");
}

TEST(TokenizerTest, LoadsFromFile) {
  std::string dir = (fs::temp_directory_path() / "hetpar_tok_XXXXXX").string();
  ASSERT_NE(::mkdtemp(dir.data()), nullptr);
  const std::string model = *TrainTokenizer(Corpus(), Options(96));
  ASSERT_TRUE(WriteFileAtomically(dir + "/t.model", model).ok());
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = Tokenizer::Load(dir + "/t.model");
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ((*tok)->source(), dir + "/t.model");
  EXPECT_EQ(*(*tok)->Encode("a small red circle"),
            *(*Tokenizer::FromSerialized(model, "mem"))->Encode("a small red circle"));
  fs::remove_all(dir);
}

TEST(TokenizerTest, ErrorsNameWhatIsWrong) {
  absl::StatusOr<std::unique_ptr<Tokenizer>> missing = Tokenizer::Load("/nonexistent/t.model");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(missing.status().message()), HasSubstr("/nonexistent/t.model"));

  absl::StatusOr<std::unique_ptr<Tokenizer>> garbage =
      Tokenizer::FromSerialized("this is not a model", "junk.model");
  EXPECT_EQ(garbage.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(garbage.status().message()), HasSubstr("junk.model"));

  absl::StatusOr<std::string> tiny = TrainTokenizer(Corpus(), Options(10));
  EXPECT_EQ(tiny.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(tiny.status().message()), HasSubstr("vocab_size=10 is too small"));

  EXPECT_EQ(TrainTokenizer({}, Options(64)).status().code(), absl::StatusCode::kInvalidArgument);

  std::unique_ptr<Tokenizer> t =
      *Tokenizer::FromSerialized(*TrainTokenizer(Corpus(), Options(96)), "m");
  absl::StatusOr<std::string> bad = t->Decode({1, 5, 100000});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("token id 100000 at position 2"));
}

}  // namespace
}  // namespace hetpar::data
