// The time a module's compute took in one step, as its step line's `compute_s` reports it.
//
// The runtime marks each forward and backward it queues (Begin, End) and the module reads the sum
// (Seconds) after the step's one host sync (ModuleState::EndStep). On the CPU work is done when a
// call returns, so a span is the host time between its marks. On CUDA the host only queues
// kernels, and the time it takes to do so says little of the GPU's: there a span is a pair of
// timing events on the device's current stream, and its time is the GPU's, from reaching the
// first mark (once the work queued before it is done) to finishing the work queued before the
// second. Recording an event does not make the host wait, and Seconds never waits: it is read
// once the sync has passed every mark.
//
// One thread (the step's) calls every method. Movable, not copyable (it owns its events).
#ifndef HETPAR_COMMON_NN_COMPUTE_SPANS_H_
#define HETPAR_COMMON_NN_COMPUTE_SPANS_H_

#include <c10/core/Device.h>
#include <c10/core/Event.h>

#include <chrono>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace hetpar::nn {

class ComputeSpans {
 public:
  // Spans of host time (the CPU).
  ComputeSpans() = default;
  // Spans of `device`'s time: host time for a CPU device, timing events on its current stream for
  // a CUDA one (created at the first Begin).
  explicit ComputeSpans(const c10::Device& device);

  ComputeSpans(ComputeSpans&&) noexcept = default;
  ComputeSpans& operator=(ComputeSpans&&) noexcept = default;
  ComputeSpans(const ComputeSpans&) = delete;
  ComputeSpans& operator=(const ComputeSpans&) = delete;

  // Opens a span at this point of the current stream (the CPU: now). A Begin while a span is open,
  // an End with none, or an event that CUDA failed to record is kept as the spans' error, which
  // Seconds returns: timing never fails the work it times. Neither throws.
  void Begin();
  // Closes the open span.
  void End();

  // The spans' time, summed, in seconds. FailedPrecondition when a span is still open, when the
  // marks were misused, or (CUDA) when the device has not yet reached a span's closing mark: read
  // it after the host has waited for the stream. Never waits; throws nothing.
  absl::StatusOr<double> Seconds() const;

  // The host time between each span's marks, summed: how long the host took to queue the work.
  // The same as Seconds on the CPU.
  double host_seconds() const { return host_seconds_; }
  // Whether the spans are timed by the device (CUDA) rather than by the host clock.
  bool on_device() const { return device_.is_cuda(); }
  int64_t spans() const { return spans_; }

 private:
  using Clock = std::chrono::steady_clock;

  void RecordEvent();  // one event on the device's current stream, appended to events_

  c10::Device device_{c10::kCPU};
  std::vector<c10::Event> events_;  // CUDA: each span's begin and end, in pairs
  int64_t spans_ = 0;
  bool open_ = false;
  Clock::time_point opened_at_;
  double host_seconds_ = 0;
  absl::Status error_;  // the first misuse of Begin and End, or failure to record an event
};

}  // namespace hetpar::nn

#endif  // HETPAR_COMMON_NN_COMPUTE_SPANS_H_
