#include "common/train/boundary.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/nn/torch_status.h"
#include "common/status.h"
#include "common/trace/recorder.h"
#include "common/train/little_endian.h"

namespace hetpar::train {
namespace {

// Framing before the header: its length, then the sender's post time.
constexpr size_t kLengthBytes = 8;
constexpr size_t kPrefixBytes = 16;

// Writes the sender's post time (Unix nanoseconds) into a message's framing.
void StampPostTime(char* framing) {
  StoreU64(framing + kLengthBytes, static_cast<uint64_t>(absl::ToUnixNanos(absl::Now())));
}

size_t MessageSize(const plan::Transfer& transfer, int64_t row_bytes) {
  return kPrefixBytes +
         static_cast<size_t>(
             plan::EncodedHeaderSize(static_cast<int64_t>(transfer.pieces.size()))) +
         static_cast<size_t>(transfer.rows * row_bytes);
}

// Length of the union of the intervals.
double UnionSeconds(std::vector<std::pair<absl::Time, absl::Time>> intervals) {
  std::sort(intervals.begin(), intervals.end());
  double total = 0;
  absl::Time begin = absl::InfinitePast(), end = absl::InfinitePast();
  for (const auto& [b, e] : intervals) {
    if (b > end) {
      if (end > begin) total += absl::ToDoubleSeconds(end - begin);
      begin = b;
      end = e;
    } else {
      end = std::max(end, e);
    }
  }
  if (end > begin) total += absl::ToDoubleSeconds(end - begin);
  return total;
}

// InternalError unless rows [offset, offset + rows) lie in a `size`-row buffer of wave `wave`.
absl::Status CheckPiece(int64_t offset, int64_t rows, int64_t size, int64_t wave) {
  if (offset < 0 || offset + rows > size) {
    return absl::InternalError(absl::StrCat("boundary piece rows [", offset, ", ", offset + rows,
                                            ") outside the ", size, "-row buffer of wave ", wave));
  }
  return absl::OkStatus();
}

// InvalidArgument unless `rows` is a contiguous [rows, hidden] tensor of row_bytes per row on
// `device`.
absl::Status CheckRows(const at::Tensor& rows, int64_t row_bytes, std::string_view what,
                       const c10::Device& device = c10::Device(c10::kCPU)) {
  if (!rows.defined() || rows.dim() != 2 || !rows.is_contiguous() || rows.device() != device ||
      rows.size(1) * static_cast<int64_t>(rows.element_size()) != row_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        std::string(what), ": expected a contiguous tensor [rows, hidden] on ", device.str(),
        " of ", row_bytes, " bytes per row",
        rows.defined() ? absl::StrCat(", got ", rows.dim(), " dims on ", rows.device().str())
                       : std::string()));
  }
  return absl::OkStatus();
}

}  // namespace

transport::Tag BoundaryTag(int64_t step, int64_t attempt, plan::Direction direction, int64_t wave) {
  const uint64_t a = static_cast<uint64_t>(attempt) & ((uint64_t{1} << 4) - 1);
  const uint64_t s = static_cast<uint64_t>(step) & ((uint64_t{1} << 16) - 1);
  const uint64_t w = static_cast<uint64_t>(wave) & ((uint64_t{1} << 19) - 1);
  return (a << 36) | (s << 20) | (w << 1) | (direction == plan::Direction::kBackward ? 1 : 0);
}

void SendDrain::Keep(std::vector<std::unique_ptr<std::string>> buffers,
                     std::vector<at::Tensor> device_buffers,
                     std::vector<std::unique_ptr<transport::Operation>> ops) {
  absl::MutexLock lock(&mu_);
  kept_.push_back({std::move(buffers), std::move(device_buffers), std::move(ops)});
}

int64_t SendDrain::Prune() {
  std::vector<Kept> done;  // destroyed outside the lock: all of their sends finished
  int64_t in_flight = 0;
  absl::MutexLock lock(&mu_);
  std::vector<Kept> keep;
  for (Kept& kept : kept_) {
    int64_t unfinished = 0;
    for (const auto& op : kept.ops) unfinished += op->Done() ? 0 : 1;
    in_flight += unfinished;
    (unfinished > 0 ? keep : done).push_back(std::move(kept));
  }
  kept_ = std::move(keep);
  return in_flight;
}

