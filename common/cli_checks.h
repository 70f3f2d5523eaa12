// Number checks for command-line options, in words a user reads: CLI11's PositiveNumber says
// "Value 0 not in range 0.000000 to 1.797693e+308" (with every digit of the largest double).
//
//   app.add_option("--steps", steps, "...")->check(hetpar::kPositiveNumber);
//   // hetpar run --steps 0  ->  "--steps: 0 is not a number > 0"
//
// The option's name comes first in CLI11's message; a value from an environment variable
// (->envname) is checked the same way and says so in its own words.
#ifndef HETPAR_COMMON_CLI_CHECKS_H_
#define HETPAR_COMMON_CLI_CHECKS_H_

#include <cmath>
#include <string>

#include "CLI/CLI.hpp"
#include "absl/strings/numbers.h"

namespace hetpar {
namespace internal {

// A validator of a finite number that `holds`; the message says `what` it must be.
template <typename Holds>
CLI::Validator NumberCheck(const std::string& what, Holds holds) {
  return CLI::Validator(
      [what, holds](std::string& input) -> std::string {
        double value = 0;
        if (!absl::SimpleAtod(input, &value) || !std::isfinite(value)) {
          return "'" + input + "' is not a number (expected " + what + ")";
        }
        if (!holds(value)) return input + " is not " + what;
        return "";
      },
      what);
}

}  // namespace internal

inline const CLI::Validator kPositiveNumber =
    internal::NumberCheck("a number > 0", [](double v) { return v > 0; });
inline const CLI::Validator kNonNegativeNumber =
    internal::NumberCheck("a number >= 0", [](double v) { return v >= 0; });

}  // namespace hetpar

#endif  // HETPAR_COMMON_CLI_CHECKS_H_
