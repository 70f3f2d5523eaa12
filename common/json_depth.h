// A bound on the nesting of JSON read from files hetpar does not write (safetensors headers,
// Hugging Face configs, score requests). nlohmann::json parses without recursion, but its dump,
// copies and comparisons recurse once per level: a crafted file of 100000 '[' parses, then
// overflows the stack where a value of it is printed in an error message. No file hetpar reads
// nests anywhere near kMaxJsonDepth.
#ifndef HETPAR_COMMON_JSON_DEPTH_H_
#define HETPAR_COMMON_JSON_DEPTH_H_

namespace hetpar {

inline constexpr int kMaxJsonDepth = 64;

// For a parse callback: whether a value at `depth` is kept. A deeper one is discarded (the parse
// goes on) and *too_deep set, for the caller to refuse the file.
inline bool WithinJsonDepth(int depth, bool* too_deep) {
  if (depth <= kMaxJsonDepth) return true;
  *too_deep = true;
  return false;
}

}  // namespace hetpar

#endif  // HETPAR_COMMON_JSON_DEPTH_H_
