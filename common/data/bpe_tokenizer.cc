#include "common/data/bpe_tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <filesystem>
#include <map>
#include <queue>
#include <set>
#include <system_error>
#include <tuple>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/data/file_util.h"
#include "common/json_depth.h"
#include "common/status.h"
#include "nlohmann/json.hpp"

namespace hetpar::data {
namespace {

using Json = nlohmann::json;

// The pattern of the ByteLevel pre-tokenizer with use_regex (GPT-2's), as the library has it.
constexpr char kGpt2Pattern[] =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
// Rust regex's \w, which the library's single_word check uses: Alphabetic, M, Nd, Pc and
// Join_Control.
constexpr char kWordCharPattern[] = R"([\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\x{200C}\x{200D}])";
constexpr char kReplacementCharacter[] = "\xEF\xBF\xBD";  // U+FFFD
// Ids index tables; real vocabularies stay below 2^18.
constexpr int64_t kMaxId = int64_t{1} << 24;

// ---- UTF-8 ----

struct Utf8Step {
  size_t length;  // of the character, or of the maximal invalid subpart (>= 1)
  bool valid;
};

// The UTF-8 sequence at s[i] (i < s.size()), delimited as Rust's String::from_utf8_lossy does:
// overlong forms, surrogates and code points above U+10FFFF are invalid.
Utf8Step NextUtf8(std::string_view s, size_t i) {
  const auto byte = [&](size_t k) -> int {
    return i + k < s.size() ? static_cast<unsigned char>(s[i + k]) : -1;
  };
  const int b0 = byte(0);
  if (b0 < 0x80) return {1, true};
  int low = 0x80;
  int high = 0xBF;
  size_t width = 0;
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    width = 2;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    width = 3;
    if (b0 == 0xE0) low = 0xA0;
    if (b0 == 0xED) high = 0x9F;
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    width = 4;
    if (b0 == 0xF0) low = 0x90;
    if (b0 == 0xF4) high = 0x8F;
  } else {
    return {1, false};
  }
  const int b1 = byte(1);
  if (b1 < low || b1 > high) return {1, false};
  for (size_t k = 2; k < width; ++k) {
    const int b = byte(k);
    if (b < 0x80 || b > 0xBF) return {k, false};
  }
  return {width, true};
}

// The code point of the valid sequence s[i, i + length).
char32_t CodePoint(std::string_view s, size_t i, size_t length) {
  const auto byte = [&](size_t k) {
    return static_cast<char32_t>(static_cast<unsigned char>(s[i + k]));
  };
  switch (length) {
    case 1:
      return byte(0);
    case 2:
      return ((byte(0) & 0x1F) << 6) | (byte(1) & 0x3F);
    case 3:
      return ((byte(0) & 0x0F) << 12) | ((byte(1) & 0x3F) << 6) | (byte(2) & 0x3F);
    default:
      return ((byte(0) & 0x07) << 18) | ((byte(1) & 0x3F) << 12) | ((byte(2) & 0x3F) << 6) |
             (byte(3) & 0x3F);
  }
}

void AppendUtf8(char32_t c, std::string* out) {
  if (c < 0x80) {
    out->push_back(static_cast<char>(c));
  } else if (c < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (c >> 6)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else if (c < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (c >> 12)));
    out->push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (c >> 18)));
    out->push_back(static_cast<char>(0x80 | ((c >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3F)));
  }
}

// Bytes to text, each maximal invalid subpart replaced by U+FFFD (Rust's from_utf8_lossy).
std::string Utf8Lossy(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  for (size_t i = 0; i < bytes.size();) {
    const Utf8Step step = NextUtf8(bytes, i);
    if (step.valid) {
      out.append(bytes.substr(i, step.length));
    } else {
      out.append(kReplacementCharacter);
    }
    i += step.length;
  }
  return out;
}

// Unicode White_Space, which Rust's char::is_whitespace and regex \s test.
bool IsWhiteSpace(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
         c == 0x3000;
}

// Offset of the first character of the trailing White_Space run of valid UTF-8 `s` (s.size() when
// there is none): the start of the library's `\s*$` match.
size_t TrailingSpaceStart(std::string_view s) {
  size_t end = s.size();
  while (end > 0) {
    size_t start = end - 1;
    while (start > 0 && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
    if (!IsWhiteSpace(CodePoint(s, start, end - start))) break;
    end = start;
  }
  return end;
}

// Length of the leading White_Space run of valid UTF-8 `s`: the end of the library's `^\s*`.
size_t LeadingSpaceLength(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const size_t length = NextUtf8(s, i).length;
    if (!IsWhiteSpace(CodePoint(s, i, length))) break;
    i += length;
  }
  return i;
}

// ---- The byte-level alphabet (GPT-2's bytes_to_unicode) ----

struct ByteLevelAlphabet {
  std::array<char32_t, 256> char_of_byte;
  std::array<int, 0x144> byte_of_char;  // -1 for a code point outside the alphabet
};

const ByteLevelAlphabet& Alphabet() {
  static const ByteLevelAlphabet* const alphabet = [] {
    auto* a = new ByteLevelAlphabet;
    a->byte_of_char.fill(-1);
    int next = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      const char32_t c = printable ? static_cast<char32_t>(b) : static_cast<char32_t>(256 + next++);
      a->char_of_byte[b] = c;
      a->byte_of_char[c] = b;
    }
    return a;
  }();
  return *alphabet;
}

// The bytes a byte-level token string stands for, or nullopt when it has a character outside the
// alphabet (the ByteLevel decoder then keeps the token's own UTF-8).
std::optional<std::string> ByteLevelToBytes(std::string_view token) {
  const ByteLevelAlphabet& alphabet = Alphabet();
  std::string out;
  for (size_t i = 0; i < token.size();) {
    const Utf8Step step = NextUtf8(token, i);
    if (!step.valid) return std::nullopt;
    const char32_t c = CodePoint(token, i, step.length);
    if (c >= alphabet.byte_of_char.size() || alphabet.byte_of_char[c] < 0) return std::nullopt;
    out.push_back(static_cast<char>(alphabet.byte_of_char[c]));
    i += step.length;
  }
  return out;
}

std::string ByteLevelString(unsigned char byte) {
  std::string out;
  AppendUtf8(Alphabet().char_of_byte[byte], &out);
  return out;
}

// ---- PCRE2 ----

std::string Pcre2Message(int code) {
  PCRE2_UCHAR buffer[256];
  if (pcre2_get_error_message(code, buffer, sizeof(buffer)) < 0) {
    return absl::StrCat("PCRE2 error ", code);
  }
  return reinterpret_cast<const char*>(buffer);
}

