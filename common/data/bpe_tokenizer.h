// A Hugging Face `tokenizer.json` with a byte-level BPE model (the Llama 3, Qwen and GPT-2
// families), encoding and decoding exactly as the `tokenizers` library and transformers'
// PreTrainedTokenizerFast do with the same file. tests/data/bpe_oracle.py is the oracle.
//
// What a file may hold (anything else is refused at load with InvalidArgument naming the file, the
// key and the value):
//   model           {"type": "BPE"}: vocab, merges as "a b" strings or ["a", "b"] pairs (rank =
//                   position), ignore_merges, unk_token / fuse_unk; dropout null or 0,
//                   byte_fallback false, continuing_subword_prefix and end_of_word_suffix null.
//   normalizer      null (or an empty Sequence). NFC and the others are refused.
//   pre_tokenizer   ByteLevel, or a Sequence of Split steps (a Regex or String pattern, behavior
//                   Isolated, invert false) ending in one ByteLevel. ByteLevel's add_prefix_space
//                   and use_regex (the GPT-2 regex) are honoured.
//   decoder         ByteLevel.
//   added_tokens    special or not; lstrip, rstrip, single_word and normalized as the library does.
//                   Each id must be the one the library assigns on load (its model.vocab id, else
//                   the next id after the model's vocabulary), else the file is refused.
//   post_processor, truncation, padding: ignored. Encode adds no bos/eos, never truncates or pads.
// Regular expressions run on PCRE2 (UTF + UCP, JIT when available) where the library uses
// Oniguruma; the few escapes that differ (\s, \w, \h, \v, \u) are rewritten to Oniguruma's
// meaning, and the ones that cannot be (\b, \B, nested classes) are refused. Both engines carry
// their own Unicode tables (PCRE2 10.42: Unicode 14), so letters added in later Unicode versions
// may still split differently.
//
// bos/eos/pad/unk come from `tokenizer_config.json` beside the file when it has the key
// (`bos_token`, `eos_token`, `pad_token`, `unk_token`: a string, an object with "content", or
// null for none); a key it lacks falls back to the first added token among well-known names (bos:
// <|begin_of_text|>, <s>, <|endoftext|>; eos: <|end_of_text|>, <|eot_id|>, </s>, <|endoftext|>,
// <|im_end|>), unk to model.unk_token; else -1. The config's added_tokens_decoder, if any, must
// repeat the file's added tokens (transformers would otherwise add or change tokens).
#ifndef HETPAR_COMMON_DATA_BPE_TOKENIZER_H_
#define HETPAR_COMMON_DATA_BPE_TOKENIZER_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace hetpar::data {

// A loaded byte-level BPE tokenizer. Immutable after creation; every method is thread-safe.
class BpeTokenizer {
 public:
  // Loads `path` (a tokenizer.json) and the tokenizer_config.json beside it, if any. NotFound
  // for a missing file; InvalidArgument for malformed JSON or anything listed above as refused.
  static absl::StatusOr<std::unique_ptr<BpeTokenizer>> Load(const std::string& path);
  // The same from the files' contents; `config_json` empty when there is no tokenizer_config.json.
  // `source` names the tokenizer.json in messages.
  static absl::StatusOr<std::unique_ptr<BpeTokenizer>> FromJson(std::string_view tokenizer_json,
                                                                std::string_view config_json,
                                                                std::string_view source);
  ~BpeTokenizer();
  BpeTokenizer(const BpeTokenizer&) = delete;
  BpeTokenizer& operator=(const BpeTokenizer&) = delete;

  // Token ids of `text` as transformers' `encode(text, add_special_tokens=False)`: added tokens
  // (special or not) are matched in the raw text first. InvalidArgument when `text` is not UTF-8.
  absl::StatusOr<std::vector<int32_t>> Encode(std::string_view text) const;
  // The text of `ids` as transformers' `decode(ids, skip_special_tokens=...)`: byte-level
  // decoding, then invalid UTF-8 replaced by U+FFFD (one per maximal invalid subpart). An id in
  // range that names no token decodes to nothing; with `skip_special_tokens` so do the added
  // tokens marked special. InvalidArgument for an id outside [0, vocab_size()).
  absl::StatusOr<std::string> Decode(const std::vector<int32_t>& ids,
                                     bool skip_special_tokens = false) const;

  // The largest id over the vocabulary and the added tokens, plus one.
  int32_t vocab_size() const;
  // The id of a token as the file spells it (byte-level: "Ġthe" for " the"; added tokens as
  // written), added tokens first; nullopt when there is none.
  std::optional<int32_t> PieceId(std::string_view piece) const;
  // The token of `id` as the file spells it (added tokens first); "" for an id with no token.
  std::string Piece(int32_t id) const;
  int32_t unk_id() const;
  int32_t bos_id() const;
  int32_t eos_id() const;
  int32_t pad_id() const;
  // The tokenizer.json path, for messages.
  const std::string& source() const;

 private:
  struct State;
  explicit BpeTokenizer(std::unique_ptr<State> state);

  std::unique_ptr<State> state_;
};

}  // namespace hetpar::data

#endif  // HETPAR_COMMON_DATA_BPE_TOKENIZER_H_
