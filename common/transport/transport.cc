#include "common/transport/transport.h"

#include "absl/strings/str_cat.h"

namespace hetpar::transport {

std::string_view MemoryKindName(MemoryKind kind) {
  switch (kind) {
    case MemoryKind::kHost:
      return "host";
    case MemoryKind::kCuda:
      return "cuda";
  }
  return "unknown";
}

absl::Status WaitAll(absl::Span<const std::unique_ptr<Operation>> ops, absl::Time deadline) {
  absl::Status first;
  for (const auto& op : ops) {
    absl::Status status = op->Wait(deadline);
    if (first.ok() && !status.ok()) first = status;
  }
  return first;
}

absl::Status ValidateBuffer(const void* data, size_t size, MemoryKind kind, std::string_view what) {
  if (kind != MemoryKind::kHost && kind != MemoryKind::kCuda) {
    return absl::InvalidArgumentError(absl::StrCat(std::string(what), ": memory kind ",
                                                   static_cast<int>(kind),
                                                   " is not one of host (0), cuda (1)"));
  }
  if (data == nullptr && size > 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(std::string(what), ": buffer is null but its size is ", size,
                     " bytes; expected a pointer to at least that many bytes"));
  }
  return absl::OkStatus();
}

absl::Status ValidateTag(Tag tag, std::string_view what) {
  if (tag > kMaxTag) {
    return absl::InvalidArgumentError(absl::StrCat(std::string(what), ": tag ", tag,
                                                   " does not fit in ", kTagBits,
                                                   " bits; expected at most ", kMaxTag));
  }
  return absl::OkStatus();
}

}  // namespace hetpar::transport
