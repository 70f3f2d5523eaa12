// The envelope every backend wraps its address in.
//
// A transport address is opaque to its users, but all backends share one envelope so that a
// peer can be named in errors and an address from the wrong backend, or a damaged one, is
// rejected with a clear message instead of being handed to a network library.
//
// Layout (little endian): "HPTA" | version u8 | backend length u8 | backend | instance id u64 |
// name length u16 | name | payload length u32 | payload.
#ifndef HETPAR_COMMON_TRANSPORT_ADDRESS_H_
#define HETPAR_COMMON_TRANSPORT_ADDRESS_H_

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace hetpar::transport {

struct AddressEnvelope {
  std::string backend;       // "ucx", "inproc"
  uint64_t instance_id = 0;  // random per transport instance; never 0
  std::string name;          // the transport's name ("enc r1")
  std::string payload;       // backend bytes (a UCX worker address, an in-process endpoint id)
};

std::string EncodeAddress(const AddressEnvelope& envelope);

// Decodes `bytes`; an address of another backend, a truncated or padded address, or a wrong
// magic/version is kInvalidArgument naming what is wrong.
absl::StatusOr<AddressEnvelope> DecodeAddress(std::string_view bytes,
                                              std::string_view expected_backend);

// A random non-zero 64-bit id for a new transport instance.
uint64_t NewInstanceId();

}  // namespace hetpar::transport

#endif  // HETPAR_COMMON_TRANSPORT_ADDRESS_H_
