#include "common/data/sequence.h"

#include <zlib.h>

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace hetpar::data {
namespace {

// One position before labels are derived.
struct Position {
  int32_t id;
  int32_t image;  // image index, or -1 for text
  bool loss;      // a token of a loss segment: a target
};

}  // namespace

absl::StatusOr<TokenSequence> BuildTokenSequence(const std::vector<Segment>& prompt,
                                                 const std::vector<Segment>& response,
                                                 const SequenceOptions& options) {
  std::vector<Segment> segments;
  segments.reserve(prompt.size() + response.size() + 2);
  if (options.bos_id >= 0) segments.push_back(Segment{false, {options.bos_id}, false});
  for (const Segment& s : prompt) segments.push_back(Segment{s.is_image, s.ids, false});
  for (const Segment& s : response) segments.push_back(Segment{s.is_image, s.ids, !s.is_image});
  if (options.eos_id >= 0) segments.push_back(Segment{false, {options.eos_id}, true});
  return BuildTokenSequence(segments, options);
}

absl::StatusOr<TokenSequence> BuildTokenSequence(const std::vector<Segment>& segments,
                                                 const SequenceOptions& options) {
  if (options.tokens_per_image <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("tokens_per_image=", options.tokens_per_image, "; expected >= 1"));
  }
  if (options.seq_len < 2) {
    return absl::InvalidArgumentError(absl::StrCat("seq_len=", options.seq_len, "; expected >= 2"));
  }
  if (options.image_token_id < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("image_token_id=", options.image_token_id, "; expected >= 0"));
  }
  // The length first: a sample far past seq_len (a line of many placeholders) is refused or cut
  // without expanding all of it.
  int64_t full_length = 0;
  int64_t images = 0;
  for (const Segment& segment : segments) {
    if (segment.is_image) {
      full_length += options.tokens_per_image;
      ++images;
    } else {
      full_length += static_cast<int64_t>(segment.ids.size());
    }
  }
  if (full_length > options.seq_len && options.overlong == OverlongPolicy::kReject) {
    const int64_t image_positions = images * options.tokens_per_image;
    return absl::InvalidArgumentError(absl::StrCat(
        "sequence has ", full_length, " tokens (", full_length - image_positions, " text + ",
        images, " images x ", options.tokens_per_image, ") > llm.model.seq_len=", options.seq_len,
        "; shorten the text, or set data.overlong: truncate"));
  }
  // One position past seq_len at most: enough to see whether the cut goes through an image.
  const size_t build = static_cast<size_t>(std::min<int64_t>(full_length, options.seq_len + 1));
  std::vector<Position> positions;
  positions.reserve(build);
  int32_t image = 0;
  for (const Segment& segment : segments) {
    if (positions.size() >= build) break;
    if (segment.is_image) {
      for (int32_t k = 0; k < options.tokens_per_image && positions.size() < build; ++k) {
        positions.push_back({options.image_token_id, image, false});
      }
      ++image;
    } else {
      for (size_t k = 0; k < segment.ids.size() && positions.size() < build; ++k) {
        positions.push_back({segment.ids[k], -1, segment.loss});
      }
    }
  }

  TokenSequence seq;
  if (full_length > options.seq_len) {
    size_t keep = static_cast<size_t>(options.seq_len);
    // Never cut through an image block: drop a partial block and everything after it.
    if (positions[keep - 1].image >= 0 && positions[keep].image == positions[keep - 1].image) {
      const int32_t cut_image = positions[keep - 1].image;
      while (keep > 0 && positions[keep - 1].image == cut_image) --keep;
    }
    positions.resize(keep);
    seq.truncated = true;
  }

  const size_t n = positions.size();
  seq.input_ids.resize(n);
  seq.labels.assign(n, kIgnoreLabel);
  seq.loss_mask.assign(n, 0);
  int32_t last_image = -1;
  for (size_t i = 0; i < n; ++i) {
    seq.input_ids[i] = positions[i].id;
    if (positions[i].image >= 0) {
      if (positions[i].image != last_image) {
        seq.image_offsets.push_back(static_cast<int32_t>(i));
        last_image = positions[i].image;
      }
    } else {
      ++seq.text_tokens;
    }
    if (i + 1 < n && positions[i + 1].loss) {
      seq.labels[i] = positions[i + 1].id;
      seq.loss_mask[i] = 1;
      ++seq.loss_tokens;
    }
  }
  if (seq.loss_tokens == 0) {
    if (seq.truncated) {
      return absl::InvalidArgumentError(absl::StrCat(
          "truncating the ", full_length, "-token sequence to llm.model.seq_len=", options.seq_len,
          " leaves no response token to train on"));
    }
    return absl::InvalidArgumentError(
        "the sample has no response token to train on (empty response text and no eos or "
        "end-of-turn marker)");
  }
  return seq;
}

uint32_t TokenSequence::Checksum() const {
  // Run for every sample a step loads: the ids go through a small buffer, not a copy of them all.
  uLong crc = 0;
  Bytef block[1024];
  size_t used = 0;
  for (int32_t id : input_ids) {
    const auto u = static_cast<uint32_t>(id);
    for (int shift = 0; shift < 32; shift += 8) block[used++] = static_cast<Bytef>(u >> shift);
    if (used == sizeof(block)) {
      crc = ::crc32(crc, block, static_cast<uInt>(used));
      used = 0;
    }
  }
  crc = ::crc32(crc, block, static_cast<uInt>(used));
  crc = ::crc32(crc, loss_mask.data(), static_cast<uInt>(loss_mask.size()));
  const auto checksum = static_cast<uint32_t>(crc);
  return checksum == 0 ? 1 : checksum;
}

}  // namespace hetpar::data
