#include "common/nn/compute_spans.h"

#include <c10/core/impl/VirtualGuardImpl.h>

#include "absl/strings/str_cat.h"
#include "common/nn/torch_status.h"
#include "common/status.h"

namespace hetpar::nn {

ComputeSpans::ComputeSpans(const c10::Device& device) : device_(device) {}

void ComputeSpans::Begin() {
  if (open_) {
    if (error_.ok()) {
      error_ = absl::FailedPreconditionError(
          absl::StrCat("compute spans: span ", spans_, " was opened twice"));
    }
    return;
  }
  open_ = true;
  opened_at_ = Clock::now();
  if (device_.is_cuda()) RecordEvent();
}

void ComputeSpans::End() {
  if (!open_) {
    if (error_.ok()) {
      error_ = absl::FailedPreconditionError(absl::StrCat(
          "compute spans: a span was closed with none open, after ", spans_, " spans"));
    }
    return;
  }
  open_ = false;
  ++spans_;
  host_seconds_ += std::chrono::duration<double>(Clock::now() - opened_at_).count();
  if (device_.is_cuda()) RecordEvent();
}

void ComputeSpans::RecordEvent() {
  absl::Status recorded = RunTorch(absl::StrCat("compute spans on ", device_.str()), [&] {
    const c10::impl::VirtualGuardImpl guard(device_.type());
    // BACKEND_DEFAULT: CUDA's default event flags, which keep timing (PyTorch's default drops it).
    c10::Event event(device_.type(), c10::EventFlag::BACKEND_DEFAULT);
    event.record(guard.getStream(device_));
    events_.push_back(std::move(event));
  });
  if (!recorded.ok() && error_.ok()) error_ = recorded;
}

absl::StatusOr<double> ComputeSpans::Seconds() const {
  HETPAR_RETURN_IF_ERROR(error_);
  if (open_) {
    return absl::FailedPreconditionError(
        absl::StrCat("compute spans: span ", spans_, " is still open"));
  }
  if (!device_.is_cuda()) return host_seconds_;
  return RunTorchOr(
      absl::StrCat("compute spans on ", device_.str()), [&]() -> absl::StatusOr<double> {
        double milliseconds = 0;
        for (size_t i = 0; i + 1 < events_.size(); i += 2) {
          if (!events_[i + 1].query()) {
            return absl::FailedPreconditionError(absl::StrCat(
                "compute spans: ", device_.str(), " has not reached the end of span ", i / 2 + 1,
                " of ", spans_, " (the spans are read after the step's host sync)"));
          }
          milliseconds += events_[i].elapsedTime(events_[i + 1]);
        }
        return milliseconds / 1000.0;
      });
}

}  // namespace hetpar::nn
