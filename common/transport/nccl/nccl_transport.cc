#include "common/transport/nccl/nccl_transport.h"

#include <algorithm>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/logging.h"
#include "common/status.h"
#include "common/transport/completion.h"
#include "common/transport/nccl/device_mover.h"
#include "common/transport/nccl/service_mover.h"
#ifdef HETPAR_HAVE_NCCL
#include "common/transport/nccl/nccl_mover.h"
#endif

namespace hetpar::transport::nccl {
namespace internal {
namespace {

// The protocol's control messages use this tag of the UCX service tag space; the service mover's
// data uses ServiceMover::kDataTag.
constexpr Tag kControlTag = 0;
static_assert(kControlTag != ServiceMover::kDataTag, "control and test data need their own tags");
constexpr uint32_t kControlMagic = 0x4E435048;  // "HPCN"
constexpr size_t kMaxPayload = 512;

enum class ControlKind : uint32_t {
  kHello = 1,           // the higher side has connected: the lower side may send the setup
  kSetup = 2,           // payload: the mover's setup (NCCL: two ncclUniqueIds)
  kChannelsFailed = 3,  // payload: why the sender's channels with us failed
  kReadyToSend = 4,     // seq, tag, size: a send is waiting for its receive
  kClearToSend = 5,     // seq: the receive is posted; post the send
  kTaken = 6,           // seq: the receiver completed without data (empty or too large)
  kWithdraw = 7,        // seq, tag: the sender cancels an announced send
  kWithdrawn = 8,       // seq: the announcement was withdrawn before any receive took it
};

// Fixed size, on one tag: the control messages of a connection stay in order.
struct ControlMessage {
  uint32_t magic = kControlMagic;
  uint32_t kind = 0;
  uint64_t seq = 0;
  uint64_t tag = 0;
  uint64_t size = 0;
  uint32_t payload_size = 0;
  uint32_t reserved = 0;
  char payload[kMaxPayload] = {};
};

std::string Describe(bool is_send, std::string_view peer_name, Tag tag, size_t size) {
  return absl::StrCat(is_send ? "send to" : "receive from", " peer '", std::string(peer_name),
                      "' tag ", tag, " (", size, " bytes)");
}

absl::Status Prefixed(const absl::Status& why, const std::string& what) {
  return absl::Status(why.code(), absl::StrCat(what, ": ", std::string(why.message())));
}

// kUnavailable naming the peer: "peer 'b' is unavailable: <detail>".
absl::Status PeerUnavailable(const std::string& peer_name, absl::string_view detail) {
  return absl::UnavailableError(absl::StrCat("peer '", peer_name, "' is unavailable: ", detail));
}

}  // namespace

// One device send or receive (or host one, in the test mode). The caller's Operation holds one
// reference, the progress thread another while the protocol works on it.
struct ProtoOp {
  bool is_send = false;
  PeerId peer = 0;
  Tag tag = 0;
  const void* src = nullptr;
  std::vector<MutableBuffer> segments;  // a receive's (one for Recv)
  size_t size = 0;                      // a send's message; a receive's capacity
  int device = -1;
  std::shared_ptr<Completion> completion;
  // Progress thread only:
  uint64_t seq = 0;
  size_t message_size = 0;  // a matched receive's message
  bool withdrawing = false;
  std::unique_ptr<MoverTransfer> transfer;
  absl::Status fail_with;  // non-OK: complete with this once the transfer is done
};

// A control message on its way, with the UCX operation that sends it.
struct OutgoingControl {
  ControlMessage message;
  std::unique_ptr<Operation> op;
};

// Progress-thread state of one peer.
struct PeerState {
  enum class Channels { kAwaitingSetup, kStarting, kReady };

  PeerId id = 0;
  std::string name;
  bool lower = false;  // our address sorts lower: we create the channels' setup
  Channels channels = Channels::kAwaitingSetup;
  absl::Time init_deadline = absl::InfiniteFuture();
  bool closed = false;  // failed, disconnected or shutting down: the protocol is over
  absl::Status closed_status;
  ControlMessage control_in;
  std::unique_ptr<Operation> control_recv;
  std::deque<std::unique_ptr<OutgoingControl>> control_out;
  uint64_t next_seq = 1;
  std::map<uint64_t, std::shared_ptr<ProtoOp>> announced;        // sends waiting for an answer
  std::deque<std::shared_ptr<ProtoOp>> cleared;                  // clear-to-send, not posted
  std::map<Tag, std::deque<std::shared_ptr<ProtoOp>>> receives;  // not matched yet
  struct Announcement {
    uint64_t seq = 0;
    size_t size = 0;
  };
  std::map<Tag, std::deque<Announcement>> announcements;  // not matched yet
  std::vector<std::shared_ptr<ProtoOp>> moving;           // the mover has them
};

class Core {
 public:
  using Options = NcclTransport::Options;