PendingSends& PendingSends::operator=(PendingSends&& other) noexcept {
  if (this == &other) return *this;
  Release();
  buffers_ = std::exchange(other.buffers_, {});
  device_buffers_ = std::exchange(other.device_buffers_, {});
  ops_ = std::exchange(other.ops_, {});
  bytes_ = std::exchange(other.bytes_, 0);
  interrupt_ = other.interrupt_;
  drain_ = std::move(other.drain_);
  return *this;
}

void PendingSends::Release() {
  bool unfinished = false;
  for (const auto& op : ops_) unfinished |= !op->Done();
  if (unfinished && drain_ != nullptr) {
    drain_->Keep(std::move(buffers_), std::move(device_buffers_), std::move(ops_));
  }
  // Finished sends (and, without a drain, unfinished ones) are destroyed here, ops first: they
  // read from the buffers.
  ops_.clear();
  buffers_.clear();
  device_buffers_.clear();
}

void PendingSends::Add(std::unique_ptr<std::string> buffer,
                       std::unique_ptr<transport::Operation> op) {
  bytes_ += static_cast<int64_t>(buffer->size());
  buffers_.push_back(std::move(buffer));
  ops_.push_back(std::move(op));
}

void PendingSends::Add(at::Tensor device_buffer, std::unique_ptr<transport::Operation> op) {
  bytes_ += device_buffer.numel();
  device_buffers_.push_back(std::move(device_buffer));
  ops_.push_back(std::move(op));
}

absl::Status PendingSends::Wait(absl::Time deadline) {
  absl::Status status = transport::WaitAll(ops_, deadline, interrupt_);
  if (status.ok()) {
    ops_.clear();
    buffers_.clear();
    device_buffers_.clear();
  }
  return status;
}

void BoundaryCommunicator::UseDevice(const c10::Device& device, bool tensor_messages) {
  device_ = device;
  device_direct_ = device.is_cuda() ? transport_->CanMove(transport::MemoryKind::kCuda)
                                    : tensor_messages && device.is_cpu();
  ordered_sender_ = device_direct_ && device.is_cuda()
                        ? std::make_unique<StreamOrderedSender>(transport_, device)
                        : nullptr;
}

transport::MemoryKind BoundaryCommunicator::MessageMemory() const {
  return device_.is_cuda() ? transport::MemoryKind::kCuda : transport::MemoryKind::kHost;
}

int BoundaryCommunicator::MessageDevice() const { return device_.is_cuda() ? device_.index() : -1; }

absl::StatusOr<transport::PeerId> BoundaryCommunicator::Peer(int64_t rank) const {
  auto it = peers_.find(rank);
  if (it == peers_.end()) {
    return absl::FailedPreconditionError(
        absl::StrCat("no data-plane connection to rank ", rank, " (the plan needs one)"));
  }
  return it->second;
}

absl::StatusOr<PendingSends> BoundaryCommunicator::SendForward(const plan::RankStepPlan& plan,
                                                               int64_t wave,
                                                               const at::Tensor& job_rows) {
  return Send(plan, plan::Direction::kForward, wave, plan.forward_sends, job_rows);
}

absl::StatusOr<PendingSends> BoundaryCommunicator::SendBackward(const plan::RankStepPlan& plan,
                                                                int64_t wave,
                                                                const at::Tensor& grad) {
  return Send(plan, plan::Direction::kBackward, wave, plan.backward_sends, grad);
}

absl::Status BoundaryCommunicator::ReceiveForward(const plan::RankStepPlan& plan, int64_t wave,
                                                  at::Tensor& buffer) {
  return Receive(plan, plan::Direction::kForward, wave, plan.forward_receives, buffer,
                 /*add=*/false);
}

absl::Status BoundaryCommunicator::ReceiveBackward(const plan::RankStepPlan& plan, int64_t wave,
                                                   at::Tensor& grad) {
  return Receive(plan, plan::Direction::kBackward, wave, plan.backward_receives, grad,
                 /*add=*/true);
}

