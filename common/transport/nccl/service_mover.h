// The test mover of the NCCL backend: moves host bytes over the UCX transport's service tag
// space (UcxTransport::SendService/RecvService), so the whole tag-matching protocol runs, and is
// tested by the conformance suite, on machines without a GPU. Messages of one direction go on
// one service tag (kDataTag), which UCX keeps in order, so they pair in posting order as NCCL's
// do. Internal to the NCCL backend.
#ifndef HETPAR_COMMON_TRANSPORT_NCCL_SERVICE_MOVER_H_
#define HETPAR_COMMON_TRANSPORT_NCCL_SERVICE_MOVER_H_

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/transport/nccl/device_mover.h"
#include "common/transport/ucx/ucx_transport.h"

namespace hetpar::transport::nccl::internal {

class ServiceMover final : public DeviceMover {
 public:
  // The service tag its data messages use (the protocol's control channel uses another).
  static constexpr Tag kDataTag = 1;

  // `ucx` is not owned and must outlive the mover's transfers' posting (it may be destroyed
  // while transfers are pending: they then complete as cancelled).
  explicit ServiceMover(ucx::UcxTransport* ucx) : ucx_(ucx) {}

  MemoryKind kind() const override { return MemoryKind::kHost; }
  absl::StatusOr<std::string> CreatePeerSetup(PeerId peer) override;
  absl::Status StartPeer(PeerId peer, std::string_view peer_name, std::string_view setup,
                         bool creator) override;
  absl::StatusOr<bool> PollPeer(PeerId peer) override;
  absl::StatusOr<std::unique_ptr<MoverTransfer>> PostSend(PeerId peer, const void* data,
                                                          size_t size, int device) override;
  absl::StatusOr<std::unique_ptr<MoverTransfer>> PostRecv(
      PeerId peer, const std::vector<MutableBuffer>& segments, size_t size, int device) override;
  void AbortPeer(PeerId peer) override;

 private:
  struct PeerChannels {
    bool aborted = false;
    // The transfers' UCX operations, to cancel the receives on abort.
    std::vector<std::weak_ptr<Operation>> operations;
  };

  void Track(PeerId peer, const std::shared_ptr<Operation>& operation);

  ucx::UcxTransport* const ucx_;
  std::map<PeerId, PeerChannels> peers_;
};

}  // namespace hetpar::transport::nccl::internal

#endif  // HETPAR_COMMON_TRANSPORT_NCCL_SERVICE_MOVER_H_
