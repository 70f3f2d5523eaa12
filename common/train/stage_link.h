// The link between neighbouring pipeline stages of one LLM replica: a stage's output rows go to
// the rank of the same (dp, cp, tp) in the next stage, and their gradient comes back, over the
// data plane (the same transport as the boundary; the coordinator lists these ranks among the
// worker's peers).
//
// One message per (step, direction, microbatch) and pair of ranks: an 8-byte little-endian
// magic, then step, attempt, direction, microbatch and rows (8 bytes each, little-endian), then
// the rows. The attempt is the coordinator's id of the step attempt (BeginAttempt), so a late
// message of an aborted attempt is never taken for the retry's.
// The receiver knows the exact size from its own microbatch (the rows of its sequence shard),
// posts the receive straight into its tensor (header into a small buffer, rows in place) and
// checks the header once the message is in: a message of another step, microbatch, direction or
// size fails the receive with both descriptions instead of being used as the wrong rows.
//
// Tags: BoundaryTag(step, attempt, direction, microbatch | 2^18), so they never match the
// boundary's messages between the same two ranks (a wave is below 2^18), nor another attempt's.
//
// Sends are posted and their messages held until they complete: each Send first drops the
// messages of completed sends (and fails with the error of a failed one), WaitSends waits for
// the rest. Receives can be posted ahead (Post) and are waited for by Receive. Every wait is
// bounded by the timeout; a dead peer fails it with kUnavailable naming the rank. One thread drives
// a StageLink.
//
// An attempt that ends early (a failure, the coordinator's abort) must not leave either side's
// messages holding the connection: UCX cannot withdraw a send its receiver has not taken, and
// withdrawing it by force tears the connection down, so the neighbour of a live replica would
// fail every later attempt. So nothing of an attempt is withdrawn while its neighbour may still
// need it: its unfinished sends are kept until they complete, its receives still posted stay
// posted through the next two attempts, and Abandon posts a receive into a scratch buffer for each
// message of the attempt that was neither received nor posted, so that the neighbour's sends of
// it complete too. The attempt's tag keeps all of these apart from the retry's messages.
#ifndef HETPAR_COMMON_TRAIN_STAGE_LINK_H_
#define HETPAR_COMMON_TRAIN_STAGE_LINK_H_

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/plan/step_plan.h"
#include "common/step_interrupt.h"
#include "common/train/boundary.h"
#include "common/train/stream_ordered_sender.h"
#include "common/transport/transport.h"

namespace hetpar::train {

// The tag of a stage message of (step, direction, microbatch).
transport::Tag StageTag(int64_t step, int64_t attempt, plan::Direction direction,
                        int64_t microbatch);

class StageLink {
 public:
  // `peers` maps world ranks to connected transport peers (it must hold both neighbours); the
  // transport must outlive the link.
  StageLink(transport::Transport* transport, std::map<int64_t, transport::PeerId> peers,
            absl::Duration timeout)
      : transport_(transport), peers_(std::move(peers)), timeout_(timeout) {}

  // Posts the send of `rows` ([rows, hidden], any layout and device; copied into the message, a
  // host buffer) to world rank `dst`. Rows on a GPU are copied into pinned memory behind the
  // work queued on the device's stream and the send is posted once they are there (a
  // StreamOrderedSender), so Send does not wait for the device.
  absl::Status Send(int64_t dst, int64_t step, plan::Direction direction, int64_t microbatch,
                    const at::Tensor& rows);
  // Posts the receive of the message from world rank `src` straight into `rows` (contiguous,
  // [rows, hidden], host memory; held until received). Posting a message twice posts it once.
  absl::Status Post(int64_t src, int64_t step, plan::Direction direction, int64_t microbatch,
                    const at::Tensor& rows);
  // Waits for the message Post posted and returns its rows tensor.
  absl::StatusOr<at::Tensor> Receive(int64_t src, int64_t step, plan::Direction direction,
                                     int64_t microbatch);
  // Waits for every send posted since the last call.
  absl::Status WaitSends();
  // One message the link expects from a neighbour in the current attempt.
  struct Expected {
    int64_t src = -1;  // world rank
    plan::Direction direction = plan::Direction::kForward;
    int64_t microbatch = 0;
    int64_t rows = 0;
  };
  // Gives up the current attempt (of step `step`), which ended early: each of `expected` that was
  // neither received nor posted gets a receive of its size (`row_bytes` per row) into a scratch
  // buffer the call's receives from one neighbour share (nothing reads it), so that the neighbour's
  // send of it completes. They go with the attempt's other receives (see Reset).
  void Abandon(int64_t step, const std::vector<Expected>& expected, int64_t row_bytes);
  // Ends the current attempt: its receives still posted stay posted through the next two
  // attempts (withdrawn by the third Reset from now); its sends still held are kept until they
  // complete.
  void Reset();
  // Reset, then carry step attempt `attempt` (the plan's) in every later message's tag and
  // header, and expect it in every message received.
  void BeginAttempt(int64_t attempt);
  int64_t attempt() const { return attempt_; }
  // Receives end early, Aborted, once `interrupt` is raised (may be null).
  void SetInterrupt(const StepInterrupt* interrupt) { interrupt_ = interrupt; }

  // Sends whose messages are still held (not yet dropped by a Send or WaitSends).
  int64_t held_sends() const { return static_cast<int64_t>(sends_.size()); }
  // Sends of attempts that ended early, not complete when the last Reset looked.
  int64_t draining_sends() const { return static_cast<int64_t>(draining_.size()); }
  // Receives of attempts that ended early, still posted when the last Reset looked.
  int64_t stale_receives() const { return static_cast<int64_t>(stale_.size()); }
  int64_t bytes_sent() const { return bytes_sent_; }
  int64_t bytes_received() const { return bytes_received_; }

 private:
  struct Posted {
    std::vector<char> header;
    at::Tensor rows;
    std::unique_ptr<transport::Operation> op;
  };
  using Key = std::tuple<int64_t, transport::Tag>;  // (peer rank, tag)
  int64_t attempt_ = 0;

  absl::StatusOr<transport::PeerId> Peer(int64_t rank) const;

  transport::Transport* transport_;
  std::map<int64_t, transport::PeerId> peers_;
  absl::Duration timeout_;
  const StepInterrupt* interrupt_ = nullptr;
  struct Sent {
    at::Tensor message;  // bytes on the host, pinned for rows from a GPU
    std::unique_ptr<transport::Operation> op;
  };
  // Drops completed sends; the first failure, naming the peer.
  absl::Status Reap();

  std::map<Key, Posted> posted_;
  std::set<Key> taken_;  // received in this attempt
  std::vector<Sent> sends_;
  int64_t resets_ = 0;
  std::vector<std::pair<int64_t, Posted>> stale_;  // (the Reset that left it, receive)
  std::vector<Sent> draining_;                     // sends of ended attempts
  // Posts the messages of rows from a GPU once they are copied (created by the first).
  std::unique_ptr<StreamOrderedSender> ordered_sender_;
  int64_t bytes_sent_ = 0;
  int64_t bytes_received_ = 0;
};

}  // namespace hetpar::train

#endif  // HETPAR_COMMON_TRAIN_STAGE_LINK_H_
