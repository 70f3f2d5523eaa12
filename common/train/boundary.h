// The boundary communicator: executes one rank's part of a step's boundary plan over the data
// plane. Encoder ranks send the rows of their jobs' blocks forward and receive their gradients
// back; LLM ranks receive image rows into their per-wave buffer and send its gradient back.
//
// Every transfer of the plan is one message: an 8-byte little-endian header length, the
// versioned header (plan/message_header.h), then the pieces' rows back to back. A receiver knows
// the exact size from its own plan, decodes the header and validates it against the header its
// plan expects before touching the payload, so a message from another step, generation, wave or
// plan is rejected with both descriptions instead of being spliced into the wrong rows.
//
// Tags: one per (step, direction, wave), so messages of different waves and directions between
// the same two ranks never match each other.
//
// A transfer whose source and destination are the same rank (colocated placement: a process is a
// rank of both modules) does not touch the transport and is not packed: the receiver copies the
// pieces' rows straight from the sender's buffer into its own. The schedule must send it before it
// is received (colocated runs do all encoder forwards before the LLM waves, and all LLM waves
// before the encoder backwards).
//
// Threading: one thread drives a BoundaryCommunicator. Every wait is bounded by the timeout; a
// dead peer fails the wait with kUnavailable naming it.
#ifndef HETPAR_COMMON_TRAIN_BOUNDARY_H_
#define HETPAR_COMMON_TRAIN_BOUNDARY_H_

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/plan/message_header.h"
#include "common/plan/step_plan.h"
#include "common/transport/transport.h"

namespace hetpar::train {

// The tag of the messages of (step, direction, wave): 20 bits of step, 19 of wave, 1 of direction.
transport::Tag BoundaryTag(int64_t step, plan::Direction direction, int64_t wave);

// Sends in flight, with the buffers they read from. Wait before dropping.
class PendingSends {
 public:
  PendingSends() = default;
  PendingSends(PendingSends&&) = default;
  PendingSends& operator=(PendingSends&&) = default;

  void Add(std::unique_ptr<std::string> buffer, std::unique_ptr<transport::Operation> op);
  // Waits for every send; the first failure (naming the peer) otherwise.
  absl::Status Wait(absl::Time deadline);
  int64_t bytes() const { return bytes_; }
  bool empty() const { return ops_.empty(); }

 private:
  std::vector<std::unique_ptr<std::string>> buffers_;
  std::vector<std::unique_ptr<transport::Operation>> ops_;
  int64_t bytes_ = 0;
};

class BoundaryCommunicator {
 public:
  // `peers` maps world ranks to connected transport peers; it must hold every rank the plans
  // this communicator runs send to or receive from. The transport must outlive it.
  BoundaryCommunicator(transport::Transport* transport, std::map<int64_t, transport::PeerId> peers,
                       absl::Duration timeout)
      : transport_(transport), peers_(std::move(peers)), timeout_(timeout) {}

  // Encoder side: sends wave `wave`'s forward transfers of `plan`, reading each piece's rows at
  // its src_offset in `job_rows` ([job rows, hidden], contiguous, row_bytes per row).
  absl::StatusOr<PendingSends> SendForward(const plan::RankStepPlan& plan, int64_t wave,
                                           const at::Tensor& job_rows);
  // LLM side: receives wave `wave`'s forward transfers into `buffer` ([image_rows[wave], hidden],
  // contiguous) at each piece's dst_offset. Rows no transfer writes are left as they are.
  absl::Status ReceiveForward(const plan::RankStepPlan& plan, int64_t wave, at::Tensor& buffer);
  // LLM side: sends the gradient rows of wave `wave` back (pieces read at their src_offset in
  // `grad`, the gradient of the image-row buffer).
  absl::StatusOr<PendingSends> SendBackward(const plan::RankStepPlan& plan, int64_t wave,
                                            const at::Tensor& grad);
  // Encoder side: receives wave `wave`'s gradient pieces and adds each at its dst_offset into
  // `grad` ([job rows, hidden], contiguous; the caller zeroes it).
  absl::Status ReceiveBackward(const plan::RankStepPlan& plan, int64_t wave, at::Tensor& grad);

  // Bytes of payload sent and received so far.
  int64_t bytes_sent() const { return bytes_sent_; }
  int64_t bytes_received() const { return bytes_received_; }

 private:
  absl::StatusOr<PendingSends> Send(const plan::RankStepPlan& plan, plan::Direction direction,
                                    int64_t wave, const std::vector<plan::Transfer>& transfers,
                                    const at::Tensor& rows);
  absl::Status Receive(const plan::RankStepPlan& plan, plan::Direction direction, int64_t wave,
                       const std::vector<plan::Transfer>& transfers, at::Tensor& rows, bool add);
  absl::StatusOr<transport::PeerId> Peer(int64_t rank) const;

  // Source buffers of transfers a rank sent to itself, by (tag, rank), waiting to be received.
  std::map<std::pair<transport::Tag, int64_t>, at::Tensor> local_;

  transport::Transport* transport_;
  std::map<int64_t, transport::PeerId> peers_;
  absl::Duration timeout_;
  int64_t bytes_sent_ = 0;
  int64_t bytes_received_ = 0;
};

}  // namespace hetpar::train

#endif  // HETPAR_COMMON_TRAIN_BOUNDARY_H_
