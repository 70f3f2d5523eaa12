// UCX backend of the data plane (UCX 1.13 or newer ucp, host memory; CUDA memory when UCX has it).
//
// Resources: one ucp context, one worker and one progress thread per UcxTransport. A process
// normally creates one UcxTransport and connects it to all its peers; tests may create several.
// The usual UCX environment is honoured (UCX_TLS, UCX_NET_DEVICES, UCX_RNDV_THRESH, ...: it is
// read by ucp_config_read). Where the environment leaves them unset, failure-detection settings
// get faster defaults than UCX's (Options below), so a dead peer surfaces within seconds.
//
// Why the tag API. A receive is posted straight into caller memory and matched by UCX itself,
// and UCX keeps messages of one sender and one tag in order. Messages above UCX's rendezvous
// threshold move by rendezvous into the posted buffer; small ones go eager. Active messages
// would need a matching layer of our own, and a large message that arrives before its receive
// would have to be held or copied.
//
// Zero copy on one host. With UCP_ERR_HANDLING_MODE_PEER, UCX 1.13 selects no shared-memory or
// CMA lanes (they cannot invalidate remote access to a failed peer's memory), so its rendezvous
// runs over TCP with a copy on each side. For peers in processes on the same host, large
// messages (>= Options::zero_copy_threshold) therefore use a rendezvous of our own over the same
// tags: the sender sends a small descriptor (pid, address, length) with the message's tag, the
// receiver's matched receive copies the bytes straight from the sender's buffer into its own with
// process_vm_readv (one copy, no transport buffers), then reports back so the send completes.
// It is enabled per connection only after the receiver proved it can read the sender's memory
// (it reads a random probe word named in the hello), so different hosts, pid namespaces or a
// ptrace policy that forbids it fall back to UCX's own path. Descriptor and data messages of one
// tag keep their order: receives match both (the descriptor flag is masked out).
//
// Tags on the wire: bit 63 marks control messages; bit 62 marks a zero-copy descriptor; bit 61
// marks the service tag space (SendService/RecvService, for backends layered on this one); bits
// 40..60 carry the sender slot, the PeerId that the *receiver* gave the sender (so a transport
// makes at most 2^21 - 1 connections); bits 0..39 are the user or service tag. A hello control
// message, sent when Connect creates the endpoint, tells the peer which slot to use; sends to a
// peer wait in a local queue until its hello has arrived (receives can be posted at once). A
// goodbye control message on Disconnect or destruction tells the peer to fail its operations with
// us; the peer acknowledges it once it will read no more of our memory, and only then (or at the
// deadline) do zero-copy sends release their buffers.
//
// Progress. The progress thread is the only thread that calls into UCX (worker in
// UCS_THREAD_MODE_SINGLE, no UCX locks). Callers' Send/Recv/Cancel/Connect/Disconnect queue a
// command and wake it through an eventfd. While operations are in flight it polls
// ucp_worker_progress; after `spin` without events it arms the worker and sleeps in epoll on the
// worker's event fd, the wake-up fd, and a short timeout (so UCX's keepalive keeps running).
// Completion callbacks run on the progress thread and complete the caller's Operation, which
// wakes the waiting thread.
//
// Failure. Endpoints use UCP_ERR_HANDLING_MODE_PEER with an error callback. On a peer error
// (or its goodbye), every queued and in-flight operation with that peer completes with
// kUnavailable naming the peer, receives are withdrawn with ucp_request_cancel, and the endpoint
// is closed with UCP_EP_CLOSE_FLAG_FORCE, releasing its sockets.
//
// Cancel withdraws receives that have not matched and sends still waiting for the peer's
// hello. UCX cannot withdraw a send it holds; such a send completes when the receiver takes it,
// when the peer fails, or when the connection is closed (Disconnect, destruction, or abandoning
// the Operation, which tears the connection down after `abandon_timeout`).
//
// Lock order: `mu_` (commands, public peer table) is never held while calling into UCX; a
// Completion's mutex is a leaf taken under nothing else or under `mu_`.
#ifndef HETPAR_COMMON_TRANSPORT_UCX_UCX_TRANSPORT_H_
#define HETPAR_COMMON_TRANSPORT_UCX_UCX_TRANSPORT_H_

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "common/transport/transport.h"

namespace hetpar::transport::ucx {

namespace internal {
class Core;
}  // namespace internal

class UcxTransport final : public Transport {
 public:
  struct Options {
    std::string name;  // shown in peers' errors, e.g. "enc r1"; must not be empty

    // Defaults applied only when the matching UCX_* variable is not set in the environment.
    absl::Duration keepalive_interval = absl::Seconds(1);  // UCX_KEEPALIVE_INTERVAL (UCX: 20 s)
    absl::Duration tcp_keepidle = absl::Seconds(2);        // UCX_TCP_KEEPIDLE (UCX: 10 s)
    absl::Duration tcp_keepintvl = absl::Seconds(1);       // UCX_TCP_KEEPINTVL (UCX: 2 s)

