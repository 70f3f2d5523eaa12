#include "coordinator/limits.h"

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace hetpar::coordinator {
namespace {

absl::Status TooLong(absl::string_view field, size_t size, size_t limit) {
  return absl::InvalidArgumentError(
      absl::StrCat(field, " is ", size, " bytes; the limit is ", limit, " bytes"));
}

bool HostCharacter(char c) {
  return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-' || c == ':' ||
         c == '_' || c == '%' || c == '[' || c == ']';
}

}  // namespace

absl::Status CheckRegistration(const v1::RegisterRequest& request) {
  const std::string& host = request.host();
  if (host.size() > kMaxHostBytes) return TooLong("host", host.size(), kMaxHostBytes);
  for (char c : host) {
    if (!HostCharacter(c)) {
      return absl::InvalidArgumentError(
          absl::StrCat("host '", Printable(host),
                       "' is not a hostname or address (letters, digits and . - : _ % [ ] only)"));
    }
  }
  if (request.data_address().size() > kMaxDataAddressBytes) {
    return TooLong("data_address", request.data_address().size(), kMaxDataAddressBytes);
  }
  if (static_cast<size_t>(request.capabilities_size()) > kMaxCapabilities) {
    return absl::InvalidArgumentError(absl::StrCat("capabilities has ", request.capabilities_size(),
                                                   " entries; the limit is ", kMaxCapabilities));
  }
  for (const std::string& capability : request.capabilities()) {
    if (capability.size() > kMaxCapabilityBytes) {
      return TooLong("a capability", capability.size(), kMaxCapabilityBytes);
    }
  }
  return absl::OkStatus();
}

absl::Status CheckKey(absl::string_view key) {
  if (key.size() > kMaxKeyBytes) return TooLong("rendezvous key", key.size(), kMaxKeyBytes);
  return absl::OkStatus();
}

absl::Status CheckValue(absl::string_view field, absl::string_view value) {
  if (value.size() > kMaxValueBytes) return TooLong(field, value.size(), kMaxValueBytes);
  return absl::OkStatus();
}

absl::Status CheckKeys(const std::vector<std::string>& keys) {
  if (keys.size() > kMaxKeysPerCall) {
    return absl::InvalidArgumentError(absl::StrCat("a rendezvous call names ", keys.size(),
                                                   " keys; the limit is ", kMaxKeysPerCall));
  }
  for (const std::string& key : keys) {
    if (absl::Status s = CheckKey(key); !s.ok()) return s;
  }
  return absl::OkStatus();
}

std::string Printable(absl::string_view text, size_t max_bytes) {
  const absl::string_view kept = text.substr(0, max_bytes);
  std::string out;
  out.reserve(kept.size());
  for (const char ch : kept) {
    const auto c = static_cast<unsigned char>(ch);
    if (c >= 0x20 && c < 0x7f) {
      out.push_back(ch);  // quotes and backslashes too: error messages quote names and paths
    } else if (ch == '\n') {
      out += "\\n";
    } else if (ch == '\r') {
      out += "\\r";
    } else if (ch == '\t') {
      out += "\\t";
    } else {
      absl::StrAppend(&out, "\\x", absl::Hex(c, absl::kZeroPad2));
    }
  }
  if (text.size() > max_bytes) absl::StrAppend(&out, "...(", text.size(), " bytes)");
  return out;
}

}  // namespace hetpar::coordinator