// A compiled PCRE2 pattern (UTF, UCP, JIT when available). Matching is thread-safe: every call
// uses its own match data.
class Regex {
 public:
  // `what` names the pattern in messages (e.g. "pre_tokenizer.pattern.Regex").
  static absl::StatusOr<std::unique_ptr<Regex>> Compile(std::string_view pattern,
                                                        uint32_t extra_options, std::string what) {
    int code = 0;
    PCRE2_SIZE offset = 0;
    pcre2_code* compiled =
        pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                      PCRE2_UTF | PCRE2_UCP | extra_options, &code, &offset, nullptr);
    if (compiled == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(Pcre2Message(code), " at offset ", offset,
                                                     " of the PCRE2 pattern '",
                                                     std::string(pattern), "'"));
    }
    // Without JIT (not built in, or no executable memory) pcre2_match interprets the pattern.
    pcre2_jit_compile(compiled, PCRE2_JIT_COMPLETE);
    return std::unique_ptr<Regex>(new Regex(compiled, std::move(what)));
  }
  ~Regex() { pcre2_code_free(code_); }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // [start, end) of every match in the valid UTF-8 `text`, left to right, as the library's
  // Oniguruma find_iter gives them: an empty match right where the previous match ended is
  // skipped.
  absl::Status FindAll(std::string_view text,
                       std::vector<std::pair<size_t, size_t>>* matches) const {
    std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> data(
        pcre2_match_data_create_from_pattern(code_, nullptr), &pcre2_match_data_free);
    if (data == nullptr) return absl::ResourceExhaustedError("cannot allocate PCRE2 match data");
    size_t position = 0;
    std::optional<size_t> last_end;
    while (position <= text.size()) {
      const int rc = Match(text, position, 0, data.get());
      if (rc == PCRE2_ERROR_NOMATCH) break;
      if (rc < 0) {
        return absl::ResourceExhaustedError(absl::StrCat(what_, " failed on a text of ",
                                                         text.size(), " bytes at byte ", position,
                                                         ": ", Pcre2Message(rc)));
      }
      const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(data.get());
      const size_t start = ovector[0];
      const size_t end = std::max<size_t>(ovector[0], ovector[1]);
      if (start == end && last_end == end) {
        position += position < text.size() ? NextUtf8(text, position).length : 1;
        continue;
      }
      position = end;
      last_end = end;
      matches->emplace_back(start, end);
    }
    return absl::OkStatus();
  }

  // Whether the pattern matches `text` from its first byte.
  bool MatchesPrefix(std::string_view text) const {
    std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> data(
        pcre2_match_data_create_from_pattern(code_, nullptr), &pcre2_match_data_free);
    return data != nullptr && Match(text, 0, PCRE2_ANCHORED, data.get()) >= 0;
  }

 private:
  Regex(pcre2_code* code, std::string what) : code_(code), what_(std::move(what)) {}

  int Match(std::string_view text, size_t offset, uint32_t options, pcre2_match_data* data) const {
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
    options |= PCRE2_NO_UTF_CHECK;  // Encode validates the text once
    int rc = pcre2_match(code_, subject, text.size(), offset, options, data, nullptr);
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT) {
      // The JIT's default 32 KiB stack is too small for this text; the interpreter's is the heap.
      rc = pcre2_match(code_, subject, text.size(), offset, options | PCRE2_NO_JIT, data, nullptr);
    }
    return rc;
  }

  pcre2_code* code_;  // owned
  std::string what_;
};

// The library compiles pre-tokenizer patterns with Oniguruma (Ruby syntax); PCRE2 reads the same
// text except for a few escapes, which this rewrites to their Oniguruma meaning:
//   \s \S  White_Space (PCRE2's \s also matches U+180E)
//   \w \W  letters, marks, numbers, connector punctuation (PCRE2's lacks marks and Pc)
//   \h \H  hexadecimal digits (PCRE2: horizontal space)
//   \v     the vertical tab (PCRE2: vertical space)
//   \uHHHH a code point (PCRE2: an error)
// \b and \B outside a class, \W and \H inside one, and nested classes have no rewrite here and are
// refused; the message says why.
absl::StatusOr<std::string> OnigurumaToPcre2(std::string_view pattern) {
  constexpr char kWord[] = R"(\p{L}\p{M}\p{N}\p{Pc})";
  std::string out;
  out.reserve(pattern.size() + 32);
  bool in_class = false;
  size_t class_start = 0;  // offset in `out` just after "[" or "[^"
  const auto refuse = [&](std::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat(
        "uses ", absl::string_view(what.data(), what.size()),
        ", which differs between Oniguruma (the tokenizers library) and PCRE2 (hetpar)"));
  };
  for (size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      const char e = pattern[++i];
      switch (e) {
        case 's':
          out += R"(\p{White_Space})";
          break;
        case 'S':
          out += R"(\P{White_Space})";
          break;
        case 'w':
          out += in_class ? kWord : absl::StrCat("[", kWord, "]");
          break;
        case 'W':
          if (in_class) return refuse("\\W inside a character class");
          out += absl::StrCat("[^", kWord, "]");
          break;
        case 'h':
          out += in_class ? "0-9a-fA-F" : "[0-9a-fA-F]";
          break;
        case 'H':
          if (in_class) return refuse("\\H inside a character class");
          out += "[^0-9a-fA-F]";
          break;
        case 'v':
          out += R"(\x{0B})";
          break;
        case 'b':
        case 'B':
          if (!in_class) return refuse(absl::StrCat("\\", std::string(1, e), " (word boundary)"));
          out += "\\b";  // a backspace in a class, in both
          break;
        case 'u': {
          const std::string_view hex = pattern.substr(i + 1, 4);
          if (hex.size() != 4 || !std::all_of(hex.begin(), hex.end(), [](char h) {
                return std::isxdigit(static_cast<unsigned char>(h)) != 0;
              })) {
            return refuse("\\u without four hexadecimal digits");
          }
          out += absl::StrCat("\\x{", absl::string_view(hex.data(), hex.size()), "}");
          i += 4;
          break;
        }
        case 'Q': {  // literal up to \E, copied as is
          const size_t end = pattern.find("\\E", i + 1);
          const size_t stop = end == std::string_view::npos ? pattern.size() : end + 2;
          out += "\\Q";
          out.append(pattern.substr(i + 1, stop - (i + 1)));
          i = stop - 1;
          break;
        }
        default:
          out += '\\';
          out += e;
      }
      continue;
    }
    if (in_class) {
      if (c == '[' && i + 1 < pattern.size() && pattern[i + 1] == ':') {
        const size_t end = pattern.find(":]", i + 2);  // a POSIX class, [:alpha:]
        if (end == std::string_view::npos) return refuse("an unterminated [: in a class");
        out.append(pattern.substr(i, end + 2 - i));
        i = end + 1;
        continue;
      }
      if (c == '[') return refuse("a nested character class");
      if (c == '&' && i + 1 < pattern.size() && pattern[i + 1] == '&') {
        return refuse("a class intersection (&&)");
      }
      if (c == ']' && out.size() > class_start) in_class = false;
      out += c;
      continue;
    }
    out += c;
    if (c == '[') {
      in_class = true;
      if (i + 1 < pattern.size() && pattern[i + 1] == '^') out += pattern[++i];
      class_start = out.size();
    }
  }
  return out;
}

