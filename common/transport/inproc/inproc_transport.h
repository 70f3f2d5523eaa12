// In-process backend: ranks as threads of one process, with the semantics of the network
// backends (tags, per-tag order, deadlines, cancel, truncation, peer failure).
//
// Used by tests and by colocated ranks that share a process. All transports of a process meet
// in one process-wide registry; an address names a transport in this process only (an address
// from another process is rejected with kInvalidArgument naming both process ids).
//
// Data moves with one memcpy from the send buffer straight into the receive buffer, in the
// thread that completes the match: the thread posting the later of the send and its receive.
// No background thread exists. Messages are rendezvous at every size: a send stays pending
// until its receive is posted.
//
// A transport "dies" when it is destroyed: peers' pending and later operations with it fail with
// kUnavailable naming it, exactly as when a remote process is killed.
//
// Lock order: one registry mutex guards all matching state; copies run outside it, and a
// Completion's mutex is only taken after the registry mutex is released.
#ifndef HETPAR_COMMON_TRANSPORT_INPROC_INPROC_TRANSPORT_H_
#define HETPAR_COMMON_TRANSPORT_INPROC_INPROC_TRANSPORT_H_

#include <memory>
#include <string>
#include <vector>

#include "common/transport/transport.h"

namespace hetpar::transport::inproc {

namespace internal {
class Endpoint;
}  // namespace internal

class InprocTransport final : public Transport {
 public:
  struct Options {
    std::string name;  // shown in peers' errors, e.g. "enc r1"; must not be empty
  };

  static absl::StatusOr<std::unique_ptr<InprocTransport>> Create(const Options& options);

  // Cancels this transport's pending operations and fails its peers' operations with it.
  ~InprocTransport() override;

  std::string_view backend() const override { return "inproc"; }
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
  // Host memory only.
  bool CanMove(MemoryKind kind) const override { return kind == MemoryKind::kHost; }

 private:
  explicit InprocTransport(std::shared_ptr<internal::Endpoint> endpoint);
  // Send and Recv: validates, then matches the operation against the oldest opposite one queued
  // for (sender, tag) or queues it. Exactly one of `src` (send) and `dst` (receive) is used; a
  // scatter receive passes its (validated) segments instead of `dst`.
  absl::StatusOr<std::unique_ptr<Operation>> Post(bool is_send, PeerId peer, Tag tag,
                                                  const void* src, void* dst, size_t size,
                                                  MemoryKind kind,
                                                  std::vector<MutableBuffer> segments = {});

  std::shared_ptr<internal::Endpoint> endpoint_;
};

}  // namespace hetpar::transport::inproc

#endif  // HETPAR_COMMON_TRANSPORT_INPROC_INPROC_TRANSPORT_H_
