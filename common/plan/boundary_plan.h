// The boundary plan: for one step, which encoder rank sends which image embedding rows to which
// LLM rank in each wave, and how the gradients of those rows come back.
//
// Unit of routing: the block, the embedding rows of one image (tokens_per_image rows, each
// llm hidden wide, `row_bytes` bytes). A transfer is one message: all block rows one rank sends
// to one other rank in one wave. A transfer carries pieces; a piece is rows
// [row_begin, row_begin + rows) of one block, read at `src_offset` in the sender's buffer and
// written at `dst_offset` in the receiver's buffer. The payload is the pieces' rows back to back
// in piece order.
//
// Buffers (the row conventions every runtime uses):
//  * Encoder side: the job buffer of encoder replica e in wave m, the projector output of the
//    job's images back to back in EncoderJob::images order (EncoderJob::row_offsets). It is
//    identical on every TP rank of the replica.
//  * LLM side: the image-row buffer of an LLM rank in wave m holds, for each sample of its
//    replica's microbatch in microbatch order, the sample's image rows whose sequence positions
//    the rank owns (sequence_sharding.h), in increasing position order (= image order, then
//    row order). Only ranks of the first pipeline stage (pp = 0) have one. Without sequence
//    parallelism every TP rank of a (replica, CP rank) owns the same positions and so has the
//    same buffer; under SP each rank owns its own slice.
//
// Forward (encoder -> LLM):
//  * Source spreading: each block is sent by exactly one TP rank of the encoder replica that
//    encoded it (`block_sender`). Blocks are taken wave by wave, largest first, each to the TP
//    rank with the fewest bytes sent so far in the step. Bound (Graham's list-scheduling
//    argument): let S be the replica's bytes in the step, b the largest block's bytes and t
//    the replica's tp. When rank r receives the last block x that it sends, its load is the
//    minimum over the t ranks, so at most (S - x) / t; it ends at most (S - x) / t + x
//    <= S / t + (1 - 1/t) * b. Hence every TP rank sends at most
//        mean + (1 - 1/t) * b,   i.e.  max / mean <= 1 + (t - 1) * b / S,
//    which is <= 1.25 whenever the replica sends at least 4 * (t - 1) largest blocks' worth.
//  * Landing with sequence parallelism: each row goes straight to the one (cp, tp) rank owning
//    its position.
//  * Landing without sequence parallelism: the rows of a block that fall in CP rank c's shard
//    (all rows when cp = 1) are a piece that lands on one TP rank of (replica, c, pp 0), the one
//    with the fewest rows received so far (same bound as above over the group), and a share step
//    (`llm_shares`) then copies every landed segment to the other TP ranks of that group.
//
// Backward (LLM -> encoder): the exact transpose. backward transfers are the forward ones with
// source and destination (and offsets) swapped: every piece's gradient returns to the rank that
// sent the rows. A block whose rows were split over several CP/SP ranks comes back as several
// pieces whose row ranges partition the block; the receiver zeroes its job-gradient buffer and
// adds each piece at its dst_offset, so every row is summed exactly once. Without SP the LLM's
// TP ranks hold identical gradients of their buffer (the TP all-reduce of the first layer's
// input gradient) and only the lander sends them back. Then a share step (`encoder_shares`)
// copies each TP rank's received gradient rows to the other TP ranks of the encoder replica.
//
// Share steps exist only for groups of more than one rank. A share step's segments partition
// its buffer [0, buffer_rows); the holder of a segment has those rows after the transfers and
// sends them to every other rank of the group.
#ifndef HETPAR_COMMON_PLAN_BOUNDARY_PLAN_H_
#define HETPAR_COMMON_PLAN_BOUNDARY_PLAN_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "common/plan/layout.h"
#include "common/plan/sample.h"
#include "common/plan/schedule.h"

