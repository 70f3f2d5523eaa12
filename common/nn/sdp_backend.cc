#include "common/nn/sdp_backend.h"

#include <ATen/SDPBackend.h>

namespace hetpar::nn {

const char* SdpBackendName(int64_t choice) {
  switch (static_cast<at::SDPBackend>(choice)) {
    case at::SDPBackend::error:
      return "error";
    case at::SDPBackend::math:
      return "math";
    case at::SDPBackend::flash_attention:
      return "flash_attention";
    case at::SDPBackend::efficient_attention:
      return "efficient_attention";
    case at::SDPBackend::cudnn_attention:
      return "cudnn_attention";
    case at::SDPBackend::overrideable:
      return "overrideable";
  }
  return "unknown";
}

}  // namespace hetpar::nn
