// The completion record that backends share with the Operations they hand out.
//
// A backend completes it once (from whichever thread finishes the transfer); callers wait on it
// with a deadline. Internal to the transport backends.
#ifndef HETPAR_COMMON_TRANSPORT_COMPLETION_H_
#define HETPAR_COMMON_TRANSPORT_COMPLETION_H_

#include <atomic>
#include <cstddef>
#include <memory>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/logging.h"
#include "common/transport/transport.h"

namespace hetpar::transport {

class Completion {
 public:
  // `description` names the operation in messages: "receive from peer 'b' tag 7 (4096 bytes)".
  explicit Completion(std::string description) : description_(std::move(description)) {}
  Completion(const Completion&) = delete;
  Completion& operator=(const Completion&) = delete;

  // Records the outcome. The first call wins and returns true; later calls change nothing.
  bool Complete(absl::Status status, size_t bytes = 0);

  bool done() const { return done_flag_.load(std::memory_order_acquire); }

  // The final status once done, or kDeadlineExceeded naming the operation at `deadline`.
  absl::Status Wait(absl::Time deadline) const;

  // Waits without producing a status; true if done by `deadline`.
  bool WaitUntil(absl::Time deadline) const;

  // Only meaningful once done().
  absl::Status status() const;
  size_t bytes() const;
  absl::Time completed_at() const;  // absl::InfinitePast() until done

  const std::string& description() const { return description_; }

 private:
  const std::string description_;
  mutable absl::Mutex mu_;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  size_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time completed_at_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  std::atomic<bool> done_flag_{false};
};

// The Operation a backend with a progress thread hands out: the caller's view of one `Op` (which
// holds `std::shared_ptr<Completion> completion`), kept alive with the backend's `Core` (which
// has Cancel(op) and Abandon(op)). Destroying it unfinished cancels the operation, waits up to
// `abandon_timeout`, then abandons it (the backend tears down the peer's connection to release
// the buffer) and waits up to `release_timeout` (the backend's teardown deadline) and a margin
// for the backend to let go.
template <class Core, class Op>
class CompletionOperation final : public Operation {
 public:
  CompletionOperation(std::shared_ptr<Core> core, std::shared_ptr<Op> op,
                      absl::Duration abandon_timeout, absl::Duration release_timeout)
      : core_(std::move(core)),
        op_(std::move(op)),
        abandon_timeout_(abandon_timeout),
        release_timeout_(release_timeout) {}

  ~CompletionOperation() override {
    if (op_->completion->done()) return;
    core_->Cancel(op_);
    if (op_->completion->WaitUntil(absl::Now() + abandon_timeout_)) return;
    HETPAR_LOG(WARNING) << op_->completion->description()
                        << ": destroyed before it finished and could not be cancelled; tearing "
                           "down the connection to release the buffer";
    core_->Abandon(op_);
    // The backend's own deadline for the teardown starts when its thread takes the abandon,
    // a little after this one: the margin keeps this wait from ending first, while the backend
    // may still write into the buffer. The wait ends as soon as the backend lets go.
    if (!op_->completion->WaitUntil(absl::Now() + release_timeout_ + kReleaseMargin)) {
      HETPAR_LOG(ERROR) << op_->completion->description()
                        << ": still held by the backend after the connection was torn down";
    }
  }

  bool Done() const override { return op_->completion->done(); }
  absl::Status Wait(absl::Time deadline) override { return op_->completion->Wait(deadline); }
  void Cancel() override { core_->Cancel(op_); }
  size_t bytes() const override { return op_->completion->bytes(); }
  absl::Time completed_at() const override { return op_->completion->completed_at(); }

 private:
  std::shared_ptr<Core> core_;
  std::shared_ptr<Op> op_;
  const absl::Duration abandon_timeout_;
  const absl::Duration release_timeout_;
  static constexpr absl::Duration kReleaseMargin = absl::Seconds(5);
};

}  // namespace hetpar::transport

#endif  // HETPAR_COMMON_TRANSPORT_COMPLETION_H_