  Core(std::unique_ptr<ucx::UcxTransport> ucx, std::unique_ptr<DeviceMover> mover,
       std::string no_mover_reason, const Options& options)
      : options_(options),
        name_(ucx->name()),
        address_(ucx->LocalAddress()),
        ucx_(std::move(ucx)),
        mover_(std::move(mover)),
        no_mover_reason_(std::move(no_mover_reason)) {
    thread_ = std::thread([this] { Loop(); });
  }
  ~Core() { Close(); }

  // --- any thread ---
  const std::string& name() const { return name_; }
  const std::string& address() const { return address_; }
  const Options& options() const { return options_; }
  bool test_mode() const { return options_.host_through_protocol_for_testing; }
  bool CanMove(MemoryKind kind) const {
    switch (kind) {
      case MemoryKind::kHost:
        return true;
      case MemoryKind::kCuda:
        return mover_ != nullptr && mover_->kind() == MemoryKind::kCuda;
    }
    return false;
  }
  ucx::UcxTransport* ucx() const { return ucx_.get(); }
  absl::StatusOr<PeerId> Connect(std::string_view peer_address, absl::Time deadline);
  absl::StatusOr<std::shared_ptr<ProtoOp>> Post(bool is_send, PeerId peer, Tag tag, const void* src,
                                                std::vector<MutableBuffer> segments, size_t size,
                                                MemoryKind kind, int device, bool scatter);
  absl::Status Disconnect(PeerId peer, absl::Time deadline);
  std::string PeerName(PeerId peer) const { return ucx_->PeerName(peer); }
  void Cancel(const std::shared_ptr<ProtoOp>& op);
  void Abandon(const std::shared_ptr<ProtoOp>& op);
  // Stops the protocol, cancels every operation and destroys the UCX transport. Idempotent.
  void Close();
  // Why CUDA memory cannot move here ("" when it can).
  std::string CudaUnavailableReason() const;

 private:
  struct PublicPeer {
    std::string name;
    bool disconnected = false;
    absl::Status dead;
  };

  bool Enqueue(std::function<void()> command);

  // --- progress thread ---
  void Loop();
  bool RunCommands();
  bool HasPendingWork() const;
  PeerState* FindState(PeerId peer);
  void AddPeer(PeerId peer, std::string name, bool lower);
  void PostControlRecv(PeerState* s);
  bool PollControl(PeerState* s);
  bool ReapControlSends(PeerState* s);
  void SendControl(PeerState* s, ControlKind kind, uint64_t seq = 0, uint64_t tag = 0,
                   uint64_t size = 0, std::string_view payload = {});
  void HandleControl(PeerState* s, const ControlMessage& message);
  void StartChannels(PeerState* s, std::string_view setup, bool creator);
  bool AdvanceChannels(PeerState* s);
  void SendOnThread(const std::shared_ptr<ProtoOp>& op);
  void RecvOnThread(const std::shared_ptr<ProtoOp>& op);
  void CancelOnThread(const std::shared_ptr<ProtoOp>& op);
  void TryMatch(PeerState* s, Tag tag);
  void TryMatchAll(PeerState* s);
  void Match(PeerState* s, const std::shared_ptr<ProtoOp>& recv,
             const PeerState::Announcement& announcement);
  void DrainCleared(PeerState* s);
  bool PollMoving(PeerState* s);
  // Ends the protocol with `s` for `why` (kUnavailable: the peer is unusable; kCancelled: local
  // disconnect or shutdown): aborts its channels and fails every operation with it.
  void ClosePeer(PeerState* s, const absl::Status& why, bool tell_peer);
  // The mover refused to post `op`'s transfer: `op` fails kUnavailable and the peer closes.
  void FailPost(PeerState* s, ProtoOp& op, absl::string_view what, const absl::Status& refused);
  void SetPublicDead(PeerId peer, const absl::Status& status);

  const Options options_;
  const std::string name_;
  const std::string address_;
  std::unique_ptr<ucx::UcxTransport> ucx_;
  std::unique_ptr<DeviceMover> mover_;
  const std::string no_mover_reason_;
  std::thread thread_;

  mutable absl::Mutex mu_;
  absl::CondVar wake_;
  std::deque<std::function<void()>> commands_ ABSL_GUARDED_BY(mu_);
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  std::map<PeerId, PublicPeer> peers_ ABSL_GUARDED_BY(mu_);
  bool closed_ = false;  // Close() has released everything (the closing thread only)

