#include "common/train/boundary.h"

#include <ATen/ATen.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace hetpar::train {
namespace {

constexpr size_t kLengthBytes = 8;

void PutLength(std::string* out, uint64_t length) {
  for (size_t i = 0; i < kLengthBytes; ++i) out->push_back(static_cast<char>(length >> (8 * i)));
}

uint64_t GetLength(const char* bytes) {
  uint64_t length = 0;
  for (size_t i = 0; i < kLengthBytes; ++i) {
    length |= static_cast<uint64_t>(static_cast<uint8_t>(bytes[i])) << (8 * i);
  }
  return length;
}

absl::Status CheckRows(const at::Tensor& rows, int64_t row_bytes, std::string_view what) {
  if (!rows.defined() || rows.dim() != 2 || !rows.is_contiguous() || !rows.device().is_cpu() ||
      rows.size(1) * static_cast<int64_t>(rows.element_size()) != row_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(std::string(what), ": expected a contiguous CPU tensor [rows, hidden] of ",
                     row_bytes, " bytes per row",
                     rows.defined() ? absl::StrCat(", got ", rows.dim(), " dims") : std::string()));
  }
  return absl::OkStatus();
}

}  // namespace

transport::Tag BoundaryTag(int64_t step, plan::Direction direction, int64_t wave) {
  const uint64_t s = static_cast<uint64_t>(step) & ((uint64_t{1} << 20) - 1);
  const uint64_t w = static_cast<uint64_t>(wave) & ((uint64_t{1} << 19) - 1);
  return (s << 20) | (w << 1) | (direction == plan::Direction::kBackward ? 1 : 0);
}

void PendingSends::Add(std::unique_ptr<std::string> buffer,
                       std::unique_ptr<transport::Operation> op) {
  bytes_ += static_cast<int64_t>(buffer->size());
  buffers_.push_back(std::move(buffer));
  ops_.push_back(std::move(op));
}

absl::Status PendingSends::Wait(absl::Time deadline) {
  absl::Status status = transport::WaitAll(ops_, deadline);
  if (status.ok()) {
    ops_.clear();
    buffers_.clear();
  }
  return status;
}

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
    const std::vector<plan::Transfer>& transfers, const at::Tensor& rows) {
  PendingSends pending;
  const int64_t row_bytes = plan.row_bytes;
  bool checked = false;
  for (const plan::Transfer& transfer : transfers) {
    if (transfer.wave != wave) continue;
    if (!checked) {
      HETPAR_RETURN_IF_ERROR(CheckRows(rows, row_bytes, "boundary send"));
      checked = true;
    }
    if (transfer.dst_rank == plan.rank) {
      // Rows that stay on this rank: the receiver copies them straight from `rows` (which the
      // caller leaves untouched until the step's receives are done); nothing is packed.
      local_[{BoundaryTag(plan.step, direction, wave), plan.rank}] = rows;
      bytes_sent_ += transfer.rows * row_bytes;
      continue;
    }
    const std::string header = plan::EncodeHeader(plan::HeaderFor(plan, direction, transfer));
    auto message = std::make_unique<std::string>();
    message->reserve(kLengthBytes + header.size() + transfer.rows * row_bytes);
    PutLength(message.get(), header.size());
    message->append(header);
    const char* base = static_cast<const char*>(rows.data_ptr());
    for (const plan::BlockPiece& piece : transfer.pieces) {
      if (piece.src_offset < 0 || piece.src_offset + piece.rows > rows.size(0)) {
        return absl::InternalError(absl::StrCat(
            "boundary send: piece rows [", piece.src_offset, ", ", piece.src_offset + piece.rows,
            ") outside the ", rows.size(0), "-row buffer of wave ", wave));
      }
      message->append(base + piece.src_offset * row_bytes, piece.rows * row_bytes);
    }
    HETPAR_ASSIGN_OR_RETURN(transport::PeerId peer, Peer(transfer.dst_rank));
    const transport::ConstBuffer buffer =
        transport::ConstBuffer::Host(message->data(), message->size());
    HETPAR_ASSIGN_OR_RETURN(
        auto op, transport_->Send(peer, BoundaryTag(plan.step, direction, wave), buffer));
    bytes_sent_ += transfer.rows * row_bytes;
    pending.Add(std::move(message), std::move(op));
  }
  return pending;
}