namespace hetpar::plan {

struct BlockPiece {
  int64_t sample = 0;      // batch index of the sample
  int64_t image = 0;       // image index within the sample
  int64_t row_begin = 0;   // first row of the block carried
  int64_t rows = 0;        // rows carried
  int64_t src_offset = 0;  // first row in the sender's buffer
  int64_t dst_offset = 0;  // first row in the receiver's buffer
};

bool operator==(const BlockPiece& a, const BlockPiece& b);

// One message: every piece `src_rank` sends `dst_rank` in `wave`, in payload order.
struct Transfer {
  int64_t wave = 0;
  int64_t src_rank = 0;
  int64_t dst_rank = 0;
  int64_t rows = 0;  // sum of the pieces' rows
  std::vector<BlockPiece> pieces;
};

bool operator==(const Transfer& a, const Transfer& b);

// The same message in the other direction: ranks and offsets swapped, pieces in the same order.
Transfer Transpose(const Transfer& transfer);

struct ShareSegment {
  int64_t holder_rank = 0;  // the rank that has rows [offset, offset + rows) and sends them
  int64_t offset = 0;
  int64_t rows = 0;
};

bool operator==(const ShareSegment& a, const ShareSegment& b);

// Copies of one buffer inside a TP group: after it every rank of `ranks` has all buffer_rows.
struct ShareStep {
  Module module = Module::kLlm;  // kLlm: forward image rows; kEncoder: backward gradients
  int64_t wave = 0;
  int64_t replica = 0;
  int64_t cp_rank = 0;         // LLM CP coordinate of the group (0 for the encoder)
  std::vector<int64_t> ranks;  // the TP group, in tp order
  int64_t buffer_rows = 0;
  std::vector<ShareSegment> segments;  // increasing offsets, partitioning [0, buffer_rows)
};

bool operator==(const ShareStep& a, const ShareStep& b);

struct BoundaryPlanOptions {
  int64_t seq_len = 0;    // llm.model.seq_len: the padded sequence the LLM shards
  int64_t row_bytes = 0;  // bytes of one embedding row: llm hidden x dtype size
};

struct BoundaryPlan {
  int64_t waves = 0;
  int64_t seq_len = 0;
  int64_t row_bytes = 0;
  int64_t llm_rank_offset = 0;
  int64_t llm_first_stage_ranks = 0;  // llm dp * tp * cp

  std::vector<Transfer> forward;          // sorted by (src_rank, wave, dst_rank)
  std::vector<int64_t> forward_by_dst;    // indices into forward, sorted by (dst_rank, wave, src)
  std::vector<Transfer> backward;         // transposes of forward, sorted by (src_rank, wave, dst)
  std::vector<int64_t> backward_by_dst;   // indices into backward, sorted by (dst_rank, wave, src)
  std::vector<ShareStep> llm_shares;      // sorted by (replica, cp_rank, wave); none under SP
  std::vector<ShareStep> encoder_shares;  // sorted by (replica, wave); none when encoder tp = 1
  // Per flat image (EncoderAssignment numbering): the encoder rank that sends its block and
  // receives its gradient.
  std::vector<int64_t> block_sender;
  // Image-row buffer sizes: entry wave * llm_first_stage_ranks + (rank - llm_rank_offset) for
  // each first-stage LLM rank.
  std::vector<int64_t> llm_buffer_rows;

  // Rows in `rank`'s image-row buffer in `wave`; 0 for ranks outside the LLM's first stage.
  int64_t LlmBufferRows(int64_t rank, int64_t wave) const;
};

// The transfers a rank sends or receives, in (wave, peer) order, pointing into the plan.
std::vector<const Transfer*> ForwardFrom(const BoundaryPlan& plan, int64_t rank);
std::vector<const Transfer*> ForwardTo(const BoundaryPlan& plan, int64_t rank);
std::vector<const Transfer*> BackwardFrom(const BoundaryPlan& plan, int64_t rank);
std::vector<const Transfer*> BackwardTo(const BoundaryPlan& plan, int64_t rank);
// The share steps a rank takes part in, in wave order.
std::vector<const ShareStep*> LlmSharesOf(const BoundaryPlan& plan, const Layout& llm,
                                          int64_t rank);
std::vector<const ShareStep*> EncoderSharesOf(const BoundaryPlan& plan, const Layout& encoder,
                                              int64_t rank);

// Builds the plan. The assignments must come from AssignLlm / AssignEncoder over `samples` with
// the placement's llm dp and encoder dp; InvalidArgument when they disagree, when a sample does
// not fit seq_len, or when seq_len cannot be sharded over the LLM's cp/tp.
absl::StatusOr<BoundaryPlan> BuildBoundaryPlan(const Placement& placement,
                                               const std::vector<SampleDescriptor>& samples,
                                               const LlmAssignment& llm,
                                               const EncoderAssignment& encoder,
                                               const BoundaryPlanOptions& options);

}  // namespace hetpar::plan

#endif  // HETPAR_COMMON_PLAN_BOUNDARY_PLAN_H_
