#include "common/nn/torch_status.h"

#include <c10/util/Exception.h>
#include <gloo/common/error.h>

#include <exception>
#include <new>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace hetpar::nn {
namespace {

absl::Status Make(absl::StatusCode code, std::string_view context, std::string_view what) {
  std::string text(absl::StripTrailingAsciiWhitespace(std::string(what)));
  const std::string lower = absl::AsciiStrToLower(text);
  if (absl::StrContains(lower, "timed out") || absl::StrContains(lower, "timeout")) {
    code = absl::StatusCode::kDeadlineExceeded;
  }
  if (context.empty()) return absl::Status(code, text);
  return absl::Status(code, absl::StrCat(std::string(context), ": ", text));
}

}  // namespace

absl::Status StatusFromCurrentException(std::string_view context) {
  try {
    throw;
  } catch (const c10::OutOfMemoryError& e) {
    return Make(absl::StatusCode::kResourceExhausted, context, e.what_without_backtrace());
  } catch (const c10::IndexError& e) {
    return Make(absl::StatusCode::kInvalidArgument, context, e.what_without_backtrace());
  } catch (const c10::ValueError& e) {
    return Make(absl::StatusCode::kInvalidArgument, context, e.what_without_backtrace());
  } catch (const c10::TypeError& e) {
    return Make(absl::StatusCode::kInvalidArgument, context, e.what_without_backtrace());
  } catch (const c10::Error& e) {
    return Make(absl::StatusCode::kInternal, context, e.what_without_backtrace());
  } catch (const ::gloo::IoException& e) {
    return Make(absl::StatusCode::kUnavailable, context, e.what());
  } catch (const std::bad_alloc& e) {
    return Make(absl::StatusCode::kResourceExhausted, context, e.what());
  } catch (const std::exception& e) {
    return Make(absl::StatusCode::kInternal, context, e.what());
  } catch (...) {
    return Make(absl::StatusCode::kInternal, context, "unknown exception");
  }
}

}  // namespace hetpar::nn