// ---- Added tokens ----

struct AddedToken {
  std::string content;
  int32_t id = -1;
  bool single_word = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = true;
  bool special = false;

  bool SameAs(const AddedToken& other) const {
    return std::tie(content, single_word, lstrip, rstrip, normalized, special) ==
           std::tie(other.content, other.single_word, other.lstrip, other.rstrip, other.normalized,
                    other.special);
  }
};

// The added tokens' contents, for leftmost-longest matching.
class TokenTrie {
 public:
  void Add(std::string_view content, int32_t value) {
    int32_t node = 0;
    for (unsigned char c : content) {
      auto it = nodes_[node].next.find(c);
      if (it == nodes_[node].next.end()) {
        it = nodes_[node].next.emplace(c, static_cast<int32_t>(nodes_.size())).first;
        nodes_.emplace_back();
      }
      node = it->second;
    }
    nodes_[node].value = value;
  }
  bool empty() const { return nodes_.size() == 1; }
  // The value and length of the longest content that starts at text[position]; value -1 for none.
  std::pair<int32_t, size_t> LongestAt(std::string_view text, size_t position) const {
    std::pair<int32_t, size_t> best = {-1, 0};
    int32_t node = 0;
    for (size_t i = position; i < text.size(); ++i) {
      auto it = nodes_[node].next.find(static_cast<unsigned char>(text[i]));
      if (it == nodes_[node].next.end()) break;
      node = it->second;
      if (nodes_[node].value >= 0) best = {nodes_[node].value, i + 1 - position};
    }
    return best;
  }

 private:
  struct Node {
    std::map<unsigned char, int32_t> next;
    int32_t value = -1;
  };
  std::vector<Node> nodes_ = std::vector<Node>(1);
};

// A piece of the input: text to pre-tokenize (id -1) or an added token.
struct Segment {
  std::string_view text;
  int32_t id;
};

struct MergeTarget {
  uint32_t rank;
  int32_t id;
};

uint64_t PairKey(int32_t left, int32_t right) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
}

// ---- JSON helpers ----

// A value for messages: 'text' for a string, JSON for the rest; long ones cut.
std::string Show(const Json& value) {
  std::string text = value.is_string() ? absl::StrCat("'", value.get_ref<const std::string&>(), "'")
                                       : value.dump(-1, ' ', false, Json::error_handler_t::replace);
  if (text.size() > 80) {
    size_t cut = 77;
    while (cut > 0 && (static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80) --cut;
    text = text.substr(0, cut) + "...";
  }
  return text;
}

// `what` names the file in messages ("tokenizer /x/tokenizer.json").
// Nested past kMaxJsonDepth: refused, since printing a value of it in a message would overflow
// the stack.
absl::StatusOr<Json> ParseJson(std::string_view text, const std::string& what) {
  bool too_deep = false;
  Json parsed;
  try {
    parsed =
        Json::parse(text.begin(), text.end(), [&too_deep](int depth, Json::parse_event_t, Json&) {
          return WithinJsonDepth(depth, &too_deep);
        });
  } catch (const Json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(what, " is not valid JSON: ", e.what()));
  }
  if (too_deep) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " nests JSON values deeper than ", kMaxJsonDepth, " levels"));
  }
  return parsed;
}

const Json* Member(const Json& object, const char* key) {
  if (!object.is_object()) return nullptr;
  auto it = object.find(key);
  return it == object.end() ? nullptr : &*it;
}

bool IsNull(const Json* value) { return value == nullptr || value->is_null(); }

// Debian's abseil has its own string_view: for StrCat and heterogeneous map lookups.
absl::string_view View(std::string_view s) { return absl::string_view(s.data(), s.size()); }

}  // namespace

// Everything a BpeTokenizer knows; built once by FromJson, then read-only.
struct BpeTokenizer::State {
  std::string source;

  // model
  std::vector<std::string> model_pieces;  // id -> model.vocab token ("" where none)
  std::vector<bool> model_has_piece;
  absl::flat_hash_map<std::string, int32_t> model_ids;  // model.vocab token -> id
  absl::flat_hash_map<std::string, int32_t> byte_ids;   // the bytes a model token stands for -> id
  std::array<int32_t, 256> byte_symbol_ids;             // single-byte model token ids, -1 if none
  absl::flat_hash_map<uint64_t, MergeTarget> merges;
  bool ignore_merges = false;
  std::optional<std::string> unk_token;
  std::optional<int32_t> model_unk_id;
  bool fuse_unk = false;

  // added tokens, by id; matched in two passes (not normalized first) as the library does
  std::map<int32_t, AddedToken> added;
  absl::flat_hash_map<std::string, int32_t> added_ids;
  std::set<std::string> special_contents;
  TokenTrie raw_trie;
  TokenTrie normalized_trie;
  std::unique_ptr<Regex> word_char;  // only when a token is single_word

  // pre-tokenizer
  std::vector<std::unique_ptr<Regex>> splits;
  bool add_prefix_space = false;
  std::unique_ptr<Regex> byte_level_regex;  // use_regex

  // decoding, by id
  int32_t vocab_size = 0;
  std::vector<std::string> id_bytes;
  std::vector<bool> id_has_token;
  std::vector<bool> id_special;

  int32_t unk_id = -1;
  int32_t bos_id = -1;
  int32_t eos_id = -1;
  int32_t pad_id = -1;

  absl::Status Invalid(std::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat("tokenizer ", source, ": ", View(what)));
  }

  std::optional<int32_t> TokenId(std::string_view piece) const {
    if (auto it = added_ids.find(View(piece)); it != added_ids.end()) return it->second;
    if (auto it = model_ids.find(View(piece)); it != model_ids.end()) return it->second;
    return std::nullopt;
  }

  absl::Status ParseModel(const Json& root);
  absl::Status ParseAddedTokens(const Json& root);
  absl::Status ParseNormalizer(const Json& root);
  absl::Status ParsePreTokenizer(const Json& root);
  absl::Status ParsePreTokenizerStep(const Json& step, const std::string& key, bool last);
  absl::Status ParseDecoder(const Json& root);
  // Compiles a pre-tokenizer pattern the way the library reads it; `key` names it in messages.
  absl::StatusOr<std::unique_ptr<Regex>> CompilePattern(std::string_view pattern, bool literal,
                                                        const std::string& key) const;
  void BuildDecodeTables();
  absl::Status ResolveSpecialIds(std::string_view config_json);

  void SplitOnAddedTokens(std::string_view sentence, const TokenTrie& trie,
                          std::vector<Segment>* out) const;
  absl::Status EncodeText(std::string_view text, std::vector<int32_t>* out) const;
  absl::Status EncodeWord(std::string_view bytes, std::vector<int32_t>* out) const;
};

