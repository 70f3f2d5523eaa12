#include "common/train/stream_ordered_sender.h"

#include <algorithm>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/logging.h"
#include "common/nn/device_copy.h"
#include "common/nn/torch_status.h"

namespace hetpar::train {

struct StreamOrderedSender::Send {
  transport::PeerId peer = 0;
  transport::Tag tag = 0;
  transport::ConstBuffer buffer;
  at::Tensor owner;
  std::function<bool()> ready;

  absl::Mutex mu;
  // Posted, refused or withdrawn: the poster no longer touches it.
  bool settled ABSL_GUARDED_BY(mu) = false;
  absl::Status refused ABSL_GUARDED_BY(mu);  // not OK: never posted, and why
  absl::Time settled_at ABSL_GUARDED_BY(mu) = absl::InfinitePast();
  std::unique_ptr<transport::Operation> posted ABSL_GUARDED_BY(mu);

  // Settles a send not posted yet with `status`; false if it was settled already.
  bool Refuse(absl::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (settled) return false;
    settled = true;
    refused = std::move(status);
    settled_at = absl::Now();
    return true;
  }
};

namespace {

// The Operation that Post returns: the send once posted.
class OrderedSendOperation final : public transport::Operation {
 public:
  explicit OrderedSendOperation(std::shared_ptr<StreamOrderedSender::Send> send)
      : send_(std::move(send)) {}

  ~OrderedSendOperation() override {
    std::unique_ptr<transport::Operation> posted;
    {
      absl::MutexLock lock(&send_->mu);
      send_->Refuse(absl::CancelledError("the send was withdrawn before it was posted"));
      posted = std::move(send_->posted);
    }
    // Cancels and waits (bounded) until the transport no longer reads the buffer, which
    // send_ keeps alive until then.
    posted.reset();
  }

  bool Done() const override {
    absl::MutexLock lock(&send_->mu);
    if (!send_->settled) return false;
    return send_->posted == nullptr || send_->posted->Done();
  }

  absl::Status Wait(absl::Time deadline) override {
    transport::Operation* posted = nullptr;
    {
      absl::MutexLock lock(&send_->mu);
      auto settled = [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return send_->settled; };
      if (!send_->mu.AwaitWithDeadline(absl::Condition(&settled), deadline)) {
        return absl::DeadlineExceededError(
            "the send is still waiting for the device to finish writing its message");
      }
      if (!send_->refused.ok()) return send_->refused;
      posted = send_->posted.get();
    }
    // Only this Operation's destructor destroys `posted`, and no one destroys an Operation
    // while waiting on it.
    return posted->Wait(deadline);
  }

  void Cancel() override {
    absl::MutexLock lock(&send_->mu);
    if (send_->Refuse(absl::CancelledError("the send was cancelled before it was posted"))) return;
    if (send_->posted != nullptr) send_->posted->Cancel();
  }

  size_t bytes() const override {
    absl::MutexLock lock(&send_->mu);
    return send_->posted != nullptr ? send_->posted->bytes() : 0;
  }

  absl::Time completed_at() const override {
    absl::MutexLock lock(&send_->mu);
    if (send_->posted != nullptr) return send_->posted->completed_at();
    return send_->settled ? send_->settled_at : absl::InfinitePast();
  }

 private:
  std::shared_ptr<StreamOrderedSender::Send> send_;
};

}  // namespace

StreamOrderedSender::StreamOrderedSender(transport::Transport* transport, c10::Device device)
    : transport_(transport), device_(device), poster_([this] { Run(); }) {}

StreamOrderedSender::~StreamOrderedSender() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  poster_.join();
  absl::MutexLock lock(&mu_);
  for (const std::shared_ptr<Send>& send : queue_) {
    absl::MutexLock send_lock(&send->mu);
    send->Refuse(
        absl::CancelledError("the data plane's sender shut down before the send was posted"));
  }
  queue_.clear();
}

std::unique_ptr<transport::Operation> StreamOrderedSender::Post(transport::PeerId peer,
                                                                transport::Tag tag,
                                                                transport::ConstBuffer buffer,
                                                                at::Tensor owner,
                                                                std::function<bool()> ready) {
  auto send = std::make_shared<Send>();
  send->peer = peer;
  send->tag = tag;
  send->buffer = buffer;
  send->owner = std::move(owner);
  send->ready = std::move(ready);
  auto op = std::make_unique<OrderedSendOperation>(send);
  absl::MutexLock lock(&mu_);
  queue_.push_back(std::move(send));
  return op;
}

size_t StreamOrderedSender::pending() const {
  absl::MutexLock lock(&mu_);
  return queue_.size();
}

void StreamOrderedSender::Run() {
  if (device_.is_cuda()) {
    const absl::Status selected = nn::RunTorch("selecting the stream-ordered sender's device",
                                               [&] { nn::MakeDeviceCurrent(device_); });
    if (!selected.ok()) HETPAR_LOG(ERROR) << selected;
  }
  constexpr absl::Duration kFirstPoll = absl::Microseconds(10);
  constexpr absl::Duration kLongestPoll = absl::Microseconds(200);
  while (true) {
    std::shared_ptr<Send> send;
    {
      absl::MutexLock lock(&mu_);
      auto work = [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return stop_ || !queue_.empty(); };
      mu_.Await(absl::Condition(&work));
      if (stop_) return;
      send = queue_.front();
    }
    absl::Duration poll = kFirstPoll;
    bool withdrawn = false;
    absl::Status failed;  // the device failed before the send's work was done
    while (true) {
      {
        absl::MutexLock lock(&send->mu);
        withdrawn = send->settled;
      }
      if (withdrawn || !send->ready) break;
      bool ready = false;
      // A device error (a faulted kernel, an aborted collective) throws from the event query:
      // the send is refused with it, as every later one will be, instead of ending the process.
      failed =
          nn::RunTorch("waiting for the device work a send reads", [&] { ready = send->ready(); });
      if (ready || !failed.ok()) break;
      {
        absl::MutexLock lock(&mu_);
        auto stopping = [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return stop_; };
        if (mu_.AwaitWithTimeout(absl::Condition(&stopping), poll)) return;
      }
      poll = std::min(poll * 2, kLongestPoll);
    }
    if (!withdrawn) {
      absl::MutexLock lock(&send->mu);
      if (!send->settled && !failed.ok()) {
        send->settled = true;
        send->settled_at = absl::Now();
        send->refused = failed;
      } else if (!send->settled) {
        absl::StatusOr<std::unique_ptr<transport::Operation>> posted =
            transport_->Send(send->peer, send->tag, send->buffer);
        send->settled = true;
        send->settled_at = absl::Now();
        if (posted.ok()) {
          send->posted = *std::move(posted);
        } else {
          send->refused = posted.status();
        }
      }
    }
    absl::MutexLock lock(&mu_);
    queue_.pop_front();
  }
}

}  // namespace hetpar::train
