// The tiny decoder the model tests share, and its samples: 32 wide, 2 layers, 8 query heads over 4
// key/value heads (GQA), a 48-wide SwiGLU, 24 positions. Small enough for float64 on 2 cores.
#ifndef HETPAR_TESTS_UTIL_TINY_LLM_H_
#define HETPAR_TESTS_UTIL_TINY_LLM_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "hetpar/v1/run_spec.pb.h"
#include "llm_trainer/language_model.h"

namespace hetpar::testing {

inline constexpr int64_t kTinyLlmHidden = 32;

inline v1::LlmModel TinyLlm(int64_t vocab) {
  v1::LlmModel m;
  m.set_hidden(kTinyLlmHidden);
  m.set_layers(2);
  m.set_heads(8);
  m.set_kv_heads(4);
  m.set_ffn(48);
  m.set_vocab(vocab);
  m.set_seq_len(24);
  m.set_rope_theta(10000);
  m.set_norm_eps(1e-5);
  return m;
}

// TinyLlm with 4 query heads over 2 key/value heads: head_dim 8, the least CUDA's flash kernels
// take (TinyLlm's head_dim 4 sends attention to the per-run path).
inline v1::LlmModel TinyLlmForFlash(int64_t vocab) {
  v1::LlmModel m = TinyLlm(vocab);
  m.set_heads(4);
  m.set_kv_heads(2);
  return m;
}

// A sample of `tokens` whose labels are the next tokens; the image placeholders at
// `image_positions` and the last position carry no loss.
inline llm::LlmSample LabeledSample(std::string id, std::vector<int64_t> tokens,
                                    std::vector<int64_t> image_positions = {}) {
  llm::LlmSample s;
  s.id = std::move(id);
  s.tokens = std::move(tokens);
  const size_t n = s.tokens.size();
  s.labels.assign(n, 0);
  s.loss_mask.assign(n, 1);
  for (size_t i = 0; i + 1 < n; ++i) s.labels[i] = s.tokens[i + 1];
  s.loss_mask[n - 1] = 0;
  for (int64_t p : image_positions) s.loss_mask[p] = 0;
  s.image_positions = std::move(image_positions);
  s.image_rows = static_cast<int64_t>(s.image_positions.size());
  return s;
}

// A LabeledSample of `length` tokens below vocab - 1, drawn from `salt`.
inline llm::LlmSample TinyLlmSample(int64_t length, int64_t salt, int64_t vocab,
                                    std::vector<int64_t> image_positions = {}) {
  std::vector<int64_t> tokens;
  for (int64_t i = 0; i < length; ++i) tokens.push_back((i * 7 + salt * 13 + 3) % (vocab - 1));
  return LabeledSample("s" + std::to_string(salt), std::move(tokens), std::move(image_positions));
}

}  // namespace hetpar::testing

#endif  // HETPAR_TESTS_UTIL_TINY_LLM_H_
