// Status helpers shared by every hetpar component.
//
// Every fallible boundary returns absl::Status or absl::StatusOr<T>. These macros keep the
// plumbing short; they never throw.
#ifndef HETPAR_COMMON_STATUS_H_
#define HETPAR_COMMON_STATUS_H_

#include <string>
#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/cord.h"
#include "absl/strings/string_view.h"

#define HETPAR_STATUS_CONCAT_INNER_(a, b) a##b
#define HETPAR_STATUS_CONCAT_(a, b) HETPAR_STATUS_CONCAT_INNER_(a, b)

// Returns from the enclosing function if `expr` (an absl::Status) is not OK.
#define HETPAR_RETURN_IF_ERROR(expr)                 \
  do {                                               \
    ::absl::Status hetpar_status_ = (expr);          \
    if (!hetpar_status_.ok()) return hetpar_status_; \
  } while (false)

// `HETPAR_ASSIGN_OR_RETURN(auto x, MakeX());` declares x from an OK StatusOr, or returns its
// status from the enclosing function.
#define HETPAR_ASSIGN_OR_RETURN(lhs, expr) \
  HETPAR_ASSIGN_OR_RETURN_IMPL_(HETPAR_STATUS_CONCAT_(hetpar_statusor_, __LINE__), lhs, expr)

#define HETPAR_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                  \
  if (!tmp.ok()) return std::move(tmp).status();      \
  lhs = std::move(tmp).value()

namespace hetpar {

// Prefixes a status message with context, keeping its code and payloads: "loading checkpoint:
// <message>".
inline absl::Status Annotate(const absl::Status& status, std::string_view context) {
  if (status.ok()) return status;
  absl::Status annotated(status.code(),
                         std::string(context) + ": " + std::string(status.message()));
  status.ForEachPayload([&annotated](absl::string_view type_url, const absl::Cord& payload) {
    annotated.SetPayload(type_url, payload);
  });
  return annotated;
}

// A status for a log line or a message: its code and message, without the payloads that
// travel with it for the code (ErrnoOf's errno, EndsRun's mark, a data path).
inline std::string StatusText(const absl::Status& status) {
  return status.ToString(absl::StatusToStringMode::kWithNoExtraData);
}

// Marks an error that retrying or replacing the worker would not cure: every replica of the run
// would meet it in turn (a checkpoint that cannot be written to checkpoint.dir), or every attempt
// of a step (the worker's data set differs from the plan's). A worker that fails with it, or
// reports a step failed with it, asks the coordinator to fail the run instead of going on without
// the worker's replica or planning the step again.
inline constexpr char kEndsRunPayload[] = "type.hetpar/ends-run";

inline absl::Status EndsRun(absl::Status status) {
  if (!status.ok()) status.SetPayload(kEndsRunPayload, absl::Cord());
  return status;
}

inline bool IsEndsRun(const absl::Status& status) {
  return status.GetPayload(kEndsRunPayload).has_value();
}

}  // namespace hetpar

#endif  // HETPAR_COMMON_STATUS_H_