absl::StatusOr<PendingSends> BoundaryCommunicator::Send(
    const plan::RankStepPlan& plan, plan::Direction direction, int64_t wave,
    const std::vector<plan::Transfer>& transfers, const at::Tensor& device_rows) {
  PendingSends pending;
  pending.interrupt_ = interrupt_;
  pending.drain_ = drain_;
  const int64_t row_bytes = plan.row_bytes;
  bool checked = false;
  // Messages are packed from `rows`: on the device when the transport moves its memory
  // (device_direct_), else on the host.
  const bool on_device = device_direct_ && device_rows.defined() && device_rows.device() == device_;
  at::Tensor rows;
  for (const plan::Transfer& transfer : transfers) {
    if (transfer.wave != wave) continue;
    if (!checked) {
      // Rows on a GPU are copied to the host once, for all of the wave's messages.
      rows = on_device                                                 ? device_rows
             : device_rows.defined() && !device_rows.device().is_cpu() ? device_rows.to(at::kCPU)
                                                                       : device_rows;
      HETPAR_RETURN_IF_ERROR(CheckRows(rows, row_bytes, "boundary send",
                                       on_device ? device_ : c10::Device(c10::kCPU)));
      checked = true;
    }
    if (transfer.dst_rank == plan.rank) {
      // Rows that stay on this rank: the receiver copies them straight from `rows` (which the
      // caller leaves untouched until the step's receives are done); nothing is packed.
      local_[{BoundaryTag(plan.step, plan.attempt, direction, wave), plan.rank}] = rows;
      bytes_sent_ += transfer.rows * row_bytes;
      continue;
    }
    for (const plan::BlockPiece& piece : transfer.pieces) {
      HETPAR_RETURN_IF_ERROR(CheckPiece(piece.src_offset, piece.rows, rows.size(0), wave));
    }
    HETPAR_ASSIGN_OR_RETURN(transport::PeerId peer, Peer(transfer.dst_rank));
    // The framing (the header's length; the post time is written just before the send is
    // posted), then the header, then the pieces' rows.
    const std::string header = plan::EncodeHeader(plan::HeaderFor(plan, direction, transfer));
    std::string framing(kPrefixBytes, '\0');
    StoreU64(framing.data(), header.size());
    framing.append(header);
    std::unique_ptr<std::string> message;
    at::Tensor device_message;
    transport::ConstBuffer buffer;
    std::unique_ptr<transport::Operation> op;
    const transport::Tag tag = BoundaryTag(plan.step, plan.attempt, direction, wave);
    if (on_device) {
      HETPAR_ASSIGN_OR_RETURN(device_message, PackOnDevice(std::move(framing), transfer, rows));
      buffer = {device_message.data_ptr(), static_cast<size_t>(device_message.numel()),
                MessageMemory(), MessageDevice()};
      if (ordered_sender_ != nullptr) {
        // The transport reads the message outside the stream's order: the send is posted once
        // the device has packed it, by the sender's thread; this one goes on queueing work.
        const nn::StreamMark packed = nn::StreamMark::After(device_);
        op = ordered_sender_->Post(peer, tag, buffer, device_message,
                                   [packed] { return packed.Reached(); });
      }
    } else {
      message = std::make_unique<std::string>(std::move(framing));
      message->reserve(message->size() + transfer.rows * row_bytes);
      const char* base = static_cast<const char*>(rows.data_ptr());
      for (const plan::BlockPiece& piece : transfer.pieces) {
        message->append(base + piece.src_offset * row_bytes, piece.rows * row_bytes);
      }
      StampPostTime(message->data());
      buffer = transport::ConstBuffer::Host(message->data(), message->size());
    }
    if (op == nullptr) {
      HETPAR_ASSIGN_OR_RETURN(op, transport_->Send(peer, tag, buffer));
    }
    bytes_sent_ += transfer.rows * row_bytes;
    if (trace::Recorder::Process().on()) {
      const double now_us = trace::NowMicros();
      trace::Recorder::Process().CompleteAt(
          trace::kBridgeLane,
          direction == plan::Direction::kForward ? "send image rows" : "send gradients", "bridge",
          now_us, now_us,
          {{"peer", transfer.dst_rank},
           {"bytes", static_cast<int64_t>(buffer.size)},
           {"wave", wave}});
    }
    if (on_device) {
      pending.Add(std::move(device_message), std::move(op));
    } else {
      pending.Add(std::move(message), std::move(op));
    }
  }
  return pending;
}

