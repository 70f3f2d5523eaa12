#include "common/transport/address.h"

#include <sys/random.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <random>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace hetpar::transport {
namespace {

constexpr char kMagic[4] = {'H', 'P', 'T', 'A'};
constexpr uint8_t kVersion = 1;

void PutInt(std::string* out, uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) out->push_back(static_cast<char>((value >> (8 * i)) & 0xff));
}

// Reads fixed-size little-endian fields and strings, reporting where the address ends early.
class Reader {
 public:
  explicit Reader(std::string_view bytes) : bytes_(bytes) {}

  bool Int(int width, uint64_t* value) {
    if (bytes_.size() - pos_ < static_cast<size_t>(width)) return false;
    *value = 0;
    for (int i = 0; i < width; ++i) {
      *value |= static_cast<uint64_t>(static_cast<uint8_t>(bytes_[pos_ + i])) << (8 * i);
    }
    pos_ += width;
    return true;
  }
  bool Bytes(size_t length, std::string* out) {
    if (bytes_.size() - pos_ < length) return false;
    out->assign(bytes_.substr(pos_, length));
    pos_ += length;
    return true;
  }
  size_t pos() const { return pos_; }
  size_t left() const { return bytes_.size() - pos_; }

 private:
  std::string_view bytes_;
  size_t pos_ = 0;
};

}  // namespace

std::string EncodeAddress(const AddressEnvelope& envelope) {
  std::string out(kMagic, sizeof(kMagic));
  PutInt(&out, kVersion, 1);
  PutInt(&out, envelope.backend.size(), 1);
  out += envelope.backend;
  PutInt(&out, envelope.instance_id, 8);
  PutInt(&out, envelope.name.size(), 2);
  out += envelope.name;
  PutInt(&out, envelope.payload.size(), 4);
  out += envelope.payload;
  return out;
}

absl::StatusOr<AddressEnvelope> DecodeAddress(std::string_view bytes,
                                              std::string_view expected_backend) {
  auto bad = [&](std::string_view what) {
    return absl::InvalidArgumentError(
        absl::StrCat("transport address of ", bytes.size(), " bytes (starting '",
                     absl::CHexEscape(std::string(bytes.substr(0, 16))), "') is not a hetpar ",
                     std::string(expected_backend), " address: ", std::string(what)));
  };
  if (bytes.size() < sizeof(kMagic) || std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0) {
    return bad("it does not start with the magic 'HPTA'");
  }
  Reader reader(bytes.substr(sizeof(kMagic)));
  uint64_t version = 0, backend_length = 0, name_length = 0, payload_length = 0;
  AddressEnvelope envelope;
  if (!reader.Int(1, &version)) return bad("it ends before the version byte");
  if (version != kVersion) {
    return bad(absl::StrCat("version ", version, "; expected ", kVersion));
  }
  if (!reader.Int(1, &backend_length) || !reader.Bytes(backend_length, &envelope.backend)) {
    return bad("it ends inside the backend name");
  }
  if (!reader.Int(8, &envelope.instance_id)) return bad("it ends inside the instance id");
  if (!reader.Int(2, &name_length) || !reader.Bytes(name_length, &envelope.name)) {
    return bad("it ends inside the transport name");
  }
  if (!reader.Int(4, &payload_length)) return bad("it ends before the payload length");
  if (reader.left() != payload_length) {
    return bad(absl::StrCat("its payload length field says ", payload_length, " bytes but ",
                            reader.left(), " follow"));
  }
  reader.Bytes(payload_length, &envelope.payload);
  if (envelope.backend != expected_backend) {
    return absl::InvalidArgumentError(
        absl::StrCat("transport address of '", envelope.name, "' is for backend '",
                     envelope.backend, "'; this transport is '", std::string(expected_backend),
                     "' (both ends of a connection must use the same backend)"));
  }
  if (envelope.instance_id == 0) return bad("its instance id is 0");
  return envelope;
}

uint64_t NewInstanceId() {
  uint64_t id = 0;
  while (id == 0) {
    if (getrandom(&id, sizeof(id), 0) != static_cast<ssize_t>(sizeof(id))) {
      std::random_device device;
      id = (static_cast<uint64_t>(device()) << 32) ^ device() ^
           static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
    }
  }
  return id;
}

}  // namespace hetpar::transport
