// What the UCX device tests share. CudaUcxRequired: whether a UCX that moves no CUDA memory fails
// a UCX device test instead of skipping it. tools/gpu-check sets HETPAR_GPU_REQUIRE_CUDA_UCX=1
// where it sees a GPU: there such a UCX is the build's or the bundle's fault (a CUDA module
// missing), not the machine's. SelectProgressThreadDevice: what a worker does for its transport
// (common/worker/bootstrap.cc).
#ifndef HETPAR_TESTS_GPU_REQUIRE_CUDA_UCX_H_
#define HETPAR_TESTS_GPU_REQUIRE_CUDA_UCX_H_

#include <c10/core/Device.h>

#include <cstdlib>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/nn/device_copy.h"
#include "common/nn/torch_status.h"
#include "common/transport/ucx/ucx_transport.h"

namespace hetpar::testing {

// Makes cuda:`index` the current device of `ucx`'s progress thread: UCX's CUDA transports (its
// copies, IPC and the event fds it arms as the thread sleeps) run there.
inline absl::Status SelectProgressThreadDevice(transport::ucx::UcxTransport& ucx, int index) {
  auto selected = std::make_shared<absl::Status>();
  absl::Status ran = ucx.RunOnProgressThread(
      [index, selected] {
        // Its context current too (a new thread's current device is 0 already, so selecting
        // cuda:0 alone would bind nothing).
        *selected =
            nn::RunTorch(absl::StrCat("selecting cuda:", index, " on UCX's progress thread"),
                         [&] { nn::MakeDeviceCurrent(c10::Device(c10::kCUDA, index)); });
      },
      absl::Now() + absl::Seconds(30));
  return ran.ok() ? *selected : ran;
}

inline bool CudaUcxRequired() {
  const char* value = std::getenv("HETPAR_GPU_REQUIRE_CUDA_UCX");
  return value != nullptr && std::string(value) == "1";
}

}  // namespace hetpar::testing

#endif  // HETPAR_TESTS_GPU_REQUIRE_CUDA_UCX_H_
