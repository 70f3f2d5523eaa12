// The models of configs/tiny.yaml, which the CPU benches time: model_bench's "tiny" case and
// plan_calibrate's fits.
#ifndef HETPAR_BENCH_TINY_MODELS_H_
#define HETPAR_BENCH_TINY_MODELS_H_

#include "hetpar/v1/run_spec.pb.h"

namespace hetpar::bench {

inline v1::EncoderModel TinyEncoder() {
  v1::EncoderModel m;
  m.set_image_size(32);
  m.set_patch(8);
  m.set_hidden(64);
  m.set_layers(2);
  m.set_heads(4);
  m.set_mlp(128);
  m.set_out_hidden(64);
  m.set_channels(3);
  return m;
}

inline v1::LlmModel TinyLlm() {
  v1::LlmModel m;
  m.set_hidden(64);
  m.set_layers(2);
  m.set_heads(4);
  m.set_kv_heads(2);
  m.set_ffn(128);
  m.set_vocab(256);
  m.set_seq_len(128);
  m.set_rope_theta(10000);
  m.set_norm_eps(1e-5);
  return m;
}

}  // namespace hetpar::bench

#endif  // HETPAR_BENCH_TINY_MODELS_H_