absl::Status BpeTokenizer::State::ParseModel(const Json& root) {
  const Json* model = Member(root, "model");
  if (model == nullptr || !model->is_object()) return Invalid("has no \"model\" object");
  const Json* type = Member(*model, "type");
  if (type != nullptr) {
    if (!type->is_string() || type->get<std::string>() != "BPE") {
      return Invalid(
          absl::StrCat("model.type=", Show(*type), " is not supported (expected 'BPE')"));
    }
  } else if (Member(*model, "merges") == nullptr) {
    return Invalid("model has no \"type\" (expected 'BPE')");
  }
  // Fields whose only supported value is the default.
  if (const Json* dropout = Member(*model, "dropout");
      !IsNull(dropout) && !(dropout->is_number() && dropout->get<double>() == 0.0)) {
    return Invalid(absl::StrCat("model.dropout=", Show(*dropout),
                                " is not supported (expected null: encoding is deterministic)"));
  }
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    const Json* value = Member(*model, key);
    if (!IsNull(value) && !(value->is_string() && value->get<std::string>().empty())) {
      return Invalid(absl::StrCat("model.", key, "=", Show(*value),
                                  " is not supported (expected null for byte-level BPE)"));
    }
  }
  const auto flag = [&](const char* key, bool* out) -> absl::Status {
    const Json* value = Member(*model, key);
    if (IsNull(value)) return absl::OkStatus();
    if (!value->is_boolean()) {
      return Invalid(absl::StrCat("model.", key, "=", Show(*value), " must be true or false"));
    }
    *out = value->get<bool>();
    return absl::OkStatus();
  };
  bool byte_fallback = false;
  HETPAR_RETURN_IF_ERROR(flag("byte_fallback", &byte_fallback));
  if (byte_fallback) {
    return Invalid("model.byte_fallback=true is not supported (expected false for byte-level BPE)");
  }
  HETPAR_RETURN_IF_ERROR(flag("fuse_unk", &fuse_unk));
  HETPAR_RETURN_IF_ERROR(flag("ignore_merges", &ignore_merges));
  if (const Json* unk = Member(*model, "unk_token"); !IsNull(unk)) {
    if (!unk->is_string()) {
      return Invalid(absl::StrCat("model.unk_token=", Show(*unk), " must be a string or null"));
    }
    unk_token = unk->get<std::string>();
  }

  const Json* vocab = Member(*model, "vocab");
  if (vocab == nullptr || !vocab->is_object()) {
    return Invalid(absl::StrCat("model.vocab must be an object of token -> id; got ",
                                vocab == nullptr ? "nothing" : Show(*vocab)));
  }
  model_ids.reserve(vocab->size());
  byte_ids.reserve(vocab->size());
  for (auto it = vocab->begin(); it != vocab->end(); ++it) {
    const Json& id = it.value();
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= kMaxId) {
      return Invalid(absl::StrCat("model.vocab['", it.key(), "']=", Show(id),
                                  " is not an id (expected an integer in [0, ", kMaxId, "))"));
    }
    const auto value = static_cast<int32_t>(id.get<int64_t>());
    if (static_cast<size_t>(value) >= model_pieces.size()) {
      model_pieces.resize(static_cast<size_t>(value) + 1);
      model_has_piece.resize(static_cast<size_t>(value) + 1, false);
    }
    if (model_has_piece[static_cast<size_t>(value)]) {
      return Invalid(absl::StrCat("model.vocab has two tokens with id ", value, ": '",
                                  model_pieces[static_cast<size_t>(value)], "' and '", it.key(),
                                  "'"));
    }
    model_pieces[static_cast<size_t>(value)] = it.key();
    model_has_piece[static_cast<size_t>(value)] = true;
    model_ids.emplace(it.key(), value);
    if (std::optional<std::string> bytes = ByteLevelToBytes(it.key())) {
      byte_ids.emplace(std::move(*bytes), value);
    }
  }
  for (int b = 0; b < 256; ++b) {
    auto it = model_ids.find(ByteLevelString(static_cast<unsigned char>(b)));
    byte_symbol_ids[static_cast<size_t>(b)] = it == model_ids.end() ? -1 : it->second;
  }
  if (unk_token.has_value()) {
    if (auto it = model_ids.find(*unk_token); it != model_ids.end()) model_unk_id = it->second;
  }

  const Json* merge_list = Member(*model, "merges");
  if (merge_list == nullptr || !merge_list->is_array()) {
    return Invalid(absl::StrCat("model.merges must be an array; got ",
                                merge_list == nullptr ? "nothing" : Show(*merge_list)));
  }
  merges.reserve(merge_list->size());
  uint32_t rank = 0;
  std::string merged;
  for (size_t i = 0; i < merge_list->size(); ++i) {
    const Json& merge = (*merge_list)[i];
    const auto invalid = [&](std::string_view why) {
      return Invalid(absl::StrCat("model.merges[", i, "]=", Show(merge), " ", View(why)));
    };
    std::string_view left, right;
    if (merge.is_string()) {
      const std::string& line = merge.get_ref<const std::string&>();
      if (line.rfind("#version", 0) == 0) continue;  // merges.txt's header; not a merge
      const size_t space = line.find(' ');
      if (space == std::string::npos || line.find(' ', space + 1) != std::string::npos) {
        return invalid("must be two tokens separated by one space");
      }
      const std::string_view text = line;
      left = text.substr(0, space);
      right = text.substr(space + 1);
    } else if (merge.is_array() && merge.size() == 2 && merge[0].is_string() &&
               merge[1].is_string()) {
      left = merge[0].get_ref<const std::string&>();
      right = merge[1].get_ref<const std::string&>();
    } else {
      return invalid("must be \"left right\" or [\"left\", \"right\"]");
    }
    auto left_id = model_ids.find(View(left));
    auto right_id = model_ids.find(View(right));
    for (const auto& [token, found] : {std::pair{left, left_id}, std::pair{right, right_id}}) {
      if (found == model_ids.end()) {
        return invalid(
            absl::StrCat("names the token '", View(token), "', which is not in model.vocab"));
      }
    }
    merged.assign(left);
    merged.append(right);
    auto merged_id = model_ids.find(merged);
    if (merged_id == model_ids.end()) {
      return invalid(absl::StrCat("merges into '", merged, "', which is not in model.vocab"));
    }
    // A pair listed twice takes its last rank, as the library's map does.
    merges.insert_or_assign(PairKey(left_id->second, right_id->second),
                            MergeTarget{rank, merged_id->second});
    ++rank;
  }
  return absl::OkStatus();
}

