// Ends a worker's waits on its peers early when the coordinator aborts the step in flight.
//
// A rank of an aborted step may be blocked on a peer that will never answer: the rows of an
// encoder that died, a collective a peer left when its own wait was interrupted. The session's
// thread raises the interrupt as the abort (or a stop) arrives; every wait on a peer (boundary
// and pipeline messages, collectives) looks at it between slices of its deadline and gives up
// with Aborted.
//
// Each attempt of a step runs in a generation of its own, and an abort names the attempt's
// generation. The step driver arms the interrupt with each plan's generation as the step starts:
// aborts of earlier attempts no longer apply, but an abort of this attempt that arrived while its
// plan still waited in the queue (the rank was finishing the step before) does, at once. A stop
// ends every attempt; after it, Clear lets the final outputs' gathers run.
//
//   StepInterrupt interrupt;
//   interrupt.Arm(plan.generation());                     // the driver, at a step's start
//   interrupt.Raise(abort.generation());                  // the session thread, on an abort
//   absl::Status s = WaitInSlices([&](absl::Time t) { return op->Wait(t); }, deadline,
//                                 &interrupt);            // Aborted once raised
#ifndef HETPAR_COMMON_STEP_INTERRUPT_H_
#define HETPAR_COMMON_STEP_INTERRUPT_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace hetpar {

class StepInterrupt {
 public:
  // A step's attempt of `generation` starts: it is interrupted if an abort of its generation or
  // a later one has arrived, or a stop (and not by aborts of earlier generations).
  void Arm(int64_t generation) {
    armed_.store(generation, std::memory_order_release);
    cleared_.store(false, std::memory_order_release);
  }
  // The coordinator aborted the attempt of `generation` (and with it any earlier one).
  void Raise(int64_t generation) {
    int64_t through = raised_through_.load(std::memory_order_acquire);
    while (generation > through &&
           !raised_through_.compare_exchange_weak(through, generation, std::memory_order_acq_rel)) {
    }
  }
  // The run stops: whatever is in flight, of any generation, ends.
  void RaiseAll() { Raise(std::numeric_limits<int64_t>::max()); }
  // After the stop: nothing raised so far interrupts the waits that follow (the final outputs'
  // gathers), until the next Arm.
  void Clear() { cleared_.store(true, std::memory_order_release); }
  // Whether a step's attempt has been armed yet (waits before the first, such as the groups a
  // worker forms as it starts, are not ended by it at every point; see nn::CommunicatorOptions).
  bool armed() const {
    return armed_.load(std::memory_order_acquire) != std::numeric_limits<int64_t>::min() + 1;
  }
  bool raised() const {
    return !cleared_.load(std::memory_order_acquire) &&
           raised_through_.load(std::memory_order_acquire) >=
               armed_.load(std::memory_order_acquire);
  }

 private:
  // Before the first Arm, any abort interrupts.
  std::atomic<int64_t> armed_{std::numeric_limits<int64_t>::min() + 1};
  std::atomic<int64_t> raised_through_{std::numeric_limits<int64_t>::min()};
  std::atomic<bool> cleared_{false};
};

// How often an interruptible wait looks at its interrupt.
inline constexpr absl::Duration kInterruptSlice = absl::Milliseconds(50);

inline absl::Status InterruptedError() {
  return absl::AbortedError("interrupted: the coordinator aborted the step");
}

// Calls `wait(slice_deadline)` (a wait that returns DeadlineExceeded when its deadline passes
// first and may be called again) until it returns anything else, `deadline` passes (its
// DeadlineExceeded), or `interrupt` (may be null) is raised (Aborted).
template <typename WaitFn>
absl::Status WaitInSlices(WaitFn&& wait, absl::Time deadline, const StepInterrupt* interrupt) {
  if (interrupt == nullptr) return wait(deadline);
  while (true) {
    if (interrupt->raised()) return InterruptedError();
    const absl::Time slice = std::min(deadline, absl::Now() + kInterruptSlice);
    absl::Status status = wait(slice);
    if (!absl::IsDeadlineExceeded(status) || slice >= deadline) return status;
  }
}

}  // namespace hetpar

#endif  // HETPAR_COMMON_STEP_INTERRUPT_H_
