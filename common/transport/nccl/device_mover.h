// The data movement under the NCCL backend's tag-matching protocol, behind a small interface so
// the protocol (nccl_transport.cc) knows nothing of NCCL and runs on machines without a GPU.
//
// A mover moves the bytes of one message to or from a connected peer once the protocol has paired
// the two sides: both sides post the operations of one direction in the same order (the
// clear-to-send order), so the k-th send posted to a peer meets the k-th receive posted there.
// Two implementations: NcclMover (ncclSend/ncclRecv on two 2-rank communicators per peer,
// nccl_mover.h) and ServiceMover (host bytes over the UCX transport's service tag space, for
// tests, service_mover.h).
//
// Threading: every method is called from the protocol's progress thread only (and the destructor
// after that thread has stopped). Internal to the NCCL backend.
#ifndef HETPAR_COMMON_TRANSPORT_NCCL_DEVICE_MOVER_H_
#define HETPAR_COMMON_TRANSPORT_NCCL_DEVICE_MOVER_H_

#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/transport/transport.h"

namespace hetpar::transport::nccl::internal {

// One posted send or receive of the mover.
class MoverTransfer {
 public:
  MoverTransfer() = default;
  MoverTransfer(const MoverTransfer&) = delete;
  MoverTransfer& operator=(const MoverTransfer&) = delete;
  // Destroying a transfer that is not done is allowed only after AbortPeer (or the peer's
  // failure); the mover then no longer touches its buffer by the time Poll has reported done.
  virtual ~MoverTransfer() = default;

  // Its final status once the bytes have moved (or the transfer failed), nullopt while pending.
  // Never blocks.
  virtual std::optional<absl::Status> Poll() = 0;
};

class DeviceMover {
 public:
  DeviceMover() = default;
  DeviceMover(const DeviceMover&) = delete;
  DeviceMover& operator=(const DeviceMover&) = delete;
  virtual ~DeviceMover() = default;

  // The memory this mover moves (kCuda for NCCL; kHost for the service mover).
  virtual MemoryKind kind() const = 0;

  // Called on the side that creates a peer's channels (the one whose address sorts lower): the
  // bytes that the other side passes to its StartPeer (NCCL: two ncclUniqueIds).
  virtual absl::StatusOr<std::string> CreatePeerSetup(PeerId peer) = 0;

  // Starts setting up the channels with `peer` (named `peer_name` in errors) from `setup`, which
  // the side with `creator` true made. Returns at once; PollPeer says when they are ready.
  virtual absl::Status StartPeer(PeerId peer, std::string_view peer_name, std::string_view setup,
                                 bool creator) = 0;

  // True once the channels with `peer` are ready, false while they are being set up; an error
  // (setup failed, or an asynchronous error later) makes the peer unusable.
  virtual absl::StatusOr<bool> PollPeer(PeerId peer) = 0;

  // Posts the send of `size` bytes at `data` (on `device` for device memory) to a ready peer.
  virtual absl::StatusOr<std::unique_ptr<MoverTransfer>> PostSend(PeerId peer, const void* data,
                                                                  size_t size, int device) = 0;

  // Posts the receive of a `size`-byte message from a ready peer over `segments` in order (their
  // total is at least `size`; device movers take exactly one segment).
  virtual absl::StatusOr<std::unique_ptr<MoverTransfer>> PostRecv(
      PeerId peer, const std::vector<MutableBuffer>& segments, size_t size, int device) = 0;

  // Tears down the channels with `peer` (NCCL: ncclCommAbort): its pending transfers finish
  // (Poll reports done) soon, successfully or not, and touch no buffer afterwards. Idempotent;
  // a peer never started is fine.
  virtual void AbortPeer(PeerId peer) = 0;

  // Called once per progress-loop turn: lets the mover advance work of its own (NCCL: calls it
  // could not issue while a communicator was busy).
  virtual void Progress() {}
};

}  // namespace hetpar::transport::nccl::internal

#endif  // HETPAR_COMMON_TRANSPORT_NCCL_DEVICE_MOVER_H_
