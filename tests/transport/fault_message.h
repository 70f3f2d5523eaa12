// The messages the transport fault tests stream between processes: every byte is a function of
// the message number and the offset, so the receiver can check all of them.
#ifndef HETPAR_TESTS_TRANSPORT_FAULT_MESSAGE_H_
#define HETPAR_TESTS_TRANSPORT_FAULT_MESSAGE_H_

#include <cstddef>
#include <cstdint>

#include "common/transport/transport.h"

namespace hetpar::transport {

inline constexpr Tag kFaultTag = 77;

inline uint8_t MessageByte(long seq, size_t offset) {
  return static_cast<uint8_t>((offset * 131) ^ (offset >> 9) ^ (seq * 29 + 7));
}

inline void FillMessage(long seq, uint8_t* data, size_t size) {
  for (size_t i = 0; i < size; ++i) data[i] = MessageByte(seq, i);
}

// The offset of the first byte that differs from message `seq`, or -1.
inline long FirstBadByte(long seq, const uint8_t* data, size_t size) {
  for (size_t i = 0; i < size; ++i) {
    if (data[i] != MessageByte(seq, i)) return static_cast<long>(i);
  }
  return -1;
}

}  // namespace hetpar::transport

#endif  // HETPAR_TESTS_TRANSPORT_FAULT_MESSAGE_H_
