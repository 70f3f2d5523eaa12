#include "common/plan/message_header.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace hetpar::plan {
namespace {

constexpr int64_t kFixedBytes = 4 + 2 + 1 + 1 + 7 * 8 + 4;
constexpr int64_t kBlockBytes = 5 * 8;

void PutUnsigned(std::string* out, uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) out->push_back(static_cast<char>((value >> (8 * i)) & 0xff));
}

class Reader {
 public:
  explicit Reader(std::string_view bytes) : bytes_(bytes) {}

  absl::Status Unsigned(int bytes, const char* what, uint64_t* value) {
    if (static_cast<int64_t>(bytes_.size()) - position_ < bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("boundary message header is truncated: ", bytes_.size(), " bytes, but ",
                       what, " needs bytes [", position_, ", ", position_ + bytes, ")"));
    }
    uint64_t v = 0;
    for (int i = 0; i < bytes; ++i) {
      v |= static_cast<uint64_t>(static_cast<unsigned char>(bytes_[position_ + i])) << (8 * i);
    }
    position_ += bytes;
    *value = v;
    return absl::OkStatus();
  }

  absl::Status Signed(const char* what, int64_t* value) {
    uint64_t v = 0;
    if (absl::Status s = Unsigned(8, what, &v); !s.ok()) return s;
    *value = static_cast<int64_t>(v);
    return absl::OkStatus();
  }

  int64_t position() const { return position_; }
  int64_t size() const { return static_cast<int64_t>(bytes_.size()); }

 private:
  std::string_view bytes_;
  int64_t position_ = 0;
};

std::string DescribeBlock(const HeaderBlock& b) {
  return absl::StrCat("sample ", b.sample_id, " image ", b.image, " rows [", b.row_begin, ", ",
                      b.row_begin + b.rows, ") at offset ", b.offset);
}

}  // namespace

std::string_view DirectionName(Direction direction) {
  switch (direction) {
    case Direction::kForward:
      return "forward";
    case Direction::kBackward:
      return "backward";
  }
  return "unknown";
}

bool operator==(const HeaderBlock& a, const HeaderBlock& b) {
  return a.sample_id == b.sample_id && a.image == b.image && a.row_begin == b.row_begin &&
         a.rows == b.rows && a.offset == b.offset;
}

bool operator==(const MessageHeader& a, const MessageHeader& b) {
  return a.version == b.version && a.direction == b.direction && a.step == b.step &&
         a.generation == b.generation && a.attempt == b.attempt && a.wave == b.wave &&
         a.src_rank == b.src_rank && a.dst_rank == b.dst_rank && a.row_bytes == b.row_bytes &&
         a.blocks == b.blocks;
}

int64_t MessageHeader::payload_rows() const {
  int64_t rows = 0;
  for (const HeaderBlock& b : blocks) rows += b.rows;
  return rows;
}

int64_t EncodedHeaderSize(int64_t blocks) { return kFixedBytes + blocks * kBlockBytes; }

std::string EncodeHeader(const MessageHeader& h) {
  std::string out;
  out.reserve(EncodedHeaderSize(static_cast<int64_t>(h.blocks.size())));
  PutUnsigned(&out, kBoundaryHeaderMagic, 4);
  PutUnsigned(&out, h.version, 2);
  PutUnsigned(&out, static_cast<uint8_t>(h.direction), 1);
  PutUnsigned(&out, 0, 1);
  for (int64_t v : {h.step, h.generation, h.attempt, h.wave, h.src_rank, h.dst_rank, h.row_bytes}) {
    PutUnsigned(&out, static_cast<uint64_t>(v), 8);
  }
  PutUnsigned(&out, h.blocks.size(), 4);
  for (const HeaderBlock& b : h.blocks) {
    for (int64_t v : {b.sample_id, b.image, b.row_begin, b.rows, b.offset}) {
      PutUnsigned(&out, static_cast<uint64_t>(v), 8);
    }
  }
  return out;
}

