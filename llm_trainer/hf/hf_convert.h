// Hugging Face checkpoints in and out of hetpar's parameter files.
//
//   hetpar convert from-hf --llm <dir> [--encoder <dir>] [--projector <file>] --out <dir>
//   hetpar convert to-hf --model <dir> --out <dir>
//
// A Hugging Face directory is its `config.json` plus `model.safetensors` (or the shards of
// `model.safetensors.index.json`). What maps onto what (docs/models.md, "Hugging Face"):
//
//   LLM: a Llama-architecture decoder (LlamaForCausalLM: RMSNorm, RoPE with rope_theta, GQA,
//   SwiGLU, tied or untied embeddings). HF keeps q_proj, k_proj and v_proj apart; hetpar's
//   llm.layers.<i>.attn.qkv holds them grouped by KV head (the g query heads of KV head j, then
//   its key head, then its value head). Both rotate the two halves of each head (RoPE), so no
//   row permutation is needed. A tied model's lm_head is its embedding: hetpar, which keeps
//   llm.output apart, gets a copy (and trains the two apart from then on).
//
//   Vision tower: a SigLIP vision model (SiglipVisionModel: learned position embedding, no class
//   token, pre-norm blocks with biases, final LayerNorm). Its attention-pooling head, when the
//   checkpoint has one, is not part of hetpar's encoder and is left out (said in the notes).
//   The projector (hetpar's encoder.projector.*; LLaVA's multi_modal_projector linear_1, GELU,
//   linear_2) comes from --projector when given, else it is initialised fresh from the seed.
//
// from-hf writes <out>/llm.hpar (and encoder.hpar), <out>/model.yaml (the RunSpec sections that
// name the module shapes and point init_from at the files) and copies the tokenizer files it
// finds beside the LLM (tokenizer.json, tokenizer_config.json, tokenizer.model). Every tensor is
// read, checked and converted before the first file is written: an import that fails writes
// nothing. to-hf writes <out>/llm (LlamaForCausalLM) and, when the model has an encoder,
// <out>/vision (SiglipVisionModel) and <out>/projector.safetensors (LLaVA's names).
#ifndef HETPAR_LLM_TRAINER_HF_HF_CONVERT_H_
#define HETPAR_LLM_TRAINER_HF_HF_CONVERT_H_

#include <ATen/core/Tensor.h>

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/nn/export.h"
#include "hetpar/v1/run_spec.pb.h"
#include "nlohmann/json.hpp"