absl::Status BoundaryCommunicator::Receive(const plan::RankStepPlan& plan,
                                           plan::Direction direction, int64_t wave,
                                           const std::vector<plan::Transfer>& transfers,
                                           at::Tensor& rows, bool add) {
  const int64_t row_bytes = plan.row_bytes;
  std::vector<const plan::Transfer*> expected;
  std::vector<std::string> buffers;
  std::vector<std::unique_ptr<transport::Operation>> ops;
  for (const plan::Transfer& transfer : transfers) {
    if (transfer.wave != wave) continue;
    expected.push_back(&transfer);
  }
  if (expected.empty()) return absl::OkStatus();
  HETPAR_RETURN_IF_ERROR(CheckRows(rows, row_bytes, "boundary receive"));
  buffers.reserve(expected.size());
  for (const plan::Transfer* transfer : expected) {
    const size_t size = kLengthBytes +
                        static_cast<size_t>(plan::EncodedHeaderSize(
                            static_cast<int64_t>(transfer->pieces.size()))) +
                        static_cast<size_t>(transfer->rows * row_bytes);
    if (transfer->src_rank == plan.rank) {
      auto local = local_.find({BoundaryTag(plan.step, direction, wave), plan.rank});
      if (local == local_.end()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "rank ", plan.rank, " expects its own ", std::string(plan::DirectionName(direction)),
            " rows of step ", plan.step, " wave ", wave, " but has not sent them"));
      }
      const at::Tensor source = std::move(local->second);
      local_.erase(local);
      for (const plan::BlockPiece& piece : transfer->pieces) {
        if (piece.src_offset < 0 || piece.src_offset + piece.rows > source.size(0) ||
            piece.dst_offset < 0 || piece.dst_offset + piece.rows > rows.size(0)) {
          return absl::InternalError(
              absl::StrCat("boundary handover: piece outside the buffers "
                           "of wave ",
                           wave));
        }
        at::Tensor from = source.narrow(0, piece.src_offset, piece.rows);
        at::Tensor to = rows.narrow(0, piece.dst_offset, piece.rows);
        if (add) {
          to.add_(from);
        } else {
          to.copy_(from);
        }
      }
      bytes_received_ += transfer->rows * row_bytes;
      buffers.emplace_back();
      ops.push_back(nullptr);
      continue;
    }
    buffers.emplace_back(size, '\0');
    HETPAR_ASSIGN_OR_RETURN(transport::PeerId peer, Peer(transfer->src_rank));
    HETPAR_ASSIGN_OR_RETURN(
        auto op, transport_->Recv(peer, BoundaryTag(plan.step, direction, wave),
                                  transport::MutableBuffer::Host(buffers.back().data(), size)));
    ops.push_back(std::move(op));
  }
  const absl::Time deadline = absl::Now() + timeout_;
  for (size_t i = 0; i < expected.size(); ++i) {
    const plan::Transfer& transfer = *expected[i];
    if (ops[i] == nullptr) continue;  // handed over in memory above
    absl::Status status = ops[i]->Wait(deadline);
    if (!status.ok()) {
      return Annotate(status,
                      absl::StrCat("receiving the ", std::string(plan::DirectionName(direction)),
                                   " rows of step ", plan.step, " wave ", wave, " from rank ",
                                   transfer.src_rank));
    }
    const std::string& message = buffers[i];
    const size_t expected_size =
        kLengthBytes +
        static_cast<size_t>(plan::EncodedHeaderSize(static_cast<int64_t>(transfer.pieces.size()))) +
        static_cast<size_t>(transfer.rows * row_bytes);
    const size_t bytes = ops[i]->bytes();
    if (bytes != expected_size) {
      return absl::DataLossError(absl::StrCat("boundary message from rank ", transfer.src_rank,
                                              " has ", bytes, " bytes; the plan says ",
                                              expected_size));
    }
    const uint64_t header_size = GetLength(message.data());
    if (header_size > message.size() - kLengthBytes) {
      return absl::DataLossError(absl::StrCat("boundary message from rank ", transfer.src_rank,
                                              ": header length ", header_size, " exceeds the ",
                                              message.size(), "-byte message"));
    }
    HETPAR_ASSIGN_OR_RETURN(
        plan::MessageHeader header,
        plan::DecodeHeader(std::string_view(message).substr(kLengthBytes, header_size)));
    HETPAR_RETURN_IF_ERROR(
        plan::ValidateHeader(header, plan::HeaderFor(plan, direction, transfer)));
    const char* payload = message.data() + kLengthBytes + header_size;
    char* base = static_cast<char*>(rows.data_ptr());
    for (const plan::BlockPiece& piece : transfer.pieces) {
      if (piece.dst_offset < 0 || piece.dst_offset + piece.rows > rows.size(0)) {
        return absl::InternalError(absl::StrCat(
            "boundary receive: piece rows [", piece.dst_offset, ", ", piece.dst_offset + piece.rows,
            ") outside the ", rows.size(0), "-row buffer of wave ", wave));
      }
      if (add) {
        at::Tensor incoming =
            at::from_blob(const_cast<char*>(payload), {piece.rows, rows.size(1)}, rows.options());
        rows.narrow(0, piece.dst_offset, piece.rows).add_(incoming);
      } else {
        std::memcpy(base + piece.dst_offset * row_bytes, payload, piece.rows * row_bytes);
      }
      payload += piece.rows * row_bytes;
    }
    bytes_received_ += transfer.rows * row_bytes;
  }
  return absl::OkStatus();
}

}  // namespace hetpar::train
