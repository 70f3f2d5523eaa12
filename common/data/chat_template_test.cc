#include "common/data/chat_template.h"

#include <algorithm>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hetpar::data {
namespace {

using ::testing::HasSubstr;
using Kind = ChatPart::Kind;

constexpr int32_t kTokensPerImage = 2;
constexpr int32_t X = kIgnoreLabel;

const std::vector<std::string>& SpecialMarkers() {
  static const std::vector<std::string> markers = {"<|begin_of_text|>", "<|start_header_id|>",
                                                   "<|end_header_id|>", "<|eot_id|>",
                                                   "<|im_start|>",      "<|im_end|>"};
  return markers;
}

std::unique_ptr<Tokenizer> Train(bool special_markers) {
  std::vector<std::string> corpus = {
      "what is this? a red circle. and the colour? red.",
      "you are terse. user assistant system",
      "USER: ASSISTANT: USER: ASSISTANT:",
      kVicunaSystemPrompt,
      "<|im_start|> <|im_end|> <|begin_of_text|> <|start_header_id|> <|end_header_id|> "
      "<|eot_id|>",
  };
  TokenizerTrainOptions options;
  options.vocab_size = 160;
  options.user_symbols = {"<image>"};
  if (special_markers) {
    for (const std::string& m : SpecialMarkers()) options.user_symbols.push_back(m);
  }
  absl::StatusOr<std::string> model = TrainTokenizer(corpus, options);
  EXPECT_TRUE(model.ok()) << model.status();
  if (!model.ok()) return nullptr;
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = Tokenizer::FromSerialized(*model, "test");
  EXPECT_TRUE(tok.ok()) << tok.status();
  return tok.ok() ? std::move(*tok) : nullptr;
}

// The two-turn conversation of every test, one image in the first user turn.
std::vector<ChatTurn> TwoTurns() {
  return {{ChatRole::kUser, "<image>what is this?"},
          {ChatRole::kAssistant, "a red circle."},
          {ChatRole::kUser, "and the colour?"},
          {ChatRole::kAssistant, "red."}};
}

// The expected sequence, written token run by token run: input_ids and which tokens are
// training targets. Labels follow the convention: position i is labelled with token i + 1 when
// that token is a target.
class Expected {
 public:
  explicit Expected(const Tokenizer* tok) : tok_(tok) {}
  // The tokens of `literal`, encoded on its own.
  Expected& Text(const std::string& literal, bool loss = false) {
    absl::StatusOr<std::vector<int32_t>> ids = tok_->Encode(literal);
    EXPECT_TRUE(ids.ok()) << ids.status();
    for (int32_t id : *ids) Add(id, loss);
    return *this;
  }
  // One piece of the tokenizer, by name.
  Expected& Piece(const std::string& piece, bool loss = false) {
    std::optional<int32_t> id = tok_->PieceId(piece);
    EXPECT_TRUE(id.has_value()) << piece;
    Add(id.value_or(-1), loss);
    return *this;
  }
  Expected& Id(int32_t id, bool loss = false) {
    Add(id, loss);
    return *this;
  }
  Expected& Image() {
    for (int k = 0; k < kTokensPerImage; ++k) Add(*tok_->PieceId("<image>"), false);
    return *this;
  }
  std::vector<int32_t> Labels() const {
    std::vector<int32_t> labels(ids_.size(), X);
    for (size_t i = 0; i + 1 < ids_.size(); ++i) {
      if (loss_[i + 1]) labels[i] = ids_[i + 1];
    }
    return labels;
  }
  std::vector<uint8_t> Mask() const {
    std::vector<uint8_t> mask(ids_.size(), 0);
    for (size_t i = 0; i + 1 < ids_.size(); ++i) mask[i] = loss_[i + 1] ? 1 : 0;
    return mask;
  }
  const std::vector<int32_t>& ids() const { return ids_; }

