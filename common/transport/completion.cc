#include "common/transport/completion.h"

#include "absl/strings/str_cat.h"

namespace hetpar::transport {

bool Completion::Complete(absl::Status status, size_t bytes) {
  absl::MutexLock lock(&mu_);
  if (done_) return false;
  done_ = true;
  completed_at_ = absl::Now();
  status_ = std::move(status);
  bytes_ = status_.ok() ? bytes : 0;
  done_flag_.store(true, std::memory_order_release);
  return true;
}

bool Completion::WaitUntil(absl::Time deadline) const {
  if (done()) return true;
  absl::MutexLock lock(&mu_);
  return mu_.AwaitWithDeadline(absl::Condition(&done_), deadline);
}

absl::Status Completion::Wait(absl::Time deadline) const {
  const absl::Time start = absl::Now();
  if (!WaitUntil(deadline)) {
    return absl::DeadlineExceededError(
        absl::StrCat(description_, ": still pending at the deadline (waited ",
                     absl::FormatDuration(absl::Now() - start), "); wait again or cancel it"));
  }
  return status();
}

absl::Status Completion::status() const {
  absl::MutexLock lock(&mu_);
  return status_;
}

size_t Completion::bytes() const {
  absl::MutexLock lock(&mu_);
  return bytes_;
}

absl::Time Completion::completed_at() const {
  absl::MutexLock lock(&mu_);
  return completed_at_;
}

}  // namespace hetpar::transport
