// The boundary communicator: executes one rank's part of a step's boundary plan over the data
// plane. Encoder ranks send the rows of their jobs' blocks forward and receive their gradients
// back; LLM ranks receive image rows into their per-wave buffer and send its gradient back.
//
// Every transfer of the plan is one message: an 8-byte little-endian header length, the
// sender's clock when it posted the message (8-byte little-endian Unix nanoseconds), the
// versioned header (plan/message_header.h), then the pieces' rows back to back. A receiver knows
// the exact size from its own plan, decodes the header and validates it against the header its
// plan expects, so a message from another step, generation, wave or plan is rejected with both
// descriptions instead of being used as the wrong rows.
//
// Forward receives are scatter receives (Transport::RecvScatter): the framing and header land in
// a small buffer and each piece's rows straight at its dst_offset in the LLM's row buffer, with no
// staging copy. The header is checked once the message is in; a mismatch fails the receive (and
// so the step) before the rows are used. Backward receives land in a staging buffer, because the
// encoder adds the pieces into its gradient.
//
// Receives can be posted ahead of need (PostForwardReceives, PostBackwardReceives): the data then
// lands while the receiver computes, and Receive* only waits for it.
//
// Timing: for every message that crossed the transport the receiver records its transfer
// interval, from the moment both ends had posted it (the later of the sender's post time and the
// receive's post time) to the moment the transport completed the receive. BridgeStats sums them
// per direction. Between hosts the sender's time comes from its own clock, so the start is only
// as exact as the hosts' clock sync (an interval is never allowed to end before it starts).
//
// Tags: one per (step, attempt, direction, wave), so messages of different waves and directions
// between the same two ranks never match each other, nor a late message of an aborted attempt
// the retry's (the attempt is the coordinator's id of the step attempt, in the plan and in the
// header).
//
// A transfer whose source and destination are the same rank (colocated placement: a process is a
// rank of both modules) does not touch the transport and is not packed: the receiver copies the
// pieces' rows straight from the sender's buffer into its own. The schedule must send it before it
// is received (colocated runs do all encoder forwards before the LLM waves, and all LLM waves
// before the encoder backwards).
//
// Threading: one thread drives a BoundaryCommunicator. Every wait is bounded by the timeout; a
// dead peer fails the wait with kUnavailable naming it.
//
// Sends are never withdrawn: those a failed or interrupted step leaves unfinished stay in flight
// (SendDrain) until the receiver takes them, since destroying one would tear down the connection
// to a peer that may be alive and only slow to give up the same step.
#ifndef HETPAR_COMMON_TRAIN_BOUNDARY_H_
#define HETPAR_COMMON_TRAIN_BOUNDARY_H_

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/nn/device_copy.h"
#include "common/plan/message_header.h"
#include "common/plan/step_plan.h"
#include "common/step_interrupt.h"
#include "common/train/stream_ordered_sender.h"
#include "common/transport/transport.h"

namespace hetpar::train {

// The tag of the messages of (step, attempt, direction, wave), in the transport's 40 bits: 4 bits
// of the attempt, 16 of the step, 19 of the wave, 1 of the direction. Neighbouring attempts and
// steps never share a tag; the header (which carries them whole) catches any wrap-around.
transport::Tag BoundaryTag(int64_t step, int64_t attempt, plan::Direction direction, int64_t wave);

// What the transport delivered to one rank in one direction since BeginStep. Same-rank handovers
// are not counted.
struct BridgeStats {
  int64_t messages = 0;
  int64_t bytes = 0;          // whole messages: framing, header and rows
  double transfer_s = 0;      // length of the union of the messages' transfer intervals
  double sum_transfer_s = 0;  // their lengths added up (> transfer_s when messages overlapped)
};

// Sends of attempts that ended early, kept in flight with the buffers they read from. A send
// is never withdrawn: UCX cannot cancel one once posted, and destroying one unfinished tears the
// peer's connection down (transport/completion.h), which would cut off a live peer for the rest
// of the run. (The NCCL data plane could withdraw one; keeping it costs only its buffer until
// the receiver takes it.) A kept send completes once its receiver takes it (a receiver that
// gives up the step posts receives for what its peers still send:
// BoundaryCommunicator::Abandon) or fails with its peer. Shared by a communicator and the
// PendingSends it returned.
class SendDrain {
 public:
  SendDrain() = default;
  SendDrain(const SendDrain&) = delete;
  SendDrain& operator=(const SendDrain&) = delete;