absl::Status BpeTokenizer::State::ParseAddedTokens(const Json& root) {
  const Json* list = Member(root, "added_tokens");
  if (IsNull(list)) return absl::OkStatus();
  if (!list->is_array()) {
    return Invalid(absl::StrCat("added_tokens=", Show(*list), " must be an array"));
  }
  // Ids as the library assigns them on load: a content already known keeps its id, then the
  // model's id for it, else the next id after the model vocabulary.
  auto next_id = static_cast<int32_t>(model_ids.size());
  for (size_t i = 0; i < list->size(); ++i) {
    const Json& entry = (*list)[i];
    const std::string key = absl::StrCat("added_tokens[", i, "]");
    if (!entry.is_object()) {
      return Invalid(absl::StrCat(key, "=", Show(entry), " must be an object"));
    }
    const Json* content = Member(entry, "content");
    const Json* id = Member(entry, "id");
    if (content == nullptr || !content->is_string()) {
      return Invalid(absl::StrCat(key, ".content must be a string; got ",
                                  content == nullptr ? "nothing" : Show(*content)));
    }
    if (id == nullptr || !id->is_number_integer() || id->get<int64_t>() < 0 ||
        id->get<int64_t>() >= kMaxId) {
      return Invalid(absl::StrCat(key, ".id must be an integer in [0, ", kMaxId, "); got ",
                                  id == nullptr ? "nothing" : Show(*id)));
    }
    AddedToken token;
    token.content = content->get<std::string>();
    for (auto [name, field] :
         {std::pair{"single_word", &token.single_word}, std::pair{"lstrip", &token.lstrip},
          std::pair{"rstrip", &token.rstrip}, std::pair{"normalized", &token.normalized},
          std::pair{"special", &token.special}}) {
      const Json* value = Member(entry, name);
      if (IsNull(value)) continue;
      if (!value->is_boolean()) {
        return Invalid(absl::StrCat(key, ".", name, "=", Show(*value), " must be true or false"));
      }
      *field = value->get<bool>();
    }
    if (token.content.empty()) continue;  // the library ignores an empty token
    int32_t assigned;
    if (auto known = added_ids.find(token.content); known != added_ids.end()) {
      assigned = known->second;
    } else if (auto in_model = model_ids.find(token.content); in_model != model_ids.end()) {
      assigned = in_model->second;
    } else {
      assigned = next_id++;
    }
    if (id->get<int64_t>() != assigned) {
      return Invalid(absl::StrCat(key, " ('", token.content, "') has id ", Show(*id),
                                  ", but the tokenizers library assigns it id ", assigned,
                                  " on load (its id in model.vocab, else the next id after the ",
                                  model_ids.size(), " model tokens); fix the file"));
    }
    token.id = assigned;
    added_ids[token.content] = assigned;
    if (token.special) special_contents.insert(token.content);
    added[assigned] = std::move(token);
  }
  for (const auto& [token_id, token] : added) {
    (token.normalized ? normalized_trie : raw_trie).Add(token.content, token_id);
    if (token.single_word && word_char == nullptr) {
      HETPAR_ASSIGN_OR_RETURN(word_char,
                              Regex::Compile(kWordCharPattern, PCRE2_ANCHORED, "word characters"));
    }
  }
  return absl::OkStatus();
}

absl::Status BpeTokenizer::State::ParseNormalizer(const Json& root) {
  const Json* normalizer = Member(root, "normalizer");
  if (IsNull(normalizer)) return absl::OkStatus();
  const Json* type = Member(*normalizer, "type");
  if (type != nullptr && *type == "Sequence") {
    const Json* steps = Member(*normalizer, "normalizers");
    if (steps != nullptr && steps->is_array() && steps->empty()) return absl::OkStatus();
  }
  return Invalid(
      absl::StrCat("normalizer.type=", type == nullptr ? Show(*normalizer) : Show(*type),
                   " is not supported (hetpar implements no normalizer; expected null)"));
}

absl::StatusOr<std::unique_ptr<Regex>> BpeTokenizer::State::CompilePattern(
    std::string_view pattern, bool literal, const std::string& key) const {
  const std::string shown = Show(Json(std::string(pattern)));
  std::string translated(pattern);
  if (!literal) {
    absl::StatusOr<std::string> pcre2 = OnigurumaToPcre2(pattern);
    if (!pcre2.ok()) return Invalid(absl::StrCat(key, "=", shown, " ", pcre2.status().message()));
    translated = *std::move(pcre2);
  }
  absl::StatusOr<std::unique_ptr<Regex>> regex = Regex::Compile(
      translated, literal ? PCRE2_LITERAL : 0, absl::StrCat("tokenizer ", source, ": ", key));
  if (!regex.ok()) {
    return Invalid(absl::StrCat(key, "=", shown, " does not compile: ", regex.status().message()));
  }
  return regex;
}

absl::Status BpeTokenizer::State::ParsePreTokenizerStep(const Json& step, const std::string& key,
                                                        bool last) {
  const Json* type = Member(step, "type");
  if (type != nullptr && *type == "ByteLevel") {
    if (!last) {
      return Invalid(absl::StrCat(key, ": ByteLevel must be the last pre-tokenizer step"));
    }
    const auto flag = [&](const char* name, bool* out) -> absl::Status {
      const Json* value = Member(step, name);
      if (IsNull(value)) return absl::OkStatus();  // the library's defaults: both true
      if (!value->is_boolean()) {
        return Invalid(absl::StrCat(key, ".", name, "=", Show(*value), " must be true or false"));
      }
      *out = value->get<bool>();
      return absl::OkStatus();
    };
    bool use_regex = true;
    add_prefix_space = true;
    HETPAR_RETURN_IF_ERROR(flag("add_prefix_space", &add_prefix_space));
    HETPAR_RETURN_IF_ERROR(flag("use_regex", &use_regex));
    if (use_regex) {
      HETPAR_ASSIGN_OR_RETURN(
          byte_level_regex,
          CompilePattern(kGpt2Pattern, /*literal=*/false, key + " (use_regex: the GPT-2 regex)"));
    }
    return absl::OkStatus();
  }
  if (type != nullptr && *type == "Split") {
    if (last) {
      return Invalid(
          absl::StrCat(key, ": the pre-tokenizer must end in ByteLevel (byte-level BPE)"));
    }
    const Json* behavior = Member(step, "behavior");
    if (behavior == nullptr || *behavior != "Isolated") {
      return Invalid(absl::StrCat(key,
                                  ".behavior=", behavior == nullptr ? "nothing" : Show(*behavior),
                                  " is not supported (expected 'Isolated')"));
    }
    const Json* invert = Member(step, "invert");
    if (!IsNull(invert) && *invert != false) {
      return Invalid(
          absl::StrCat(key, ".invert=", Show(*invert), " is not supported (expected false)"));
    }
    const Json* pattern = Member(step, "pattern");
    const Json* regex = pattern == nullptr ? nullptr : Member(*pattern, "Regex");
    const Json* literal = pattern == nullptr ? nullptr : Member(*pattern, "String");
    if (regex != nullptr && regex->is_string()) {
      HETPAR_ASSIGN_OR_RETURN(std::unique_ptr<Regex> compiled,
                              CompilePattern(regex->get<std::string>(), /*literal=*/false,
                                             absl::StrCat(key, ".pattern.Regex")));
      splits.push_back(std::move(compiled));
    } else if (literal != nullptr && literal->is_string()) {
      HETPAR_ASSIGN_OR_RETURN(std::unique_ptr<Regex> compiled,
                              CompilePattern(literal->get<std::string>(), /*literal=*/true,
                                             absl::StrCat(key, ".pattern.String")));
      splits.push_back(std::move(compiled));
    } else {
      return Invalid(absl::StrCat(key, ".pattern=", pattern == nullptr ? "nothing" : Show(*pattern),
                                  " must be {\"Regex\": \"...\"} or {\"String\": \"...\"}"));
    }
    return absl::OkStatus();
  }
  return Invalid(absl::StrCat(key, ".type=", type == nullptr ? "nothing" : Show(*type),
                              " is not supported (expected Split or ByteLevel)"));
}

