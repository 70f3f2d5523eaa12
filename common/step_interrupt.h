// Ends a worker's waits on its peers early when the coordinator aborts the step in flight.
//
// A rank of an aborted step may be blocked on a peer that will never answer: the rows of an
// encoder that died, a collective a peer left when its own wait was interrupted. The session's
// thread raises the interrupt as the abort (or a stop) arrives; every wait on a peer (boundary
// and pipeline messages, collectives) looks at it between slices of its deadline and gives up
// with Aborted. The step driver arms it as each step starts, which clears it.
//
//   StepInterrupt interrupt;
//   interrupt.Arm();                                      // the driver, at a step's start
//   interrupt.Raise();                                    // the session thread, on an abort
//   absl::Status s = WaitInSlices([&](absl::Time t) { return op->Wait(t); }, deadline,
//                                 &interrupt);            // Aborted once raised
#ifndef HETPAR_COMMON_STEP_INTERRUPT_H_
#define HETPAR_COMMON_STEP_INTERRUPT_H_

#include <algorithm>
#include <atomic>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace hetpar {

class StepInterrupt {
 public:
  // A step starts: nothing is interrupted.
  void Arm() { raised_.store(false, std::memory_order_release); }
  // The coordinator aborted the step in flight (or stopped the run).
  void Raise() { raised_.store(true, std::memory_order_release); }
  bool raised() const { return raised_.load(std::memory_order_acquire); }

 private:
  std::atomic<bool> raised_{false};
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
