// The data plane: tagged, asynchronous, zero-copy byte transfers between hetpar processes.
//
// Embeddings go forward and their gradients come back over this interface. Backends live in
// sibling folders with the same shape (`inproc/`, `ucx/`); callers see only this header and a
// backend's factory (or `factory.h`, which picks one by name).
//
// Model
//   - Every transport has a local address: opaque bytes that the coordinator relays to peers.
//     The address carries the transport's name ("enc r1"), so errors can name the peer.
//   - Connect(address) returns a PeerId. Connecting is symmetric: both ends call Connect with
//     each other's address. Connect returns at once; a send to a peer starts moving once the
//     peer has connected back (a receive can be posted at any time).
//   - Send/Recv post an operation and return at once. A send reads the caller's memory; a
//     receive writes straight into the caller's memory (for example a tensor's storage): no
//     copy through transport-owned buffers for large messages. The memory must stay valid and
//     untouched until the operation is done (see Operation).
//   - Matching: a message from peer P with tag T lands in the oldest pending receive for
//     (P, T). Messages from one peer with one tag arrive in the order they were sent; there is
//     no ordering between different tags or different peers.
//   - Completion: a send is done when the receiver has taken the data (it may need the matching
//     receive to be posted, so post receives before waiting on sends); a receive is done when
//     every byte is in the caller's buffer.
//   - Every wait has a deadline (Operation::Wait). A wait that times out leaves the operation
//     pending: wait again, or Cancel it.
//   - Failure: when a peer dies (process killed, connection lost, or it disconnected), every
//     pending and every later operation with that peer fails with kUnavailable and a message
//     naming the peer, within the caller's deadline. Operations with other peers carry on.
//
// Error codes used by every backend
//   kInvalidArgument    bad address, unknown PeerId, tag above kMaxTag, null data with size > 0
//   kUnimplemented      a memory kind this build cannot move (CUDA in a CPU-only build)
//   kDeadlineExceeded   Wait's deadline passed; the operation is still pending
//   kCancelled          the operation was cancelled (Cancel, Disconnect or transport shutdown)
//   kOutOfRange         a message was larger than the receive buffer (truncation); the
//                       receive buffer's contents are then unspecified
//   kUnavailable        the peer is dead or gone
//   kFailedPrecondition the PeerId was disconnected locally
//   kAlreadyExists      Connect to an address that is already connected
//
// Threading contract
//   Every Transport method is thread-safe and may be called from any thread. Operation methods
//   are thread-safe too, but an Operation must not be destroyed while another thread uses it.
//   Progress is driven by the backend, never by the caller: the UCX backend runs one progress
//   thread per transport; the in-process backend moves data in the thread that completes a
//   match (the one that posts the later of a send and its receive). Callers only post and wait.
//
// Lifetime
//   A Transport outlives nothing of the caller's: destroying it cancels every pending operation
//   (they complete with kCancelled) and tells connected peers it is gone. Operations may outlive
//   their transport; they are then already done.
#ifndef HETPAR_COMMON_TRANSPORT_TRANSPORT_H_
#define HETPAR_COMMON_TRANSPORT_TRANSPORT_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/step_interrupt.h"

namespace hetpar::transport {

// Where a buffer lives. Backends that cannot reach a kind return kUnimplemented when an
// operation is posted with it.
enum class MemoryKind : uint8_t {
  kHost = 0,  // ordinary process memory
  kCuda = 1,  // CUDA device memory (`device` names the GPU)
};

std::string_view MemoryKindName(MemoryKind kind);

// Caller memory that a send reads from. Not owned.
struct ConstBuffer {
  const void* data = nullptr;
  size_t size = 0;
  MemoryKind kind = MemoryKind::kHost;
  int device = -1;  // CUDA device ordinal for kCuda; -1 for host memory

  static ConstBuffer Host(const void* data, size_t size) { return {data, size}; }
};

// Caller memory that a receive writes into. Not owned.
struct MutableBuffer {
  void* data = nullptr;
  size_t size = 0;
  MemoryKind kind = MemoryKind::kHost;
  int device = -1;

  static MutableBuffer Host(void* data, size_t size) { return {data, size}; }
};

// Tags are chosen by the caller (for example step, wave and direction packed together).
using Tag = uint64_t;
inline constexpr int kTagBits = 40;
inline constexpr Tag kMaxTag = (Tag{1} << kTagBits) - 1;

// A connected peer, local to one transport. Never reused after Disconnect.
using PeerId = uint32_t;

// One posted send or receive.
//
// Destroying an Operation that is not done cancels it and waits until the backend no longer
// touches its buffer. That wait is bounded: an unmatched receive is withdrawn at once; a
// transfer in progress finishes or fails with its peer; a UCX send that the receiver never
// takes is released by tearing down that peer's connection after the backend's abandon
// timeout (the peer then sees this side as unavailable).
class Operation {
 public:
  Operation() = default;
  Operation(const Operation&) = delete;
  Operation& operator=(const Operation&) = delete;
  virtual ~Operation() = default;

  // True once the operation has finished, successfully or not. Never blocks.
  virtual bool Done() const = 0;