absl::Status BpeTokenizer::State::ParsePreTokenizer(const Json& root) {
  const Json* pre_tokenizer = Member(root, "pre_tokenizer");
  if (IsNull(pre_tokenizer)) {
    return Invalid("pre_tokenizer=null is not supported (byte-level BPE needs ByteLevel)");
  }
  const Json* type = Member(*pre_tokenizer, "type");
  if (type != nullptr && *type == "Sequence") {
    const Json* steps = Member(*pre_tokenizer, "pretokenizers");
    if (steps == nullptr || !steps->is_array() || steps->empty()) {
      return Invalid(
          absl::StrCat("pre_tokenizer.pretokenizers=", steps == nullptr ? "nothing" : Show(*steps),
                       " must be a non-empty array"));
    }
    for (size_t i = 0; i < steps->size(); ++i) {
      HETPAR_RETURN_IF_ERROR(
          ParsePreTokenizerStep((*steps)[i], absl::StrCat("pre_tokenizer.pretokenizers[", i, "]"),
                                i + 1 == steps->size()));
    }
    return absl::OkStatus();
  }
  return ParsePreTokenizerStep(*pre_tokenizer, "pre_tokenizer", /*last=*/true);
}

absl::Status BpeTokenizer::State::ParseDecoder(const Json& root) {
  const Json* decoder = Member(root, "decoder");
  const Json* type = decoder == nullptr ? nullptr : Member(*decoder, "type");
  if (type != nullptr && *type == "ByteLevel") return absl::OkStatus();
  return Invalid(absl::StrCat(
      "decoder",
      type == nullptr ? absl::StrCat("=", decoder == nullptr ? "nothing" : Show(*decoder))
                      : absl::StrCat(".type=", Show(*type)),
      " is not supported (expected ByteLevel)"));
}

void BpeTokenizer::State::BuildDecodeTables() {
  vocab_size = static_cast<int32_t>(model_pieces.size());
  if (!added.empty()) vocab_size = std::max(vocab_size, added.rbegin()->first + 1);
  const auto size = static_cast<size_t>(vocab_size);
  id_bytes.assign(size, "");
  id_has_token.assign(size, false);
  id_special.assign(size, false);
  for (size_t id = 0; id < size; ++id) {
    std::string_view token;
    if (auto it = added.find(static_cast<int32_t>(id)); it != added.end()) {
      token = it->second.content;
    } else if (id < model_pieces.size() && model_has_piece[id]) {
      token = model_pieces[id];
    } else {
      continue;
    }
    id_has_token[id] = true;
    std::optional<std::string> bytes = ByteLevelToBytes(token);
    id_bytes[id] = bytes.has_value() ? std::move(*bytes) : std::string(token);
  }
  // The library tests the token text of an id against the special contents; an added token's
  // text has one id (its model id when the vocabulary has it), so this marks the same ids.
  for (const std::string& content : special_contents) id_special[added_ids.at(content)] = true;
}

absl::Status BpeTokenizer::State::ResolveSpecialIds(std::string_view config_json) {
  const std::string config_name =
      (std::filesystem::path(source).parent_path() / "tokenizer_config.json").string();
  Json config;
  if (!config_json.empty()) {
    HETPAR_ASSIGN_OR_RETURN(config, ParseJson(config_json, "tokenizer config " + config_name));
    if (!config.is_object()) {
      return absl::InvalidArgumentError(
          absl::StrCat("tokenizer config ", config_name, " must be a JSON object"));
    }
  }
  // transformers re-adds the config's added tokens over the file's: they must agree.
  if (const Json* decoder = Member(config, "added_tokens_decoder"); !IsNull(decoder)) {
    if (!decoder->is_object()) {
      return absl::InvalidArgumentError(absl::StrCat("tokenizer config ", config_name,
                                                     ": added_tokens_decoder must be an object"));
    }
    for (auto it = decoder->begin(); it != decoder->end(); ++it) {
      const Json* content = Member(it.value(), "content");
      auto token = added.end();
      int32_t id = -1;
      if (absl::SimpleAtoi(it.key(), &id)) token = added.find(id);
      bool same = token != added.end() && content != nullptr && *content == token->second.content;
      for (auto [name, field] :
           {std::pair{"single_word", &AddedToken::single_word},
            std::pair{"lstrip", &AddedToken::lstrip}, std::pair{"rstrip", &AddedToken::rstrip},
            std::pair{"normalized", &AddedToken::normalized},
            std::pair{"special", &AddedToken::special}}) {
        const Json* value = Member(it.value(), name);
        if (same && value != nullptr && *value != token->second.*field) same = false;
      }
      if (!same) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tokenizer config ", config_name, ": added_tokens_decoder['", it.key(),
            "']=", Show(it.value()), " differs from the added token ", it.key(), " of ", source,
            " (transformers would add or change it; hetpar reads tokens from tokenizer.json "
            "only)"));
      }
    }
  }
  const auto first_added = [&](std::initializer_list<const char*> names) -> int32_t {
    for (const char* name : names) {
      if (auto it = added_ids.find(name); it != added_ids.end()) return it->second;
    }
    return -1;
  };
  struct Special {
    const char* key;
    int32_t* id;
    int32_t fallback;
  };
  const Special specials[] = {
      {"bos_token", &bos_id, first_added({"<|begin_of_text|>", "<s>", "<|endoftext|>"})},
      {"eos_token", &eos_id,
       first_added({"<|end_of_text|>", "<|eot_id|>", "</s>", "<|endoftext|>", "<|im_end|>"})},
      {"pad_token", &pad_id, -1},
      {"unk_token", &unk_id, model_unk_id.value_or(-1)},
  };
  for (const Special& special : specials) {
    const Json* value = Member(config, special.key);
    if (value == nullptr) {
      *special.id = special.fallback;
      continue;
    }
    if (value->is_null()) {
      *special.id = -1;
      continue;
    }
    const Json* content = value->is_object() ? Member(*value, "content") : value;
    if (content == nullptr || !content->is_string()) {
      return absl::InvalidArgumentError(
          absl::StrCat("tokenizer config ", config_name, ": ", special.key, "=", Show(*value),
                       " must be a string, an object with \"content\", or null"));
    }
    std::optional<int32_t> id = TokenId(content->get_ref<const std::string&>());
    if (!id.has_value()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tokenizer config ", config_name, ": ", special.key, "='", content->get<std::string>(),
          "' is not a token of ", source, " (hetpar does not add tokens from the config)"));
    }
    *special.id = *id;
  }
  return absl::OkStatus();
}