  // Progress thread only (and Close() after the join).
  std::map<PeerId, std::unique_ptr<PeerState>> states_;
  bool stop_ = false;
};

// ---------------------------------------------------------------------------------------------
// Calls from user threads

bool Core::Enqueue(std::function<void()> command) {
  absl::MutexLock lock(&mu_);
  if (stopped_) return false;
  commands_.push_back(std::move(command));
  wake_.Signal();
  return true;
}

std::string Core::CudaUnavailableReason() const {
  if (test_mode()) {
    return "this nccl transport was created with host_through_protocol_for_testing (no NCCL)";
  }
  if (mover_ == nullptr) return no_mover_reason_;
  return "";
}

absl::StatusOr<PeerId> Core::Connect(std::string_view peer_address, absl::Time deadline) {
  auto peer = ucx_->Connect(peer_address, deadline);
  if (!peer.ok()) return peer.status();
  std::string peer_name = ucx_->PeerName(*peer);
  const bool lower = address_ < peer_address;
  absl::MutexLock lock(&mu_);
  peers_[*peer] = PublicPeer{peer_name, false, absl::OkStatus()};
  if (!stopped_) {
    commands_.push_back([this, id = *peer, peer_name, lower] { AddPeer(id, peer_name, lower); });
    wake_.Signal();
  }
  return *peer;
}

absl::StatusOr<std::shared_ptr<ProtoOp>> Core::Post(bool is_send, PeerId peer, Tag tag,
                                                    const void* src,
                                                    std::vector<MutableBuffer> segments,
                                                    size_t size, MemoryKind kind, int device,
                                                    bool scatter) {
  auto op = std::make_shared<ProtoOp>();
  op->is_send = is_send;
  op->peer = peer;
  op->tag = tag;
  op->src = src;
  op->segments = std::move(segments);
  op->size = size;
  op->device = device;
  absl::MutexLock lock(&mu_);
  auto info = peers_.find(peer);
  const std::string what = Describe(
      is_send, info == peers_.end() ? absl::StrCat("<unknown peer ", peer, ">") : info->second.name,
      tag, size);
  if (info == peers_.end()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": '", name_, "' has no peer ", peer,
                                                   "; expected a PeerId from Connect"));
  }
  if (absl::Status s = ValidateTag(tag, what); !s.ok()) return s;
  if (!scatter) {
    if (absl::Status s =
            ValidateBuffer(is_send ? src : (op->segments.empty() ? nullptr : op->segments[0].data),
                           size, kind, what);
        !s.ok()) {
      return s;
    }
  }
  if (kind == MemoryKind::kCuda) {
    if (!CanMove(MemoryKind::kCuda)) {
      return absl::UnimplementedError(absl::StrCat(
          what, ": device ", device, " memory cannot be moved: ", CudaUnavailableReason()));
    }
    if (device != options_.cuda_device) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": the buffer is on device ", device,
                                                     "; this transport's NCCL communicators are "
                                                     "on device ",
                                                     options_.cuda_device,
                                                     " (options.cuda_device)"));
    }
  } else if (kind != MemoryKind::kHost || !test_mode()) {
    return absl::InternalError(absl::StrCat(what, ": memory kind ",
                                            std::string(MemoryKindName(kind)),
                                            " does not go through the NCCL protocol"));
  }
  if (info->second.disconnected) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, ": peer ", peer, " was disconnected by this transport"));
  }
  if (!info->second.dead.ok()) {
    return absl::UnavailableError(
        absl::StrCat(what, ": ", std::string(info->second.dead.message())));
  }
  if (stopped_) return absl::CancelledError(absl::StrCat(what, ": the transport is shutting down"));
  op->completion = std::make_shared<Completion>(what);
  if (is_send) {
    commands_.push_back([this, op] { SendOnThread(op); });
  } else {
    commands_.push_back([this, op] { RecvOnThread(op); });
  }
  wake_.Signal();
  return op;
}

absl::Status Core::Disconnect(PeerId peer, absl::Time deadline) {
  auto done =
      std::make_shared<Completion>(absl::StrCat("disconnecting '", name_, "' from peer ", peer));
  {
    absl::MutexLock lock(&mu_);
    auto info = peers_.find(peer);
    if (info == peers_.end()) {
      return absl::InvalidArgumentError(absl::StrCat("disconnect: '", name_, "' has no peer ", peer,
                                                     "; expected a PeerId from Connect"));
    }
    if (info->second.disconnected) return absl::OkStatus();
    info->second.disconnected = true;
    if (stopped_) return absl::OkStatus();
    commands_.push_back([this, peer, done] {
      if (PeerState* s = FindState(peer)) {
        ClosePeer(s,
                  absl::CancelledError(
                      absl::StrCat("cancelled: peer ", peer, " was disconnected locally")),
                  /*tell_peer=*/false);
      }
      done->Complete(absl::OkStatus());
    });
    wake_.Signal();
  }
  if (absl::Status s = done->Wait(deadline); !s.ok()) return s;
  // Cancels the control channel and the service mover's transfers; the peer is told we left.
  return ucx_->Disconnect(peer, deadline);
}

void Core::Cancel(const std::shared_ptr<ProtoOp>& op) {
  if (op->completion->done()) return;
  Enqueue([this, op] { CancelOnThread(op); });
}

void Core::Abandon(const std::shared_ptr<ProtoOp>& op) {
  Enqueue([this, op] {
    PeerState* s = FindState(op->peer);
    if (s == nullptr || op->completion->done()) return;
    const absl::Status why = PeerUnavailable(
        s->name, absl::StrCat("the connection was torn down because ",
                              op->completion->description(), " was destroyed before it finished"));
    ClosePeer(s, why, /*tell_peer=*/true);
    // Ends the UCX operations that still hold buffers (bounded by the deadline).
    absl::Status disconnected = ucx_->Disconnect(op->peer, absl::Now() + options_.abandon_timeout);
    if (!disconnected.ok()) HETPAR_LOG(WARNING) << disconnected;
  });
}

