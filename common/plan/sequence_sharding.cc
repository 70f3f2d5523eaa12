#include "common/plan/sequence_sharding.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace hetpar::plan {

bool operator==(const PositionRange& a, const PositionRange& b) {
  return a.begin == b.begin && a.end == b.end;
}

std::pair<int64_t, int64_t> LoadBalancedChunks(int64_t cp, int64_t cp_rank) {
  return {cp_rank, 2 * cp - 1 - cp_rank};
}

absl::StatusOr<SequenceSharding> SequenceSharding::Create(int64_t seq_len, int64_t cp, int64_t tp,
                                                          bool sequence_parallel) {
  if (seq_len < 1 || cp < 1 || tp < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("sequence sharding needs seq_len, cp, tp >= 1; "
                     "got seq_len=",
                     seq_len, " cp=", cp, " tp=", tp));
  }
  if (cp > 1 && seq_len % (2 * cp) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("seq_len=", seq_len, " is not a multiple of 2 x cp=", 2 * cp,
                     " (load-balanced causal chunks: CP rank i owns chunks i and 2cp-1-i)"));
  }
  if (sequence_parallel && (seq_len / cp) % tp != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("seq_len=", seq_len, " / cp=", cp, " = ", seq_len / cp,
                     " positions per CP rank is not a multiple of tp=", tp,
                     " (sequence parallelism splits them evenly over the TP ranks)"));
  }
  SequenceSharding sharding;
  sharding.seq_len_ = seq_len;
  sharding.cp_ = cp;
  sharding.tp_ = tp;
  sharding.sequence_parallel_ = sequence_parallel;

  std::vector<Segment> pieces;
  const int64_t chunk = cp > 1 ? seq_len / (2 * cp) : seq_len;
  const int64_t piece = sequence_parallel ? seq_len / cp / tp : seq_len / cp;
  for (int64_t c = 0; c < cp; ++c) {
    std::vector<PositionRange> local;  // the CP rank's local sequence as global ranges
    if (cp > 1) {
      const auto [first, second] = LoadBalancedChunks(cp, c);
      local.push_back({first * chunk, (first + 1) * chunk});
      local.push_back({second * chunk, (second + 1) * chunk});
    } else {
      local.push_back({0, seq_len});
    }
    int64_t local_pos = 0;
    for (const PositionRange& range : local) {
      int64_t pos = range.begin;
      while (pos < range.end) {
        const int64_t owner_tp = sequence_parallel ? local_pos / piece : -1;
        const int64_t piece_end_local =
            sequence_parallel ? (owner_tp + 1) * piece : local_pos + range.end - pos;
        const int64_t take = std::min(range.end - pos, piece_end_local - local_pos);
        pieces.push_back({pos, pos + take, c, owner_tp,
                          sequence_parallel ? local_pos - owner_tp * piece : local_pos});
        pos += take;
        local_pos += take;
      }
    }
  }
  std::sort(pieces.begin(), pieces.end(),
            [](const Segment& a, const Segment& b) { return a.begin < b.begin; });
  for (const Segment& s : pieces) {
    if (!sharding.segments_.empty()) {
      Segment& last = sharding.segments_.back();
      if (last.end == s.begin && last.cp_rank == s.cp_rank && last.tp_rank == s.tp_rank &&
          last.local_begin + (last.end - last.begin) == s.local_begin) {
        last.end = s.end;
        continue;
      }
    }
    sharding.segments_.push_back(s);
  }
  return sharding;
}

std::vector<PositionRange> SequenceSharding::Ranges(int64_t cp_rank, int64_t tp_rank) const {
  std::vector<PositionRange> ranges;
  for (const Segment& s : segments_) {
    if (s.cp_rank != cp_rank) continue;
    if (s.tp_rank >= 0 && s.tp_rank != tp_rank) continue;
    if (!ranges.empty() && ranges.back().end == s.begin) {
      ranges.back().end = s.end;
    } else {
      ranges.push_back({s.begin, s.end});
    }
  }
  return ranges;
}

int64_t SequenceSharding::SegmentOf(int64_t position) const {
  auto it = std::upper_bound(segments_.begin(), segments_.end(), position,
                             [](int64_t p, const Segment& s) { return p < s.begin; });
  return static_cast<int64_t>(it - segments_.begin()) - 1;
}

}  // namespace hetpar::plan
