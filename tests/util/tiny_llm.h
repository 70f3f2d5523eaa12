// The tiny decoder the model tests share: 32 wide, 2 layers, 8 query heads over 4 key/value
// heads (GQA), a 48-wide SwiGLU, 24 positions. Small enough for float64 on 2 cores.
#ifndef HETPAR_TESTS_UTIL_TINY_LLM_H_
#define HETPAR_TESTS_UTIL_TINY_LLM_H_

#include <cstdint>

#include "hetpar/v1/run_spec.pb.h"

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

}  // namespace hetpar::testing

#endif  // HETPAR_TESTS_UTIL_TINY_LLM_H_