void Core::Close() {
  bool join = false;
  {
    absl::MutexLock lock(&mu_);
    if (!stopped_) {
      stopped_ = true;
      join = true;
      commands_.push_back([this] {
        for (auto& [id, s] : states_) {
          ClosePeer(s.get(), absl::CancelledError("cancelled: the transport was destroyed"),
                    /*tell_peer=*/false);
        }
        stop_ = true;
      });
      wake_.Signal();
    }
  }
  if (join && thread_.joinable()) thread_.join();
  if (closed_) return;
  closed_ = true;
  // Destroying the UCX transport ends every UCX operation (control messages, the service
  // mover's transfers) and says goodbye to the peers; the channels are aborted already.
  ucx_.reset();
  for (auto& [id, s] : states_) {
    for (auto& op : s->moving) {
      if (op->transfer != nullptr) op->transfer->Poll();
      op->completion->Complete(Prefixed(
          op->fail_with.ok() ? absl::CancelledError("cancelled: the transport was destroyed")
                             : op->fail_with,
          op->completion->description()));
    }
  }
  states_.clear();
  mover_.reset();
}

// ---------------------------------------------------------------------------------------------
// Progress thread

void Core::Loop() {
  absl::Duration backoff = absl::ZeroDuration();
  while (true) {
    bool active = RunCommands();
    if (stop_) break;
    if (mover_ != nullptr) mover_->Progress();
    for (auto& [id, s] : states_) {
      active |= PollControl(s.get());
      active |= ReapControlSends(s.get());
      active |= AdvanceChannels(s.get());
      active |= PollMoving(s.get());
    }
    if (active) {
      backoff = absl::ZeroDuration();
      continue;
    }
    // Nothing happened: sleep a little longer each time, less long while operations are
    // pending (completions are polled), until a command wakes the thread.
    const absl::Duration longest =
        HasPendingWork() ? absl::Microseconds(500) : absl::Milliseconds(5);
    backoff = std::min(longest, std::max(absl::Microseconds(20), backoff * 2));
    absl::MutexLock lock(&mu_);
    if (commands_.empty()) wake_.WaitWithTimeout(&mu_, backoff);
  }
}

bool Core::RunCommands() {
  std::deque<std::function<void()>> batch;
  {
    absl::MutexLock lock(&mu_);
    batch.swap(commands_);
  }
  for (auto& command : batch) command();
  return !batch.empty();
}

bool Core::HasPendingWork() const {
  for (const auto& [id, s] : states_) {
    if (s->closed) continue;
    if (!s->moving.empty() || !s->announced.empty() || !s->cleared.empty() ||
        !s->control_out.empty() || s->channels == PeerState::Channels::kStarting) {
      return true;
    }
    for (const auto& [tag, receives] : s->receives) {
      if (!receives.empty()) return true;
    }
  }
  return false;
}

PeerState* Core::FindState(PeerId peer) {
  auto it = states_.find(peer);
  return it == states_.end() ? nullptr : it->second.get();
}

void Core::SetPublicDead(PeerId peer, const absl::Status& status) {
  absl::MutexLock lock(&mu_);
  auto it = peers_.find(peer);
  if (it != peers_.end() && it->second.dead.ok()) it->second.dead = status;
}

void Core::AddPeer(PeerId peer, std::string name, bool lower) {
  auto state = std::make_unique<PeerState>();
  state->id = peer;
  state->name = std::move(name);
  state->lower = lower;
  PeerState* s = state.get();
  states_[peer] = std::move(state);
  PostControlRecv(s);
  // The lower side creates the channels' setup once it knows we have connected back.
  if (!lower) SendControl(s, ControlKind::kHello);
}

void Core::PostControlRecv(PeerState* s) {
  auto op = ucx_->RecvService(s->id, kControlTag,
                              MutableBuffer::Host(&s->control_in, sizeof(s->control_in)));
  if (!op.ok()) {
    ClosePeer(s,
              PeerUnavailable(s->name, absl::StrCat("cannot receive on the control channel: ",
                                                    std::string(op.status().message()))),
              /*tell_peer=*/false);
    return;
  }
  s->control_recv = std::move(op).value();
}

bool Core::PollControl(PeerState* s) {
  bool active = false;
  while (s->control_recv != nullptr && s->control_recv->Done()) {
    active = true;
    const absl::Status status = s->control_recv->Wait(absl::InfinitePast());
    const size_t length = s->control_recv->bytes();
    s->control_recv.reset();
    if (status.code() == absl::StatusCode::kCancelled ||
        status.code() == absl::StatusCode::kFailedPrecondition) {
      return active;  // local disconnect or shutdown
    }
    if (status.code() == absl::StatusCode::kUnavailable) {
      ClosePeer(s,
                absl::UnavailableError(absl::StrCat(
                    "peer '", s->name,
                    "' is unavailable (control channel: ", std::string(status.message()), ")")),
                /*tell_peer=*/false);
      return active;
    }
    const ControlMessage message = s->control_in;
    PostControlRecv(s);
    if (!status.ok() || length != sizeof(ControlMessage) || message.magic != kControlMagic) {
      HETPAR_LOG(WARNING) << "nccl transport '" << name_
                          << "': ignoring a malformed control message of " << length
                          << " bytes from peer '" << s->name << "' (" << StatusText(status) << ")";
      continue;
    }
    HandleControl(s, message);
  }
  return active;
}

