#include "common/plan/message_header.h"

#include <random>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hetpar::plan {
namespace {

using ::testing::HasSubstr;

MessageHeader Example() {
  MessageHeader h;
  h.direction = Direction::kBackward;
  h.step = 12;
  h.generation = 3;
  h.attempt = 9;
  h.wave = 5;
  h.src_rank = 40;
  h.dst_rank = 7;
  h.row_bytes = 256;
  h.blocks = {{1001, 0, 0, 16, 0}, {1001, 1, 4, 12, 16}, {77, 2, 0, 16, 28}};
  return h;
}

TEST(MessageHeaderTest, RoundTripsEveryField) {
  const MessageHeader h = Example();
  const std::string bytes = EncodeHeader(h);
  EXPECT_EQ(static_cast<int64_t>(bytes.size()), EncodedHeaderSize(3));
  // Magic "HPBH", version 2, direction 1, then step 12, generation 3 and attempt 9.
  EXPECT_EQ(bytes.substr(0, 4), "HPBH");
  EXPECT_EQ(bytes[4], 2);
  EXPECT_EQ(bytes[5], 0);
  EXPECT_EQ(bytes[6], 1);
  EXPECT_EQ(bytes[8], 12);
  EXPECT_EQ(bytes[16], 3);
  EXPECT_EQ(bytes[24], 9);
  auto back = DecodeHeader(bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(*back == h);
  EXPECT_EQ(back->payload_rows(), 44);
  EXPECT_EQ(back->payload_bytes(), 44 * 256);
  EXPECT_EQ(back->blocks[1].sample_id, 1001);
  EXPECT_EQ(back->blocks[1].row_begin, 4);
  EXPECT_EQ(back->blocks[2].offset, 28);
}

TEST(MessageHeaderTest, RandomHeadersRoundTrip) {
  std::mt19937_64 rng(5);
  for (int i = 0; i < 500; ++i) {
    MessageHeader h;
    h.direction = rng() % 2 ? Direction::kForward : Direction::kBackward;
    h.step = rng() % 100000;
    h.generation = rng() % 50;
    h.attempt = rng() % 1000;
    h.wave = rng() % 1000;
    h.src_rank = rng() % 4096;
    h.dst_rank = rng() % 4096;
    h.row_bytes = 1 + rng() % 65536;
    h.blocks.resize(rng() % 20);
    for (auto& b : h.blocks) {
      b = {static_cast<int64_t>(rng() >> 1), static_cast<int64_t>(rng() % 16),
           static_cast<int64_t>(rng() % 4096), 1 + static_cast<int64_t>(rng() % 4096),
           static_cast<int64_t>(rng() % 100000)};
    }
    auto back = DecodeHeader(EncodeHeader(h));
    ASSERT_TRUE(back.ok()) << back.status();
    ASSERT_TRUE(*back == h) << DescribeHeader(h);
  }
}

TEST(MessageHeaderTest, RejectsDamagedBytes) {
  const std::string good = EncodeHeader(Example());
  // Every truncation fails with a message naming the size.
  for (size_t n = 0; n < good.size(); ++n) {
    auto r = DecodeHeader(good.substr(0, n));
    ASSERT_FALSE(r.ok()) << n;
  }
  EXPECT_THAT(std::string(DecodeHeader(good.substr(0, 10)).status().message()),
              HasSubstr("truncated"));
  std::string extra = good + "x";
  EXPECT_THAT(std::string(DecodeHeader(extra).status().message()), HasSubstr("expected 188"));
  std::string magic = good;
  magic[0] = 'X';
  EXPECT_THAT(std::string(DecodeHeader(magic).status().message()), HasSubstr("magic"));
  std::string version = good;
  version[4] = 1;
  EXPECT_THAT(std::string(DecodeHeader(version).status().message()),
              HasSubstr("version 1 at byte 4; this build reads version 2"));
  std::string direction = good;
  direction[6] = 9;
  EXPECT_THAT(std::string(DecodeHeader(direction).status().message()), HasSubstr("direction 9"));
  MessageHeader empty_block = Example();
  empty_block.blocks[0].rows = 0;
  EXPECT_THAT(std::string(DecodeHeader(EncodeHeader(empty_block)).status().message()),
              HasSubstr("no rows"));
}

TEST(MessageHeaderTest, ValidationNamesTheFieldAndBothMessages) {
  const MessageHeader plan = Example();
  EXPECT_TRUE(ValidateHeader(plan, plan).ok());

  MessageHeader stale = plan;
  stale.generation = 2;
  absl::Status s = ValidateHeader(stale, plan);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("generation is 2 in the header but 3 in the plan"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("header: backward step 12 generation 2"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("plan: backward step 12 generation 3"));

  // A message of an aborted attempt of the same step and generation.
  MessageHeader late = plan;
  late.attempt = 8;
  s = ValidateHeader(late, plan);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()), HasSubstr("attempt is 8 in the header but 9 in the plan"));

  MessageHeader moved = plan;
  moved.blocks[1].offset = 17;
  s = ValidateHeader(moved, plan);
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("block 1 is sample 1001 image 1 rows [4, 16) at offset 17 in the header "
                        "but sample 1001 image 1 rows [4, 16) at offset 16 in the plan"));

  MessageHeader shorter = plan;
  shorter.blocks.pop_back();
  s = ValidateHeader(shorter, plan);
  EXPECT_THAT(std::string(s.message()), HasSubstr("lists 2 blocks but the plan 3"));

  MessageHeader wave = plan;
  wave.wave = 6;
  EXPECT_THAT(std::string(ValidateHeader(wave, plan).message()),
              HasSubstr("wave is 6 in the header but 5 in the plan"));
}

}  // namespace
}  // namespace hetpar::plan
