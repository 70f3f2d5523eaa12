#include "common/transport/faulty_transport.h"

#include <algorithm>
#include <map>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace hetpar::transport {
namespace internal {
namespace {

// How often a waiter looks at the injected-failure flag while the wrapped operation runs.
constexpr absl::Duration kFailurePollInterval = absl::Milliseconds(2);

struct PeerFaults {
  int64_t ops = 0;
  int64_t sends = 0;
  absl::Status failed;  // non-OK once the peer counts as dead
};

}  // namespace

// One operation posted through the decorator.
struct FaultyOp {
  std::string what;
  PeerId peer = 0;
  Tag tag = 0;
  ConstBuffer buffer;  // for delayed sends
  size_t size = 0;

  absl::Mutex mu;
  bool posted ABSL_GUARDED_BY(mu) = false;   // handed to the wrapped transport (or dropped)
  bool dropped ABSL_GUARDED_BY(mu) = false;  // completed here, never sent
  absl::Time dropped_at ABSL_GUARDED_BY(mu) = absl::InfinitePast();
  absl::Status final_status ABSL_GUARDED_BY(mu);  // set when it ends here (cancel, post error)
  std::unique_ptr<Operation> inner ABSL_GUARDED_BY(mu);
};

class FaultyState {
 public:
  FaultyState(std::unique_ptr<Transport> inner, const FaultPlan& plan)
      : inner_(std::move(inner)), plan_(plan) {}

  Transport& inner() { return *inner_; }

  void SetPlan(const FaultPlan& plan) {
    absl::MutexLock lock(&mu_);
    plan_ = plan;
  }

  void FailPeer(PeerId peer, std::string_view reason) {
    const std::string name = inner_->PeerName(peer);
    absl::MutexLock lock(&mu_);
    PeerFaults& faults = peers_[peer];
    if (faults.failed.ok()) {
      faults.failed = absl::UnavailableError(
          absl::StrCat("peer '", name, "' is unavailable: ", std::string(reason)));
    }
  }

  absl::Status PeerFailure(PeerId peer) const {
    absl::MutexLock lock(&mu_);
    auto it = peers_.find(peer);
    return it == peers_.end() ? absl::OkStatus() : it->second.failed;
  }

  // Counts one operation with `peer`; returns its failure if the peer is (now) dead.
  absl::Status CountOperation(PeerId peer, bool is_send, bool* drop, absl::Duration* delay) {
    const std::string name = inner_->PeerName(peer);
    absl::MutexLock lock(&mu_);
    PeerFaults& faults = peers_[peer];
    if (!faults.failed.ok()) return faults.failed;
    ++faults.ops;
    if (plan_.fail_after_ops >= 0 && faults.ops > plan_.fail_after_ops) {
      faults.failed = absl::UnavailableError(
          absl::StrCat("peer '", name, "' is unavailable: injected failure after ",
                       plan_.fail_after_ops, " operations"));
      return faults.failed;
    }
    if (is_send) {
      ++faults.sends;
      *drop = plan_.drop_every_nth_send > 0 && faults.sends % plan_.drop_every_nth_send == 0;
      *delay = plan_.send_delay;
    }
    return absl::OkStatus();
  }

  void ScheduleSend(absl::Time due, std::shared_ptr<FaultyOp> op) {
    absl::MutexLock lock(&mu_);
    delayed_.emplace(due, std::move(op));
    ++schedule_version_;
    if (!delay_thread_.joinable()) delay_thread_ = std::thread([this] { DelayLoop(); });
  }

  // Stops the delay thread and destroys the wrapped transport.
  void Stop() {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
    }
    if (delay_thread_.joinable()) delay_thread_.join();
    std::multimap<absl::Time, std::shared_ptr<FaultyOp>> left;
    {
      absl::MutexLock lock(&mu_);
      left.swap(delayed_);
    }
    for (auto& [due, op] : left) {
      absl::MutexLock lock(&op->mu);
      if (!op->posted && op->final_status.ok()) {
        op->final_status = absl::CancelledError(
            absl::StrCat(op->what, ": cancelled: the transport was destroyed"));
      }
    }
    inner_.reset();
  }

 private:
  void DelayLoop() {
    while (true) {
      std::vector<std::shared_ptr<FaultyOp>> due_now;
      {
        absl::MutexLock lock(&mu_);
        while (true) {
          if (stopping_) return;
          const absl::Time wake =
              delayed_.empty() ? absl::InfiniteFuture() : delayed_.begin()->first;
          if (wake <= absl::Now()) break;
          const uint64_t seen = schedule_version_;
          auto changed = [this, seen]() { return stopping_ || schedule_version_ != seen; };
          mu_.AwaitWithDeadline(absl::Condition(&changed), wake);
        }
        while (!delayed_.empty() && delayed_.begin()->first <= absl::Now()) {
          due_now.push_back(std::move(delayed_.begin()->second));
          delayed_.erase(delayed_.begin());
        }
      }
      for (auto& op : due_now) {
        absl::MutexLock lock(&op->mu);
        if (!op->final_status.ok()) continue;  // cancelled while waiting
        auto inner = inner_->Send(op->peer, op->tag, op->buffer);
        op->posted = true;
        if (inner.ok()) {
          op->inner = std::move(inner).value();
        } else {
          op->final_status = inner.status();
        }
      }
    }
  }

