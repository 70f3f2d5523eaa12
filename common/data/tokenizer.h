// Text tokenisation with a sentencepiece model or a Hugging Face byte-level BPE `tokenizer.json`
// (bpe_tokenizer.h), and training of a sentencepiece model.
//
// sentencepiece runs inside libhetpar_sentencepiece.so, loaded on first use (see
// sentencepiece_bridge.h for why): from $HETPAR_SENTENCEPIECE_MODULE when set, else from the
// build tree, else from the directory of the running executable.
//
// Models trained here reserve fixed ids: 0 <unk>, 1 <s> (bos), 2 </s> (eos), 3 <pad>, then the
// user-defined symbols in the order given (the synthetic set's `<image>` is id 4), then the
// learned pieces. Training is single-threaded over the sentences in the order given and samples
// nothing, so the same sentences and options give a byte-identical model.
#ifndef HETPAR_COMMON_DATA_TOKENIZER_H_
#define HETPAR_COMMON_DATA_TOKENIZER_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"

struct HetparSpmApi;
struct HetparSpmProcessor;

namespace hetpar::data {

class BpeTokenizer;

// A loaded sentencepiece model or byte-level BPE tokenizer.json. Immutable after creation; every
// method is thread-safe.
class Tokenizer {
 public:
  // Loads a `.model` file, or a path ending in `.json` as a Hugging Face tokenizer.json (with the
  // tokenizer_config.json beside it; see bpe_tokenizer.h for what is supported and where the
  // bos/eos/pad/unk ids come from). NotFound for a missing file, InvalidArgument for one that is
  // not a sentencepiece model, or a tokenizer.json that hetpar cannot reproduce exactly.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> Load(const std::string& path);
  // Loads a serialized model; `source` names it in error messages.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromSerialized(const std::string& model,
                                                                   std::string_view source);
  ~Tokenizer();
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  // Piece ids of `text` (no bos/eos added). Characters outside the model map to unk_id().
  // tokenizer.json: transformers' encode(text, add_special_tokens=False), exactly; added tokens
  // (bos, <image>, ...) written in the text become their ids.
  absl::StatusOr<std::vector<int32_t>> Encode(std::string_view text) const;
  // The text of `ids`; control ids (bos, eos, pad) decode to nothing.
  // tokenizer.json: transformers' decode(ids, skip_special_tokens=False), exactly: special tokens
  // decode to their text ("<|eot_id|>"), not to nothing.
  absl::StatusOr<std::string> Decode(const std::vector<int32_t>& ids) const;

  // Number of pieces; every id is in [0, vocab_size()). tokenizer.json: the largest id over the
  // vocabulary and the added tokens, plus one.
  int32_t vocab_size() const;
  // The id of a piece (e.g. "<image>" or "▁red"), or nullopt when the model has none.
  // tokenizer.json: pieces are byte-level ("Ġred" for " red").
  std::optional<int32_t> PieceId(std::string_view piece) const;
  // The piece text of `id` (word starts carry U+2581 "▁"; tokenizer.json: as PieceId).
  std::string Piece(int32_t id) const;
  int32_t unk_id() const { return unk_id_; }
  int32_t bos_id() const { return bos_id_; }
  int32_t eos_id() const { return eos_id_; }
  int32_t pad_id() const { return pad_id_; }
  // Where the model came from (a path), for messages.
  const std::string& source() const { return source_; }

 private:
  Tokenizer(const HetparSpmApi* api, HetparSpmProcessor* processor, std::string source);
  explicit Tokenizer(std::unique_ptr<BpeTokenizer> bpe);

  const HetparSpmApi* api_ = nullptr;
  HetparSpmProcessor* processor_ = nullptr;  // owned; destroyed through api_
  std::unique_ptr<BpeTokenizer> bpe_;        // set for a tokenizer.json; then api_ is null
  std::string source_;
  std::vector<std::string> pieces_;  // id -> piece
  std::unordered_map<std::string, int32_t> piece_ids_;
  int32_t unk_id_ = 0;
  int32_t bos_id_ = -1;
  int32_t eos_id_ = -1;
  int32_t pad_id_ = -1;
};

struct TokenizerTrainOptions {
  // The largest vocabulary wanted (it must fit llm.model.vocab). The trained model has at most
  // this many pieces; fewer when the sentences do not support more.
  int32_t vocab_size = 256;
  // Pieces that are always one token and never split or merged, e.g. "<image>".
  std::vector<std::string> user_symbols;
  // "bpe" or "unigram".
  std::string model_type = "bpe";
};

// Trains a sentencepiece model on `sentences`; returns the serialized model (the bytes of a
// `.model` file). InvalidArgument when the options cannot work (vocab too small for the
// characters and reserved pieces), naming the value and the minimum.
absl::StatusOr<std::string> TrainTokenizer(const std::vector<std::string>& sentences,
                                           const TokenizerTrainOptions& options);

}  // namespace hetpar::data

#endif  // HETPAR_COMMON_DATA_TOKENIZER_H_
