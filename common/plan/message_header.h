// The header of one boundary message, and its check against the plan.
//
// Every boundary transfer (boundary_plan.h) travels as one message: this header, then the
// payload, the pieces' rows back to back (rows x row_bytes bytes). A receiver decodes the
// header, builds the header its own plan expects for (direction, wave, source) and validates one
// against the other before it touches the payload, so a message from another step, generation,
// attempt, wave or plan is rejected loudly instead of being spliced into the wrong rows.
//
// Wire format, version 2, all integers little-endian:
//   u32 magic "HPBH" (0x48425048) | u16 version | u8 direction (0 forward, 1 backward) | u8 0
//   i64 step | i64 generation | i64 attempt | i64 wave | i64 src_rank | i64 dst_rank |
//   i64 row_bytes
//   u32 block count, then per block: i64 sample_id | i64 image | i64 row_begin | i64 rows |
//   i64 offset (the first row in the receiver's buffer)
#ifndef HETPAR_COMMON_PLAN_MESSAGE_HEADER_H_
#define HETPAR_COMMON_PLAN_MESSAGE_HEADER_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace hetpar::plan {

inline constexpr uint32_t kBoundaryHeaderMagic = 0x48425048;  // "HPBH" in little-endian bytes
inline constexpr uint16_t kBoundaryHeaderVersion = 2;

enum class Direction : uint8_t { kForward = 0, kBackward = 1 };

std::string_view DirectionName(Direction direction);  // "forward" / "backward"

// One piece as the receiver sees it.
struct HeaderBlock {
  int64_t sample_id = 0;  // dataset id of the sample (not its batch position)
  int64_t image = 0;      // image index within the sample
  int64_t row_begin = 0;  // first row of the block carried
  int64_t rows = 0;
  int64_t offset = 0;  // first row in the receiver's buffer
};

bool operator==(const HeaderBlock& a, const HeaderBlock& b);

struct MessageHeader {
  uint16_t version = kBoundaryHeaderVersion;
  Direction direction = Direction::kForward;
  int64_t step = 0;
  int64_t generation = 0;
  // The coordinator's id of the step attempt (StepPlan): a step aborted and planned again is a
  // new attempt, so a late message of the aborted one never passes for the retry's.
  int64_t attempt = 0;
  int64_t wave = 0;
  int64_t src_rank = 0;
  int64_t dst_rank = 0;
  int64_t row_bytes = 0;
  std::vector<HeaderBlock> blocks;

  int64_t payload_rows() const;
  int64_t payload_bytes() const { return payload_rows() * row_bytes; }
};

bool operator==(const MessageHeader& a, const MessageHeader& b);

// Bytes of an encoded header with `blocks` blocks.
int64_t EncodedHeaderSize(int64_t blocks);

std::string EncodeHeader(const MessageHeader& header);

// InvalidArgument (naming the byte offset and what was expected) for a truncated buffer, a
// wrong magic, an unknown version or direction, trailing bytes, or negative counts.
absl::StatusOr<MessageHeader> DecodeHeader(std::string_view bytes);

// OK when `received` equals `expected`. Otherwise FailedPrecondition naming the first field that
// differs with both values, and both messages ("forward step 3 wave 1 rank 0 -> 4").
absl::Status ValidateHeader(const MessageHeader& received, const MessageHeader& expected);

// "forward step 3 generation 0 wave 1 rank 0 -> 4, 2 blocks, 96 rows".
std::string DescribeHeader(const MessageHeader& header);

}  // namespace hetpar::plan

#endif  // HETPAR_COMMON_PLAN_MESSAGE_HEADER_H_
