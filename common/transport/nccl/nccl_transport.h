// NCCL backend of the data plane: CUDA buffers move by ncclSend/ncclRecv, everything else by the
// UCX transport it wraps.
//
// A worker creates a UcxTransport, registers its address with the coordinator, and once it knows
// the RunSpec wraps it: LocalAddress(), name() and PeerName() stay the UCX transport's, so peers
// connect with the addresses they already have. Host memory (Send/Recv/RecvScatter) passes
// straight through to the UCX transport with the same tags.
//
// Device memory goes through a tag-matching protocol, because NCCL has no tags:
//   - Control channel: fixed-size control messages on one tag of the UCX transport's service tag
//     space (UcxTransport::SendService/RecvService; user tags use all 40 bits), so they stay in
//     order per peer and never meet user messages.
//   - Channels: two 2-rank NCCL communicators per peer, one per direction (one communicator used
//     from two streams at once can deadlock). The side whose address sorts lower creates both
//     ncclUniqueIds and sends them once the other side says it has connected; both sides then
//     init them non-blocking (ncclCommInitRankConfig, blocking = 0) and the progress thread polls
//     ncclCommGetAsyncError, so Options::init_timeout bounds the set-up. Device operations with
//     a peer whose communicators are not ready wait (their own deadlines apply).
//   - Ready-to-send: a send announces (sequence number, tag, size). The receiver keeps the
//     announcements and its pending device receives per tag and pairs them oldest first, so the
//     messages of one (peer, tag) land in send order; on a pair it posts ncclRecv and answers
//     clear-to-send (the sequence number); the sender posts ncclSend on clear-to-send. Both sides
//     post one direction's NCCL calls in clear-to-send order, so they pair up.
//   - A message larger than its receive buffer fails the receive with kOutOfRange (both sizes)
//     and moves nothing: the receiver answers "taken", and the send completes OK, as a UCX send
//     into a too-small receive does. Empty messages are taken the same way.
//   - Completion: separate CUDA streams for sends and receives, a cudaEvent after each NCCL call,
//     and the progress thread polls cudaEventQuery. Callers only post and wait.
//   - Cancel: a device operation with no NCCL call posted is withdrawn (a send asks the receiver,
//     and completes normally if a clear-to-send crossed its withdrawal); one already posted
//     completes normally.
//   - Failure: when the UCX side reports the peer dead (a control receive or send fails with
//     kUnavailable), or NCCL reports an asynchronous error, the peer's communicators are aborted
//     (ncclCommAbort) and every pending and later device operation with it fails with
//     kUnavailable naming the peer. Disconnect and destruction abort the communicators and
//     cancel pending operations, then disconnect or destroy the UCX transport.
//   - One GPU per process: NCCL refuses two ranks on one GPU ("Duplicate GPU detected"); the
//     error says so and points at transport ucx (CUDA UCX) for processes that share a GPU.
//
// The protocol does not know NCCL: the data movement sits behind DeviceMover (device_mover.h).
// Options::host_through_protocol_for_testing swaps NCCL for a mover that carries host bytes over
// the UCX service channel and routes *host* operations through the protocol, so the conformance
// suite checks the protocol on machines without a GPU.
//
// Threading: every method is thread-safe (transport.h). One progress thread per transport runs
// the protocol and is the only thread that calls NCCL and CUDA; callers' posts queue commands for
// it. Lock order: the transport's mutex, then a Completion's (a leaf).
#ifndef HETPAR_COMMON_TRANSPORT_NCCL_NCCL_TRANSPORT_H_
#define HETPAR_COMMON_TRANSPORT_NCCL_NCCL_TRANSPORT_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/transport/transport.h"
#include "common/transport/ucx/ucx_transport.h"

namespace hetpar::transport::nccl {

namespace internal {
class Core;
}  // namespace internal

class NcclTransport final : public Transport {
 public:
  struct Options {
    // The GPU this process's NCCL communicators use; device buffers must be on it.
    int cuda_device = 0;
    // How long a peer's communicators may take to become ready once set-up starts.
    absl::Duration init_timeout = absl::Seconds(60);
    // How long destroying an unfinished Operation waits after cancelling it before the
    // connection to its peer is torn down to release the buffer.
    absl::Duration abandon_timeout = absl::Seconds(2);
    // Test only: no NCCL; host operations go through the protocol, their bytes over the UCX
    // transport's service channel, and CanMove(kCuda) is false.
    bool host_through_protocol_for_testing = false;
  };

  // Takes over `ucx` (which may already be connected to nothing, or to peers that also wrap).
  // kUnimplemented when this build has no NCCL (unless host_through_protocol_for_testing).
  // Without a usable CUDA device the transport is created and CanMove(kCuda) is false.
  static absl::StatusOr<std::unique_ptr<NcclTransport>> Wrap(std::unique_ptr<ucx::UcxTransport> ucx,
                                                             const Options& options);

  // Aborts the communicators, cancels pending operations (kCancelled) and destroys the UCX
  // transport (which says goodbye to the peers).
  ~NcclTransport() override;

  std::string_view backend() const override { return "nccl"; }
  const std::string& name() const override;
  std::string LocalAddress() const override;
  absl::StatusOr<PeerId> Connect(std::string_view peer_address, absl::Time deadline) override;
  absl::StatusOr<std::unique_ptr<Operation>> Send(PeerId peer, Tag tag,
                                                  ConstBuffer buffer) override;
  absl::StatusOr<std::unique_ptr<Operation>> Recv(PeerId peer, Tag tag,
                                                  MutableBuffer buffer) override;
  // Host memory only, as for every backend.
  absl::StatusOr<std::unique_ptr<Operation>> RecvScatter(
      PeerId peer, Tag tag, std::vector<MutableBuffer> segments) override;
  absl::Status Disconnect(PeerId peer, absl::Time deadline) override;
  std::string PeerName(PeerId peer) const override;
  // Host memory always; CUDA memory when this build has NCCL and options.cuda_device is usable.
  bool CanMove(MemoryKind kind) const override;

  // Whether this build has NCCL (hetpar built against libtorch with CUDA and NCCL found).
  static bool BuiltWithNccl();

 private:
  explicit NcclTransport(std::shared_ptr<internal::Core> core);

  std::shared_ptr<internal::Core> core_;
};

}  // namespace hetpar::transport::nccl

#endif  // HETPAR_COMMON_TRANSPORT_NCCL_NCCL_TRANSPORT_H_