bool Core::ReapControlSends(PeerState* s) {
  bool active = false;
  for (auto it = s->control_out.begin(); it != s->control_out.end();) {
    if (!(*it)->op->Done()) {
      ++it;
      continue;
    }
    active = true;
    const absl::Status status = (*it)->op->Wait(absl::InfinitePast());
    it = s->control_out.erase(it);
    if (status.code() == absl::StatusCode::kUnavailable) {
      ClosePeer(s,
                absl::UnavailableError(absl::StrCat(
                    "peer '", s->name,
                    "' is unavailable (control channel: ", std::string(status.message()), ")")),
                /*tell_peer=*/false);
      return active;  // ClosePeer may have added to control_out
    }
  }
  return active;
}

void Core::SendControl(PeerState* s, ControlKind kind, uint64_t seq, uint64_t tag, uint64_t size,
                       std::string_view payload) {
  auto out = std::make_unique<OutgoingControl>();
  out->message.kind = static_cast<uint32_t>(kind);
  out->message.seq = seq;
  out->message.tag = tag;
  out->message.size = size;
  const size_t n = std::min(payload.size(), kMaxPayload);
  out->message.payload_size = static_cast<uint32_t>(n);
  if (n > 0) std::memcpy(out->message.payload, payload.data(), n);
  auto op =
      ucx_->SendService(s->id, kControlTag, ConstBuffer::Host(&out->message, sizeof(out->message)));
  if (!op.ok()) {
    if (op.status().code() == absl::StatusCode::kUnavailable) {
      ClosePeer(s,
                absl::UnavailableError(absl::StrCat("peer '", s->name,
                                                    "' is unavailable (control channel: ",
                                                    std::string(op.status().message()), ")")),
                /*tell_peer=*/false);
    }
    return;  // otherwise disconnected locally or shutting down
  }
  out->op = std::move(op).value();
  s->control_out.push_back(std::move(out));
}

void Core::HandleControl(PeerState* s, const ControlMessage& message) {
  const std::string_view payload(message.payload,
                                 std::min<size_t>(message.payload_size, kMaxPayload));
  switch (static_cast<ControlKind>(message.kind)) {
    case ControlKind::kHello: {
      if (!s->lower || s->closed || s->channels != PeerState::Channels::kAwaitingSetup) return;
      if (mover_ == nullptr) {
        StartChannels(s, "", /*creator=*/true);  // fails, saying why
        return;
      }
      auto setup = mover_->CreatePeerSetup(s->id);
      if (!setup.ok()) {
        ClosePeer(
            s,
            absl::UnavailableError(absl::StrCat("peer '", s->name,
                                                "' is unavailable for device memory: creating the "
                                                "channels' setup failed: ",
                                                std::string(setup.status().message()))),
            /*tell_peer=*/true);
        return;
      }
      if (setup->size() > kMaxPayload) {
        ClosePeer(s,
                  absl::InternalError(absl::StrCat("the channels' setup is ", setup->size(),
                                                   " bytes; the control message holds at most ",
                                                   kMaxPayload)),
                  /*tell_peer=*/true);
        return;
      }
      SendControl(s, ControlKind::kSetup, 0, 0, 0, *setup);
      StartChannels(s, *setup, /*creator=*/true);
      return;
    }
    case ControlKind::kSetup:
      if (s->lower || s->closed || s->channels != PeerState::Channels::kAwaitingSetup) return;
      StartChannels(s, payload, /*creator=*/false);
      return;
    case ControlKind::kChannelsFailed:
      ClosePeer(s,
                absl::UnavailableError(absl::StrCat("peer '", s->name,
                                                    "' is unavailable for device memory: it "
                                                    "reports: ",
                                                    std::string(payload))),
                /*tell_peer=*/false);
      return;
    case ControlKind::kReadyToSend:
      if (s->closed) return;
      s->announcements[message.tag].push_back({message.seq, static_cast<size_t>(message.size)});
      TryMatch(s, message.tag);
      return;
    case ControlKind::kClearToSend: {
      auto it = s->announced.find(message.seq);
      if (it == s->announced.end()) return;  // failed or cancelled meanwhile
      s->cleared.push_back(std::move(it->second));
      s->announced.erase(it);
      DrainCleared(s);
      return;
    }
    case ControlKind::kTaken: {
      auto it = s->announced.find(message.seq);
      if (it == s->announced.end()) return;
      std::shared_ptr<ProtoOp> op = std::move(it->second);
      s->announced.erase(it);
      op->completion->Complete(absl::OkStatus(), op->size);
      return;
    }
    case ControlKind::kWithdraw: {
      auto it = s->announcements.find(message.tag);
      if (it == s->announcements.end()) return;  // already matched: its answer is on the way
      auto& queue = it->second;
      for (auto a = queue.begin(); a != queue.end(); ++a) {
        if (a->seq == message.seq) {
          queue.erase(a);
          if (queue.empty()) s->announcements.erase(it);
          SendControl(s, ControlKind::kWithdrawn, message.seq);
          return;
        }
      }
      return;
    }
    case ControlKind::kWithdrawn: {
      auto it = s->announced.find(message.seq);
      if (it == s->announced.end()) return;
      std::shared_ptr<ProtoOp> op = std::move(it->second);
      s->announced.erase(it);
      op->completion->Complete(
          absl::CancelledError(absl::StrCat(op->completion->description(), ": cancelled")));
      return;
    }
  }
  HETPAR_LOG(WARNING) << "nccl transport '" << name_
                      << "': ignoring a control message of unknown kind " << message.kind
                      << " from peer '" << s->name << "'";
}