absl::StatusOr<at::Tensor> BoundaryCommunicator::PackOnDevice(std::string framing,
                                                              const plan::Transfer& transfer,
                                                              const at::Tensor& rows) const {
  const int64_t row_bytes = rows.size(1) * static_cast<int64_t>(rows.element_size());
  const int64_t head_bytes = static_cast<int64_t>(framing.size());
  at::Tensor message;
  HETPAR_RETURN_IF_ERROR(nn::RunTorch("packing a boundary message on the device", [&] {
    message = at::empty({head_bytes + transfer.rows * row_bytes},
                        at::TensorOptions().dtype(at::kByte).device(device_));
    // The pieces' rows, gathered on the device after the framing and header.
    const at::Tensor bytes = rows.view(at::kByte);  // [rows, row_bytes]
    int64_t offset = head_bytes;
    for (const plan::BlockPiece& piece : transfer.pieces) {
      message.narrow(0, offset, piece.rows * row_bytes)
          .copy_(bytes.narrow(0, piece.src_offset, piece.rows).reshape({-1}));
      offset += piece.rows * row_bytes;
    }
    StampPostTime(framing.data());
    message.narrow(0, 0, head_bytes)
        .copy_(nn::ToDevice(
            at::from_blob(framing.data(), {head_bytes}, at::TensorOptions().dtype(at::kByte)),
            device_));
  }));
  return message;
}

absl::StatusOr<std::vector<BoundaryCommunicator::PostedReceive>> BoundaryCommunicator::Post(
    const plan::RankStepPlan& plan, plan::Direction direction, int64_t wave,
    const std::vector<plan::Transfer>& transfers, const at::Tensor& straight) {
  const int64_t row_bytes = plan.row_bytes;
  if (straight.defined()) {
    HETPAR_RETURN_IF_ERROR(CheckRows(straight, row_bytes, "boundary receive", ReceiveDevice()));
  }
  std::vector<PostedReceive> posted;
  for (const plan::Transfer& transfer : transfers) {
    if (transfer.wave != wave) continue;
    PostedReceive& r = posted.emplace_back();
    r.src_rank = transfer.src_rank;
    if (transfer.src_rank == plan.rank) continue;  // handed over in memory by Receive
    // One transfer that cannot be posted (a dead peer) leaves the others posted: their senders
    // are alive, and their sends complete only once a receive takes them. Receive reports it.
    r.error = PostOne(plan, direction, wave, transfer, straight, r);
  }
  return posted;
}

absl::Status BoundaryCommunicator::PostOne(const plan::RankStepPlan& plan,
                                           plan::Direction direction, int64_t wave,
                                           const plan::Transfer& transfer,
                                           const at::Tensor& straight, PostedReceive& r) {
  const int64_t row_bytes = plan.row_bytes;
  HETPAR_ASSIGN_OR_RETURN(transport::PeerId peer, Peer(transfer.src_rank));
  const transport::Tag tag = BoundaryTag(plan.step, plan.attempt, direction, wave);
  if (device_direct_) {
    // The whole message lands on the device; Receive checks its header there and places
    // (or adds) the rows with device copies.
    // From memory no queued kernel still uses: the transport writes it whenever the data
    // arrives, outside the stream's order (nn::EmptyForTransport).
    const size_t size = MessageSize(transfer, row_bytes);
    HETPAR_RETURN_IF_ERROR(nn::RunTorch("allocating a boundary receive on the device", [&] {
      r.device_message = nn::EmptyForTransport(static_cast<int64_t>(size), device_);
    }));
    r.rows = straight;
    r.posted = absl::Now();
    HETPAR_ASSIGN_OR_RETURN(
        r.op, transport_->Recv(peer, tag,
                               transport::MutableBuffer{r.device_message.data_ptr(), size,
                                                        MessageMemory(), MessageDevice()}));
    return absl::OkStatus();
  }
  if (!straight.defined()) {
    const size_t size = MessageSize(transfer, row_bytes);
    r.buffer.assign(size, 0);
    r.posted = absl::Now();
    HETPAR_ASSIGN_OR_RETURN(
        r.op, transport_->Recv(peer, tag, transport::MutableBuffer::Host(r.buffer.data(), size)));
    return absl::OkStatus();
  }
  // Framing and header into r.buffer, each piece's rows at its place in `straight`.
  r.buffer.assign(kPrefixBytes + static_cast<size_t>(plan::EncodedHeaderSize(
                                     static_cast<int64_t>(transfer.pieces.size()))),
                  0);
  r.rows = straight;
  std::vector<transport::MutableBuffer> segments = {
      transport::MutableBuffer::Host(r.buffer.data(), r.buffer.size())};
  char* base = static_cast<char*>(straight.data_ptr());
  for (const plan::BlockPiece& piece : transfer.pieces) {
    HETPAR_RETURN_IF_ERROR(CheckPiece(piece.dst_offset, piece.rows, straight.size(0), wave));
    segments.push_back(transport::MutableBuffer::Host(base + piece.dst_offset * row_bytes,
                                                      piece.rows * row_bytes));
  }
  r.posted = absl::Now();
  HETPAR_ASSIGN_OR_RETURN(r.op, transport_->RecvScatter(peer, tag, std::move(segments)));
  return absl::OkStatus();
}