 private:
  void Add(int32_t id, bool loss) {
    ids_.push_back(id);
    loss_.push_back(loss);
  }
  const Tokenizer* tok_;
  std::vector<int32_t> ids_;
  std::vector<bool> loss_;
};

class ChatTemplateTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    special_ = Train(true).release();
    plain_ = Train(false).release();
  }
  static void TearDownTestSuite() {
    delete special_;
    delete plain_;
  }

  static absl::StatusOr<TokenSequence> Build(ChatTemplate t, const std::vector<ChatTurn>& turns,
                                             const Tokenizer& tok, int* placeholders = nullptr) {
    absl::StatusOr<EncodedChat> encoded =
        EncodeChatParts(ApplyChatTemplate(t, turns), tok, "<image>");
    if (!encoded.ok()) return encoded.status();
    if (placeholders != nullptr) *placeholders = encoded->image_placeholders;
    SequenceOptions o;
    o.tokens_per_image = kTokensPerImage;
    o.seq_len = 512;
    o.image_token_id = *tok.PieceId("<image>");
    return BuildTokenSequence(encoded->segments, o);
  }

  static void ExpectSequence(const absl::StatusOr<TokenSequence>& got, const Expected& want) {
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->input_ids, want.ids());
    EXPECT_EQ(got->labels, want.Labels());
    EXPECT_EQ(got->loss_mask, want.Mask());
  }

  static Tokenizer* special_;  // knows the llama3 / chatml markers as one piece each
  static Tokenizer* plain_;    // does not (like hetpar's synthetic tokenizer)
};

Tokenizer* ChatTemplateTest::special_ = nullptr;
Tokenizer* ChatTemplateTest::plain_ = nullptr;

TEST_F(ChatTemplateTest, Names) {
  EXPECT_EQ(*ParseChatTemplate(""), ChatTemplate::kPlain);
  EXPECT_EQ(*ParseChatTemplate("plain"), ChatTemplate::kPlain);
  EXPECT_EQ(*ParseChatTemplate("vicuna"), ChatTemplate::kVicuna);
  EXPECT_EQ(*ParseChatTemplate("llama3"), ChatTemplate::kLlama3);
  EXPECT_EQ(*ParseChatTemplate("chatml"), ChatTemplate::kChatml);
  absl::StatusOr<ChatTemplate> bad = ParseChatTemplate("mistral");
  ASSERT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(
      std::string(bad.status().message()),
      HasSubstr("data.chat_template='mistral' is not one of: plain, vicuna, llama3, chatml"));
  for (ChatTemplate t : {ChatTemplate::kPlain, ChatTemplate::kVicuna, ChatTemplate::kLlama3,
                         ChatTemplate::kChatml}) {
    EXPECT_EQ(*ParseChatTemplate(ChatTemplateName(t)), t);
  }
}

TEST_F(ChatTemplateTest, ChatmlParts) {
  const std::vector<ChatPart> want = {{Kind::kMarker, "<|im_start|>", false},
                                      {Kind::kMarker, "system\n", false},
                                      {Kind::kContent, "be brief.", false},
                                      {Kind::kMarker, "<|im_end|>", false},
                                      {Kind::kMarker, "\n", false},
                                      {Kind::kMarker, "<|im_start|>", false},
                                      {Kind::kMarker, "user\n", false},
                                      {Kind::kContent, "hi", false},
                                      {Kind::kMarker, "<|im_end|>", false},
                                      {Kind::kMarker, "\n", false},
                                      {Kind::kMarker, "<|im_start|>", false},
                                      {Kind::kMarker, "assistant\n", false},
                                      {Kind::kContent, "hello.", true},
                                      {Kind::kMarker, "<|im_end|>", true},
                                      {Kind::kMarker, "\n", false}};
  EXPECT_EQ(ApplyChatTemplate(ChatTemplate::kChatml, {{ChatRole::kSystem, "be brief."},
                                                      {ChatRole::kUser, "hi"},
                                                      {ChatRole::kAssistant, "hello."}}),
            want);
}

TEST_F(ChatTemplateTest, VicunaPartsUseTheDefaultSystemPrompt) {
  const std::vector<ChatPart> want = {{Kind::kBos, "", false},
                                      {Kind::kContent, kVicunaSystemPrompt, false},
                                      {Kind::kMarker, " USER: ", false},
                                      {Kind::kContent, "hi", false},
                                      {Kind::kMarker, " ASSISTANT: ", false},
                                      {Kind::kContent, "hello.", true},
                                      {Kind::kEos, "", true}};
  EXPECT_EQ(ApplyChatTemplate(ChatTemplate::kVicuna,
                              {{ChatRole::kUser, "hi"}, {ChatRole::kAssistant, "hello."}}),
            want);
}

TEST_F(ChatTemplateTest, Plain) {
  const Tokenizer& t = *special_;
  Expected want(&t);
  want.Id(t.bos_id())
      .Image()
      .Text("what is this?")
      .Text("a red circle.", true)
      .Id(t.eos_id(), true)
      .Text("and the colour?")
      .Text("red.", true)
      .Id(t.eos_id(), true);
  int placeholders = 0;
  ExpectSequence(Build(ChatTemplate::kPlain, TwoTurns(), t, &placeholders), want);
  EXPECT_EQ(placeholders, 1);
}

