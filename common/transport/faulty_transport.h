// A Transport decorator that injects faults, for tests: it drops sends, delays them, or makes a
// peer fail after a number of operations, the way a lost message, a slow link or a dead process
// would look to the caller.
//
//   auto inner = inproc::InprocTransport::Create({"enc r0"});
//   FaultPlan plan;
//   plan.fail_after_ops = 3;  // the 4th operation with any peer finds it dead
//   auto faulty = FaultyTransport::Create(std::move(inner).value(), plan);
//
// Everything else is forwarded to the wrapped transport unchanged. Thread-safe like every
// Transport. A delayed send is handed to the wrapped transport by one delay thread, started on
// first use.
#ifndef HETPAR_COMMON_TRANSPORT_FAULTY_TRANSPORT_H_
#define HETPAR_COMMON_TRANSPORT_FAULTY_TRANSPORT_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "common/transport/transport.h"

namespace hetpar::transport {

struct FaultPlan {
  // After this many operations (sends and receives) have been posted with a peer, the peer
  // counts as dead: later posts return kUnavailable naming it, and its pending operations fail
  // with kUnavailable. Negative: never.
  int64_t fail_after_ops = -1;
  // Every n-th send to a peer (counting from 1) is dropped: it completes OK here and never
  // reaches the peer, whose receive then waits until its deadline. 0: never.
  int64_t drop_every_nth_send = 0;
  // Sends reach the wrapped transport only after this delay.
  absl::Duration send_delay = absl::ZeroDuration();
};

namespace internal {
class FaultyState;
}  // namespace internal

class FaultyTransport final : public Transport {
 public:
  static absl::StatusOr<std::unique_ptr<FaultyTransport>> Create(std::unique_ptr<Transport> inner,
                                                                 const FaultPlan& plan);
  // Stops the delay thread (delayed sends not yet handed over complete with kCancelled), then
  // destroys the wrapped transport.
  ~FaultyTransport() override;

  // Replaces the plan for operations posted from now on (counts so far are kept).
  void SetPlan(const FaultPlan& plan);
  // Makes `peer` dead now, as if its process had been killed.
  void FailPeer(PeerId peer);

  std::string_view backend() const override;
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
  bool CanMove(MemoryKind kind) const override;

 private:
  explicit FaultyTransport(std::shared_ptr<internal::FaultyState> state);
  // Counts a receive of `size` bytes against the fault plan, then posts it with `post`.
  absl::StatusOr<std::unique_ptr<Operation>> WrapReceive(
      PeerId peer, Tag tag, size_t size,
      absl::FunctionRef<absl::StatusOr<std::unique_ptr<Operation>>()> post);

  std::shared_ptr<internal::FaultyState> state_;
};

}  // namespace hetpar::transport

#endif  // HETPAR_COMMON_TRANSPORT_FAULTY_TRANSPORT_H_
