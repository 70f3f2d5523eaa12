// 8-byte little-endian integers in message framing (the boundary's and the stage link's).
#ifndef HETPAR_COMMON_TRAIN_LITTLE_ENDIAN_H_
#define HETPAR_COMMON_TRAIN_LITTLE_ENDIAN_H_

#include <cstddef>
#include <cstdint>

namespace hetpar::train {

inline void StoreU64(char* out, uint64_t value) {
  for (size_t i = 0; i < 8; ++i) out[i] = static_cast<char>(value >> (8 * i));
}

inline uint64_t GetU64(const char* bytes) {
  uint64_t value = 0;
  for (size_t i = 0; i < 8; ++i) {
    value |= static_cast<uint64_t>(static_cast<uint8_t>(bytes[i])) << (8 * i);
  }
  return value;
}

}  // namespace hetpar::train

#endif  // HETPAR_COMMON_TRAIN_LITTLE_ENDIAN_H_
