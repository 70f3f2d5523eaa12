// `hetpar score`: the log-probability a model gives each next token of token sequences.
//
//   hetpar score --model <dir> --tokens in.jsonl [--out out.jsonl] [--dtype float64] [--tp 2]
//
// Each input line is {"tokens": [ids...]} (n >= 2 ids), optionally with "images": [paths]: then
// each -1 in "tokens" stands for one image, in order, and becomes the encoder's
// (image_size / patch)^2 rows (the image resized to image_size and normalised as the data loader
// does; relative paths are relative to the input file). Each output line is
// {"logprobs": [...]}: entry i is log p(token i+1 | tokens 0..i) over the sequence with images
// expanded, n' - 1 entries; an entry whose target is an image row is null.
//
// The model is a directory OpenModelDirectory accepts (from-hf's output, a run's model/). It
// runs on CPU in `dtype` (float32 or float64; the parameters are converted from the file's
// dtype) over `tp` tensor-parallel ranks, threads of this process joined by Gloo: the logits
// stay split by vocabulary and the log-softmax is reduced over the ranks. A sequence longer than
// llm.model.seq_len is scored anyway (RoPE tables are built for the longest line).
#ifndef HETPAR_LLM_TRAINER_HF_SCORE_H_
#define HETPAR_LLM_TRAINER_HF_SCORE_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"

namespace hetpar::hf {

struct ScoreOptions {
  std::string model_dir;
  std::string tokens_path;
  std::string out_path;           // empty: standard output
  std::string dtype = "float32";  // or "float64"
  int tp = 1;
  int64_t micro_batch = 8;  // sequences per forward
};

// Errors name the input file and line (malformed JSON, a missing or non-integer "tokens", an id
// outside the vocabulary, fewer than 2 tokens, images without an encoder or not matching the -1
// markers), or the model file. Nothing is written to out_path unless every line scored.
absl::Status Score(const ScoreOptions& options);

}  // namespace hetpar::hf

#endif  // HETPAR_LLM_TRAINER_HF_SCORE_H_
