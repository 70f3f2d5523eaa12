#include "common/nn/ucx_progress_device.h"

#include <memory>

#include "absl/strings/str_cat.h"
#include "common/nn/device_copy.h"
#include "common/nn/torch_status.h"

namespace hetpar::nn {

absl::Status SelectProgressThreadDevice(transport::ucx::UcxTransport& ucx,
                                        const c10::Device& device, absl::Time deadline) {
  if (!device.is_cuda()) return absl::OkStatus();
  // Shared: past a missed deadline the call may still run, after this function returned.
  auto selected = std::make_shared<absl::Status>();
  const absl::Status ran = ucx.RunOnProgressThread(
      [device, selected] {
        *selected = RunTorch(absl::StrCat("selecting ", device.str(), " on UCX's progress thread"),
                             [&] { MakeDeviceCurrent(device); });
      },
      deadline);
  return ran.ok() ? *selected : ran;
}

}  // namespace hetpar::nn
