#include "common/data/sequence.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hetpar::data {
namespace {

using ::testing::HasSubstr;

Segment Text(std::vector<int32_t> ids) { return Segment{false, std::move(ids)}; }
Segment Image() { return Segment{true, {}}; }

SequenceOptions Options(int32_t tpi, int32_t seq_len, OverlongPolicy overlong) {
  SequenceOptions o;
  o.tokens_per_image = tpi;
  o.seq_len = seq_len;
  o.overlong = overlong;
  o.image_token_id = 4;
  o.bos_id = 1;
  o.eos_id = 2;
  return o;
}

constexpr int32_t X = kIgnoreLabel;

TEST(SequenceTest, ExpandsImagesAndShiftsLabelsOntoTheResponse) {
  absl::StatusOr<TokenSequence> s = BuildTokenSequence(
      {Image(), Text({10, 11})}, {Text({20, 21, 22})}, Options(3, 32, OverlongPolicy::kReject));
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->input_ids, (std::vector<int32_t>{1, 4, 4, 4, 10, 11, 20, 21, 22, 2}));
  // Position i predicts input_ids[i + 1]; only response tokens and the eos are targets.
  EXPECT_EQ(s->labels, (std::vector<int32_t>{X, X, X, X, X, 20, 21, 22, 2, X}));
  EXPECT_EQ(s->loss_mask, (std::vector<uint8_t>{0, 0, 0, 0, 0, 1, 1, 1, 1, 0}));
  EXPECT_EQ(s->image_offsets, (std::vector<int32_t>{1}));
  EXPECT_EQ(s->text_tokens, 7);
  EXPECT_EQ(s->loss_tokens, 4);
  EXPECT_EQ(s->length(), 10);
  EXPECT_EQ(s->images(), 1);
  EXPECT_FALSE(s->truncated);
}

// The checksum is zlib's CRC-32 of the ids (4 little-endian bytes each) and the mask (a byte
// each); the expected values are Python's zlib.crc32 of those bytes.
TEST(SequenceTest, TheChecksumCoversEveryIdAndTheLossMask) {
  absl::StatusOr<TokenSequence> s = BuildTokenSequence(
      {Image(), Text({10, 11})}, {Text({20, 21, 22})}, Options(3, 32, OverlongPolicy::kReject));
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->Checksum(), 0xf998bee2u);
  // Another id of the same length: another checksum, where every length agrees.
  absl::StatusOr<TokenSequence> other = BuildTokenSequence(
      {Image(), Text({10, 11})}, {Text({20, 21, 23})}, Options(3, 32, OverlongPolicy::kReject));
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_EQ(other->Checksum(), 0x16ca0803u);
  // The same ids with another target: another checksum.
  TokenSequence masked = *s;
  masked.loss_mask[5] = 0;
  EXPECT_NE(masked.Checksum(), s->Checksum());
  // Longer than the checksum's 1 KiB buffer of ids: 700 ids (i * 7) % 251, every other one a
  // target.
  TokenSequence long_sequence;
  for (int32_t i = 0; i < 700; ++i) {
    long_sequence.input_ids.push_back((i * 7) % 251);
    long_sequence.loss_mask.push_back(static_cast<uint8_t>(i % 2));
  }
  EXPECT_EQ(long_sequence.Checksum(), 0x99dfbcf4u);
}

TEST(SequenceTest, ImagesInsideTheResponseAreNeverTargets) {
  absl::StatusOr<TokenSequence> s = BuildTokenSequence({Image()}, {Text({30}), Image(), Text({31})},
                                                       Options(2, 32, OverlongPolicy::kReject));
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->input_ids, (std::vector<int32_t>{1, 4, 4, 30, 4, 4, 31, 2}));
  EXPECT_EQ(s->labels, (std::vector<int32_t>{X, X, 30, X, X, 31, 2, X}));
  EXPECT_EQ(s->loss_mask, (std::vector<uint8_t>{0, 0, 1, 0, 0, 1, 1, 0}));
  EXPECT_EQ(s->image_offsets, (std::vector<int32_t>{1, 4}));
  EXPECT_EQ(s->loss_tokens, 3);
  EXPECT_EQ(s->text_tokens, 4);
}

