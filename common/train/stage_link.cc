#include "common/train/stage_link.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/nn/device_copy.h"
#include "common/nn/torch_status.h"
#include "common/status.h"
#include "common/train/little_endian.h"

namespace hetpar::train {
namespace {

constexpr uint64_t kMagic = 0x31454741545350ULL;  // "PSTAGE1" (little-endian)
constexpr size_t kHeaderWords = 6;  // magic, step, attempt, direction, microbatch, rows
constexpr size_t kHeaderBytes = kHeaderWords * 8;
constexpr int64_t kStageWaveBit = int64_t{1} << 18;

std::string Describe(int64_t step, int64_t attempt, plan::Direction direction, int64_t microbatch,
                     int64_t rows) {
  return absl::StrCat(direction == plan::Direction::kForward ? "activations" : "gradients",
                      " of step ", step, " (attempt ", attempt, ") microbatch ", microbatch, " (",
                      rows, " rows)");
}

}  // namespace

transport::Tag StageTag(int64_t step, int64_t attempt, plan::Direction direction,
                        int64_t microbatch) {
  return BoundaryTag(step, attempt, direction, microbatch | kStageWaveBit);
}

void StageLink::BeginAttempt(int64_t attempt) {
  Reset();
  attempt_ = attempt;
}

absl::StatusOr<transport::PeerId> StageLink::Peer(int64_t rank) const {
  auto it = peers_.find(rank);
  if (it == peers_.end()) {
    return absl::FailedPreconditionError(absl::StrCat("no data-plane connection to rank ", rank,
                                                      " (the neighbouring pipeline stage)"));
  }
  return it->second;
}

absl::Status StageLink::Send(int64_t dst, int64_t step, plan::Direction direction,
                             int64_t microbatch, const at::Tensor& rows) {
  if (!rows.defined() || rows.dim() != 2) {
    return absl::InvalidArgumentError("stage send: expected a tensor [rows, hidden]");
  }
  HETPAR_ASSIGN_OR_RETURN(transport::PeerId peer, Peer(dst));
  HETPAR_RETURN_IF_ERROR(Reap());
  const transport::Tag tag = StageTag(step, attempt_, direction, microbatch);
  const int64_t row_count = rows.size(0);
  const uint64_t header[kHeaderWords] = {kMagic,
                                         static_cast<uint64_t>(step),
                                         static_cast<uint64_t>(attempt_),
                                         static_cast<uint64_t>(direction),
                                         static_cast<uint64_t>(microbatch),
                                         static_cast<uint64_t>(row_count)};
  // The message is host memory (pinned for rows on a GPU): the header, then the rows copied in
  // (behind the work queued on the GPU's stream, without waiting for it).
  Sent sent;
  size_t data_bytes = 0;
  HETPAR_RETURN_IF_ERROR(nn::RunTorch("copying stage rows into their message", [&] {
    const at::Tensor data = rows.detach().contiguous();
    data_bytes = static_cast<size_t>(data.numel()) * data.element_size();
    sent.message = nn::HostBytesFor(static_cast<int64_t>(kHeaderBytes + data_bytes), rows.device());
    char* bytes = static_cast<char*>(sent.message.data_ptr());
    for (size_t i = 0; i < kHeaderWords; ++i) StoreU64(bytes + 8 * i, header[i]);
    if (data_bytes > 0) {
      sent.message.narrow(0, kHeaderBytes, static_cast<int64_t>(data_bytes))
          .copy_(data.view(at::kByte).reshape({-1}), /*non_blocking=*/true);
    }
  }));
  const transport::ConstBuffer buffer =
      transport::ConstBuffer::Host(sent.message.data_ptr(), kHeaderBytes + data_bytes);
  if (rows.is_cuda()) {
    // Posted by the ordered sender once the copy is done; this thread does not wait for it.
    const nn::StreamMark copied = nn::StreamMark::After(rows.device());
    if (ordered_sender_ == nullptr) {
      ordered_sender_ = std::make_unique<StreamOrderedSender>(transport_, rows.device());
    }
    sent.op = ordered_sender_->Post(peer, tag, buffer, sent.message,
                                    [copied] { return copied.Reached(); });
  } else {
    HETPAR_ASSIGN_OR_RETURN(sent.op, transport_->Send(peer, tag, buffer));
  }
  bytes_sent_ += static_cast<int64_t>(data_bytes);
  sends_.push_back(std::move(sent));
  return absl::OkStatus();
}

absl::Status StageLink::Reap() {
  // Every send still in flight is kept, past a failed one too: a send is never withdrawn
  // (destroying one tears down the connection to a live neighbour).
  std::vector<Sent> pending;
  absl::Status failed;
  for (Sent& sent : sends_) {
    if (!sent.op->Done()) {
      pending.push_back(std::move(sent));
      continue;
    }
    absl::Status status = sent.op->Wait(absl::InfinitePast());
    if (!status.ok() && failed.ok()) {
      failed = Annotate(status, "sending to a neighbouring pipeline stage");
    }
  }
  sends_ = std::move(pending);
  return failed;
}

absl::Status StageLink::Post(int64_t src, int64_t step, plan::Direction direction,
                             int64_t microbatch, const at::Tensor& rows) {
  const Key key{src, StageTag(step, attempt_, direction, microbatch)};
  if (posted_.count(key) != 0) return absl::OkStatus();
  if (!rows.defined() || rows.dim() != 2 || !rows.is_contiguous() || !rows.device().is_cpu()) {
    return absl::InvalidArgumentError(
        "stage receive: expected a contiguous CPU tensor [rows, hidden]");
  }
  HETPAR_ASSIGN_OR_RETURN(transport::PeerId peer, Peer(src));
  Posted posted;
  posted.header.assign(kHeaderBytes, 0);
  posted.rows = rows;
  std::vector<transport::MutableBuffer> segments = {
      transport::MutableBuffer::Host(posted.header.data(), posted.header.size())};
  const size_t data_bytes = static_cast<size_t>(rows.numel()) * rows.element_size();
  if (data_bytes > 0)
    segments.push_back(transport::MutableBuffer::Host(rows.data_ptr(), data_bytes));
  HETPAR_ASSIGN_OR_RETURN(posted.op,
                          transport_->RecvScatter(peer, std::get<1>(key), std::move(segments)));
  posted_.emplace(key, std::move(posted));
  return absl::OkStatus();
}

absl::StatusOr<at::Tensor> StageLink::Receive(int64_t src, int64_t step, plan::Direction direction,
                                              int64_t microbatch) {
  auto it = posted_.find(Key{src, StageTag(step, attempt_, direction, microbatch)});
  if (it == posted_.end()) {
    return absl::FailedPreconditionError(
        absl::StrCat("stage receive of the ", Describe(step, attempt_, direction, microbatch, 0),
                     " from rank ", src, " was not posted"));
  }
  const Key key = it->first;
  Posted posted = std::move(it->second);
  posted_.erase(it);
  const int64_t rows = posted.rows.size(0);
  const std::string expected = Describe(step, attempt_, direction, microbatch, rows);
  absl::Status status = WaitInSlices([&](absl::Time until) { return posted.op->Wait(until); },
                                     absl::Now() + timeout_, interrupt_);
  if (!status.ok()) {
    // Still posted (an abort, a timeout): it stays so, with the attempt's other receives.
    if (!posted.op->Done()) posted_.emplace(key, std::move(posted));
    return Annotate(status, absl::StrCat("receiving the ", expected, " from pipeline rank ", src));
  }
  taken_.insert(key);
  const size_t data_bytes = static_cast<size_t>(posted.rows.numel()) * posted.rows.element_size();
  const char* h = posted.header.data();
  const bool matches = posted.op->bytes() == kHeaderBytes + data_bytes && GetU64(h) == kMagic &&
                       GetU64(h + 8) == static_cast<uint64_t>(step) &&
                       GetU64(h + 16) == static_cast<uint64_t>(attempt_) &&
                       GetU64(h + 24) == static_cast<uint64_t>(direction) &&
                       GetU64(h + 32) == static_cast<uint64_t>(microbatch) &&
                       GetU64(h + 40) == static_cast<uint64_t>(rows);
  if (!matches) {
    const plan::Direction got_direction =
        GetU64(h + 24) == 0 ? plan::Direction::kForward : plan::Direction::kBackward;
    return absl::DataLossError(absl::StrCat(
        "pipeline rank ", src, " sent ", posted.op->bytes(), " bytes",
        GetU64(h) == kMagic
            ? absl::StrCat(" of the ", Describe(static_cast<int64_t>(GetU64(h + 8)),
                                                static_cast<int64_t>(GetU64(h + 16)), got_direction,
                                                static_cast<int64_t>(GetU64(h + 32)),
                                                static_cast<int64_t>(GetU64(h + 40))))
            : std::string(" without a stage header"),
        "; expected the ", expected, ", ", kHeaderBytes + data_bytes, " bytes"));
  }
  bytes_received_ += static_cast<int64_t>(data_bytes);
  return posted.rows;
}

absl::Status StageLink::WaitSends() {
  std::vector<std::unique_ptr<transport::Operation>> ops;
  for (Sent& sent : sends_) ops.push_back(std::move(sent.op));
  absl::Status status = transport::WaitAll(ops, absl::Now() + timeout_, interrupt_);
  if (!status.ok()) {
    for (size_t i = 0; i < ops.size(); ++i) sends_[i].op = std::move(ops[i]);
    return Annotate(status, "sending to the neighbouring pipeline stages");
  }
  sends_.clear();
  return absl::OkStatus();
}

void StageLink::Abandon(int64_t step, const std::vector<Expected>& expected, int64_t row_bytes) {
  const size_t posted_before = posted_.size();
  // The absorbed messages are never read: the receives from one neighbour (whose messages land
  // one at a time) share one scratch buffer, of the largest of them, each receive holding it
  // until it is withdrawn or done.
  std::map<int64_t, int64_t> largest;  // source rank -> rows
  for (const Expected& message : expected) {
    largest[message.src] = std::max(largest[message.src], message.rows);
  }
  std::map<int64_t, at::Tensor> scratches;
  for (const auto& [src, rows] : largest) {
    scratches[src] = at::empty({std::max<int64_t>(1, rows * row_bytes)}, at::kByte);
  }
  for (const Expected& message : expected) {
    const at::Tensor& scratch = scratches[message.src];
    const Key key{message.src, StageTag(step, attempt_, message.direction, message.microbatch)};
    if (posted_.count(key) != 0 || taken_.count(key) != 0) continue;
    absl::StatusOr<transport::PeerId> peer = Peer(message.src);
    if (!peer.ok()) continue;
    Posted posted;
    posted.header.assign(kHeaderBytes, 0);
    posted.rows = scratch;
    std::vector<transport::MutableBuffer> segments = {
        transport::MutableBuffer::Host(posted.header.data(), posted.header.size())};
    const int64_t bytes = std::max<int64_t>(0, message.rows) * row_bytes;
    if (bytes > 0) {
      segments.push_back(
          transport::MutableBuffer::Host(scratch.data_ptr(), static_cast<size_t>(bytes)));
    }
    absl::StatusOr<std::unique_ptr<transport::Operation>> op =
        transport_->RecvScatter(*peer, std::get<1>(key), std::move(segments));
    if (!op.ok()) {
      // A neighbour that is gone sends nothing more.
      if (absl::IsUnavailable(op.status())) continue;
      HETPAR_LOG(WARNING) << "step " << step << ": cannot post the receive of the "
                          << Describe(step, attempt_, message.direction, message.microbatch,
                                      message.rows)
                          << " from pipeline rank " << message.src
                          << " to absorb it: " << StatusText(op.status());
      continue;
    }
    posted.op = std::move(op).value();
    posted_.emplace(key, std::move(posted));
  }
  int64_t in_flight = 0;
  for (const Sent& sent : sends_) in_flight += sent.op->Done() ? 0 : 1;
  if (posted_.size() == posted_before && in_flight == 0 && posted_before == 0) return;
  HETPAR_LOG(INFO) << "step " << step << " (attempt " << attempt_
                   << ") ended early: the pipeline link absorbs " << posted_.size() - posted_before
                   << " messages of the neighbouring stages (" << posted_before
                   << " receives already posted stay so), and keeps " << in_flight
                   << " sends in flight until they complete";
}

void StageLink::Reset() {
  ++resets_;
  // Receives left by the Reset before the last one are withdrawn (destroying a pending receive
  // withdraws it); those the last one left wait once more, beside the ones left now: each waits
  // through two attempts.
  std::vector<std::pair<int64_t, Posted>> keep;
  for (auto& [left, posted] : stale_) {
    if (!posted.op->Done() && left >= resets_ - 1) keep.emplace_back(left, std::move(posted));
  }
  for (auto& [key, posted] : posted_) {
    if (!posted.op->Done()) keep.emplace_back(resets_, std::move(posted));
  }
  stale_ = std::move(keep);
  posted_.clear();
  taken_.clear();
  // A send is never withdrawn: it completes once its receiver takes it, or fails with the peer.
  std::vector<Sent> pending;
  for (std::vector<Sent>* sends : {&draining_, &sends_}) {
    for (Sent& sent : *sends) {
      if (!sent.op->Done()) pending.push_back(std::move(sent));
    }
  }
  draining_ = std::move(pending);
  sends_.clear();
}

}  // namespace hetpar::train