  // Blocks until the operation is done or `deadline` passes. Returns the operation's final
  // status once done (OK, kCancelled, kUnavailable, kOutOfRange, ...), or kDeadlineExceeded if
  // it is still pending at the deadline. May be called again after kDeadlineExceeded.
  virtual absl::Status Wait(absl::Time deadline) = 0;

  // Asks the backend to withdraw the operation. An operation whose data has not started to
  // move completes with kCancelled; one already moving completes normally (or fails). Wait
  // reports which. Cancelling a done operation does nothing.
  virtual void Cancel() = 0;

  // Bytes moved once the operation completed OK: the message length for a receive (at most
  // the buffer size), the buffer size for a send. 0 before that.
  virtual size_t bytes() const = 0;

  // When the backend finished the operation (absl::Now() on the thread that completed it), or
  // absl::InfinitePast() while it is pending. Lets a caller that waits late still time the
  // transfer itself.
  virtual absl::Time completed_at() const = 0;
};

// The data plane seen by its users. Non-copyable; created by a backend's factory.
class Transport {
 public:
  Transport() = default;
  Transport(const Transport&) = delete;
  Transport& operator=(const Transport&) = delete;
  virtual ~Transport() = default;

  // "ucx" or "inproc".
  virtual std::string_view backend() const = 0;
  // This transport's name, as peers print it in their errors.
  virtual const std::string& name() const = 0;

  // Opaque bytes that a peer passes to Connect to reach this transport.
  virtual std::string LocalAddress() const = 0;

  // Connects to the transport whose LocalAddress() is `peer_address`. Returns once the local
  // side is set up (or `deadline` passes); the peer must Connect back for sends to start.
  virtual absl::StatusOr<PeerId> Connect(std::string_view peer_address, absl::Time deadline) = 0;

  // Posts a send of `buffer` to `peer` with `tag` (at most kMaxTag). Argument errors and a peer
  // already known to be dead are returned here; later failures are reported by the Operation.
  virtual absl::StatusOr<std::unique_ptr<Operation>> Send(PeerId peer, Tag tag,
                                                          ConstBuffer buffer) = 0;

  // Posts a receive of one message from `peer` with `tag` into `buffer`.
  virtual absl::StatusOr<std::unique_ptr<Operation>> Recv(PeerId peer, Tag tag,
                                                          MutableBuffer buffer) = 0;

  // Posts a receive of one message from `peer` with `tag` scattered over `segments` in order:
  // the message's first segments[0].size bytes land in segments[0], the next ones in
  // segments[1], and so on, straight from the transport (UCX stages only messages under 32
  // bytes, which land in a small bounce area first). A shorter message
  // fills a prefix of the segments; a longer one fails with kOutOfRange. Host memory only
  // (kUnimplemented for other kinds). Matching, completion and failure are those of Recv; bytes()
  // is the message length. Lets a receiver put the parts of one message where each belongs.
  virtual absl::StatusOr<std::unique_ptr<Operation>> RecvScatter(
      PeerId peer, Tag tag, std::vector<MutableBuffer> segments) = 0;

  // Closes the connection to `peer`: pending operations with it complete with kCancelled, the
  // peer is told that this side is gone (its operations with us fail with kUnavailable) and the
  // connection's resources (sockets, endpoints) are released by `deadline`. Later operations on
  // `peer` fail with kFailedPrecondition. Disconnecting a dead peer releases its resources.
  virtual absl::Status Disconnect(PeerId peer, absl::Time deadline) = 0;

  // The peer's name from its address ("enc r1"), or "<unknown peer N>".
  virtual std::string PeerName(PeerId peer) const = 0;

  // Whether Send and Recv take buffers of `kind` (host memory always). Fixed for the transport's
  // lifetime. Callers stage other kinds through host memory.
  virtual bool CanMove(MemoryKind kind) const = 0;
};

// Waits for every operation with one shared deadline. Returns OK when all completed OK, else
// the first non-OK status in `ops` order (kDeadlineExceeded if one is still pending).
absl::Status WaitAll(absl::Span<const std::unique_ptr<Operation>> ops, absl::Time deadline);
// The same, ending early (Aborted) once `interrupt` (may be null) is raised.
absl::Status WaitAll(absl::Span<const std::unique_ptr<Operation>> ops, absl::Time deadline,
                     const StepInterrupt* interrupt);

// Checks a buffer against what every backend requires (non-null data when size > 0, a known
// memory kind). `what` names the operation in the message ("send to peer 'b' tag 7").
absl::Status ValidateBuffer(const void* data, size_t size, MemoryKind kind, std::string_view what);

// Checks that `tag` fits kTagBits.
absl::Status ValidateTag(Tag tag, std::string_view what);

// Bytes the segments hold together.
size_t TotalSize(absl::Span<const MutableBuffer> segments);

// Checks scatter segments: host memory, each non-null when its size > 0.
absl::Status ValidateSegments(absl::Span<const MutableBuffer> segments, std::string_view what);

// Copies `size` bytes at `src` over `segments` in order (size <= their total).
void ScatterCopy(const void* src, size_t size, absl::Span<const MutableBuffer> segments);

// Copies the first `size` bytes held by `segments` (in order) to `dst`.
void GatherCopy(absl::Span<const MutableBuffer> segments, void* dst, size_t size);

}  // namespace hetpar::transport

#endif  // HETPAR_COMMON_TRANSPORT_TRANSPORT_H_