absl::Status BoundaryCommunicator::PostAhead(const plan::RankStepPlan& plan,
                                             plan::Direction direction, int64_t wave,
                                             const at::Tensor& straight) {
  const transport::Tag tag = BoundaryTag(plan.step, plan.attempt, direction, wave);
  if (posted_.count(tag) != 0) return absl::OkStatus();
  HETPAR_ASSIGN_OR_RETURN(
      std::vector<PostedReceive> posted,
      Post(plan, direction, wave,
           direction == plan::Direction::kForward ? plan.forward_receives : plan.backward_receives,
           straight));
  posted_.emplace(tag, std::move(posted));
  return absl::OkStatus();
}

absl::Status BoundaryCommunicator::PostForwardReceives(const plan::RankStepPlan& plan, int64_t wave,
                                                       const at::Tensor& buffer) {
  return PostAhead(plan, plan::Direction::kForward, wave, buffer);
}

absl::Status BoundaryCommunicator::PostBackwardReceives(const plan::RankStepPlan& plan,
                                                        int64_t wave) {
  return PostAhead(plan, plan::Direction::kBackward, wave, at::Tensor());
}

void BoundaryCommunicator::Abandon(const plan::RankStepPlan& plan) {
  for (const plan::Direction direction : {plan::Direction::kForward, plan::Direction::kBackward}) {
    const std::vector<plan::Transfer>& transfers =
        direction == plan::Direction::kForward ? plan.forward_receives : plan.backward_receives;
    for (const plan::Transfer& transfer : transfers) {
      const transport::Tag tag = BoundaryTag(plan.step, plan.attempt, direction, transfer.wave);
      if (posted_.count(tag) != 0 || taken_.count(tag) != 0) continue;
      // Into staging: the message is only absorbed.
      if (absl::Status s = PostAhead(plan, direction, transfer.wave, at::Tensor()); !s.ok()) {
        HETPAR_LOG(WARNING) << "step " << plan.step << ": cannot post the receives of wave "
                            << transfer.wave << " to absorb them: " << StatusText(s);
      }
    }
  }
}

void BoundaryCommunicator::AbandonUnrun(const plan::RankStepPlan& plan) {
  BeginStep();
  Abandon(plan);
}

void BoundaryCommunicator::BeginStep() {
  ++steps_begun_;
  const int64_t draining = drain_->Prune();
  if (draining > 0 && draining != draining_sends_) {
    HETPAR_LOG(INFO) << draining
                     << " boundary sends of attempts that ended early are still in flight, "
                        "waiting for their receivers to take them";
  }
  draining_sends_ = draining;
  taken_.clear();
  // Receives left a step ago or more were withdrawn (destroying a pending receive withdraws
  // it); the ones the last step left wait one more.
  std::vector<std::pair<int64_t, PostedReceive>> keep;
  for (auto& [left, receive] : stale_) {
    if (receive.op != nullptr && !receive.op->Done() && left >= steps_begun_ - 1) {
      keep.emplace_back(left, std::move(receive));
    }
  }
  stale_ = std::move(keep);
  for (auto& [tag, receives] : posted_) {
    for (PostedReceive& receive : receives) {
      if (receive.op != nullptr && !receive.op->Done()) {
        stale_.emplace_back(steps_begun_, std::move(receive));
      }
    }
  }
  posted_.clear();
  local_.clear();
  device_headers_.clear();
  for (auto& intervals : intervals_) intervals.clear();
}

BridgeStats BoundaryCommunicator::Stats(plan::Direction direction) const {
  BridgeStats stats;
  std::vector<std::pair<absl::Time, absl::Time>> spans;
  for (const Interval& interval : intervals_[static_cast<int>(direction)]) {
    ++stats.messages;
    stats.bytes += interval.bytes;
    stats.sum_transfer_s += absl::ToDoubleSeconds(interval.end - interval.start);
    spans.emplace_back(interval.start, interval.end);
  }
  stats.transfer_s = UnionSeconds(std::move(spans));
  return stats;
}

