// The one place where exceptions from libtorch, c10d and Gloo become absl::Status.
//
// Tensor code (model forward and backward, the collectives inside autograd) throws c10::Error or
// Gloo exceptions the way libtorch does; every public entry point of hetpar_nn and the models
// runs that code through RunTorch / RunTorchOr so that no exception leaves the component.
//
// Mapping: a timed-out collective or store wait -> DeadlineExceeded; a Gloo I/O error (a peer
// closed its connection) -> Unavailable; c10::IndexError / ValueError / TypeError ->
// InvalidArgument; c10::OutOfMemoryError -> ResourceExhausted; anything else -> Internal.
// Messages keep libtorch's text without its C++ backtrace, prefixed by the caller's context.
#ifndef HETPAR_COMMON_NN_TORCH_STATUS_H_
#define HETPAR_COMMON_NN_TORCH_STATUS_H_

#include <string_view>
#include <type_traits>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace hetpar::nn {

// Translates the exception currently being handled. Call only inside a catch block.
absl::Status StatusFromCurrentException(std::string_view context);

// Runs `fn()` (returning void) and translates any exception it throws.
template <typename Fn>
absl::Status RunTorch(std::string_view context, Fn&& fn) {
  try {
    std::forward<Fn>(fn)();
    return absl::OkStatus();
  } catch (...) {
    return StatusFromCurrentException(context);
  }
}

// Runs `fn()` returning a value (or a StatusOr of one) and translates any exception it throws.
template <typename Fn, typename R = std::invoke_result_t<Fn>>
auto RunTorchOr(std::string_view context, Fn&& fn)
    -> std::conditional_t<std::is_convertible_v<absl::Status, R>, R, absl::StatusOr<R>> {
  try {
    return std::forward<Fn>(fn)();
  } catch (...) {
    return StatusFromCurrentException(context);
  }
}

}  // namespace hetpar::nn

#endif  // HETPAR_COMMON_NN_TORCH_STATUS_H_
