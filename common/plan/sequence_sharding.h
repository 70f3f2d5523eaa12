// How one sample's token sequence is split over the LLM's context-parallel (CP) and
// sequence-parallel (SP) ranks. This is the one definition the boundary plan and the LLM code
// both use.
//
// A sample's input is its token sequence padded to `seq_len` positions (llm.model.seq_len).
//
// Context parallelism, cp > 1 (load-balanced for causal attention): the sequence is cut into
// 2*cp equal chunks of seq_len / (2*cp) positions; CP rank i owns chunk i and chunk 2*cp-1-i,
// in that order. Its local sequence is the two chunks concatenated (seq_len / cp positions), so
// every CP rank gets one cheap early chunk and one expensive late chunk. With cp = 1 the local
// sequence is the whole sequence.
//
// Sequence parallelism (sequence_parallel = true): each CP rank's local sequence is further cut
// into tp equal contiguous pieces; TP rank t owns piece t. Without it every TP rank of a CP rank
// holds the whole local sequence.
//
// Every position belongs to exactly one CP rank and, under SP, to exactly one (cp, tp) rank.
// Local order is global position order (chunk i comes before chunk 2*cp-1-i).
#ifndef HETPAR_COMMON_PLAN_SEQUENCE_SHARDING_H_
#define HETPAR_COMMON_PLAN_SEQUENCE_SHARDING_H_

#include <cstdint>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace hetpar::plan {

// Positions [begin, end) of a sequence.
struct PositionRange {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end - begin; }
};

bool operator==(const PositionRange& a, const PositionRange& b);

// The two chunk indices (of 2*cp) that CP rank `cp_rank` owns: {cp_rank, 2*cp-1-cp_rank}.
std::pair<int64_t, int64_t> LoadBalancedChunks(int64_t cp, int64_t cp_rank);

class SequenceSharding {
 public:
  // A maximal run of positions with one owner.
  struct Segment {
    int64_t begin = 0;  // global positions [begin, end)
    int64_t end = 0;
    int64_t cp_rank = 0;      // CP rank that owns them
    int64_t tp_rank = -1;     // SP: the TP rank that owns them; -1: every TP rank of cp_rank
    int64_t local_begin = 0;  // index of `begin` in the owner's local sequence
  };

  // Needs seq_len >= 1; seq_len divisible by 2*cp when cp > 1; and, with sequence_parallel,
  // the local length seq_len / cp divisible by tp. Errors name the values and the rule.
  static absl::StatusOr<SequenceSharding> Create(int64_t seq_len, int64_t cp, int64_t tp,
                                                 bool sequence_parallel);

  int64_t seq_len() const { return seq_len_; }
  int64_t cp() const { return cp_; }
  int64_t tp() const { return tp_; }
  bool sequence_parallel() const { return sequence_parallel_; }
  // Positions one rank holds: seq_len / cp, divided by tp under SP.
  int64_t shard_length() const {
    return sequence_parallel_ ? seq_len_ / cp_ / tp_ : seq_len_ / cp_;
  }

  // Global positions owned by (cp_rank, tp_rank), increasing; their concatenation is that
  // rank's local sequence. Without SP the result does not depend on tp_rank.
  std::vector<PositionRange> Ranges(int64_t cp_rank, int64_t tp_rank) const;

  // All owner runs, covering [0, seq_len) in position order.
  const std::vector<Segment>& segments() const { return segments_; }
  // Index into segments() of the run holding `position` (0 <= position < seq_len).
  int64_t SegmentOf(int64_t position) const;

 private:
  SequenceSharding() = default;

  int64_t seq_len_ = 0;
  int64_t cp_ = 1;
  int64_t tp_ = 1;
  bool sequence_parallel_ = false;
  std::vector<Segment> segments_;
};

}  // namespace hetpar::plan

#endif  // HETPAR_COMMON_PLAN_SEQUENCE_SHARDING_H_