    // Same-host zero copy (see above) for messages of at least this many bytes.
    bool same_host_zero_copy = true;
    size_t zero_copy_threshold = size_t{32} << 10;

    // How long the progress thread keeps polling after the last event before it sleeps.
    absl::Duration spin = absl::Microseconds(200);
    // How long destroying an unfinished Operation waits after cancelling it before the
    // connection to its peer is torn down to release the buffer.
    absl::Duration abandon_timeout = absl::Seconds(2);
    // How long destruction waits for goodbyes and endpoint closes before it forces them.
    absl::Duration shutdown_timeout = absl::Seconds(2);
  };

  // Creates the context, worker and progress thread. UCX failures (no usable transport for
  // UCX_TLS, a bad UCX_* value) come back as a Status naming the step that failed.
  static absl::StatusOr<std::unique_ptr<UcxTransport>> Create(const Options& options);

  // Says goodbye to every connected peer, cancels pending operations (kCancelled), closes the
  // endpoints and stops the progress thread, within about options.shutdown_timeout.
  ~UcxTransport() override;

  std::string_view backend() const override { return "ucx"; }
  const std::string& name() const override;
  std::string LocalAddress() const override;
  absl::StatusOr<PeerId> Connect(std::string_view peer_address, absl::Time deadline) override;
  absl::StatusOr<std::unique_ptr<Operation>> Send(PeerId peer, Tag tag,
                                                  ConstBuffer buffer) override;
  absl::StatusOr<std::unique_ptr<Operation>> Recv(PeerId peer, Tag tag,
                                                  MutableBuffer buffer) override;
  absl::StatusOr<std::unique_ptr<Operation>> RecvScatter(
      PeerId peer, Tag tag, std::vector<MutableBuffer> segments) override;
  absl::Status Disconnect(PeerId peer, absl::Time deadline) override;
  std::string PeerName(PeerId peer) const override;

  // A second tag space for backends layered on this transport (the NCCL backend's control
  // channel): the same semantics as Send/Recv/RecvScatter, tags up to kMaxTag, but a service
  // message never matches a user receive and a user message never matches a service receive,
  // whatever their tags. Peer failure, Disconnect and destruction treat both spaces alike.
  absl::StatusOr<std::unique_ptr<Operation>> SendService(PeerId peer, Tag tag, ConstBuffer buffer);
  absl::StatusOr<std::unique_ptr<Operation>> RecvService(PeerId peer, Tag tag,
                                                         MutableBuffer buffer);
  absl::StatusOr<std::unique_ptr<Operation>> RecvScatterService(
      PeerId peer, Tag tag, std::vector<MutableBuffer> segments);

  // Whether Send/Recv accept buffers of `kind`: host memory always; CUDA memory when UCX
  // reports CUDA among its memory types (a UCX built with CUDA whose CUDA module loaded, which
  // needs the GPU driver). Fixed for the transport's lifetime; any thread.
  bool CanMove(MemoryKind kind) const override;

  // Runs `fn` on the progress thread (before its next round of progress) and returns once it
  // has run: thread set-up that the transport cannot know of when it starts, such as making the
  // rank's GPU the thread's current device once the RunSpec names it (UCX's CUDA transports then
  // find a context there). Unavailable once the transport is shutting down; DeadlineExceeded if
  // `fn` has not run by `deadline` (it may still run later: what it refers to must outlive the
  // transport or be owned by `fn`).
  absl::Status RunOnProgressThread(std::function<void()> fn, absl::Time deadline);

  // Operations that completed OK, and how many of them went by same-host zero copy.
  struct Stats {
    uint64_t sends = 0;
    uint64_t receives = 0;
    uint64_t zero_copy_sends = 0;     // the peer copied the bytes straight out of our buffer
    uint64_t zero_copy_receives = 0;  // we copied the bytes straight out of the sender's buffer
  };
  Stats stats() const;

 private:
  explicit UcxTransport(std::shared_ptr<internal::Core> core);
  absl::StatusOr<std::unique_ptr<Operation>> PostSend(bool service, PeerId peer, Tag tag,
                                                      ConstBuffer buffer);
  absl::StatusOr<std::unique_ptr<Operation>> PostRecv(bool service, PeerId peer, Tag tag,
                                                      MutableBuffer buffer);
  absl::StatusOr<std::unique_ptr<Operation>> PostRecvScatter(bool service, PeerId peer, Tag tag,
                                                             std::vector<MutableBuffer> segments);

  std::shared_ptr<internal::Core> core_;
};

}  // namespace hetpar::transport::ucx

#endif  // HETPAR_COMMON_TRANSPORT_UCX_UCX_TRANSPORT_H_