  void Keep(std::vector<std::unique_ptr<std::string>> buffers,
            std::vector<at::Tensor> device_buffers,
            std::vector<std::unique_ptr<transport::Operation>> ops);
  // Drops the sends that completed; the number still in flight.
  int64_t Prune();

 private:
  struct Kept {
    std::vector<std::unique_ptr<std::string>> buffers;
    std::vector<at::Tensor> device_buffers;
    std::vector<std::unique_ptr<transport::Operation>> ops;
  };
  absl::Mutex mu_;
  std::vector<Kept> kept_ ABSL_GUARDED_BY(mu_);
};

// Sends in flight, with the buffers they read from. Dropped with sends unfinished (the step
// failed or was interrupted), it hands them to its communicator's SendDrain.
class PendingSends {
 public:
  PendingSends() = default;
  ~PendingSends() { Release(); }
  PendingSends(PendingSends&& other) noexcept { *this = std::move(other); }
  PendingSends& operator=(PendingSends&& other) noexcept;

  void Add(std::unique_ptr<std::string> buffer, std::unique_ptr<transport::Operation> op);
  // A message in device memory (BoundaryCommunicator::device_direct).
  void Add(at::Tensor device_buffer, std::unique_ptr<transport::Operation> op);
  // Waits for every send; the first failure (naming the peer) otherwise; Aborted when the step
  // is interrupted first.
  absl::Status Wait(absl::Time deadline);
  int64_t bytes() const { return bytes_; }
  bool empty() const { return ops_.empty(); }

 private:
  // Hands unfinished sends to drain_ (destroys finished ones).
  void Release();

  std::vector<std::unique_ptr<std::string>> buffers_;
  std::vector<at::Tensor> device_buffers_;
  std::vector<std::unique_ptr<transport::Operation>> ops_;
  int64_t bytes_ = 0;
  const StepInterrupt* interrupt_ = nullptr;
  std::shared_ptr<SendDrain> drain_;
  friend class BoundaryCommunicator;
};

class BoundaryCommunicator {
 public:
  // `peers` maps world ranks to connected transport peers; it must hold every rank the plans
  // this communicator runs send to or receive from. The transport must outlive it.
  BoundaryCommunicator(transport::Transport* transport, std::map<int64_t, transport::PeerId> peers,
                       absl::Duration timeout)
      : transport_(transport), peers_(std::move(peers)), timeout_(timeout) {}

  // Where the caller's tensors live (nn::ExecutionContext::device). On a GPU whose memory the
  // transport moves (Transport::CanMove: UCX built with CUDA, on a machine with the driver),
  // the communicator turns device_direct(): each message is packed and received in device memory
  // (the same bytes as below), sends read the caller's device rows and receives take device
  // tensors, with no copy through the host but the header's. Neither side waits for the device
  // per message: a send is posted by a thread of its own once the device has packed it
  // (StreamOrderedSender), and a received header is checked after the step's host sync
  // (CheckDeviceHeaders). Otherwise messages are host
  // buffers: rows on a GPU are copied to the host once per wave (both Send* calls), and receives
  // take host tensors, which the caller moves to its device. Call before the first step.
  // `tensor_messages` packs and receives messages as tensors on `device` even where it is the CPU
  // (host memory), the way device_direct() does on a GPU: tests check that path without one.
  void UseDevice(const c10::Device& device, bool tensor_messages = false);
  bool device_direct() const { return device_direct_; }

  // Encoder side: sends wave `wave`'s forward transfers of `plan`, reading each piece's rows at
  // its src_offset in `job_rows` ([job rows, hidden], contiguous, row_bytes per row).
  absl::StatusOr<PendingSends> SendForward(const plan::RankStepPlan& plan, int64_t wave,
                                           const at::Tensor& job_rows);
  // LLM side: receives wave `wave`'s forward transfers into `buffer` ([image_rows[wave], hidden],
  // contiguous) at each piece's dst_offset. Rows no transfer writes are left as they are. If
  // the wave's receives were posted ahead, `buffer` must be the tensor they were posted into.
  absl::Status ReceiveForward(const plan::RankStepPlan& plan, int64_t wave, at::Tensor& buffer);
  // LLM side: sends the gradient rows of wave `wave` back (pieces read at their src_offset in
  // `grad`, the gradient of the image-row buffer).
  absl::StatusOr<PendingSends> SendBackward(const plan::RankStepPlan& plan, int64_t wave,
                                            const at::Tensor& grad);
  // Encoder side: receives wave `wave`'s gradient pieces and adds each at its dst_offset into
  // `grad` ([job rows, hidden], contiguous; the caller zeroes it).
  absl::Status ReceiveBackward(const plan::RankStepPlan& plan, int64_t wave, at::Tensor& grad);

