#include "common/transport/inproc/inproc_transport.h"

#include <unistd.h>

#include <cstring>
#include <deque>
#include <map>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/transport/address.h"
#include "common/transport/completion.h"

namespace hetpar::transport::inproc {
namespace internal {
namespace {

constexpr std::string_view kBackend = "inproc";

enum class OpKind { kSend, kRecv };
enum class OpState { kQueued, kMoving, kDone };

struct PendingOp;
using PendingOpPtr = std::shared_ptr<PendingOp>;
using QueueKey = std::pair<uint64_t, Tag>;  // (sender endpoint id, tag)

// Sends and receives waiting for a partner, for one (sender, tag) at one receiving endpoint.
// At most one of the two is non-empty at any time.
struct MatchQueue {
  std::deque<PendingOpPtr> sends;
  std::deque<PendingOpPtr> recvs;
};

struct Link {
  uint64_t remote_id = 0;
  std::string remote_name;
  bool disconnected = false;  // Disconnect was called on this side
  absl::Status dead;          // OK while the peer is reachable
};

std::string Describe(OpKind kind, std::string_view peer_name, Tag tag, size_t size) {
  return absl::StrCat(kind == OpKind::kSend ? "send to" : "receive from", " peer '",
                      std::string(peer_name), "' tag ", tag, " (", size, " bytes)");
}

absl::Status PeerUnavailable(std::string_view peer_name, std::string_view reason) {
  return absl::UnavailableError(
      absl::StrCat("peer '", std::string(peer_name), "' is unavailable: ", std::string(reason)));
}

}  // namespace

// The matching state of one transport. Every field below `name` is guarded by the registry's
// mutex (one lock for the whole process keeps matching and failure handling simple; copies run
// outside it).
class Endpoint {
 public:
  Endpoint(uint64_t id, std::string name) : id(id), name(std::move(name)) {}

  const uint64_t id;
  const std::string name;

  bool alive = true;
  PeerId next_peer = 1;
  std::map<PeerId, Link> links;
  absl::flat_hash_map<uint64_t, PeerId> live_links;     // remote id -> its live PeerId
  absl::flat_hash_map<uint64_t, std::string> departed;  // peers that disconnected from us
  std::map<QueueKey, MatchQueue> queues;                // messages to this endpoint
  int moving = 0;  // copies in flight that touch this endpoint's buffers
};

namespace {

struct PendingOp {
  OpKind kind;
  std::shared_ptr<Completion> completion;
  Endpoint* owner = nullptr;  // valid while queued or moving (the owner waits for both)
  uint64_t receiver = 0;      // endpoint whose queues hold the op
  QueueKey key;
  const void* src = nullptr;
  void* dst = nullptr;
  std::vector<MutableBuffer> segments;  // a scatter receive's, instead of dst
  size_t size = 0;
  OpState state = OpState::kQueued;
};

// Outcomes decided under the lock and delivered after it is released.
using Outcomes = std::vector<std::pair<std::shared_ptr<Completion>, absl::Status>>;

void Deliver(Outcomes* outcomes) {
  for (auto& [completion, status] : *outcomes) {
    absl::Status annotated =
        absl::Status(status.code(),
                     absl::StrCat(completion->description(), ": ", std::string(status.message())));
    completion->Complete(std::move(annotated));
  }
  outcomes->clear();
}

class Registry {
 public:
  static Registry& Get() {
    static Registry* registry = new Registry();  // never destroyed: transports may outlive main
    return *registry;
  }

  absl::Mutex mu;
  absl::flat_hash_map<uint64_t, std::shared_ptr<Endpoint>> endpoints ABSL_GUARDED_BY(mu);

  Endpoint* Find(uint64_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    auto it = endpoints.find(id);
    return it == endpoints.end() ? nullptr : it->second.get();
  }

  // Removes every queued op at `at` whose sender is `sender_id` (all senders when 0), handing
  // the outcome chosen by `decide` to `outcomes`.
  template <typename Decide>
  void FailQueues(Endpoint* at, uint64_t sender_id, Decide decide, Outcomes* outcomes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    for (auto it = at->queues.begin(); it != at->queues.end();) {
      if (sender_id != 0 && it->first.first != sender_id) {
        ++it;
        continue;
      }
      for (auto* list : {&it->second.sends, &it->second.recvs}) {
        for (auto& op : *list) {
          op->state = OpState::kDone;
          outcomes->emplace_back(op->completion, decide(*op));
        }
      }
      it = at->queues.erase(it);
    }
  }

