// Size checks the models share when they are built from a RunSpec: errors name the field, the
// value and what was expected ("llm.layout.tp=3 does not divide llm.model.heads=4 (...)").
#ifndef HETPAR_COMMON_NN_SIZE_CHECKS_H_
#define HETPAR_COMMON_NN_SIZE_CHECKS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace hetpar::nn {

inline absl::Status CheckPositive(const char* field, int64_t value) {
  if (value >= 1) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(field, "=", value, " must be >= 1"));
}

inline absl::Status CheckDivides(const char* divisor_field, int64_t divisor, const char* field,
                                 int64_t value, const char* why = "") {
  if (value % divisor == 0) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(divisor_field, "=", divisor, " does not divide ",
                                                 field, "=", value, *why ? " (" : "", why,
                                                 *why ? ")" : ""));
}

}  // namespace hetpar::nn

#endif  // HETPAR_COMMON_NN_SIZE_CHECKS_H_