// The library's AddedVocabulary::find_matches: leftmost-longest matches, single_word, lstrip and
// rstrip, and the text between them. Empty segments are dropped (PreTokenizedString::split).
void BpeTokenizer::State::SplitOnAddedTokens(std::string_view sentence, const TokenTrie& trie,
                                             std::vector<Segment>* out) const {
  if (sentence.empty()) return;
  if (trie.empty()) {
    out->push_back({sentence, -1});
    return;
  }
  std::vector<std::tuple<size_t, size_t, int32_t>> matches;  // start, stop, id
  for (size_t i = 0; i < sentence.size();) {
    const auto [id, length] = trie.LongestAt(sentence, i);
    if (id < 0) {
      ++i;
      continue;
    }
    matches.emplace_back(i, i + length, id);
    i += length;
  }
  const auto is_word_char = [&](std::string_view character) {
    return word_char != nullptr && word_char->MatchesPrefix(character);
  };
  size_t start_offset = 0;
  for (auto [start, stop, id] : matches) {
    const AddedToken& token = added.at(id);
    if (token.single_word) {
      bool start_space = true;
      if (start > 0) {
        size_t last = start - 1;
        while (last > 0 && (static_cast<unsigned char>(sentence[last]) & 0xC0) == 0x80) --last;
        start_space = !is_word_char(sentence.substr(last, start - last));
      }
      const bool stop_space = stop == sentence.size() ||
                              !is_word_char(sentence.substr(stop, NextUtf8(sentence, stop).length));
      if (!start_space || !stop_space) continue;
    }
    if (token.lstrip) {
      start = std::max(TrailingSpaceStart(sentence.substr(0, start)), start_offset);
    }
    if (token.rstrip) stop += LeadingSpaceLength(sentence.substr(stop));
    if (start_offset < start) {
      out->push_back({sentence.substr(start_offset, start - start_offset), -1});
    }
    out->push_back({sentence.substr(start, stop - start), id});
    start_offset = stop;
  }
  if (start_offset < sentence.size()) out->push_back({sentence.substr(start_offset), -1});
}

// Pre-tokenizes text between added tokens (the Split steps, then ByteLevel) and runs the model on
// every pre-token.
absl::Status BpeTokenizer::State::EncodeText(std::string_view text,
                                             std::vector<int32_t>* out) const {
  std::vector<std::string_view> pieces = {text};
  std::vector<std::string_view> next;
  std::vector<std::pair<size_t, size_t>> matches;
  // Isolated: every match and every gap between matches is a piece; empty ones are dropped.
  const auto isolate = [&](std::string_view piece, const Regex& regex,
                           std::vector<std::string_view>* into) -> absl::Status {
    matches.clear();
    HETPAR_RETURN_IF_ERROR(regex.FindAll(piece, &matches));
    size_t previous = 0;
    for (const auto& [start, end] : matches) {
      if (previous < start) into->push_back(piece.substr(previous, start - previous));
      if (start < end) into->push_back(piece.substr(start, end - start));
      previous = end;
    }
    if (previous < piece.size()) into->push_back(piece.substr(previous));
    return absl::OkStatus();
  };
  for (const std::unique_ptr<Regex>& split : splits) {
    next.clear();
    for (std::string_view piece : pieces) HETPAR_RETURN_IF_ERROR(isolate(piece, *split, &next));
    pieces.swap(next);
  }
  std::string word;
  for (std::string_view piece : pieces) {
    word.clear();
    if (add_prefix_space && piece.front() != ' ') word.push_back(' ');
    word.append(piece);
    if (byte_level_regex == nullptr) {
      HETPAR_RETURN_IF_ERROR(EncodeWord(word, out));
      continue;
    }
    next.clear();
    HETPAR_RETURN_IF_ERROR(isolate(word, *byte_level_regex, &next));
    for (std::string_view pre_token : next) HETPAR_RETURN_IF_ERROR(EncodeWord(pre_token, out));
  }
  return absl::OkStatus();
}

// The library's BPE::tokenize on one pre-token (given as the bytes it stands for): ignore_merges,
// one symbol per byte (unknown ones to unk_token, or dropped without one), then Word::merge_all:
// the lowest-ranked adjacent pair first, the leftmost among equals.
absl::Status BpeTokenizer::State::EncodeWord(std::string_view bytes,
                                             std::vector<int32_t>* out) const {
  if (bytes.empty()) return absl::OkStatus();
  if (ignore_merges) {
    if (auto it = byte_ids.find(View(bytes)); it != byte_ids.end()) {
      out->push_back(it->second);
      return absl::OkStatus();
    }
  }
  struct Symbol {
    int32_t id;
    int32_t prev;
    int32_t next;
    int32_t length;  // 0 once merged into its left neighbour
  };
  std::vector<Symbol> symbols;
  symbols.reserve(bytes.size());
  const auto add = [&](int32_t id, int32_t length) {
    const auto index = static_cast<int32_t>(symbols.size());
    if (!symbols.empty()) symbols.back().next = index;
    symbols.push_back({id, index - 1, -1, length});
  };
  int32_t unk_length = 0;  // bytes of the pending unk symbol; 0 for none
  for (unsigned char byte : bytes) {
    const int32_t id = byte_symbol_ids[byte];
    if (id >= 0) {
      if (unk_length > 0) add(*model_unk_id, unk_length);
      unk_length = 0;
      add(id, 1);
    } else if (unk_token.has_value()) {
      if (!model_unk_id.has_value()) {
        return absl::FailedPreconditionError(
            absl::StrCat("tokenizer ", source, ": model.unk_token '", *unk_token,
                         "' is not in model.vocab, and the text has a byte (0x", absl::Hex(byte),
                         ") the vocabulary lacks"));
      }
      if (unk_length > 0 && !fuse_unk) {
        add(*model_unk_id, unk_length);
        unk_length = 0;
      }
      ++unk_length;
    }
  }
  if (unk_length > 0) add(*model_unk_id, unk_length);

  struct QueuedMerge {
    uint32_t rank;
    int32_t position;
    int32_t id;
  };
  const auto later = [](const QueuedMerge& a, const QueuedMerge& b) {
    return a.rank != b.rank ? a.rank > b.rank : a.position > b.position;
  };
  std::priority_queue<QueuedMerge, std::vector<QueuedMerge>, decltype(later)> queue(later);
  const auto find_merge = [&](int32_t left, int32_t right) -> const MergeTarget* {
    auto it = merges.find(PairKey(left, right));
    return it == merges.end() ? nullptr : &it->second;
  };
  for (size_t i = 0; i + 1 < symbols.size(); ++i) {
    if (const MergeTarget* m = find_merge(symbols[i].id, symbols[i + 1].id)) {
      queue.push({m->rank, static_cast<int32_t>(i), m->id});
    }
  }
  while (!queue.empty()) {
    const QueuedMerge top = queue.top();
    queue.pop();
    const auto position = static_cast<size_t>(top.position);
    if (symbols[position].length == 0 || symbols[position].next < 0) continue;
    const Symbol right = symbols[static_cast<size_t>(symbols[position].next)];
    // An entry is stale when its pair has changed since it was queued.
    const MergeTarget* current = find_merge(symbols[position].id, right.id);
    if (current == nullptr || current->id != top.id) continue;
    symbols[static_cast<size_t>(symbols[position].next)].length = 0;
    symbols[position].id = top.id;
    symbols[position].length += right.length;
    symbols[position].next = right.next;
    if (right.next >= 0) symbols[static_cast<size_t>(right.next)].prev = top.position;
    const Symbol& merged = symbols[position];
    if (merged.prev >= 0) {
      if (const MergeTarget* m =
              find_merge(symbols[static_cast<size_t>(merged.prev)].id, merged.id)) {
        queue.push({m->rank, merged.prev, m->id});
      }
    }
    if (merged.next >= 0) {
      if (const MergeTarget* m =
              find_merge(merged.id, symbols[static_cast<size_t>(merged.next)].id)) {
        queue.push({m->rank, top.position, m->id});
      }
    }
  }
  for (const Symbol& symbol : symbols) {
    if (symbol.length != 0) out->push_back(symbol.id);
  }
  return absl::OkStatus();
}