  // Post the receives of one wave now, so their data can land before the Receive* call that
  // needs it: forward ones straight into `buffer` (held until received), backward ones into
  // staging. Posting a wave twice posts it once.
  absl::Status PostForwardReceives(const plan::RankStepPlan& plan, int64_t wave,
                                   const at::Tensor& buffer);
  absl::Status PostBackwardReceives(const plan::RankStepPlan& plan, int64_t wave);

  // The step of `plan` ended early on this rank (a failure, an interrupt): posts the receives of
  // its waves that were neither posted nor taken, so that what live peers still send in it finds
  // a receive (BeginStep withdraws them a step later).
  void Abandon(const plan::RankStepPlan& plan);
  // The step of `plan` failed on this rank before it began (its groups could not be formed):
  // BeginStep, then Abandon, as for a step that failed at once.
  void AbandonUnrun(const plan::RankStepPlan& plan);

  // Every wait of this communicator (and of the sends it returns) ends early, Aborted, once
  // `interrupt` is raised (may be null: waits end at their deadline only).
  void SetInterrupt(const StepInterrupt* interrupt) { interrupt_ = interrupt; }

  // Starts a step: drops the rows still held for a step that ended early (an aborted step) and
  // clears the transfer records. Receives still posted for such a step stay posted through one
  // more step, so that a live peer's send of the aborted step finds its receive and completes
  // (a send the receiver never takes would tie up the connection); then they are withdrawn.
  // Sends of such a step stay in flight until taken (SendDrain); the ones taken are dropped here.
  void BeginStep();

  // Sends of earlier attempts still in flight (SendDrain), as of the last BeginStep.
  int64_t draining_sends() const { return draining_sends_; }

  // The peer of world rank `rank` is now `peer` (a worker that joined the run into the rank of a
  // lost one). Receives still posted on the old peer stay as they are until withdrawn.
  void SetPeer(int64_t rank, transport::PeerId peer) { peers_[rank] = peer; }

  // Checks the headers of the messages this step received in device memory (device_direct()).
  // Receive* copies each one's framing and header to the host behind the device work queued so
  // far and places the rows where the plan puts them (the message's size matched the plan's),
  // so that the step's one host sync (ModuleState::EndStep) brings the headers too. Call after
  // that sync: each header is compared with the plan's here, failing as Receive* fails for a
  // host message (DataLoss, or the plan's header check), and Stats gets the messages' transfer
  // records. Waits for the device only where it has not caught up yet. Messages in host memory
  // are checked by Receive* itself.
  absl::Status CheckDeviceHeaders();

  // Transfer records of one direction since BeginStep.
  BridgeStats Stats(plan::Direction direction) const;

  // Bytes of payload sent and received so far.
  int64_t bytes_sent() const { return bytes_sent_; }
  int64_t bytes_received() const { return bytes_received_; }

 private:
  // A receive posted over the transport, with the buffer it writes into.
  struct PostedReceive {
    int64_t src_rank = 0;
    // The whole message (staging), or only its framing and header when the rows go straight
    // to `rows`. Its storage does not move with the struct.
    std::vector<char> buffer;
    at::Tensor rows;            // a straight receive's destination, held until received
    at::Tensor device_message;  // device_direct(): the whole message, in device memory
    std::unique_ptr<transport::Operation> op;
    absl::Time posted;
    // Why no receive could be posted (op stays null): its peer is gone, or the plan is wrong.
    // The wave's other receives are posted all the same, so live peers' sends are taken.
    absl::Status error;
  };
  // A device message's header, on its way to the host (CheckDeviceHeaders).
  struct DeviceHeader {
    at::Tensor head;        // the framing and header, on the host (pinned on a GPU)
    nn::StreamMark copied;  // reached once `head` holds them
    plan::MessageHeader expected;
    plan::Direction direction = plan::Direction::kForward;
    int64_t src_rank = 0;
    int64_t step = 0;
    int64_t wave = 0;
    absl::Time posted;
    absl::Time end;
    int64_t bytes = 0;
  };
  // Transfer intervals of received messages.
  struct Interval {
    absl::Time start;
    absl::Time end;
    int64_t bytes = 0;
  };