 private:
  Registry() = default;
};

// Copies a matched pair outside the lock and completes both.
void Move(const PendingOpPtr& send, const PendingOpPtr& recv) {
  absl::Status recv_status;
  if (send->size > recv->size) {
    recv_status = absl::OutOfRangeError(
        absl::StrCat(recv->completion->description(), ": the message is ", send->size,
                     " bytes, larger than the ", recv->size,
                     "-byte receive buffer (truncated; buffer contents unspecified)"));
  } else if (!recv->segments.empty()) {
    ScatterCopy(send->src, send->size, recv->segments);
  } else if (send->size > 0) {
    std::memcpy(recv->dst, send->src, send->size);
  }
  Registry& registry = Registry::Get();
  {
    absl::MutexLock lock(&registry.mu);
    send->state = OpState::kDone;
    recv->state = OpState::kDone;
    --send->owner->moving;
    --recv->owner->moving;
  }
  send->completion->Complete(absl::OkStatus(), send->size);
  recv->completion->Complete(std::move(recv_status), send->size);
}

class InprocOperation final : public Operation {
 public:
  explicit InprocOperation(PendingOpPtr op) : op_(std::move(op)) {}

  ~InprocOperation() override {
    if (op_->completion->done()) return;
    Cancel();
    // Bounded: a queued op is withdrawn by Cancel; a moving one finishes its memcpy.
    op_->completion->WaitUntil(absl::InfiniteFuture());
  }

  bool Done() const override { return op_->completion->done(); }
  absl::Status Wait(absl::Time deadline) override { return op_->completion->Wait(deadline); }
  size_t bytes() const override { return op_->completion->bytes(); }
  absl::Time completed_at() const override { return op_->completion->completed_at(); }

  void Cancel() override {
    Registry& registry = Registry::Get();
    {
      absl::MutexLock lock(&registry.mu);
      if (op_->state != OpState::kQueued) return;
      Endpoint* at = registry.Find(op_->receiver);
      if (at != nullptr) {
        auto it = at->queues.find(op_->key);
        if (it != at->queues.end()) {
          auto& list = op_->kind == OpKind::kSend ? it->second.sends : it->second.recvs;
          for (auto i = list.begin(); i != list.end(); ++i) {
            if (*i == op_) {
              list.erase(i);
              break;
            }
          }
          if (it->second.sends.empty() && it->second.recvs.empty()) at->queues.erase(it);
        }
      }
      op_->state = OpState::kDone;
    }
    op_->completion->Complete(
        absl::CancelledError(absl::StrCat(op_->completion->description(), ": cancelled")));
  }