namespace hetpar::hf {

using TensorMap = std::map<std::string, at::Tensor>;

// The LlmModel of a Llama `config.json` (`source` names the file in errors). Refuses what the
// model cannot represent, naming the key and its value: another architecture or model_type, a
// hidden_act other than silu, attention or MLP biases, rope scaling, a head_dim other than
// hidden_size / num_attention_heads. seq_len is `seq_len` when > 0, else
// min(max_position_embeddings, 4096). `tied` receives tie_word_embeddings.
absl::StatusOr<hetpar::v1::LlmModel> LlmModelFromHfConfig(const nlohmann::json& config,
                                                          const std::string& source,
                                                          int64_t seq_len, bool* tied);
// The config.json of a LlamaForCausalLM with `model`'s shapes (untied embeddings), dtype `dtype`.
nlohmann::json HfConfigFromLlmModel(const hetpar::v1::LlmModel& model, const std::string& dtype);

// hetpar's LLM parameters (full tensors, in the model's registration order) from a Llama
// checkpoint's tensors. Every expected tensor must be there with its shape and nothing else may
// be (rotary inv_freq buffers aside): NotFound / InvalidArgument naming the tensor and `source`.
absl::StatusOr<std::vector<nn::FullParameter>> LlmParametersFromHf(
    const TensorMap& hf, const hetpar::v1::LlmModel& model, bool tied, const std::string& source);
// The inverse: a LlamaForCausalLM's tensors from hetpar's (InvalidArgument for a missing one).
absl::StatusOr<TensorMap> HfTensorsFromLlm(const std::vector<nn::FullParameter>& params,
                                           const hetpar::v1::LlmModel& model);

// The EncoderModel of a SigLIP vision `config.json` (model_type siglip_vision_model, or a siglip
// config's vision_config). out_hidden is `out_hidden` (the LLM's hidden size).
absl::StatusOr<hetpar::v1::EncoderModel> EncoderModelFromHfConfig(const nlohmann::json& config,
                                                                  const std::string& source,
                                                                  int64_t out_hidden);
nlohmann::json HfConfigFromEncoderModel(const hetpar::v1::EncoderModel& model,
                                        const std::string& dtype);

// hetpar's vision tower parameters (encoder.*, projector excluded) from a SigLIP checkpoint's
// tensors (keys with or without the "vision_model." prefix). `notes` receives what was left out.
absl::StatusOr<std::vector<nn::FullParameter>> TowerParametersFromHf(
    const TensorMap& hf, const hetpar::v1::EncoderModel& model, const std::string& source,
    std::vector<std::string>* notes);
// The projector's parameters from LLaVA-named tensors (multi_modal_projector.linear_{1,2}.*).
absl::StatusOr<std::vector<nn::FullParameter>> ProjectorParametersFromHf(
    const TensorMap& hf, const hetpar::v1::EncoderModel& model, const std::string& source);
// A SiglipVisionModel's tensors and the projector's LLaVA-named ones from hetpar's encoder.
absl::StatusOr<TensorMap> HfTensorsFromTower(const std::vector<nn::FullParameter>& params,
                                             const hetpar::v1::EncoderModel& model);
absl::StatusOr<TensorMap> HfTensorsFromProjector(const std::vector<nn::FullParameter>& params);

struct ImportOptions {
  std::string llm_dir;      // required
  std::string encoder_dir;  // optional: a SigLIP vision model
  std::string projector;    // optional, with encoder_dir: a safetensors file of the projector
  std::string out_dir;      // required
  int64_t seq_len = 0;      // llm.model.seq_len; 0: min(max_position_embeddings, 4096)
  int64_t seed = 1234;      // seeds a fresh projector
  // With encoder_dir: LLaVA's vision_feature_layer, the tower's hidden state its projector reads
  // (1..L a layer's output, -L..-1 from the end; before post_layernorm). The tower is imported up
  // to that layer without post_layernorm (encoder.model.no_final_norm). 0: hetpar's own, the
  // last layer after post_layernorm.
  int64_t vision_feature_layer = 0;
};

struct ImportResult {
  hetpar::v1::LlmModel llm;
  std::optional<hetpar::v1::EncoderModel> encoder;
  std::vector<std::string> notes;    // what the user should know (left-out tensors, copies, ...)
  std::vector<std::string> written;  // files written, in order
};

absl::StatusOr<ImportResult> ImportFromHf(const ImportOptions& options);

// A model hetpar can load: `dir`/model.yaml (from-hf) or a run's model/ directory (the run's
// config.yaml one level up), with llm.hpar and, when present, encoder.hpar.
struct ModelDirectory {
  std::string dir;
  hetpar::v1::LlmModel llm;
  std::optional<hetpar::v1::EncoderModel> encoder;
  std::string llm_path;
  std::string encoder_path;  // empty without an encoder
};
absl::StatusOr<ModelDirectory> OpenModelDirectory(const std::string& dir);

struct ExportResult {
  std::vector<std::string> notes;  // what the user should know (a tower without its final norm)
  std::vector<std::string> written;
};
// Writes <out_dir>/llm, and with an encoder <out_dir>/vision and <out_dir>/projector.safetensors.
// Tensors keep the dtype they were saved in.
absl::StatusOr<ExportResult> ExportToHf(const std::string& model_dir, const std::string& out_dir);

}  // namespace hetpar::hf

#endif  // HETPAR_LLM_TRAINER_HF_HF_CONVERT_H_
