// The NCCL mover: ncclSend/ncclRecv on two 2-rank communicators per peer (one per direction),
// non-blocking init polled with ncclCommGetAsyncError, one CUDA stream for sends and one for
// receives, a cudaEvent after each call polled with cudaEventQuery. Only built when hetpar has
// libtorch with CUDA and NCCL (HETPAR_HAVE_NCCL). Internal to the NCCL backend.
#ifndef HETPAR_COMMON_TRANSPORT_NCCL_NCCL_MOVER_H_
#define HETPAR_COMMON_TRANSPORT_NCCL_NCCL_MOVER_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/transport/nccl/device_mover.h"

namespace hetpar::transport::nccl::internal {

// Checks that `cuda_device` exists and creates the streams on it. `local_name` ("enc r1") names
// this side in errors. Fails (naming the reason) without a GPU or a CUDA driver.
absl::StatusOr<std::unique_ptr<DeviceMover>> CreateNcclMover(int cuda_device,
                                                             const std::string& local_name);

}  // namespace hetpar::transport::nccl::internal

#endif  // HETPAR_COMMON_TRANSPORT_NCCL_NCCL_MOVER_H_
