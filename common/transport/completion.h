// The completion record that backends share with the Operations they hand out.
//
// A backend completes it once (from whichever thread finishes the transfer); callers wait on it
// with a deadline. Internal to the transport backends.
#ifndef HETPAR_COMMON_TRANSPORT_COMPLETION_H_
#define HETPAR_COMMON_TRANSPORT_COMPLETION_H_

#include <atomic>
#include <cstddef>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

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

}  // namespace hetpar::transport

#endif  // HETPAR_COMMON_TRANSPORT_COMPLETION_H_