void Core::StartChannels(PeerState* s, std::string_view setup, bool creator) {
  if (mover_ == nullptr) {
    ClosePeer(s,
              absl::UnavailableError(
                  absl::StrCat("peer '", s->name, "' is unavailable for device memory: '", name_,
                               "' cannot move device memory: ", no_mover_reason_)),
              /*tell_peer=*/true);
    return;
  }
  absl::Status started = mover_->StartPeer(s->id, s->name, setup, creator);
  if (!started.ok()) {
    ClosePeer(s,
              absl::UnavailableError(absl::StrCat(
                  "peer '", s->name,
                  "' is unavailable for device memory: ", std::string(started.message()))),
              /*tell_peer=*/true);
    return;
  }
  s->channels = PeerState::Channels::kStarting;
  s->init_deadline = absl::Now() + options_.init_timeout;
}

bool Core::AdvanceChannels(PeerState* s) {
  if (s->closed || mover_ == nullptr) return false;
  if (s->channels == PeerState::Channels::kAwaitingSetup) return false;
  if (s->channels == PeerState::Channels::kReady && s->moving.empty()) return false;
  auto ready = mover_->PollPeer(s->id);
  if (!ready.ok()) {
    ClosePeer(s, PeerUnavailable(s->name, ready.status().message()), /*tell_peer=*/true);
    return true;
  }
  if (s->channels == PeerState::Channels::kReady) return false;
  if (!*ready) {
    if (absl::Now() < s->init_deadline) return false;
    ClosePeer(s,
              absl::UnavailableError(
                  absl::StrCat("peer '", s->name,
                               "' is unavailable for device memory: its channels (NCCL "
                               "communicators) were not ready within init_timeout ",
                               absl::FormatDuration(options_.init_timeout))),
              /*tell_peer=*/true);
    return true;
  }
  s->channels = PeerState::Channels::kReady;
  TryMatchAll(s);
  DrainCleared(s);
  return true;
}

void Core::SendOnThread(const std::shared_ptr<ProtoOp>& op) {
  PeerState* s = FindState(op->peer);
  if (s == nullptr || s->closed) {
    const absl::Status why =
        s == nullptr ? absl::UnavailableError("the connection was never set up") : s->closed_status;
    op->completion->Complete(Prefixed(why, op->completion->description()));
    return;
  }
  op->seq = s->next_seq++;
  s->announced[op->seq] = op;
  SendControl(s, ControlKind::kReadyToSend, op->seq, op->tag, op->size);
}

void Core::RecvOnThread(const std::shared_ptr<ProtoOp>& op) {
  PeerState* s = FindState(op->peer);
  if (s == nullptr || s->closed) {
    const absl::Status why =
        s == nullptr ? absl::UnavailableError("the connection was never set up") : s->closed_status;
    op->completion->Complete(Prefixed(why, op->completion->description()));
    return;
  }
  s->receives[op->tag].push_back(op);
  TryMatch(s, op->tag);
}

void Core::CancelOnThread(const std::shared_ptr<ProtoOp>& op) {
  PeerState* s = FindState(op->peer);
  if (s == nullptr || s->closed || op->completion->done()) return;
  if (op->is_send) {
    // Only an announcement that no receive has taken can be withdrawn; the receiver decides.
    auto it = s->announced.find(op->seq);
    if (it == s->announced.end() || it->second != op || op->withdrawing) return;
    op->withdrawing = true;
    SendControl(s, ControlKind::kWithdraw, op->seq, op->tag);
    return;
  }
  auto it = s->receives.find(op->tag);
  if (it == s->receives.end()) return;
  auto found = std::find(it->second.begin(), it->second.end(), op);
  if (found == it->second.end()) return;  // matched: it completes normally
  it->second.erase(found);
  if (it->second.empty()) s->receives.erase(it);
  op->completion->Complete(
      absl::CancelledError(absl::StrCat(op->completion->description(), ": cancelled")));
}