TEST(SequenceTest, TextOnlyAndNoSpecialTokens) {
  SequenceOptions o = Options(4, 16, OverlongPolicy::kReject);
  o.bos_id = -1;
  o.eos_id = -1;
  absl::StatusOr<TokenSequence> s = BuildTokenSequence({Text({7, 8})}, {Text({9, 10})}, o);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->input_ids, (std::vector<int32_t>{7, 8, 9, 10}));
  EXPECT_EQ(s->labels, (std::vector<int32_t>{X, 9, 10, X}));
  EXPECT_EQ(s->loss_tokens, 2);
  EXPECT_TRUE(s->image_offsets.empty());
}

// prompt [10], response [20 21] <image> [22 23], tpi 3:
//   0:bos 1:10 2:20 3:21 4-6:image 7:22 8:23 9:eos  (10 tokens)
std::vector<Segment> LongResponse() { return {Text({20, 21}), Image(), Text({22, 23})}; }

TEST(SequenceTest, RejectsOverlongWithCounts) {
  absl::StatusOr<TokenSequence> s =
      BuildTokenSequence({Text({10})}, LongResponse(), Options(3, 8, OverlongPolicy::kReject));
  ASSERT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.status().message()),
              HasSubstr("sequence has 10 tokens (7 text + 1 images x 3) > llm.model.seq_len=8"));
}

TEST(SequenceTest, TruncatesInText) {
  absl::StatusOr<TokenSequence> s =
      BuildTokenSequence({Text({10})}, LongResponse(), Options(3, 8, OverlongPolicy::kTruncate));
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->input_ids, (std::vector<int32_t>{1, 10, 20, 21, 4, 4, 4, 22}));
  EXPECT_EQ(s->labels, (std::vector<int32_t>{X, 20, 21, X, X, X, 22, X}));
  EXPECT_EQ(s->image_offsets, (std::vector<int32_t>{4}));
  EXPECT_EQ(s->loss_tokens, 3);
  EXPECT_TRUE(s->truncated);
}

TEST(SequenceTest, TruncationNeverSplitsAnImage) {
  // A cut at 6 would keep 2 of the image's 3 rows: the whole image goes.
  absl::StatusOr<TokenSequence> s =
      BuildTokenSequence({Text({10})}, LongResponse(), Options(3, 6, OverlongPolicy::kTruncate));
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->input_ids, (std::vector<int32_t>{1, 10, 20, 21}));
  EXPECT_EQ(s->labels, (std::vector<int32_t>{X, 20, 21, X}));
  EXPECT_TRUE(s->image_offsets.empty());
  EXPECT_EQ(s->loss_tokens, 2);
  EXPECT_TRUE(s->truncated);
  // A cut right after the image keeps it whole.
  absl::StatusOr<TokenSequence> t =
      BuildTokenSequence({Text({10})}, LongResponse(), Options(3, 7, OverlongPolicy::kTruncate));
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->input_ids, (std::vector<int32_t>{1, 10, 20, 21, 4, 4, 4}));
  EXPECT_EQ(t->image_offsets, (std::vector<int32_t>{4}));
}

// More than 32767 images in one sample: each is still its own block (an image index does not
// wrap into text).
TEST(SequenceTest, EveryImageOfAManyImageSampleIsItsOwnBlock) {
  std::vector<Segment> prompt(40000, Image());
  absl::StatusOr<TokenSequence> s =
      BuildTokenSequence(prompt, {Text({20})}, Options(1, 50000, OverlongPolicy::kReject));
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->images(), 40000);
  EXPECT_EQ(s->image_offsets.back(), 40000);  // after the bos
  EXPECT_EQ(s->text_tokens, 3);               // bos, 20, eos
}

// A sample of a million images (256 rows each) is cut to seq_len, never expanded in full.
TEST(SequenceTest, AFarTooLongSampleIsCutToSeqLen) {
  std::vector<Segment> prompt = {Text({10})};
  prompt.insert(prompt.end(), 1000000, Image());
  absl::StatusOr<TokenSequence> refused =
      BuildTokenSequence({Text({10})}, prompt, Options(256, 1024, OverlongPolicy::kReject));
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(refused.status().message()),
              HasSubstr("(4 text + 1000000 images x 256) > llm.model.seq_len=1024"));
  std::vector<Segment> response = {Text({20, 21})};
  response.insert(response.end(), 1000000, Image());
  absl::StatusOr<TokenSequence> cut =
      BuildTokenSequence({Text({10})}, response, Options(256, 1024, OverlongPolicy::kTruncate));
  ASSERT_TRUE(cut.ok()) << cut.status();
  EXPECT_EQ(cut->length(), 4 + 3 * 256);  // bos, 10, 20, 21, then the images that fit whole
  EXPECT_EQ(cut->images(), 3);
  EXPECT_TRUE(cut->truncated);
}