  std::unique_ptr<Transport> inner_;
  mutable absl::Mutex mu_;
  FaultPlan plan_ ABSL_GUARDED_BY(mu_);
  std::map<PeerId, PeerFaults> peers_ ABSL_GUARDED_BY(mu_);
  std::multimap<absl::Time, std::shared_ptr<FaultyOp>> delayed_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t schedule_version_ ABSL_GUARDED_BY(mu_) = 0;  // bumped by ScheduleSend
  std::thread delay_thread_;
};

namespace {

class FaultyOperation final : public Operation {
 public:
  FaultyOperation(std::shared_ptr<FaultyState> state, std::shared_ptr<FaultyOp> op)
      : state_(std::move(state)), op_(std::move(op)) {}

  ~FaultyOperation() override {
    std::unique_ptr<Operation> inner;
    {
      absl::MutexLock lock(&op_->mu);
      if (!op_->posted && op_->final_status.ok()) {
        op_->final_status = absl::CancelledError(absl::StrCat(op_->what, ": cancelled"));
      }
      inner = std::move(op_->inner);
    }
    // The wrapped operation's destructor cancels it and waits until it releases the buffer.
  }

  bool Done() const override {
    absl::MutexLock lock(&op_->mu);
    if (op_->dropped || !op_->final_status.ok()) return true;
    if (op_->inner != nullptr && op_->inner->Done()) return true;
    return !state_->PeerFailure(op_->peer).ok();
  }

  absl::Status Wait(absl::Time deadline) override {
    const absl::Time start = absl::Now();
    while (true) {
      {
        absl::MutexLock lock(&op_->mu);
        if (op_->dropped) return absl::OkStatus();
        if (!op_->final_status.ok()) return op_->final_status;
        if (op_->inner != nullptr && op_->inner->Done()) {
          return op_->inner->Wait(absl::InfinitePast());
        }
        absl::Status failed = state_->PeerFailure(op_->peer);
        if (!failed.ok()) {
          if (op_->inner != nullptr) op_->inner->Cancel();
          return absl::UnavailableError(
              absl::StrCat(op_->what, ": ", std::string(failed.message())));
        }
      }
      const absl::Time now = absl::Now();
      if (now >= deadline) {
        return absl::DeadlineExceededError(
            absl::StrCat(op_->what, ": still pending at the deadline (waited ",
                         absl::FormatDuration(now - start), "); wait again or cancel it"));
      }
      const absl::Time slice = std::min(deadline, now + kFailurePollInterval);
      Operation* inner = nullptr;
      {
        absl::MutexLock lock(&op_->mu);
        inner = op_->inner.get();
      }
      // The wrapped operation is only released by this object's destructor, so `inner` stays
      // valid while this thread waits on it.
      if (inner != nullptr) {
        inner->Wait(slice).IgnoreError();
      } else {
        absl::SleepFor(slice - now);
      }
    }
  }

  void Cancel() override {
    absl::MutexLock lock(&op_->mu);
    if (!op_->posted && op_->final_status.ok()) {
      op_->final_status = absl::CancelledError(absl::StrCat(op_->what, ": cancelled"));
    } else if (op_->inner != nullptr) {
      op_->inner->Cancel();
    }
  }

  size_t bytes() const override {
    absl::MutexLock lock(&op_->mu);
    if (op_->dropped) return op_->size;
    return op_->inner != nullptr ? op_->inner->bytes() : 0;
  }

  absl::Time completed_at() const override {
    absl::MutexLock lock(&op_->mu);
    if (op_->dropped) return op_->dropped_at;
    return op_->inner != nullptr ? op_->inner->completed_at() : absl::InfinitePast();
  }

 private:
  std::shared_ptr<FaultyState> state_;
  std::shared_ptr<FaultyOp> op_;
};

std::string Describe(bool is_send, std::string_view peer_name, Tag tag, size_t size) {
  return absl::StrCat(is_send ? "send to" : "receive from", " peer '", std::string(peer_name),
                      "' tag ", tag, " (", size, " bytes)");
}

}  // namespace
}  // namespace internal

absl::StatusOr<std::unique_ptr<FaultyTransport>> FaultyTransport::Create(
    std::unique_ptr<Transport> inner, const FaultPlan& plan) {
  if (inner == nullptr) {
    return absl::InvalidArgumentError("FaultyTransport::Create: the wrapped transport is null");
  }
  if (plan.drop_every_nth_send < 0) {
    return absl::InvalidArgumentError(absl::StrCat("FaultPlan.drop_every_nth_send is ",
                                                   plan.drop_every_nth_send,
                                                   "; expected 0 (never) or a positive count"));
  }
  if (plan.send_delay < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("FaultPlan.send_delay is ",
                                                   absl::FormatDuration(plan.send_delay),
                                                   "; expected zero or positive"));
  }
  return std::unique_ptr<FaultyTransport>(
      new FaultyTransport(std::make_shared<internal::FaultyState>(std::move(inner), plan)));
}