void Core::TryMatch(PeerState* s, Tag tag) {
  while (true) {
    // Empty queues are dropped: tags are many (step, wave and direction packed together).
    auto receives = s->receives.find(tag);
    if (receives != s->receives.end() && receives->second.empty()) {
      s->receives.erase(receives);
      receives = s->receives.end();
    }
    auto announcements = s->announcements.find(tag);
    if (announcements != s->announcements.end() && announcements->second.empty()) {
      s->announcements.erase(announcements);
      announcements = s->announcements.end();
    }
    if (s->closed || s->channels != PeerState::Channels::kReady || receives == s->receives.end() ||
        announcements == s->announcements.end()) {
      return;
    }
    std::shared_ptr<ProtoOp> recv = std::move(receives->second.front());
    receives->second.pop_front();
    const PeerState::Announcement announcement = announcements->second.front();
    announcements->second.pop_front();
    Match(s, recv, announcement);
  }
}

void Core::TryMatchAll(PeerState* s) {
  std::vector<Tag> tags;
  for (const auto& [tag, queue] : s->announcements) tags.push_back(tag);
  for (Tag tag : tags) TryMatch(s, tag);
}

void Core::Match(PeerState* s, const std::shared_ptr<ProtoOp>& recv,
                 const PeerState::Announcement& announcement) {
  recv->seq = announcement.seq;
  recv->message_size = announcement.size;
  if (announcement.size > recv->size) {
    recv->completion->Complete(absl::OutOfRangeError(
        absl::StrCat(recv->completion->description(), ": the message is larger than the ",
                     recv->size, "-byte receive buffer (it is ", announcement.size,
                     " bytes); truncated, buffer contents unspecified")));
    SendControl(s, ControlKind::kTaken, announcement.seq);
    return;
  }
  if (announcement.size == 0) {
    recv->completion->Complete(absl::OkStatus(), 0);
    SendControl(s, ControlKind::kTaken, announcement.seq);
    return;
  }
  auto transfer = mover_->PostRecv(s->id, recv->segments, announcement.size, recv->device);
  if (!transfer.ok()) {
    FailPost(s, *recv, "posting a receive", transfer.status());
    return;
  }
  recv->transfer = std::move(transfer).value();
  s->moving.push_back(recv);
  SendControl(s, ControlKind::kClearToSend, announcement.seq);
}

void Core::DrainCleared(PeerState* s) {
  while (!s->closed && s->channels == PeerState::Channels::kReady && !s->cleared.empty()) {
    std::shared_ptr<ProtoOp> op = std::move(s->cleared.front());
    s->cleared.pop_front();
    auto transfer = mover_->PostSend(s->id, op->src, op->size, op->device);
    if (!transfer.ok()) {
      FailPost(s, *op, "posting a send", transfer.status());
      return;
    }
    op->transfer = std::move(transfer).value();
    s->moving.push_back(std::move(op));
  }
}

bool Core::PollMoving(PeerState* s) {
  bool active = false;
  absl::Status failure;
  for (auto it = s->moving.begin(); it != s->moving.end();) {
    ProtoOp& op = **it;
    std::optional<absl::Status> result = op.transfer->Poll();
    if (!result.has_value()) {
      ++it;
      continue;
    }
    active = true;
    if (!op.fail_with.ok()) {
      op.completion->Complete(Prefixed(op.fail_with, op.completion->description()));
    } else if (result->ok()) {
      op.completion->Complete(absl::OkStatus(), op.is_send ? op.size : op.message_size);
    } else {
      const absl::Status why = PeerUnavailable(s->name, result->message());
      op.completion->Complete(Prefixed(why, op.completion->description()));
      if (failure.ok()) failure = why;
    }
    it = s->moving.erase(it);
  }
  if (!failure.ok()) ClosePeer(s, failure, /*tell_peer=*/true);
  return active;
}

void Core::FailPost(PeerState* s, ProtoOp& op, absl::string_view what,
                    const absl::Status& refused) {
  const absl::Status why =
      PeerUnavailable(s->name, absl::StrCat(what, " failed: ", refused.message()));
  op.completion->Complete(Prefixed(why, op.completion->description()));
  ClosePeer(s, why, /*tell_peer=*/true);
}

void Core::ClosePeer(PeerState* s, const absl::Status& why, bool tell_peer) {
  if (s->closed) return;
  s->closed = true;
  s->closed_status = why;
  if (why.code() == absl::StatusCode::kUnavailable) {
    SetPublicDead(s->id, why);
    HETPAR_LOG(INFO) << "nccl transport '" << name_ << "': " << why.message();
  }
  if (tell_peer) SendControl(s, ControlKind::kChannelsFailed, 0, 0, 0, std::string(why.message()));
  if (mover_ != nullptr && s->channels != PeerState::Channels::kAwaitingSetup) {
    mover_->AbortPeer(s->id);
  }
  auto fail = [&](const std::shared_ptr<ProtoOp>& op) {
    op->completion->Complete(Prefixed(why, op->completion->description()));
  };
  for (auto& [seq, op] : s->announced) fail(op);
  s->announced.clear();
  for (auto& op : s->cleared) fail(op);
  s->cleared.clear();
  for (auto& [tag, queue] : s->receives) {
    for (auto& op : queue) fail(op);
  }
  s->receives.clear();
  s->announcements.clear();
  // Operations the mover has complete once it lets go of their buffers (soon: it aborted).
  for (auto& op : s->moving) op->fail_with = why;
}

}  // namespace internal