BpeTokenizer::BpeTokenizer(std::unique_ptr<State> state) : state_(std::move(state)) {}

BpeTokenizer::~BpeTokenizer() = default;

absl::StatusOr<std::unique_ptr<BpeTokenizer>> BpeTokenizer::Load(const std::string& path) {
  absl::StatusOr<std::string> json = ReadFileToString(path);
  if (!json.ok()) {
    return absl::Status(json.status().code(), absl::StrCat("tokenizer: ", json.status().message()));
  }
  const std::string config_path =
      (std::filesystem::path(path).parent_path() / "tokenizer_config.json").string();
  std::string config;
  std::error_code ec;
  if (std::filesystem::exists(config_path, ec)) {
    absl::StatusOr<std::string> read = ReadFileToString(config_path);
    if (!read.ok()) {
      return absl::Status(read.status().code(),
                          absl::StrCat("tokenizer config: ", read.status().message()));
    }
    config = *std::move(read);
  }
  return FromJson(*json, config, path);
}

absl::StatusOr<std::unique_ptr<BpeTokenizer>> BpeTokenizer::FromJson(
    std::string_view tokenizer_json, std::string_view config_json, std::string_view source) {
  auto state = std::make_unique<State>();
  state->source = std::string(source);
  HETPAR_ASSIGN_OR_RETURN(const Json root, ParseJson(tokenizer_json, "tokenizer " + state->source));
  if (!root.is_object()) return state->Invalid("the file must hold a JSON object");
  HETPAR_RETURN_IF_ERROR(state->ParseModel(root));
  HETPAR_RETURN_IF_ERROR(state->ParseAddedTokens(root));
  HETPAR_RETURN_IF_ERROR(state->ParseNormalizer(root));
  HETPAR_RETURN_IF_ERROR(state->ParsePreTokenizer(root));
  HETPAR_RETURN_IF_ERROR(state->ParseDecoder(root));
  state->BuildDecodeTables();
  if (state->vocab_size == 0) return state->Invalid("has an empty vocabulary");
  HETPAR_RETURN_IF_ERROR(state->ResolveSpecialIds(config_json));
  return std::unique_ptr<BpeTokenizer>(new BpeTokenizer(std::move(state)));
}

absl::StatusOr<std::vector<int32_t>> BpeTokenizer::Encode(std::string_view text) const {
  for (size_t i = 0; i < text.size();) {
    const Utf8Step step = NextUtf8(text, i);
    if (!step.valid) {
      return absl::InvalidArgumentError(absl::StrCat("tokenizer ", state_->source,
                                                     ": the text is not valid UTF-8 at byte ", i,
                                                     " of ", text.size()));
    }
    i += step.length;
  }
  std::vector<Segment> raw, segments;
  state_->SplitOnAddedTokens(text, state_->raw_trie, &raw);
  for (const Segment& segment : raw) {
    if (segment.id >= 0) {
      segments.push_back(segment);
    } else {
      state_->SplitOnAddedTokens(segment.text, state_->normalized_trie, &segments);
    }
  }
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 1);
  for (const Segment& segment : segments) {
    if (segment.id >= 0) {
      ids.push_back(segment.id);
    } else {
      HETPAR_RETURN_IF_ERROR(state_->EncodeText(segment.text, &ids));
    }
  }
  return ids;
}

absl::StatusOr<std::string> BpeTokenizer::Decode(const std::vector<int32_t>& ids,
                                                 bool skip_special_tokens) const {
  std::string bytes;
  for (size_t i = 0; i < ids.size(); ++i) {
    const int32_t id = ids[i];
    if (id < 0 || id >= state_->vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("token id ", id, " at position ", i, " is outside the vocabulary [0, ",
                       state_->vocab_size, ") of tokenizer ", state_->source));
    }
    const auto index = static_cast<size_t>(id);
    if (!state_->id_has_token[index]) continue;
    if (skip_special_tokens && state_->id_special[index]) continue;
    bytes += state_->id_bytes[index];
  }
  return Utf8Lossy(bytes);
}

int32_t BpeTokenizer::vocab_size() const { return state_->vocab_size; }

std::optional<int32_t> BpeTokenizer::PieceId(std::string_view piece) const {
  return state_->TokenId(piece);
}

std::string BpeTokenizer::Piece(int32_t id) const {
  if (auto it = state_->added.find(id); it != state_->added.end()) return it->second.content;
  if (id < 0 || static_cast<size_t>(id) >= state_->model_pieces.size()) return "";
  return state_->model_pieces[static_cast<size_t>(id)];
}

int32_t BpeTokenizer::unk_id() const { return state_->unk_id; }
int32_t BpeTokenizer::bos_id() const { return state_->bos_id; }
int32_t BpeTokenizer::eos_id() const { return state_->eos_id; }
int32_t BpeTokenizer::pad_id() const { return state_->pad_id; }
const std::string& BpeTokenizer::source() const { return state_->source; }

}  // namespace hetpar::data