TEST_F(ChatTemplateTest, PlainOneTurnEqualsThePromptTextForm) {
  const Tokenizer& t = *special_;
  SequenceOptions o;
  o.tokens_per_image = kTokensPerImage;
  o.seq_len = 512;
  o.image_token_id = *t.PieceId("<image>");
  o.bos_id = t.bos_id();
  o.eos_id = t.eos_id();
  // prompt "<image>what is this?", text "a red circle." as the prompt/text form builds it.
  absl::StatusOr<TokenSequence> old_form =
      BuildTokenSequence({Segment{true, {}}, Segment{false, *t.Encode("what is this?")}},
                         {Segment{false, *t.Encode("a red circle.")}}, o);
  ASSERT_TRUE(old_form.ok()) << old_form.status();
  absl::StatusOr<TokenSequence> chat = Build(
      ChatTemplate::kPlain,
      {{ChatRole::kUser, "<image>what is this?"}, {ChatRole::kAssistant, "a red circle."}}, t);
  ASSERT_TRUE(chat.ok()) << chat.status();
  EXPECT_EQ(chat->input_ids, old_form->input_ids);
  EXPECT_EQ(chat->labels, old_form->labels);
  EXPECT_EQ(chat->loss_mask, old_form->loss_mask);
  EXPECT_EQ(chat->image_offsets, old_form->image_offsets);
  EXPECT_EQ(chat->loss_tokens, old_form->loss_tokens);
  EXPECT_EQ(chat->text_tokens, old_form->text_tokens);
  // And both are what the convention says.
  Expected want(&t);
  want.Id(t.bos_id())
      .Image()
      .Text("what is this?")
      .Text("a red circle.", true)
      .Id(t.eos_id(), true);
  ExpectSequence(chat, want);
}

TEST_F(ChatTemplateTest, Vicuna) {
  const Tokenizer& t = *special_;
  Expected want(&t);
  want.Id(t.bos_id())
      .Text(
          "A chat between a curious human and an artificial intelligence assistant. The "
          "assistant gives helpful, detailed, and polite answers to the human's questions.")
      .Text(" USER: ")
      .Image()
      .Text("what is this?")
      .Text(" ASSISTANT: ")
      .Text("a red circle.", true)
      .Id(t.eos_id(), true)
      .Text("USER: ")
      .Text("and the colour?")
      .Text(" ASSISTANT: ")
      .Text("red.", true)
      .Id(t.eos_id(), true);
  ExpectSequence(Build(ChatTemplate::kVicuna, TwoTurns(), t), want);
}

TEST_F(ChatTemplateTest, VicunaWithASystemTurn) {
  const Tokenizer& t = *special_;
  std::vector<ChatTurn> turns = TwoTurns();
  turns.insert(turns.begin(), ChatTurn{ChatRole::kSystem, "you are terse."});
  Expected want(&t);
  want.Id(t.bos_id())
      .Text("you are terse.")
      .Text(" USER: ")
      .Image()
      .Text("what is this?")
      .Text(" ASSISTANT: ")
      .Text("a red circle.", true)
      .Id(t.eos_id(), true)
      .Text("USER: ")
      .Text("and the colour?")
      .Text(" ASSISTANT: ")
      .Text("red.", true)
      .Id(t.eos_id(), true);
  ExpectSequence(Build(ChatTemplate::kVicuna, turns, t), want);
}

