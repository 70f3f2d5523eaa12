// The name of the kernel at::scaled_dot_product_attention picks, for logs and bench lines:
//
//   const int64_t choice = at::_fused_sdp_choice(q, k, v, {}, 0.0, /*is_causal=*/true,
//                                                std::nullopt, /*enable_gqa=*/true);
//   std::cout << nn::SdpBackendName(choice);  // "flash_attention"
#ifndef HETPAR_COMMON_NN_SDP_BACKEND_H_
#define HETPAR_COMMON_NN_SDP_BACKEND_H_

#include <cstdint>

namespace hetpar::nn {

// "math", "flash_attention", "efficient_attention", "cudnn_attention", "overrideable", "error",
// or "unknown" for a value this libtorch does not name.
const char* SdpBackendName(int64_t choice);

}  // namespace hetpar::nn

#endif  // HETPAR_COMMON_NN_SDP_BACKEND_H_