FaultyTransport::FaultyTransport(std::shared_ptr<internal::FaultyState> state)
    : state_(std::move(state)) {}

FaultyTransport::~FaultyTransport() { state_->Stop(); }

void FaultyTransport::SetPlan(const FaultPlan& plan) { state_->SetPlan(plan); }

void FaultyTransport::FailPeer(PeerId peer) { state_->FailPeer(peer, "injected failure"); }

std::string_view FaultyTransport::backend() const { return state_->inner().backend(); }

const std::string& FaultyTransport::name() const { return state_->inner().name(); }

std::string FaultyTransport::LocalAddress() const { return state_->inner().LocalAddress(); }

absl::StatusOr<PeerId> FaultyTransport::Connect(std::string_view peer_address,
                                                absl::Time deadline) {
  return state_->inner().Connect(peer_address, deadline);
}

absl::StatusOr<std::unique_ptr<Operation>> FaultyTransport::Send(PeerId peer, Tag tag,
                                                                 ConstBuffer buffer) {
  auto op = std::make_shared<internal::FaultyOp>();
  op->what = internal::Describe(true, state_->inner().PeerName(peer), tag, buffer.size);
  op->peer = peer;
  op->tag = tag;
  op->buffer = buffer;
  op->size = buffer.size;
  bool drop = false;
  absl::Duration delay;
  absl::Status counted = state_->CountOperation(peer, /*is_send=*/true, &drop, &delay);
  if (!counted.ok()) {
    return absl::UnavailableError(absl::StrCat(op->what, ": ", std::string(counted.message())));
  }
  if (drop || delay > absl::ZeroDuration()) {
    if (auto s = ValidateTag(tag, op->what); !s.ok()) return s;
    if (auto s = ValidateBuffer(buffer.data, buffer.size, buffer.kind, op->what); !s.ok()) {
      return s;
    }
  }
  if (drop) {
    absl::MutexLock lock(&op->mu);
    op->posted = true;
    op->dropped = true;
    op->dropped_at = absl::Now();
  } else if (delay > absl::ZeroDuration()) {
    state_->ScheduleSend(absl::Now() + delay, op);
  } else {
    auto inner = state_->inner().Send(peer, tag, buffer);
    if (!inner.ok()) return inner.status();
    absl::MutexLock lock(&op->mu);
    op->posted = true;
    op->inner = std::move(inner).value();
  }
  return std::unique_ptr<Operation>(new internal::FaultyOperation(state_, std::move(op)));
}

absl::StatusOr<std::unique_ptr<Operation>> FaultyTransport::Recv(PeerId peer, Tag tag,
                                                                 MutableBuffer buffer) {
  return WrapReceive(peer, tag, buffer.size,
                     [&] { return state_->inner().Recv(peer, tag, buffer); });
}

absl::StatusOr<std::unique_ptr<Operation>> FaultyTransport::RecvScatter(
    PeerId peer, Tag tag, std::vector<MutableBuffer> segments) {
  const size_t total = TotalSize(segments);
  return WrapReceive(peer, tag, total,
                     [&] { return state_->inner().RecvScatter(peer, tag, std::move(segments)); });
}

absl::StatusOr<std::unique_ptr<Operation>> FaultyTransport::WrapReceive(
    PeerId peer, Tag tag, size_t size,
    absl::FunctionRef<absl::StatusOr<std::unique_ptr<Operation>>()> post) {
  auto op = std::make_shared<internal::FaultyOp>();
  op->what = internal::Describe(false, state_->inner().PeerName(peer), tag, size);
  op->peer = peer;
  op->tag = tag;
  op->size = size;
  bool drop = false;
  absl::Duration delay;
  absl::Status counted = state_->CountOperation(peer, /*is_send=*/false, &drop, &delay);
  if (!counted.ok()) {
    return absl::UnavailableError(absl::StrCat(op->what, ": ", std::string(counted.message())));
  }
  auto inner = post();
  if (!inner.ok()) return inner.status();
  {
    absl::MutexLock lock(&op->mu);
    op->posted = true;
    op->inner = std::move(inner).value();
  }
  return std::unique_ptr<Operation>(new internal::FaultyOperation(state_, std::move(op)));
}

absl::Status FaultyTransport::Disconnect(PeerId peer, absl::Time deadline) {
  return state_->inner().Disconnect(peer, deadline);
}

std::string FaultyTransport::PeerName(PeerId peer) const { return state_->inner().PeerName(peer); }

bool FaultyTransport::CanMove(MemoryKind kind) const { return state_->inner().CanMove(kind); }

}  // namespace hetpar::transport
