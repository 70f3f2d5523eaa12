#include "common/transport/transport.h"

#include <algorithm>
#include <cstring>

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

absl::Status WaitAll(absl::Span<const std::unique_ptr<Operation>> ops, absl::Time deadline,
                     const StepInterrupt* interrupt) {
  return WaitInSlices(
      [&](absl::Time until) {
        for (const auto& op : ops) {
          absl::Status pending = op->Wait(until);
          if (absl::IsDeadlineExceeded(pending)) return pending;
        }
        return WaitAll(ops, until);  // every one done: the first failure
      },
      deadline, interrupt);
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

size_t TotalSize(absl::Span<const MutableBuffer> segments) {
  size_t total = 0;
  for (const MutableBuffer& segment : segments) total += segment.size;
  return total;
}

absl::Status ValidateSegments(absl::Span<const MutableBuffer> segments, std::string_view what) {
  for (size_t i = 0; i < segments.size(); ++i) {
    const MutableBuffer& segment = segments[i];
    const std::string which = absl::StrCat(std::string(what), " segment ", i);
    if (auto s = ValidateBuffer(segment.data, segment.size, segment.kind, which); !s.ok()) {
      return s;
    }
    if (segment.kind != MemoryKind::kHost) {
      return absl::UnimplementedError(absl::StrCat(which,
                                                   ": scatter receives take host memory only; got ",
                                                   std::string(MemoryKindName(segment.kind))));
    }
  }
  return absl::OkStatus();
}

void ScatterCopy(const void* src, size_t size, absl::Span<const MutableBuffer> segments) {
  const char* from = static_cast<const char*>(src);
  for (const MutableBuffer& segment : segments) {
    if (size == 0) break;
    const size_t n = std::min(size, segment.size);
    if (n > 0) std::memcpy(segment.data, from, n);
    from += n;
    size -= n;
  }
}

void GatherCopy(absl::Span<const MutableBuffer> segments, void* dst, size_t size) {
  char* to = static_cast<char*>(dst);
  for (const MutableBuffer& segment : segments) {
    if (size == 0) break;
    const size_t n = std::min(size, segment.size);
    if (n > 0) std::memcpy(to, segment.data, n);
    to += n;
    size -= n;
  }
}

}  // namespace hetpar::transport