absl::Status BoundaryCommunicator::Receive(const plan::RankStepPlan& plan,
                                           plan::Direction direction, int64_t wave,
                                           const std::vector<plan::Transfer>& transfers,
                                           at::Tensor& rows, bool add) {
  const int64_t row_bytes = plan.row_bytes;
  std::vector<const plan::Transfer*> expected;
  for (const plan::Transfer& transfer : transfers) {
    if (transfer.wave != wave) continue;
    expected.push_back(&transfer);
  }
  if (expected.empty()) return absl::OkStatus();
  HETPAR_RETURN_IF_ERROR(CheckRows(rows, row_bytes, "boundary receive", ReceiveDevice()));
  // Forward rows go straight into `rows`; gradients are added, so they are staged.
  const at::Tensor straight = add ? at::Tensor() : rows;
  const transport::Tag tag = BoundaryTag(plan.step, plan.attempt, direction, wave);
  std::vector<PostedReceive> posted;
  auto ahead = posted_.find(tag);
  if (ahead != posted_.end()) {
    posted = std::move(ahead->second);
    posted_.erase(ahead);
  } else {
    HETPAR_ASSIGN_OR_RETURN(posted, Post(plan, direction, wave, transfers, straight));
  }
  taken_.insert(tag);
  // Whenever the step ends here (interrupted, a peer gone, a bad message), the receives not taken
  // yet stay posted, so live peers' sends complete (BeginStep withdraws them a step later).
  size_t next = 0;  // posted[next...] are not taken yet
  bool all_taken = false;
  absl::Cleanup leave_posted = [&] {
    if (all_taken || next >= posted.size()) return;
    std::vector<PostedReceive>& left = posted_[tag];
    for (size_t j = next; j < posted.size(); ++j) left.push_back(std::move(posted[j]));
  };
  for (const PostedReceive& r : posted) {
    if (r.rows.defined() && !r.rows.is_same(rows)) {
      return absl::InvalidArgumentError(
          absl::StrCat("boundary receive of wave ", wave,
                       ": the receives were posted into another buffer than the one given"));
    }
  }
  if (posted.size() != expected.size()) {
    return absl::InternalError(absl::StrCat("boundary receive of wave ", wave, ": ", posted.size(),
                                            " receives posted for ", expected.size(),
                                            " transfers"));
  }
  // A receive that could not be posted fails the wave before any wait for the others.
  for (size_t i = 0; i < expected.size(); ++i) {
    if (!posted[i].error.ok()) {
      return Annotate(posted[i].error,
                      absl::StrCat("receiving the ", std::string(plan::DirectionName(direction)),
                                   " rows of step ", plan.step, " wave ", wave, " from rank ",
                                   expected[i]->src_rank));
    }
  }
  const absl::Time deadline = absl::Now() + timeout_;
  for (size_t i = 0; i < expected.size(); ++i) {
    next = i;
    const plan::Transfer& transfer = *expected[i];
    PostedReceive& receive = posted[i];
    if (transfer.src_rank == plan.rank) {
      auto local = local_.find({BoundaryTag(plan.step, plan.attempt, direction, wave), plan.rank});
      if (local == local_.end()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "rank ", plan.rank, " expects its own ", std::string(plan::DirectionName(direction)),
            " rows of step ", plan.step, " wave ", wave, " but has not sent them"));
      }
      const at::Tensor source = std::move(local->second);
      local_.erase(local);
      for (const plan::BlockPiece& piece : transfer.pieces) {
        HETPAR_RETURN_IF_ERROR(CheckPiece(piece.src_offset, piece.rows, source.size(0), wave));
        HETPAR_RETURN_IF_ERROR(CheckPiece(piece.dst_offset, piece.rows, rows.size(0), wave));
        at::Tensor from = source.narrow(0, piece.src_offset, piece.rows);
        at::Tensor to = rows.narrow(0, piece.dst_offset, piece.rows);
        if (add) {
          to.add_(from);
        } else {
          to.copy_(from);
        }
      }
      bytes_received_ += transfer.rows * row_bytes;
      continue;
    }
    if (receive.src_rank != transfer.src_rank || receive.op == nullptr) {
      return absl::InternalError(absl::StrCat(
          "boundary receive of wave ", wave, ": the receive posted for rank ", receive.src_rank,
          " does not match the transfer from rank ", transfer.src_rank));
    }
    absl::Status status = WaitInSlices([&](absl::Time until) { return receive.op->Wait(until); },
                                       deadline, interrupt_);
    if (!status.ok()) {
      return Annotate(status,
                      absl::StrCat("receiving the ", std::string(plan::DirectionName(direction)),
                                   " rows of step ", plan.step, " wave ", wave, " from rank ",
                                   transfer.src_rank));
    }
    const size_t expected_size = MessageSize(transfer, row_bytes);
    const size_t bytes = receive.op->bytes();
    if (bytes != expected_size) {
      return absl::DataLossError(absl::StrCat("boundary message from rank ", transfer.src_rank,
                                              " has ", bytes, " bytes; the plan says ",
                                              expected_size));
    }
    if (receive.device_message.defined()) {
      // A message on the device: its framing and header (as long as the plan's) start for the
      // host behind the work queued so far and are checked after the step's host sync
      // (CheckDeviceHeaders); the rows are placed at the plan's offsets meanwhile.
      const int64_t head_bytes =
          static_cast<int64_t>(kPrefixBytes) +
          plan::EncodedHeaderSize(static_cast<int64_t>(transfer.pieces.size()));
      DeviceHeader& header = device_headers_.emplace_back();
      // The copies queued from here read the message: its block is not handed to a later
      // receive before they are done (the allocator waits for the stream's work queued when the
      // block is freed), however this returns.
      HETPAR_RETURN_IF_ERROR(nn::RunTorch("copying a boundary header from the device", [&] {
        nn::RecordStreamUse(receive.device_message);
        header.head = nn::HostBytesFor(head_bytes, device_);
        header.head.copy_(receive.device_message.narrow(0, 0, head_bytes), /*non_blocking=*/true);
      }));
      header.copied = nn::StreamMark::After(device_);
      header.expected = plan::HeaderFor(plan, direction, transfer);
      header.direction = direction;
      header.src_rank = transfer.src_rank;
      header.step = plan.step;
      header.wave = wave;
      header.posted = receive.posted;
      header.end = receive.op->completed_at();
      header.bytes = static_cast<int64_t>(bytes);
      bytes_received_ += transfer.rows * row_bytes;
      HETPAR_RETURN_IF_ERROR(PlaceFromDevice(receive.device_message,
                                             static_cast<size_t>(head_bytes), transfer, wave,
                                             row_bytes, rows, add));
      continue;
    }
    const std::string_view message(receive.buffer.data(), receive.buffer.size());
    HETPAR_ASSIGN_OR_RETURN(const uint64_t header_size,
                            CheckHeader(message, plan::HeaderFor(plan, direction, transfer),
                                        direction, transfer.src_rank, receive.posted,
                                        receive.op->completed_at(), static_cast<int64_t>(bytes)));
    bytes_received_ += transfer.rows * row_bytes;
    if (receive.rows.defined()) continue;  // the rows landed in place
    const char* payload = message.data() + kPrefixBytes + header_size;
    // The header's length puts the rows anywhere: a tensor over them must start on an element
    // boundary (float64 rows after a header of 4 mod 8 bytes would not), so such rows are copied.
    std::vector<double> aligned;
    if (reinterpret_cast<uintptr_t>(payload) % static_cast<uintptr_t>(rows.element_size()) != 0) {
      const size_t payload_bytes = message.size() - kPrefixBytes - header_size;
      aligned.resize((payload_bytes + sizeof(double) - 1) / sizeof(double));
      std::memcpy(aligned.data(), payload, payload_bytes);
      payload = reinterpret_cast<const char*>(aligned.data());
    }
    for (const plan::BlockPiece& piece : transfer.pieces) {
      HETPAR_RETURN_IF_ERROR(CheckPiece(piece.dst_offset, piece.rows, rows.size(0), wave));
      // Staged messages are gradients: added in.
      at::Tensor incoming =
          at::from_blob(const_cast<char*>(payload), {piece.rows, rows.size(1)}, rows.options());
      rows.narrow(0, piece.dst_offset, piece.rows).add_(incoming);
      payload += piece.rows * row_bytes;
    }
  }
  all_taken = true;
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> BoundaryCommunicator::CheckHeader(std::string_view message,
                                                           const plan::MessageHeader& expected,
                                                           plan::Direction direction,
                                                           int64_t src_rank, absl::Time posted,
                                                           absl::Time end, int64_t bytes) {
  if (message.size() < kPrefixBytes) {
    return absl::DataLossError(absl::StrCat("boundary message from rank ", src_rank, " has ",
                                            message.size(), " bytes, less than its framing"));
  }
  const uint64_t header_size = GetU64(message.data());
  if (header_size > message.size() - kPrefixBytes) {
    return absl::DataLossError(absl::StrCat("boundary message from rank ", src_rank,
                                            ": header length ", header_size, " exceeds the ",
                                            message.size(), "-byte message"));
  }
  HETPAR_ASSIGN_OR_RETURN(plan::MessageHeader header,
                          plan::DecodeHeader(message.substr(kPrefixBytes, header_size)));
  HETPAR_RETURN_IF_ERROR(plan::ValidateHeader(header, expected));
  const absl::Time sent =
      absl::FromUnixNanos(static_cast<int64_t>(GetU64(message.data() + kLengthBytes)));
  intervals_[static_cast<int>(direction)].push_back(
      {std::min(std::max(sent, posted), end), end, bytes});
  if (trace::Recorder::Process().on()) {
    trace::Recorder::Process().CompleteAt(
        trace::kBridgeLane,
        direction == plan::Direction::kForward ? "receive image rows" : "receive gradients",
        "bridge",
        absl::ToDoubleMicroseconds(intervals_[static_cast<int>(direction)].back().start -
                                   absl::UnixEpoch()),
        absl::ToDoubleMicroseconds(end - absl::UnixEpoch()),
        {{"peer", src_rank}, {"bytes", bytes}, {"wave", expected.wave}});
  }
  return header_size;
}

