// A bound on the nesting of JSON read from files hetpar does not write (safetensors headers,
// Hugging Face configs, score requests). nlohmann::json parses without recursion, but its dump,
// copies and comparisons recurse once per level: a crafted file of 100000 '[' parses, then
// overflows the stack where a value of it is printed in an error message. No file hetpar reads
// nests anywhere near kMaxJsonDepth.
#ifndef HETPAR_COMMON_JSON_DEPTH_H_
#define HETPAR_COMMON_JSON_DEPTH_H_

#include <string>
#include <utility>

namespace hetpar {

inline constexpr int kMaxJsonDepth = 64;

// For a parse callback: whether a value at `depth` is kept. A deeper one is discarded (the parse
// goes on) and *too_deep set, for the caller to refuse the file.
inline bool WithinJsonDepth(int depth, bool* too_deep) {
  if (depth <= kMaxJsonDepth) return true;
  *too_deep = true;
  return false;
}

// Json::parse(input..., without exceptions) with the values nested past kMaxJsonDepth discarded
// and *too_deep set. Json is nlohmann::json (not included here).
template <typename Json, typename... Input>
Json ParseJsonWithinDepth(bool* too_deep, Input&&... input) {
  return Json::parse(
      std::forward<Input>(input)...,
      [too_deep](int depth, typename Json::parse_event_t, Json&) {
        return WithinJsonDepth(depth, too_deep);
      },
      /*allow_exceptions=*/false);
}

// " of at most <kMaxJsonDepth> levels" after "... is not a JSON object" when the input was too
// deep; empty otherwise.
inline std::string JsonDepthNote(bool too_deep) {
  return too_deep ? " of at most " + std::to_string(kMaxJsonDepth) + " levels" : "";
}

}  // namespace hetpar

#endif  // HETPAR_COMMON_JSON_DEPTH_H_
