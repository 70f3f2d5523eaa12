// What nccl_transport_device_test and its peer process (nccl_device_peer) exchange.
#ifndef HETPAR_TESTS_GPU_NCCL_DEVICE_SCRIPT_H_
#define HETPAR_TESTS_GPU_NCCL_DEVICE_SCRIPT_H_

#include <cstddef>
#include <cstdint>

#include "common/transport/transport.h"

namespace hetpar::transport {

// Echoed messages: three on one tag (their order is checked), one on another, sizes odd.
inline constexpr int kEchoCount = 4;
inline constexpr Tag kEchoTags[kEchoCount] = {5, 5, 6, 5};
inline constexpr size_t kEchoSizes[kEchoCount] = {(size_t{1} << 20) + 3, 4097,
                                                  (size_t{8} << 20) + 1, 1};
inline constexpr Tag kEchoReply = 100;  // the echo of tag t comes back on t + kEchoReply
// A message of kTruncMessage bytes into a kTruncBuffer-byte device receive.
inline constexpr Tag kTruncTag = 7;
inline constexpr size_t kTruncBuffer = 1000;
inline constexpr size_t kTruncMessage = 2000;
inline constexpr Tag kReportTag = 8;  // one host byte: the truncated receive's status code
inline constexpr Tag kIdleTag = 9;

// Byte `i` of echo message `k`.
inline uint8_t EchoByte(int k, size_t i) {
  return static_cast<uint8_t>((i * 131) ^ (i >> 9) ^ (k * 29 + 7));
}

}  // namespace hetpar::transport

#endif  // HETPAR_TESTS_GPU_NCCL_DEVICE_SCRIPT_H_