absl::Status BoundaryCommunicator::CheckDeviceHeaders() {
  std::vector<DeviceHeader> headers = std::move(device_headers_);
  device_headers_.clear();
  for (const DeviceHeader& h : headers) {
    // After the step's host sync the copy is done; otherwise this waits for it.
    HETPAR_RETURN_IF_ERROR(
        nn::RunTorch("waiting for a boundary header from the device", [&] { h.copied.Wait(); }));
    const std::string_view message(static_cast<const char*>(h.head.data_ptr()),
                                   static_cast<size_t>(h.head.numel()));
    const absl::StatusOr<uint64_t> header_size =
        CheckHeader(message, h.expected, h.direction, h.src_rank, h.posted, h.end, h.bytes);
    if (!header_size.ok()) {
      return Annotate(
          header_size.status(),
          absl::StrCat("the ", std::string(plan::DirectionName(h.direction)), " rows of step ",
                       h.step, " wave ", h.wave, " from rank ", h.src_rank));
    }
    // The rows were placed after a header of the plan's size.
    if (*header_size != message.size() - kPrefixBytes) {
      return absl::DataLossError(
          absl::StrCat("boundary message from rank ", h.src_rank, ": header length ", *header_size,
                       ", but the plan's header for step ", h.step, " wave ", h.wave, " has ",
                       message.size() - kPrefixBytes, " bytes"));
    }
  }
  return absl::OkStatus();
}

