#include "common/transport/nccl/service_mover.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace hetpar::transport::nccl::internal {
namespace {

constexpr std::string_view kSetup = "service-mover-v1";

class ServiceTransfer final : public MoverTransfer {
 public:
  explicit ServiceTransfer(std::shared_ptr<Operation> operation)
      : operation_(std::move(operation)) {}

  std::optional<absl::Status> Poll() override {
    if (!operation_->Done()) return std::nullopt;
    return operation_->Wait(absl::InfinitePast());
  }

 private:
  std::shared_ptr<Operation> operation_;
};

}  // namespace

absl::StatusOr<std::string> ServiceMover::CreatePeerSetup(PeerId /*peer*/) {
  return std::string(kSetup);
}

absl::Status ServiceMover::StartPeer(PeerId peer, std::string_view peer_name,
                                     std::string_view setup, bool /*creator*/) {
  if (setup != kSetup) {
    return absl::InvalidArgumentError(
        absl::StrCat("service mover: the setup from peer '", std::string(peer_name), "' is '",
                     std::string(setup), "'; expected '", std::string(kSetup), "'"));
  }
  peers_[peer];
  return absl::OkStatus();
}

absl::StatusOr<bool> ServiceMover::PollPeer(PeerId peer) { return peers_.count(peer) > 0; }

absl::StatusOr<std::unique_ptr<MoverTransfer>> ServiceMover::PostSend(PeerId peer, const void* data,
                                                                      size_t size, int /*device*/) {
  auto op = ucx_->SendService(peer, kDataTag, ConstBuffer::Host(data, size));
  if (!op.ok()) return op.status();
  std::shared_ptr<Operation> shared = std::move(op).value();
  Track(peer, shared);
  return std::unique_ptr<MoverTransfer>(new ServiceTransfer(std::move(shared)));
}

absl::StatusOr<std::unique_ptr<MoverTransfer>> ServiceMover::PostRecv(
    PeerId peer, const std::vector<MutableBuffer>& segments, size_t size, int /*device*/) {
  absl::StatusOr<std::unique_ptr<Operation>> op;
  if (segments.size() == 1) {
    op = ucx_->RecvService(peer, kDataTag, MutableBuffer::Host(segments[0].data, size));
  } else {
    op = ucx_->RecvScatterService(peer, kDataTag, segments);
  }
  if (!op.ok()) return op.status();
  std::shared_ptr<Operation> shared = std::move(op).value();
  Track(peer, shared);
  return std::unique_ptr<MoverTransfer>(new ServiceTransfer(std::move(shared)));
}

void ServiceMover::Track(PeerId peer, const std::shared_ptr<Operation>& operation) {
  std::vector<std::weak_ptr<Operation>>& operations = peers_[peer].operations;
  if (operations.size() >= 64) {
    operations.erase(
        std::remove_if(operations.begin(), operations.end(),
                       [](const std::weak_ptr<Operation>& op) { return op.expired(); }),
        operations.end());
  }
  operations.push_back(operation);
}

void ServiceMover::AbortPeer(PeerId peer) {
  auto it = peers_.find(peer);
  if (it == peers_.end() || it->second.aborted) return;
  it->second.aborted = true;
  // Receives are withdrawn; sends that UCX holds end with the connection (the protocol
  // disconnects or has lost the peer).
  for (const std::weak_ptr<Operation>& weak : it->second.operations) {
    if (std::shared_ptr<Operation> op = weak.lock()) op->Cancel();
  }
  it->second.operations.clear();
}

}  // namespace hetpar::transport::nccl::internal