 private:
  PendingOpPtr op_;
};

}  // namespace
}  // namespace internal

using internal::Endpoint;
using internal::Registry;

absl::StatusOr<std::unique_ptr<InprocTransport>> InprocTransport::Create(const Options& options) {
  if (options.name.empty()) {
    return absl::InvalidArgumentError(
        "in-process transport: options.name is empty; expected a name peers can print, e.g. "
        "'enc r1'");
  }
  if (options.name.size() > 1000) {
    return absl::InvalidArgumentError(absl::StrCat("in-process transport: options.name is ",
                                                   options.name.size(),
                                                   " bytes; expected at most 1000"));
  }
  Registry& registry = Registry::Get();
  std::shared_ptr<Endpoint> endpoint;
  {
    absl::MutexLock lock(&registry.mu);
    uint64_t id = NewInstanceId();
    while (registry.endpoints.contains(id)) id = NewInstanceId();
    endpoint = std::make_shared<Endpoint>(id, options.name);
    registry.endpoints[id] = endpoint;
  }
  return std::unique_ptr<InprocTransport>(new InprocTransport(std::move(endpoint)));
}

InprocTransport::InprocTransport(std::shared_ptr<Endpoint> endpoint)
    : endpoint_(std::move(endpoint)) {}

InprocTransport::~InprocTransport() {
  Registry& registry = Registry::Get();
  internal::Outcomes outcomes;
  Endpoint* self = endpoint_.get();
  const std::string gone =
      absl::StrCat("peer '", self->name, "' is unavailable: its transport was destroyed");
  {
    absl::MutexLock lock(&registry.mu);
    self->alive = false;
    registry.endpoints.erase(self->id);
    auto decide = [&](const internal::PendingOp& op) {
      return op.owner == self ? absl::CancelledError("cancelled: the transport was destroyed")
                              : absl::UnavailableError(gone);
    };
    registry.FailQueues(self, 0, decide, &outcomes);
    for (auto& [id, other] : registry.endpoints) {
      registry.FailQueues(other.get(), self->id, decide, &outcomes);
      auto live = other->live_links.find(self->id);
      if (live != other->live_links.end()) {
        other->links[live->second].dead = absl::UnavailableError(gone);
        other->live_links.erase(live);
      }
      other->departed[self->id] = self->name;
    }
  }
  internal::Deliver(&outcomes);
  absl::MutexLock lock(&registry.mu);
  auto no_copies = [self]() { return self->moving == 0; };
  registry.mu.Await(absl::Condition(&no_copies));
}

const std::string& InprocTransport::name() const { return endpoint_->name; }

std::string InprocTransport::LocalAddress() const {
  AddressEnvelope envelope;
  envelope.backend = std::string(internal::kBackend);
  envelope.instance_id = endpoint_->id;
  envelope.name = endpoint_->name;
  const uint32_t pid = static_cast<uint32_t>(getpid());
  envelope.payload.assign(reinterpret_cast<const char*>(&pid), sizeof(pid));
  return EncodeAddress(envelope);
}

absl::StatusOr<PeerId> InprocTransport::Connect(std::string_view peer_address,
                                                absl::Time /*deadline*/) {
  auto envelope = DecodeAddress(peer_address, internal::kBackend);
  if (!envelope.ok()) return envelope.status();
  uint32_t pid = 0;
  if (envelope->payload.size() != sizeof(pid)) {
    return absl::InvalidArgumentError(absl::StrCat("in-process address of '", envelope->name,
                                                   "' has a ", envelope->payload.size(),
                                                   "-byte payload; expected ", sizeof(pid)));
  }
  std::memcpy(&pid, envelope->payload.data(), sizeof(pid));
  if (pid != static_cast<uint32_t>(getpid())) {
    return absl::InvalidArgumentError(
        absl::StrCat("in-process address of '", envelope->name, "' belongs to process ", pid,
                     "; this is process ", getpid(), " (use the ucx backend between processes)"));
  }
  Registry& registry = Registry::Get();
  Endpoint* self = endpoint_.get();
  absl::MutexLock lock(&registry.mu);
  Endpoint* remote = registry.Find(envelope->instance_id);
  if (remote == nullptr) {
    return internal::PeerUnavailable(envelope->name,
                                     "no in-process transport with this address exists any more");
  }
  auto live = self->live_links.find(remote->id);
  if (live != self->live_links.end()) {
    return absl::AlreadyExistsError(absl::StrCat("'", self->name, "' is already connected to '",
                                                 remote->name, "' as peer ", live->second));
  }
  const PeerId peer = self->next_peer++;
  internal::Link& link = self->links[peer];
  link.remote_id = remote->id;
  link.remote_name = remote->name;
  remote->departed.erase(self->id);
  if (self->departed.contains(remote->id)) {
    link.dead = internal::PeerUnavailable(remote->name, "it disconnected from this transport");
  } else {
    self->live_links[remote->id] = peer;
  }
  return peer;
}

absl::StatusOr<std::unique_ptr<Operation>> InprocTransport::Send(PeerId peer, Tag tag,
                                                                 ConstBuffer buffer) {
  return Post(/*is_send=*/true, peer, tag, buffer.data, nullptr, buffer.size, buffer.kind);
}

absl::StatusOr<std::unique_ptr<Operation>> InprocTransport::Recv(PeerId peer, Tag tag,
                                                                 MutableBuffer buffer) {
  return Post(/*is_send=*/false, peer, tag, nullptr, buffer.data, buffer.size, buffer.kind);
}

absl::StatusOr<std::unique_ptr<Operation>> InprocTransport::RecvScatter(
    PeerId peer, Tag tag, std::vector<MutableBuffer> segments) {
  const size_t total = TotalSize(segments);
  if (absl::Status s = ValidateSegments(
          segments, internal::Describe(internal::OpKind::kRecv, PeerName(peer), tag, total));
      !s.ok()) {
    return s;
  }
  return Post(/*is_send=*/false, peer, tag, nullptr, nullptr, total, MemoryKind::kHost,
              std::move(segments));
}

absl::StatusOr<std::unique_ptr<Operation>> InprocTransport::Post(
    bool is_send, PeerId peer, Tag tag, const void* src, void* dst, size_t size, MemoryKind kind,
    std::vector<MutableBuffer> segments) {
  using internal::OpKind;
  using internal::PendingOp;
  Registry& registry = Registry::Get();
  Endpoint* self = endpoint_.get();
  const OpKind op_kind = is_send ? OpKind::kSend : OpKind::kRecv;
  const std::string peer_name = PeerName(peer);
  const std::string what = internal::Describe(op_kind, peer_name, tag, size);
  if (auto s = ValidateTag(tag, what); !s.ok()) return s;
  if (segments.empty()) {
    if (auto s = ValidateBuffer(is_send ? src : dst, size, kind, what); !s.ok()) return s;
  }
  if (kind != MemoryKind::kHost) {
    return absl::UnimplementedError(
        absl::StrCat(what, ": the in-process backend moves host memory only; ",
                     std::string(MemoryKindName(kind)), " memory needs a GPU-aware backend"));
  }
  auto op = std::make_shared<PendingOp>();
  op->kind = op_kind;
  op->completion = std::make_shared<Completion>(what);
  op->owner = self;
  op->src = src;
  op->dst = dst;
  op->segments = std::move(segments);
  op->size = size;
  internal::PendingOpPtr match;
  {
    absl::MutexLock lock(&registry.mu);
    auto link = self->links.find(peer);
    if (link == self->links.end()) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": '", self->name, "' has no peer ",
                                                     peer,
                                                     "; expected a PeerId returned by Connect"));
    }
    if (link->second.disconnected) {
      return absl::FailedPreconditionError(
          absl::StrCat(what, ": peer ", peer, " was disconnected by this transport"));
    }
    if (!link->second.dead.ok()) {
      return absl::UnavailableError(
          absl::StrCat(what, ": ", std::string(link->second.dead.message())));
    }
    // Queues live at the receiver, keyed by (sender, tag).
    Endpoint* receiver = is_send ? registry.Find(link->second.remote_id) : self;
    op->receiver = receiver->id;
    op->key = {is_send ? self->id : link->second.remote_id, tag};
    internal::MatchQueue& queue = receiver->queues[op->key];
    auto& opposite = is_send ? queue.recvs : queue.sends;
    if (!opposite.empty()) {
      match = opposite.front();
      opposite.pop_front();
      if (queue.sends.empty() && queue.recvs.empty()) receiver->queues.erase(op->key);
      match->state = internal::OpState::kMoving;
      op->state = internal::OpState::kMoving;
      ++self->moving;
      ++match->owner->moving;
    } else {
      (is_send ? queue.sends : queue.recvs).push_back(op);
    }
  }
  if (match != nullptr) {
    if (is_send) {
      internal::Move(op, match);
    } else {
      internal::Move(match, op);
    }
  }
  return std::unique_ptr<Operation>(new internal::InprocOperation(std::move(op)));
}