absl::StatusOr<MessageHeader> DecodeHeader(std::string_view bytes) {
  Reader r(bytes);
  uint64_t magic = 0;
  uint64_t version = 0;
  uint64_t direction = 0;
  uint64_t reserved = 0;
  if (absl::Status s = r.Unsigned(4, "the magic", &magic); !s.ok()) return s;
  if (magic != kBoundaryHeaderMagic) {
    return absl::InvalidArgumentError(absl::StrCat("boundary message header: magic 0x",
                                                   absl::Hex(magic), " at byte 0; expected 0x",
                                                   absl::Hex(kBoundaryHeaderMagic), " (\"HPBH\")"));
  }
  if (absl::Status s = r.Unsigned(2, "the version", &version); !s.ok()) return s;
  if (version != kBoundaryHeaderVersion) {
    return absl::InvalidArgumentError(absl::StrCat("boundary message header: version ", version,
                                                   " at byte 4; this build reads version ",
                                                   kBoundaryHeaderVersion));
  }
  if (absl::Status s = r.Unsigned(1, "the direction", &direction); !s.ok()) return s;
  if (direction > 1) {
    return absl::InvalidArgumentError(absl::StrCat("boundary message header: direction ", direction,
                                                   " at byte 6; expected 0 (forward) or 1 "
                                                   "(backward)"));
  }
  if (absl::Status s = r.Unsigned(1, "the reserved byte", &reserved); !s.ok()) return s;
  MessageHeader h;
  h.version = static_cast<uint16_t>(version);
  h.direction = static_cast<Direction>(direction);
  for (auto [field, name] : {std::pair<int64_t*, const char*>{&h.step, "the step"},
                             {&h.generation, "the generation"},
                             {&h.attempt, "the attempt"},
                             {&h.wave, "the wave"},
                             {&h.src_rank, "the source rank"},
                             {&h.dst_rank, "the destination rank"},
                             {&h.row_bytes, "the row size"}}) {
    if (absl::Status s = r.Signed(name, field); !s.ok()) return s;
  }
  uint64_t count = 0;
  if (absl::Status s = r.Unsigned(4, "the block count", &count); !s.ok()) return s;
  const int64_t expected_size = EncodedHeaderSize(static_cast<int64_t>(count));
  if (r.size() != expected_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "boundary message header: ", r.size(), " bytes for ", count, " blocks; expected ",
        expected_size, " (", kFixedBytes, " + ", count, " x ", kBlockBytes, ")"));
  }
  h.blocks.resize(count);
  for (HeaderBlock& b : h.blocks) {
    for (int64_t* field : {&b.sample_id, &b.image, &b.row_begin, &b.rows, &b.offset}) {
      if (absl::Status s = r.Signed("a block", field); !s.ok()) return s;
    }
    if (b.image < 0 || b.row_begin < 0 || b.rows < 1 || b.offset < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("boundary message header: block ", DescribeBlock(b),
                       " has a negative index or no rows; expected image, row_begin, offset >= 0 "
                       "and rows >= 1"));
    }
  }
  if (h.row_bytes < 1 || h.wave < 0 || h.step < 0 || h.attempt < 0 || h.src_rank < 0 ||
      h.dst_rank < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "boundary message header: ", DescribeHeader(h),
        " has a negative step, attempt, wave or rank or row_bytes < 1 (row_bytes=", h.row_bytes,
        ")"));
  }
  return h;
}

std::string DescribeHeader(const MessageHeader& h) {
  return absl::StrCat(std::string(DirectionName(h.direction)), " step ", h.step, " generation ",
                      h.generation, " attempt ", h.attempt, " wave ", h.wave, " rank ", h.src_rank,
                      " -> ", h.dst_rank, ", ", h.blocks.size(), " blocks, ", h.payload_rows(),
                      " rows of ", h.row_bytes, " bytes");
}

absl::Status ValidateHeader(const MessageHeader& received, const MessageHeader& expected) {
  if (received == expected) return absl::OkStatus();
  std::string difference;
  auto field = [&](const char* name, int64_t got, int64_t want) {
    if (difference.empty() && got != want) {
      difference = absl::StrCat(name, " is ", got, " in the header but ", want, " in the plan");
    }
  };
  field("version", received.version, expected.version);
  field("direction", static_cast<int64_t>(received.direction),
        static_cast<int64_t>(expected.direction));
  field("step", received.step, expected.step);
  field("generation", received.generation, expected.generation);
  field("attempt", received.attempt, expected.attempt);
  field("wave", received.wave, expected.wave);
  field("source rank", received.src_rank, expected.src_rank);
  field("destination rank", received.dst_rank, expected.dst_rank);
  field("row_bytes", received.row_bytes, expected.row_bytes);
  if (difference.empty()) {
    const size_t n = std::min(received.blocks.size(), expected.blocks.size());
    for (size_t i = 0; i < n && difference.empty(); ++i) {
      if (!(received.blocks[i] == expected.blocks[i])) {
        difference =
            absl::StrCat("block ", i, " is ", DescribeBlock(received.blocks[i]),
                         " in the header but ", DescribeBlock(expected.blocks[i]), " in the plan");
      }
    }
    if (difference.empty()) {
      difference = absl::StrCat("the header lists ", received.blocks.size(),
                                " blocks but the plan ", expected.blocks.size());
    }
  }
  return absl::FailedPreconditionError(absl::StrCat("boundary message rejected: ", difference,
                                                    " (header: ", DescribeHeader(received),
                                                    "; plan: ", DescribeHeader(expected), ")"));
}

}  // namespace hetpar::plan
