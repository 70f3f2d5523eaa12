// The rank's GPU on UCX's progress thread. UCX's CUDA transports (its copies, CUDA IPC and the
// event fds it arms as the thread sleeps) run on the transport's progress thread and use the CUDA
// context current there; a new thread has none, and its current device is GPU 0. A worker, the
// transport bench and the device tests all make the GPU they compute on current there, with its
// context bound, through this one function.
//
//   HETPAR_RETURN_IF_ERROR(nn::SelectProgressThreadDevice(
//       *ucx, execution.device(), absl::Now() + peer_timeout));
#ifndef HETPAR_COMMON_NN_UCX_PROGRESS_DEVICE_H_
#define HETPAR_COMMON_NN_UCX_PROGRESS_DEVICE_H_

#include <c10/core/Device.h>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/transport/ucx/ucx_transport.h"

namespace hetpar::nn {

// Makes `device` the current device of `ucx`'s progress thread, its CUDA context bound (as
// MakeDeviceCurrent does on the calling thread). Nothing to do for a CPU device. Fails with
// libtorch's error, as RunTorch maps it, when the device cannot be made current there (a
// CUDA error, an index the process cannot see); with DeadlineExceeded when the progress thread
// has not run the call by `deadline`; with Unavailable once the transport is shutting down.
absl::Status SelectProgressThreadDevice(transport::ucx::UcxTransport& ucx,
                                        const c10::Device& device, absl::Time deadline);

}  // namespace hetpar::nn

#endif  // HETPAR_COMMON_NN_UCX_PROGRESS_DEVICE_H_