absl::Status InprocTransport::Disconnect(PeerId peer, absl::Time /*deadline*/) {
  Registry& registry = Registry::Get();
  Endpoint* self = endpoint_.get();
  internal::Outcomes outcomes;
  {
    absl::MutexLock lock(&registry.mu);
    auto link_it = self->links.find(peer);
    if (link_it == self->links.end()) {
      return absl::InvalidArgumentError(absl::StrCat("disconnect: '", self->name, "' has no peer ",
                                                     peer,
                                                     "; expected a PeerId returned by Connect"));
    }
    internal::Link& link = link_it->second;
    if (link.disconnected) return absl::OkStatus();
    link.disconnected = true;
    const bool was_live = link.dead.ok();
    if (!was_live) return absl::OkStatus();  // the peer is gone; nothing is queued with it
    self->live_links.erase(link.remote_id);
    Endpoint* remote = registry.Find(link.remote_id);
    const std::string gone = absl::StrCat(
        "peer '", self->name, "' is unavailable: it disconnected from '", link.remote_name, "'");
    auto decide = [&](const internal::PendingOp& op) {
      return op.owner == self ? absl::CancelledError(absl::StrCat("cancelled: peer ", peer,
                                                                  " was disconnected locally"))
                              : absl::UnavailableError(gone);
    };
    registry.FailQueues(self, link.remote_id, decide, &outcomes);
    if (remote != nullptr) {
      registry.FailQueues(remote, self->id, decide, &outcomes);
      auto live = remote->live_links.find(self->id);
      if (live != remote->live_links.end()) {
        remote->links[live->second].dead = absl::UnavailableError(gone);
        remote->live_links.erase(live);
      }
      remote->departed[self->id] = self->name;
    }
  }
  internal::Deliver(&outcomes);
  return absl::OkStatus();
}

std::string InprocTransport::PeerName(PeerId peer) const {
  Registry& registry = Registry::Get();
  absl::MutexLock lock(&registry.mu);
  auto link = endpoint_->links.find(peer);
  if (link == endpoint_->links.end()) return absl::StrCat("<unknown peer ", peer, ">");
  return link->second.remote_name;
}

}  // namespace hetpar::transport::inproc