TEST(SequenceTest, TruncationThatLeavesNoTargetIsAnError) {
  absl::StatusOr<TokenSequence> s = BuildTokenSequence({Image(), Text({10, 11, 12})}, {Text({20})},
                                                       Options(3, 5, OverlongPolicy::kTruncate));
  ASSERT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.status().message()), HasSubstr("leaves no response token"));
}

TEST(SequenceTest, BadOptions) {
  EXPECT_FALSE(BuildTokenSequence({}, {Text({1})}, Options(0, 8, OverlongPolicy::kReject)).ok());
  EXPECT_FALSE(BuildTokenSequence({}, {Text({1})}, Options(1, 1, OverlongPolicy::kReject)).ok());
  SequenceOptions o = Options(1, 8, OverlongPolicy::kReject);
  o.image_token_id = -1;
  EXPECT_FALSE(BuildTokenSequence({}, {Text({1})}, o).ok());
}

Segment Loss(std::vector<int32_t> ids) { return Segment{false, std::move(ids), true}; }

TEST(SequenceTest, SegmentFormPutsLossOnEveryLossSegment) {
  // bos, image, user [10 11], answer [20 21] + eot [9], user [12], answer [22] + eot [9].
  SequenceOptions o = Options(2, 32, OverlongPolicy::kReject);
  o.bos_id = 77;  // not used by the segment form
  o.eos_id = 78;
  absl::StatusOr<TokenSequence> s =
      BuildTokenSequence({Text({1}), Image(), Text({10, 11}), Loss({20, 21}), Loss({9}), Text({12}),
                          Loss({22}), Loss({9})},
                         o);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->input_ids, (std::vector<int32_t>{1, 4, 4, 10, 11, 20, 21, 9, 12, 22, 9}));
  EXPECT_EQ(s->labels, (std::vector<int32_t>{X, X, X, X, 20, 21, 9, X, 22, 9, X}));
  EXPECT_EQ(s->loss_mask, (std::vector<uint8_t>{0, 0, 0, 0, 1, 1, 1, 0, 1, 1, 0}));
  EXPECT_EQ(s->image_offsets, (std::vector<int32_t>{1}));
  EXPECT_EQ(s->loss_tokens, 5);
  EXPECT_EQ(s->text_tokens, 9);
}

TEST(SequenceTest, SegmentFormImagesNeverCarryLoss) {
  absl::StatusOr<TokenSequence> s = BuildTokenSequence(
      {Text({1}), Segment{true, {}, true}, Loss({20})}, Options(2, 32, OverlongPolicy::kReject));
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->input_ids, (std::vector<int32_t>{1, 4, 4, 20}));
  EXPECT_EQ(s->loss_mask, (std::vector<uint8_t>{0, 0, 1, 0}));
  EXPECT_EQ(s->loss_tokens, 1);
}

TEST(SequenceTest, SegmentFormTruncationKeepsTheRulesAndNeedsALossToken) {
  // 0:1 1:10 2:20(loss) 3-5:image 6:21(loss); a cut at 5 drops the whole image.
  const std::vector<Segment> segments = {Text({1, 10}), Loss({20}), Image(), Loss({21})};
  absl::StatusOr<TokenSequence> s =
      BuildTokenSequence(segments, Options(3, 5, OverlongPolicy::kTruncate));
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->input_ids, (std::vector<int32_t>{1, 10, 20}));
  EXPECT_EQ(s->labels, (std::vector<int32_t>{X, 20, X}));
  EXPECT_TRUE(s->truncated);
  absl::StatusOr<TokenSequence> none = BuildTokenSequence({Text({1, 10, 11, 12}), Loss({20})},
                                                          Options(3, 4, OverlongPolicy::kTruncate));
  ASSERT_EQ(none.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(none.status().message()), HasSubstr("leaves no response token"));
  absl::StatusOr<TokenSequence> empty =
      BuildTokenSequence({Text({1, 10})}, Options(3, 8, OverlongPolicy::kReject));
  ASSERT_EQ(empty.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(empty.status().message()), HasSubstr("no response token to train on"));
}

}  // namespace
}  // namespace hetpar::data