TEST_F(ChatTemplateTest, Llama3) {
  const Tokenizer& t = *special_;
  // The role names are not pieces of this tokenizer: they are encoded as text.
  ASSERT_FALSE(t.PieceId("user").has_value());
  ASSERT_FALSE(t.PieceId("assistant").has_value());
  Expected want(&t);
  want.Piece("<|begin_of_text|>")
      .Piece("<|start_header_id|>")
      .Text("user")
      .Piece("<|end_header_id|>")
      .Text("\n\n")
      .Image()
      .Text("what is this?")
      .Piece("<|eot_id|>")
      .Piece("<|start_header_id|>")
      .Text("assistant")
      .Piece("<|end_header_id|>")
      .Text("\n\n")
      .Text("a red circle.", true)
      .Piece("<|eot_id|>", true)
      .Piece("<|start_header_id|>")
      .Text("user")
      .Piece("<|end_header_id|>")
      .Text("\n\n")
      .Text("and the colour?")
      .Piece("<|eot_id|>")
      .Piece("<|start_header_id|>")
      .Text("assistant")
      .Piece("<|end_header_id|>")
      .Text("\n\n")
      .Text("red.", true)
      .Piece("<|eot_id|>", true);
  absl::StatusOr<TokenSequence> got = Build(ChatTemplate::kLlama3, TwoTurns(), t);
  ExpectSequence(got, want);
  // No tokenizer bos or eos: <|begin_of_text|> and <|eot_id|> take their places.
  ASSERT_TRUE(got.ok());
  for (int32_t id : got->input_ids) {
    EXPECT_NE(id, t.bos_id());
    EXPECT_NE(id, t.eos_id());
  }
  // Targets: the two answers, each closed by one <|eot_id|>.
  const int32_t eot = *t.PieceId("<|eot_id|>");
  EXPECT_EQ(got->loss_tokens,
            static_cast<int32_t>(t.Encode("a red circle.")->size() + t.Encode("red.")->size()) + 2);
  EXPECT_EQ(std::count(got->labels.begin(), got->labels.end(), eot), 2);
}

TEST_F(ChatTemplateTest, Chatml) {
  const Tokenizer& t = *special_;
  ASSERT_FALSE(t.PieceId("user\n").has_value());
  ASSERT_FALSE(t.PieceId("\n").has_value());
  Expected want(&t);
  want.Piece("<|im_start|>")
      .Text("user\n")
      .Image()
      .Text("what is this?")
      .Piece("<|im_end|>")
      .Text("\n")
      .Piece("<|im_start|>")
      .Text("assistant\n")
      .Text("a red circle.", true)
      .Piece("<|im_end|>", true)
      .Text("\n")
      .Piece("<|im_start|>")
      .Text("user\n")
      .Text("and the colour?")
      .Piece("<|im_end|>")
      .Text("\n")
      .Piece("<|im_start|>")
      .Text("assistant\n")
      .Text("red.", true)
      .Piece("<|im_end|>", true)
      .Text("\n");
  ExpectSequence(Build(ChatTemplate::kChatml, TwoTurns(), t), want);
}

TEST_F(ChatTemplateTest, MarkersATokenizerDoesNotKnowAreEncodedAsText) {
  const Tokenizer& t = *plain_;
  ASSERT_FALSE(t.PieceId("<|im_end|>").has_value());
  const std::vector<int32_t> im_end = *t.Encode("<|im_end|>");
  ASSERT_GT(im_end.size(), 1u);  // several pieces, every one a target after an answer
  Expected want(&t);
  want.Text("<|im_start|>")
      .Text("user\n")
      .Image()
      .Text("what is this?")
      .Text("<|im_end|>")
      .Text("\n")
      .Text("<|im_start|>")
      .Text("assistant\n")
      .Text("a red circle.", true)
      .Text("<|im_end|>", true)
      .Text("\n")
      .Text("<|im_start|>")
      .Text("user\n")
      .Text("and the colour?")
      .Text("<|im_end|>")
      .Text("\n")
      .Text("<|im_start|>")
      .Text("assistant\n")
      .Text("red.", true)
      .Text("<|im_end|>", true)
      .Text("\n");
  absl::StatusOr<TokenSequence> got = Build(ChatTemplate::kChatml, TwoTurns(), t);
  ExpectSequence(got, want);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->loss_tokens, static_cast<int32_t>(t.Encode("a red circle.")->size() +
                                                   t.Encode("red.")->size() + 2 * im_end.size()));
}

TEST_F(ChatTemplateTest, ImagesInEveryTurnAreCountedAndNeverTargets) {
  const Tokenizer& t = *special_;
  int placeholders = 0;
  absl::StatusOr<TokenSequence> got = Build(ChatTemplate::kChatml,
                                            {{ChatRole::kUser, "<image><image>what is this?"},
                                             {ChatRole::kAssistant, "a red circle.<image>red."}},
                                            t, &placeholders);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(placeholders, 3);
  ASSERT_EQ(got->images(), 3);
  const int32_t image = *t.PieceId("<image>");
  for (size_t i = 0; i < got->labels.size(); ++i) {
    if (got->loss_mask[i]) {
      EXPECT_NE(got->labels[i], image) << i;
    }
  }
  // The answer's two texts and <|im_end|> are the targets.
  EXPECT_EQ(got->loss_tokens,
            static_cast<int32_t>(t.Encode("a red circle.")->size() + t.Encode("red.")->size()) + 1);
}

}  // namespace
}  // namespace hetpar::data
