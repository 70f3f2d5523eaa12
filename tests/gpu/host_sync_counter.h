// Counts the host syncs that ATen's CUDA code makes on this thread while it is alive: blocking
// copies between host and device, .item(), stream and device synchronisation. It turns on
// libtorch's CUDA sync debug mode (the switch behind torch.cuda.set_sync_debug_mode), which
// reports each such call as a warning, and counts those warnings with a warning handler of this
// thread. A wait inside the CUDA runtime that ATen does not route through its sync check (e.g.
// the first cudaHostAlloc) is not seen. Nor is a sync on another thread, such as autograd's
// device thread, which runs a CUDA backward: for those, SyncsThrow.
#ifndef HETPAR_TESTS_GPU_HOST_SYNC_COUNTER_H_
#define HETPAR_TESTS_GPU_HOST_SYNC_COUNTER_H_

#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Exception.h>

#include <string>
#include <vector>

namespace hetpar::testing {

// While alive, every host sync that ATen's CUDA code makes, on any thread, throws (sync debug
// mode L_ERROR): autograd carries an error of its device thread back to the caller of
// backward(), so a step's compute that syncs anywhere fails, naming the call.
class SyncsThrow {
 public:
  SyncsThrow() : previous_(c10::cuda::warning_state().get_sync_debug_mode()) {
    c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_ERROR);
  }
  ~SyncsThrow() { c10::cuda::warning_state().set_sync_debug_mode(previous_); }
  SyncsThrow(const SyncsThrow&) = delete;
  SyncsThrow& operator=(const SyncsThrow&) = delete;

 private:
  c10::cuda::SyncDebugMode previous_;
};

class HostSyncCounter {
 public:
  HostSyncCounter()
      : previous_(c10::cuda::warning_state().get_sync_debug_mode()), guard_(&handler_) {
    c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_WARN);
  }
  ~HostSyncCounter() { c10::cuda::warning_state().set_sync_debug_mode(previous_); }
  HostSyncCounter(const HostSyncCounter&) = delete;
  HostSyncCounter& operator=(const HostSyncCounter&) = delete;

  int syncs() const { return handler_.syncs; }
  // Where each sync was reported from (the warning's source location and message).
  const std::vector<std::string>& where() const { return handler_.where; }

 private:
  struct Handler : c10::WarningHandler {
    void process(const c10::Warning& warning) override {
      if (warning.msg().find("synchroniz") == std::string::npos) return;
      ++syncs;
      where.push_back(std::string(warning.source_location().file) + ":" +
                      std::to_string(warning.source_location().line) + " " + warning.msg());
    }
    int syncs = 0;
    std::vector<std::string> where;
  };

  c10::cuda::SyncDebugMode previous_;
  Handler handler_;
  c10::WarningUtils::WarningHandlerGuard guard_;
};

}  // namespace hetpar::testing

#endif  // HETPAR_TESTS_GPU_HOST_SYNC_COUNTER_H_