absl::Status BoundaryCommunicator::PlaceFromDevice(const at::Tensor& message, size_t payload_offset,
                                                   const plan::Transfer& transfer, int64_t wave,
                                                   int64_t row_bytes, at::Tensor& rows, bool add) {
  for (const plan::BlockPiece& piece : transfer.pieces) {
    HETPAR_RETURN_IF_ERROR(CheckPiece(piece.dst_offset, piece.rows, rows.size(0), wave));
  }
  return nn::RunTorch("placing boundary rows on the device", [&] {
    int64_t offset = static_cast<int64_t>(payload_offset);
    for (const plan::BlockPiece& piece : transfer.pieces) {
      const int64_t n = piece.rows * row_bytes;
      const at::Tensor incoming = message.narrow(0, offset, n);
      at::Tensor to = rows.narrow(0, piece.dst_offset, piece.rows);
      if (add) {
        // Gradients are added: the bytes go to an aligned buffer first, then read as rows.
        at::Tensor aligned = at::empty({n}, message.options());
        aligned.copy_(incoming);
        to.add_(aligned.view(rows.scalar_type()).view({piece.rows, rows.size(1)}));
      } else {
        to.view(at::kByte).view({-1}).copy_(incoming);
      }
      offset += n;
    }
  });
}

}  // namespace hetpar::train