// -----------------------------------------------------------------------------------------------

bool NcclTransport::BuiltWithNccl() {
#ifdef HETPAR_HAVE_NCCL
  return true;
#else
  return false;
#endif
}

absl::StatusOr<std::unique_ptr<NcclTransport>> NcclTransport::Wrap(
    std::unique_ptr<ucx::UcxTransport> ucx, const Options& options) {
  if (ucx == nullptr) {
    return absl::InvalidArgumentError("nccl transport: Wrap needs a UCX transport; got null");
  }
  std::unique_ptr<internal::DeviceMover> mover;
  std::string no_mover_reason;
  if (options.host_through_protocol_for_testing) {
    mover = std::make_unique<internal::ServiceMover>(ucx.get());
  } else {
#ifdef HETPAR_HAVE_NCCL
    auto nccl = internal::CreateNcclMover(options.cuda_device, ucx->name());
    if (nccl.ok()) {
      mover = std::move(nccl).value();
    } else {
      no_mover_reason = std::string(nccl.status().message());
    }
#else
    return absl::UnimplementedError(absl::StrCat(
        "nccl transport '", ucx->name(),
        "': this build of hetpar has no NCCL (it was configured without libtorch's CUDA, or "
        "without NCCL's headers and library); use transport ucx"));
#endif
  }
  auto core = std::make_shared<internal::Core>(std::move(ucx), std::move(mover),
                                               std::move(no_mover_reason), options);
  return std::unique_ptr<NcclTransport>(new NcclTransport(std::move(core)));
}

NcclTransport::NcclTransport(std::shared_ptr<internal::Core> core) : core_(std::move(core)) {}

NcclTransport::~NcclTransport() { core_->Close(); }

const std::string& NcclTransport::name() const { return core_->name(); }

std::string NcclTransport::LocalAddress() const { return core_->address(); }

bool NcclTransport::CanMove(MemoryKind kind) const { return core_->CanMove(kind); }

absl::StatusOr<PeerId> NcclTransport::Connect(std::string_view peer_address, absl::Time deadline) {
  return core_->Connect(peer_address, deadline);
}

absl::StatusOr<std::unique_ptr<Operation>> NcclTransport::Send(PeerId peer, Tag tag,
                                                               ConstBuffer buffer) {
  if (buffer.kind == MemoryKind::kHost && !core_->test_mode()) {
    return core_->ucx()->Send(peer, tag, buffer);
  }
  auto op = core_->Post(/*is_send=*/true, peer, tag, buffer.data, {}, buffer.size, buffer.kind,
                        buffer.device, /*scatter=*/false);
  if (!op.ok()) return op.status();
  return std::unique_ptr<Operation>(new CompletionOperation<internal::Core, internal::ProtoOp>(
      core_, std::move(op).value(), core_->options().abandon_timeout,
      core_->options().abandon_timeout));
}

absl::StatusOr<std::unique_ptr<Operation>> NcclTransport::Recv(PeerId peer, Tag tag,
                                                               MutableBuffer buffer) {
  if (buffer.kind == MemoryKind::kHost && !core_->test_mode()) {
    return core_->ucx()->Recv(peer, tag, buffer);
  }
  auto op = core_->Post(/*is_send=*/false, peer, tag, nullptr, {buffer}, buffer.size, buffer.kind,
                        buffer.device, /*scatter=*/false);
  if (!op.ok()) return op.status();
  return std::unique_ptr<Operation>(new CompletionOperation<internal::Core, internal::ProtoOp>(
      core_, std::move(op).value(), core_->options().abandon_timeout,
      core_->options().abandon_timeout));
}

absl::StatusOr<std::unique_ptr<Operation>> NcclTransport::RecvScatter(
    PeerId peer, Tag tag, std::vector<MutableBuffer> segments) {
  if (!core_->test_mode()) return core_->ucx()->RecvScatter(peer, tag, std::move(segments));
  const size_t total = TotalSize(segments);
  if (absl::Status s =
          ValidateSegments(segments, absl::StrCat("receive from peer '", PeerName(peer), "' tag ",
                                                  tag, " (", total, " bytes)"));
      !s.ok()) {
    return s;
  }
  auto op = core_->Post(/*is_send=*/false, peer, tag, nullptr, std::move(segments), total,
                        MemoryKind::kHost, -1, /*scatter=*/true);
  if (!op.ok()) return op.status();
  return std::unique_ptr<Operation>(new CompletionOperation<internal::Core, internal::ProtoOp>(
      core_, std::move(op).value(), core_->options().abandon_timeout,
      core_->options().abandon_timeout));
}

absl::Status NcclTransport::Disconnect(PeerId peer, absl::Time deadline) {
  return core_->Disconnect(peer, deadline);
}

std::string NcclTransport::PeerName(PeerId peer) const { return core_->PeerName(peer); }

}  // namespace hetpar::transport::nccl