  absl::StatusOr<PendingSends> Send(const plan::RankStepPlan& plan, plan::Direction direction,
                                    int64_t wave, const std::vector<plan::Transfer>& transfers,
                                    const at::Tensor& rows);
  absl::Status Receive(const plan::RankStepPlan& plan, plan::Direction direction, int64_t wave,
                       const std::vector<plan::Transfer>& transfers, at::Tensor& rows, bool add);
  absl::StatusOr<transport::PeerId> Peer(int64_t rank) const;
  // The memory kind and device of messages packed as tensors on device_.
  transport::MemoryKind MessageMemory() const;
  int MessageDevice() const;
  // Where receives land: device_ when device_direct_, else the host.
  c10::Device ReceiveDevice() const { return device_direct_ ? device_ : c10::Device(c10::kCPU); }
  // One transfer's message in device memory: `framing` (its post time stamped here), then the
  // pieces' rows gathered from `rows` (on device_), by copies queued on the device's stream.
  absl::StatusOr<at::Tensor> PackOnDevice(std::string framing, const plan::Transfer& transfer,
                                          const at::Tensor& rows) const;
  // Decodes `message`'s framing and header (its first bytes), checks the header against
  // `expected` and records the transfer (Stats, trace); the header's size.
  absl::StatusOr<uint64_t> CheckHeader(std::string_view message,
                                       const plan::MessageHeader& expected,
                                       plan::Direction direction, int64_t src_rank,
                                       absl::Time posted, absl::Time end, int64_t bytes);
  // Copies (or adds) the pieces of a device message's payload, which starts at `payload_offset`,
  // into `rows` at their dst_offset.
  absl::Status PlaceFromDevice(const at::Tensor& message, size_t payload_offset,
                               const plan::Transfer& transfer, int64_t wave, int64_t row_bytes,
                               at::Tensor& rows, bool add);
  // The receives of (direction, wave) in plan order; a same-rank transfer has no op. With
  // `straight` defined, each message's rows are scattered straight into it.
  absl::StatusOr<std::vector<PostedReceive>> Post(const plan::RankStepPlan& plan,
                                                  plan::Direction direction, int64_t wave,
                                                  const std::vector<plan::Transfer>& transfers,
                                                  const at::Tensor& straight);
  // Posts the receive of one transfer from another rank into `r`.
  absl::Status PostOne(const plan::RankStepPlan& plan, plan::Direction direction, int64_t wave,
                       const plan::Transfer& transfer, const at::Tensor& straight,
                       PostedReceive& r);
  absl::Status PostAhead(const plan::RankStepPlan& plan, plan::Direction direction, int64_t wave,
                         const at::Tensor& straight);

  // Receives posted ahead, by tag.
  std::map<transport::Tag, std::vector<PostedReceive>> posted_;
  // Receives of steps that ended early, with the BeginStep count when they were left.
  std::vector<std::pair<int64_t, PostedReceive>> stale_;
  std::set<transport::Tag> taken_;  // (direction, wave) receives taken by this step
  int64_t steps_begun_ = 0;
  std::shared_ptr<SendDrain> drain_ = std::make_shared<SendDrain>();
  int64_t draining_sends_ = 0;
  const StepInterrupt* interrupt_ = nullptr;
  std::vector<Interval> intervals_[2];        // by direction
  std::vector<DeviceHeader> device_headers_;  // received this step, not checked yet

  // Source buffers of transfers a rank sent to itself, by (tag, rank), waiting to be received.
  std::map<std::pair<transport::Tag, int64_t>, at::Tensor> local_;

  transport::Transport* transport_;
  std::map<int64_t, transport::PeerId> peers_;
  absl::Duration timeout_;
  c10::Device device_ = c10::Device(c10::kCPU);
  bool device_direct_ = false;
  // Posts device messages once packed (device_direct_ on a GPU).
  std::unique_ptr<StreamOrderedSender> ordered_sender_;
  int64_t bytes_sent_ = 0;
  int64_t bytes_received_ = 0;
};

}  // namespace hetpar::train

#endif  // HETPAR_COMMON_TRAIN_BOUNDARY_H_
