#include "llm_trainer/hf/hf_convert.h"

#include <ATen/ATen.h>
#include <stdlib.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/atomic_file.h"
#include "common/config/config.h"
#include "common/data/tokenizer.h"
#include "common/errno_status.h"
#include "common/json_depth.h"
#include "common/nn/safetensors.h"
#include "common/nn/torch_status.h"
#include "common/status.h"
#include "encoder_service/encoder.h"

namespace hetpar::hf {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr int64_t kDefaultMaxSeqLen = 4096;

std::string Key(const std::string& source, const std::string& key) {
  return absl::StrCat(source, ": ", key);
}

absl::StatusOr<int64_t> IntAt(const json& config, const std::string& key,
                              const std::string& source) {
  auto it = config.find(key);
  if (it == config.end() || it->is_null()) {
    return absl::InvalidArgumentError(absl::StrCat(Key(source, key), " is missing"));
  }
  if (!it->is_number_integer() || it->get<int64_t>() < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(Key(source, key), "=", it->dump(), " is not a positive integer"));
  }
  return it->get<int64_t>();
}

absl::StatusOr<double> DoubleAt(const json& config, const std::string& key,
                                const std::string& source, double fallback) {
  auto it = config.find(key);
  if (it == config.end() || it->is_null()) return fallback;
  if (!it->is_number() || !(it->get<double>() > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat(Key(source, key), "=", it->dump(), " is not a positive number"));
  }
  return it->get<double>();
}

std::string StringAt(const json& config, const std::string& key, const std::string& fallback) {
  auto it = config.find(key);
  return it != config.end() && it->is_string() ? it->get<std::string>() : fallback;
}

bool TrueAt(const json& config, const std::string& key, bool fallback) {
  auto it = config.find(key);
  return it != config.end() && it->is_boolean() ? it->get<bool>() : fallback;
}

absl::Status Refuse(const std::string& source, const std::string& key, const json& value,
                    const std::string& why) {
  return absl::InvalidArgumentError(absl::StrCat(Key(source, key), "=", value.dump(), ": ", why));
}

absl::StatusOr<json> ReadJsonFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  bool too_deep = false;
  json parsed = ParseJsonWithinDepth<json>(&too_deep, in);
  if (parsed.is_discarded() || !parsed.is_object() || too_deep) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, " is not a JSON object", JsonDepthNote(too_deep)));
  }
  return parsed;
}

std::string ShapeText(at::IntArrayRef shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// Takes `name` out of `hf`: NotFound when absent, InvalidArgument when its shape is not `shape`.
class TensorSource {
 public:
  TensorSource(const TensorMap& hf, std::string source) : hf_(hf), source_(std::move(source)) {}

  absl::StatusOr<at::Tensor> Take(const std::string& name, std::vector<int64_t> shape) {
    auto it = hf_.find(name);
    if (it == hf_.end()) {
      return absl::NotFoundError(absl::StrCat(
          source_, ": tensor '", name, "' is missing (expected shape ", ShapeText(shape), ")"));
    }
    if (!at::isFloatingType(it->second.scalar_type())) {
      return absl::InvalidArgumentError(absl::StrCat(source_, ": tensor '", name, "' holds ",
                                                     c10::toString(it->second.scalar_type()),
                                                     " values; a weight is floating-point"));
    }
    if (it->second.sizes() != at::IntArrayRef(shape)) {
      return absl::InvalidArgumentError(absl::StrCat(source_, ": tensor '", name, "' has shape ",
                                                     ShapeText(it->second.sizes()), ", expected ",
                                                     ShapeText(shape)));
    }
    taken_.insert(name);
    return it->second;
  }
  bool Has(const std::string& name) const { return hf_.count(name) > 0; }
  void Skip(const std::string& name) { taken_.insert(name); }

  // InvalidArgument naming the tensors not taken (besides those `ignore` accepts).
  template <typename Ignore>
  absl::Status CheckAllTaken(Ignore ignore) const {
    std::vector<std::string> left;
    for (const auto& [name, tensor] : hf_) {
      if (taken_.count(name) == 0 && !ignore(name)) left.push_back(name);
    }
    if (left.empty()) return absl::OkStatus();
    if (left.size() > 8) {
      left.resize(8);
      left.push_back("...");
    }
    return absl::InvalidArgumentError(absl::StrCat(
        source_, ": unexpected tensors the model has no place for: ", absl::StrJoin(left, ", ")));
  }

 private:
  const TensorMap& hf_;
  std::string source_;
  std::set<std::string> taken_;
};

// The HF dtype name of a tensor dtype.
std::string HfDtypeName(at::ScalarType dtype) {
  switch (dtype) {
    case at::kDouble:
      return "float64";
    case at::kBFloat16:
      return "bfloat16";
    case at::kHalf:
      return "float16";
    default:
      return "float32";
  }
}

absl::StatusOr<const nn::FullParameter*> Find(const std::vector<nn::FullParameter>& params,
                                              const std::string& name) {
  for (const auto& p : params) {
    if (p.name == name) return &p;
  }
  return absl::InvalidArgumentError(absl::StrCat("the model has no parameter '", name, "'"));
}

absl::Status WriteJson(const std::string& path, const json& value) {
  return WriteFileAtomically(path, value.dump(2) + "\n");
}

absl::StatusOr<std::vector<nn::SafetensorsTensor>> ToList(const TensorMap& tensors) {
  std::vector<nn::SafetensorsTensor> out;
  out.reserve(tensors.size());
  for (const auto& [name, tensor] : tensors) out.push_back({name, tensor});
  return out;
}

std::string LlmModelYaml(const hetpar::v1::LlmModel& m) {
  return absl::StrCat("  model:\n    hidden: ", m.hidden(), "\n    layers: ", m.layers(),
                      "\n    heads: ", m.heads(), "\n    kv_heads: ", m.kv_heads(),
                      "\n    ffn: ", m.ffn(), "\n    vocab: ", m.vocab(),
                      "\n    seq_len: ", m.seq_len(),
                      "\n    rope_theta: ", config::FormatDouble(m.rope_theta()),
                      "\n    norm_eps: ", config::FormatDouble(m.norm_eps()), "\n");
}

std::string EncoderModelYaml(const hetpar::v1::EncoderModel& m) {
  return absl::StrCat("  model:\n    image_size: ", m.image_size(), "\n    patch: ", m.patch(),
                      "\n    hidden: ", m.hidden(), "\n    layers: ", m.layers(),
                      "\n    heads: ", m.heads(), "\n    mlp: ", m.mlp(),
                      "\n    out_hidden: ", m.out_hidden(), "\n    channels: ", m.channels(),
                      "\n    activation: ", m.activation(),
                      "\n    norm_eps: ", config::FormatDouble(m.norm_eps()), "\n",
                      m.no_final_norm() ? "    no_final_norm: true\n" : "");
}

}  // namespace

absl::StatusOr<hetpar::v1::LlmModel> LlmModelFromHfConfig(const json& config,
                                                          const std::string& source,
                                                          int64_t seq_len, bool* tied) {
  const std::string model_type = StringAt(config, "model_type", "");
  if (model_type != "llama") {
    return Refuse(source, "model_type", config.value("model_type", json()),
                  "only Llama-architecture decoders (model_type \"llama\") can be imported");
  }
  if (auto it = config.find("architectures"); it != config.end() && it->is_array()) {
    for (const json& a : *it) {
      if (a != "LlamaForCausalLM" && a != "LlamaModel") {
        return Refuse(source, "architectures", *it, "expected LlamaForCausalLM");
      }
    }
  }
  if (const std::string act = StringAt(config, "hidden_act", "silu"); act != "silu") {
    return Refuse(source, "hidden_act", act, "hetpar's MLP is SwiGLU (silu)");
  }
  for (const char* key : {"attention_bias", "mlp_bias"}) {
    if (TrueAt(config, key, false)) return Refuse(source, key, true, "hetpar's LLM has no biases");
  }
  if (auto it = config.find("rope_scaling"); it != config.end() && !it->is_null()) {
    return Refuse(source, "rope_scaling", *it, "RoPE scaling is not implemented");
  }
  double rope_theta = 10000.0;
  HETPAR_ASSIGN_OR_RETURN(rope_theta, DoubleAt(config, "rope_theta", source, rope_theta));
  if (auto it = config.find("rope_parameters"); it != config.end() && !it->is_null()) {
    if (!it->is_object()) return Refuse(source, "rope_parameters", *it, "expected an object");
    const std::string type = StringAt(*it, "rope_type", StringAt(*it, "type", "default"));
    if (type != "default") {
      return Refuse(source, "rope_parameters.rope_type", type,
                    "only the default RoPE is implemented (no scaling)");
    }
    HETPAR_ASSIGN_OR_RETURN(rope_theta,
                            DoubleAt(*it, "rope_theta", source + ": rope_parameters", rope_theta));
  }
  hetpar::v1::LlmModel m;
  HETPAR_ASSIGN_OR_RETURN(int64_t hidden, IntAt(config, "hidden_size", source));
  HETPAR_ASSIGN_OR_RETURN(int64_t layers, IntAt(config, "num_hidden_layers", source));
  HETPAR_ASSIGN_OR_RETURN(int64_t heads, IntAt(config, "num_attention_heads", source));
  int64_t kv_heads = heads;
  if (config.contains("num_key_value_heads") && !config["num_key_value_heads"].is_null()) {
    HETPAR_ASSIGN_OR_RETURN(kv_heads, IntAt(config, "num_key_value_heads", source));
  }
  HETPAR_ASSIGN_OR_RETURN(int64_t ffn, IntAt(config, "intermediate_size", source));
  HETPAR_ASSIGN_OR_RETURN(int64_t vocab, IntAt(config, "vocab_size", source));
  int64_t max_positions = kDefaultMaxSeqLen;
  if (config.contains("max_position_embeddings")) {
    HETPAR_ASSIGN_OR_RETURN(max_positions, IntAt(config, "max_position_embeddings", source));
  }
  if (hidden % heads != 0) {
    return Refuse(source, "num_attention_heads", heads,
                  absl::StrCat("does not divide hidden_size=", hidden));
  }
  if (heads % kv_heads != 0) {
    return Refuse(source, "num_key_value_heads", kv_heads,
                  absl::StrCat("does not divide num_attention_heads=", heads));
  }
  if (auto it = config.find("head_dim");
      it != config.end() && !it->is_null() && *it != json(hidden / heads)) {
    return Refuse(
        source, "head_dim", *it,
        absl::StrCat("hetpar's head size is hidden_size / num_attention_heads = ", hidden / heads));
  }
  double eps = 1e-6;
  HETPAR_ASSIGN_OR_RETURN(eps, DoubleAt(config, "rms_norm_eps", source, eps));
  m.set_hidden(hidden);
  m.set_layers(layers);
  m.set_heads(heads);
  m.set_kv_heads(kv_heads);
  m.set_ffn(ffn);
  m.set_vocab(vocab);
  m.set_seq_len(seq_len > 0 ? seq_len : std::min(max_positions, kDefaultMaxSeqLen));
  m.set_rope_theta(rope_theta);
  m.set_norm_eps(eps);
  if (tied != nullptr) *tied = TrueAt(config, "tie_word_embeddings", false);
  return m;
}

json HfConfigFromLlmModel(const hetpar::v1::LlmModel& m, const std::string& dtype) {
  return json{{"architectures", {"LlamaForCausalLM"}},
              {"model_type", "llama"},
              {"hidden_size", m.hidden()},
              {"intermediate_size", m.ffn()},
              {"num_hidden_layers", m.layers()},
              {"num_attention_heads", m.heads()},
              {"num_key_value_heads", m.kv_heads()},
              {"head_dim", m.hidden() / m.heads()},
              {"vocab_size", m.vocab()},
              {"max_position_embeddings", m.seq_len()},
              {"rope_theta", m.rope_theta()},
              {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", m.rope_theta()}}},
              {"rms_norm_eps", m.norm_eps()},
              {"hidden_act", "silu"},
              {"attention_bias", false},
              {"attention_dropout", 0.0},
              {"mlp_bias", false},
              {"tie_word_embeddings", false},
              {"initializer_range", 0.02},
              {"use_cache", true},
              {"dtype", dtype},
              {"torch_dtype", dtype}};
}

absl::StatusOr<std::vector<nn::FullParameter>> LlmParametersFromHf(const TensorMap& hf,
                                                                   const hetpar::v1::LlmModel& m,
                                                                   bool tied,
                                                                   const std::string& source) {
  TensorSource in(hf, source);
  const int64_t hidden = m.hidden();
  const int64_t d = hidden / m.heads();
  const int64_t g = m.heads() / m.kv_heads();
  std::vector<nn::FullParameter> out;
  HETPAR_ASSIGN_OR_RETURN(at::Tensor embed,
                          in.Take("model.embed_tokens.weight", {m.vocab(), hidden}));
  out.push_back({"llm.embed.weight", embed});
  for (int64_t i = 0; i < m.layers(); ++i) {
    const std::string hfp = absl::StrCat("model.layers.", i, ".");
    const std::string hp = absl::StrCat("llm.layers.", i, ".");
    HETPAR_ASSIGN_OR_RETURN(at::Tensor attn_norm,
                            in.Take(hfp + "input_layernorm.weight", {hidden}));
    HETPAR_ASSIGN_OR_RETURN(at::Tensor q,
                            in.Take(hfp + "self_attn.q_proj.weight", {m.heads() * d, hidden}));
    HETPAR_ASSIGN_OR_RETURN(at::Tensor k,
                            in.Take(hfp + "self_attn.k_proj.weight", {m.kv_heads() * d, hidden}));
    HETPAR_ASSIGN_OR_RETURN(at::Tensor v,
                            in.Take(hfp + "self_attn.v_proj.weight", {m.kv_heads() * d, hidden}));
    HETPAR_ASSIGN_OR_RETURN(at::Tensor o,
                            in.Take(hfp + "self_attn.o_proj.weight", {hidden, m.heads() * d}));
    HETPAR_ASSIGN_OR_RETURN(at::Tensor mlp_norm,
                            in.Take(hfp + "post_attention_layernorm.weight", {hidden}));
    HETPAR_ASSIGN_OR_RETURN(at::Tensor gate,
                            in.Take(hfp + "mlp.gate_proj.weight", {m.ffn(), hidden}));
    HETPAR_ASSIGN_OR_RETURN(at::Tensor up, in.Take(hfp + "mlp.up_proj.weight", {m.ffn(), hidden}));
    HETPAR_ASSIGN_OR_RETURN(at::Tensor down,
                            in.Take(hfp + "mlp.down_proj.weight", {hidden, m.ffn()}));
    // [kv, g*d, hidden] ++ [kv, d, hidden] ++ [kv, d, hidden] along dim 1: each KV head's group.
    at::Tensor qkv =
        at::cat({q.reshape({m.kv_heads(), g * d, hidden}), k.reshape({m.kv_heads(), d, hidden}),
                 v.reshape({m.kv_heads(), d, hidden})},
                1)
            .reshape({(m.heads() + 2 * m.kv_heads()) * d, hidden});
    out.push_back({hp + "attn_norm.weight", attn_norm});
    out.push_back({hp + "attn.qkv.weight", qkv});
    out.push_back({hp + "attn.proj.weight", o});
    out.push_back({hp + "mlp_norm.weight", mlp_norm});
    out.push_back({hp + "mlp.gate.weight", gate});
    out.push_back({hp + "mlp.up.weight", up});
    out.push_back({hp + "mlp.down.weight", down});
  }
  HETPAR_ASSIGN_OR_RETURN(at::Tensor norm, in.Take("model.norm.weight", {hidden}));
  out.push_back({"llm.norm.weight", norm});
  at::Tensor head;
  if (in.Has("lm_head.weight")) {
    HETPAR_ASSIGN_OR_RETURN(head, in.Take("lm_head.weight", {m.vocab(), hidden}));
    if (tied && !head.equal(embed)) {
      return absl::InvalidArgumentError(
          absl::StrCat(source,
                       ": tie_word_embeddings is true but lm_head.weight differs from "
                       "model.embed_tokens.weight"));
    }
  } else if (tied) {
    head = embed.clone();
  } else {
    return absl::NotFoundError(absl::StrCat(
        source, ": tensor 'lm_head.weight' is missing and tie_word_embeddings is false"));
  }
  out.push_back({"llm.output.weight", head});
  HETPAR_RETURN_IF_ERROR(in.CheckAllTaken(
      [](const std::string& name) { return absl::EndsWith(name, ".rotary_emb.inv_freq"); }));
  for (auto& p : out) p.tensor = p.tensor.contiguous();
  return out;
}

absl::StatusOr<TensorMap> HfTensorsFromLlm(const std::vector<nn::FullParameter>& params,
                                           const hetpar::v1::LlmModel& m) {
  const int64_t hidden = m.hidden();
  const int64_t d = hidden / m.heads();
  const int64_t g = m.heads() / m.kv_heads();
  TensorMap out;
  auto get = [&](const std::string& name) { return Find(params, name); };
  HETPAR_ASSIGN_OR_RETURN(const nn::FullParameter* embed, get("llm.embed.weight"));
  out["model.embed_tokens.weight"] = embed->tensor;
  for (int64_t i = 0; i < m.layers(); ++i) {
    const std::string hfp = absl::StrCat("model.layers.", i, ".");
    const std::string hp = absl::StrCat("llm.layers.", i, ".");
    HETPAR_ASSIGN_OR_RETURN(const nn::FullParameter* qkv, get(hp + "attn.qkv.weight"));
    at::Tensor grouped = qkv->tensor.reshape({m.kv_heads(), (g + 2) * d, hidden});
    out[hfp + "self_attn.q_proj.weight"] =
        grouped.narrow(1, 0, g * d).reshape({m.heads() * d, hidden}).contiguous();
    out[hfp + "self_attn.k_proj.weight"] =
        grouped.narrow(1, g * d, d).reshape({m.kv_heads() * d, hidden}).contiguous();
    out[hfp + "self_attn.v_proj.weight"] =
        grouped.narrow(1, (g + 1) * d, d).reshape({m.kv_heads() * d, hidden}).contiguous();
    for (const auto& [hf_name, name] : std::vector<std::pair<std::string, std::string>>{
             {"input_layernorm.weight", "attn_norm.weight"},
             {"self_attn.o_proj.weight", "attn.proj.weight"},
             {"post_attention_layernorm.weight", "mlp_norm.weight"},
             {"mlp.gate_proj.weight", "mlp.gate.weight"},
             {"mlp.up_proj.weight", "mlp.up.weight"},
             {"mlp.down_proj.weight", "mlp.down.weight"}}) {
      HETPAR_ASSIGN_OR_RETURN(const nn::FullParameter* p, get(hp + name));
      out[hfp + hf_name] = p->tensor;
    }
  }
  HETPAR_ASSIGN_OR_RETURN(const nn::FullParameter* norm, get("llm.norm.weight"));
  out["model.norm.weight"] = norm->tensor;
  HETPAR_ASSIGN_OR_RETURN(const nn::FullParameter* head, get("llm.output.weight"));
  out["lm_head.weight"] = head->tensor;
  return out;
}

absl::StatusOr<hetpar::v1::EncoderModel> EncoderModelFromHfConfig(const json& full_config,
                                                                  const std::string& source,
                                                                  int64_t out_hidden) {
  const json* config = &full_config;
  std::string where = source;
  const std::string model_type = StringAt(full_config, "model_type", "");
  if (model_type == "llava") {
    // Its tensors are named under vision_tower. beside the language model's and the
    // projector's, which this reader does not take apart.
    return Refuse(source, "model_type", full_config.value("model_type", json()),
                  "a LLaVA checkpoint holds the whole model; pass a directory of its vision tower "
                  "alone (transformers: model.vision_tower.save_pretrained(DIR), "
                  "safe_serialization=True) and its projector with --projector");
  }
  if (model_type == "siglip") {
    auto it = full_config.find("vision_config");
    if (it == full_config.end() || !it->is_object()) {
      return absl::InvalidArgumentError(absl::StrCat(Key(source, "vision_config"), " is missing"));
    }
    config = &*it;
    where = source + ": vision_config";
    if (StringAt(*config, "model_type", "siglip_vision_model") != "siglip_vision_model") {
      return Refuse(where, "model_type", config->value("model_type", json()),
                    "only SigLIP vision towers (siglip_vision_model) can be imported");
    }
  } else if (model_type != "siglip_vision_model") {
    return Refuse(source, "model_type", full_config.value("model_type", json()),
                  "only SigLIP vision towers (siglip_vision_model) can be imported");
  }
  hetpar::v1::EncoderModel m;
  HETPAR_ASSIGN_OR_RETURN(int64_t hidden, IntAt(*config, "hidden_size", where));
  HETPAR_ASSIGN_OR_RETURN(int64_t layers, IntAt(*config, "num_hidden_layers", where));
  HETPAR_ASSIGN_OR_RETURN(int64_t heads, IntAt(*config, "num_attention_heads", where));
  HETPAR_ASSIGN_OR_RETURN(int64_t mlp, IntAt(*config, "intermediate_size", where));
  HETPAR_ASSIGN_OR_RETURN(int64_t image_size, IntAt(*config, "image_size", where));
  HETPAR_ASSIGN_OR_RETURN(int64_t patch, IntAt(*config, "patch_size", where));
  int64_t channels = 3;
  if (config->contains("num_channels")) {
    HETPAR_ASSIGN_OR_RETURN(channels, IntAt(*config, "num_channels", where));
  }
  const std::string act = StringAt(*config, "hidden_act", "gelu_pytorch_tanh");
  if (act != "gelu" && act != "gelu_pytorch_tanh") {
    return Refuse(where, "hidden_act", act, "hetpar's encoder has gelu and gelu_pytorch_tanh");
  }
  const std::string activation = act == "gelu" ? "gelu" : "gelu_tanh";
  double eps = 1e-6;
  HETPAR_ASSIGN_OR_RETURN(eps, DoubleAt(*config, "layer_norm_eps", where, eps));
  if (hidden % heads != 0) {
    return Refuse(where, "num_attention_heads", heads,
                  absl::StrCat("does not divide hidden_size=", hidden));
  }
  if (image_size % patch != 0) {
    return Refuse(where, "patch_size", patch,
                  absl::StrCat("does not divide image_size=", image_size));
  }
  m.set_image_size(image_size);
  m.set_patch(patch);
  m.set_hidden(hidden);
  m.set_layers(layers);
  m.set_heads(heads);
  m.set_mlp(mlp);
  m.set_out_hidden(out_hidden);
  m.set_channels(channels);
  m.set_activation(activation);
  m.set_norm_eps(eps);
  return m;
}

json HfConfigFromEncoderModel(const hetpar::v1::EncoderModel& m, const std::string& dtype) {
  return json{{"architectures", {"SiglipVisionModel"}},
              {"model_type", "siglip_vision_model"},
              {"hidden_size", m.hidden()},
              {"intermediate_size", m.mlp()},
              {"num_hidden_layers", m.layers()},
              {"num_attention_heads", m.heads()},
              {"num_channels", m.channels()},
              {"image_size", m.image_size()},
              {"patch_size", m.patch()},
              {"hidden_act", m.activation() == "gelu_tanh" ? "gelu_pytorch_tanh" : "gelu"},
              {"layer_norm_eps", m.norm_eps()},
              {"attention_dropout", 0.0},
              {"vision_use_head", false},
              {"dtype", dtype},
              {"torch_dtype", dtype}};
}

absl::StatusOr<std::vector<nn::FullParameter>> TowerParametersFromHf(
    const TensorMap& hf_in, const hetpar::v1::EncoderModel& m, const std::string& source,
    std::vector<std::string>* notes) {
  // Keys as SiglipVisionModel saves them ("vision_model." prefix) or without it; a SiglipModel's
  // text half is not looked at.
  TensorMap hf;
  std::vector<std::string> head;
  for (const auto& [name, tensor] : hf_in) {
    std::string key = name;
    if (key.rfind("vision_model.", 0) == 0) key = key.substr(13);
    if (key.rfind("head.", 0) == 0) {
      head.push_back(name);
      continue;
    }
    hf[key] = tensor;
  }
  if (!head.empty() && notes != nullptr) {
    notes->push_back(absl::StrCat("left out the attention-pooling head (", head.size(),
                                  " tensors): hetpar's encoder feeds every patch row to the LLM"));
  }
  TensorSource in(hf, source);
  const int64_t hidden = m.hidden();
  const int64_t d = hidden / m.heads();
  const int64_t tokens = config::TokensPerImage(m);
  std::vector<nn::FullParameter> out;
  HETPAR_ASSIGN_OR_RETURN(
      at::Tensor patch_w,
      in.Take("embeddings.patch_embedding.weight", {hidden, m.channels(), m.patch(), m.patch()}));
  HETPAR_ASSIGN_OR_RETURN(at::Tensor patch_b, in.Take("embeddings.patch_embedding.bias", {hidden}));
  HETPAR_ASSIGN_OR_RETURN(at::Tensor pos,
                          in.Take("embeddings.position_embedding.weight", {tokens, hidden}));
  out.push_back({"encoder.patch_embed.weight",
                 patch_w.reshape({hidden, m.channels() * m.patch() * m.patch()})});
  out.push_back({"encoder.patch_embed.bias", patch_b});
  out.push_back({"encoder.pos_embed", pos});
  for (int64_t i = 0; i < m.layers(); ++i) {
    const std::string hfp = absl::StrCat("encoder.layers.", i, ".");
    const std::string hp = absl::StrCat("encoder.layers.", i, ".");
    HETPAR_ASSIGN_OR_RETURN(at::Tensor n1w, in.Take(hfp + "layer_norm1.weight", {hidden}));
    HETPAR_ASSIGN_OR_RETURN(at::Tensor n1b, in.Take(hfp + "layer_norm1.bias", {hidden}));
    std::vector<at::Tensor> w, b;
    for (const char* proj : {"q_proj", "k_proj", "v_proj"}) {
      const std::string p = absl::StrCat(hfp, "self_attn.", proj);
      HETPAR_ASSIGN_OR_RETURN(at::Tensor pw, in.Take(p + ".weight", {hidden, hidden}));
      HETPAR_ASSIGN_OR_RETURN(at::Tensor pb, in.Take(p + ".bias", {hidden}));
      w.push_back(pw.reshape({m.heads(), 1, d, hidden}));
      b.push_back(pb.reshape({m.heads(), 1, d}));
    }
    HETPAR_ASSIGN_OR_RETURN(at::Tensor ow,
                            in.Take(hfp + "self_attn.out_proj.weight", {hidden, hidden}));
    HETPAR_ASSIGN_OR_RETURN(at::Tensor ob, in.Take(hfp + "self_attn.out_proj.bias", {hidden}));
    HETPAR_ASSIGN_OR_RETURN(at::Tensor n2w, in.Take(hfp + "layer_norm2.weight", {hidden}));
    HETPAR_ASSIGN_OR_RETURN(at::Tensor n2b, in.Take(hfp + "layer_norm2.bias", {hidden}));
    HETPAR_ASSIGN_OR_RETURN(at::Tensor f1w, in.Take(hfp + "mlp.fc1.weight", {m.mlp(), hidden}));
    HETPAR_ASSIGN_OR_RETURN(at::Tensor f1b, in.Take(hfp + "mlp.fc1.bias", {m.mlp()}));
    HETPAR_ASSIGN_OR_RETURN(at::Tensor f2w, in.Take(hfp + "mlp.fc2.weight", {hidden, m.mlp()}));
    HETPAR_ASSIGN_OR_RETURN(at::Tensor f2b, in.Take(hfp + "mlp.fc2.bias", {hidden}));
    out.push_back({hp + "norm1.weight", n1w});
    out.push_back({hp + "norm1.bias", n1b});
    // Head h owns rows [3*d*h, 3*d*(h+1)): its q, k and v rows.
    out.push_back({hp + "attn.qkv.weight", at::cat(w, 1).reshape({3 * hidden, hidden})});
    out.push_back({hp + "attn.qkv.bias", at::cat(b, 1).reshape({3 * hidden})});
    out.push_back({hp + "attn.proj.weight", ow});
    out.push_back({hp + "attn.proj.bias", ob});
    out.push_back({hp + "norm2.weight", n2w});
    out.push_back({hp + "norm2.bias", n2b});
    out.push_back({hp + "mlp.fc1.weight", f1w});
    out.push_back({hp + "mlp.fc1.bias", f1b});
    out.push_back({hp + "mlp.fc2.weight", f2w});
    out.push_back({hp + "mlp.fc2.bias", f2b});
  }
  if (!m.no_final_norm()) {
    HETPAR_ASSIGN_OR_RETURN(at::Tensor nw, in.Take("post_layernorm.weight", {hidden}));
    HETPAR_ASSIGN_OR_RETURN(at::Tensor nb, in.Take("post_layernorm.bias", {hidden}));
    out.push_back({"encoder.norm.weight", nw});
    out.push_back({"encoder.norm.bias", nb});
  }
  // Without the final norm (a LLaVA projector's input, ImportOptions::vision_feature_layer), the
  // tower stops at its feature layer: post_layernorm and the layers after it are left out.
  const auto left_out = [&m](const std::string& name) {
    if (!m.no_final_norm()) return false;
    if (name.rfind("post_layernorm.", 0) == 0) return true;
    int64_t layer = -1;
    const std::string prefix = "encoder.layers.";
    return name.rfind(prefix, 0) == 0 &&
           absl::SimpleAtoi(
               name.substr(prefix.size(), name.find('.', prefix.size()) - prefix.size()), &layer) &&
           layer >= m.layers();
  };
  HETPAR_RETURN_IF_ERROR(in.CheckAllTaken([&left_out](const std::string& name) {
    return name.rfind("text_model.", 0) == 0 || name == "logit_scale" || name == "logit_bias" ||
           name == "embeddings.position_ids" || left_out(name);
  }));
  for (auto& p : out) p.tensor = p.tensor.contiguous();
  return out;
}

absl::StatusOr<std::vector<nn::FullParameter>> ProjectorParametersFromHf(
    const TensorMap& hf, const hetpar::v1::EncoderModel& m, const std::string& source) {
  TensorMap stripped;
  for (const auto& [name, tensor] : hf) {
    std::string key = name;
    for (const char* prefix : {"model.", ""}) {
      const std::string p = absl::StrCat(prefix, "multi_modal_projector.");
      if (key.rfind(p, 0) == 0) {
        key = key.substr(p.size());
        break;
      }
    }
    stripped[key] = tensor;
  }
  TensorSource in(stripped, source);
  const int64_t out_hidden = m.out_hidden();
  std::vector<nn::FullParameter> out;
  HETPAR_ASSIGN_OR_RETURN(at::Tensor w1, in.Take("linear_1.weight", {out_hidden, m.hidden()}));
  HETPAR_ASSIGN_OR_RETURN(at::Tensor b1, in.Take("linear_1.bias", {out_hidden}));
  HETPAR_ASSIGN_OR_RETURN(at::Tensor w2, in.Take("linear_2.weight", {out_hidden, out_hidden}));
  HETPAR_ASSIGN_OR_RETURN(at::Tensor b2, in.Take("linear_2.bias", {out_hidden}));
  HETPAR_RETURN_IF_ERROR(in.CheckAllTaken([](const std::string&) { return false; }));
  out.push_back({"encoder.projector.fc1.weight", w1.contiguous()});
  out.push_back({"encoder.projector.fc1.bias", b1.contiguous()});
  out.push_back({"encoder.projector.fc2.weight", w2.contiguous()});
  out.push_back({"encoder.projector.fc2.bias", b2.contiguous()});
  return out;
}

absl::StatusOr<TensorMap> HfTensorsFromTower(const std::vector<nn::FullParameter>& params,
                                             const hetpar::v1::EncoderModel& m) {
  const int64_t hidden = m.hidden();
  const int64_t d = hidden / m.heads();
  TensorMap out;
  auto get = [&](const std::string& name) { return Find(params, name); };
  const std::string v = "vision_model.";
  HETPAR_ASSIGN_OR_RETURN(const nn::FullParameter* pw, get("encoder.patch_embed.weight"));
  out[v + "embeddings.patch_embedding.weight"] =
      pw->tensor.reshape({hidden, m.channels(), m.patch(), m.patch()}).contiguous();
  HETPAR_ASSIGN_OR_RETURN(const nn::FullParameter* pb, get("encoder.patch_embed.bias"));
  out[v + "embeddings.patch_embedding.bias"] = pb->tensor;
  HETPAR_ASSIGN_OR_RETURN(const nn::FullParameter* pos, get("encoder.pos_embed"));
  out[v + "embeddings.position_embedding.weight"] = pos->tensor;
  for (int64_t i = 0; i < m.layers(); ++i) {
    const std::string hfp = absl::StrCat(v, "encoder.layers.", i, ".");
    const std::string hp = absl::StrCat("encoder.layers.", i, ".");
    HETPAR_ASSIGN_OR_RETURN(const nn::FullParameter* qkv_w, get(hp + "attn.qkv.weight"));
    HETPAR_ASSIGN_OR_RETURN(const nn::FullParameter* qkv_b, get(hp + "attn.qkv.bias"));
    at::Tensor w = qkv_w->tensor.reshape({m.heads(), 3, d, hidden});
    at::Tensor b = qkv_b->tensor.reshape({m.heads(), 3, d});
    const char* names[] = {"q_proj", "k_proj", "v_proj"};
    for (int64_t j = 0; j < 3; ++j) {
      const std::string p = absl::StrCat(hfp, "self_attn.", names[j]);
      out[p + ".weight"] = w.select(1, j).reshape({hidden, hidden}).contiguous();
      out[p + ".bias"] = b.select(1, j).reshape({hidden}).contiguous();
    }
    for (const auto& [hf_name, name] : std::vector<std::pair<std::string, std::string>>{
             {"layer_norm1.weight", "norm1.weight"},
             {"layer_norm1.bias", "norm1.bias"},
             {"self_attn.out_proj.weight", "attn.proj.weight"},
             {"self_attn.out_proj.bias", "attn.proj.bias"},
             {"layer_norm2.weight", "norm2.weight"},
             {"layer_norm2.bias", "norm2.bias"},
             {"mlp.fc1.weight", "mlp.fc1.weight"},
             {"mlp.fc1.bias", "mlp.fc1.bias"},
             {"mlp.fc2.weight", "mlp.fc2.weight"},
             {"mlp.fc2.bias", "mlp.fc2.bias"}}) {
      HETPAR_ASSIGN_OR_RETURN(const nn::FullParameter* p, get(hp + name));
      out[hfp + hf_name] = p->tensor;
    }
  }
  if (m.no_final_norm()) {
    // A SiglipVisionModel always has one. This one is the identity's affine part (weight 1, bias
    // 0), which a LLaVA model reading the last layer's states (vision_feature_layer -1) never
    // applies.
    out[v + "post_layernorm.weight"] = at::ones({hidden}, pos->tensor.options());
    out[v + "post_layernorm.bias"] = at::zeros({hidden}, pos->tensor.options());
    return out;
  }
  HETPAR_ASSIGN_OR_RETURN(const nn::FullParameter* nw, get("encoder.norm.weight"));
  HETPAR_ASSIGN_OR_RETURN(const nn::FullParameter* nb, get("encoder.norm.bias"));
  out[v + "post_layernorm.weight"] = nw->tensor;
  out[v + "post_layernorm.bias"] = nb->tensor;
  return out;
}

absl::StatusOr<TensorMap> HfTensorsFromProjector(const std::vector<nn::FullParameter>& params) {
  TensorMap out;
  for (const auto& [hf_name, name] :
       std::vector<std::pair<std::string, std::string>>{{"linear_1.weight", "fc1.weight"},
                                                        {"linear_1.bias", "fc1.bias"},
                                                        {"linear_2.weight", "fc2.weight"},
                                                        {"linear_2.bias", "fc2.bias"}}) {
    HETPAR_ASSIGN_OR_RETURN(const nn::FullParameter* p, Find(params, "encoder.projector." + name));
    out["multi_modal_projector." + hf_name] = p->tensor;
  }
  return out;
}

absl::StatusOr<ImportResult> ImportFromHf(const ImportOptions& options) {
  if (options.llm_dir.empty()) return absl::InvalidArgumentError("--llm is required");
  if (options.out_dir.empty()) return absl::InvalidArgumentError("--out is required");
  if (!options.projector.empty() && options.encoder_dir.empty()) {
    return absl::InvalidArgumentError("--projector needs --encoder (the tower it projects)");
  }
  if (options.vision_feature_layer != 0 && options.encoder_dir.empty()) {
    return absl::InvalidArgumentError(
        "--vision-feature-layer needs --encoder (the tower whose layer it names)");
  }
  ImportResult result;
  // Everything is read and converted first: nothing is written unless all of it succeeds.
  const std::string llm_config_path = options.llm_dir + "/config.json";
  HETPAR_ASSIGN_OR_RETURN(json llm_config, ReadJsonFile(llm_config_path));
  bool tied = false;
  HETPAR_ASSIGN_OR_RETURN(
      result.llm, LlmModelFromHfConfig(llm_config, llm_config_path, options.seq_len, &tied));
  HETPAR_ASSIGN_OR_RETURN(TensorMap llm_tensors, nn::ReadSafetensorsDirectory(options.llm_dir));
  HETPAR_ASSIGN_OR_RETURN(std::vector<nn::FullParameter> llm_params,
                          LlmParametersFromHf(llm_tensors, result.llm, tied, options.llm_dir));
  llm_tensors.clear();
  if (tied) {
    result.notes.push_back(
        "tie_word_embeddings: llm.output.weight starts as a copy of llm.embed.weight and trains "
        "apart from it");
  }
  std::vector<nn::FullParameter> encoder_params;
  if (!options.encoder_dir.empty()) {
    const std::string enc_config_path = options.encoder_dir + "/config.json";
    HETPAR_ASSIGN_OR_RETURN(json enc_config, ReadJsonFile(enc_config_path));
    HETPAR_ASSIGN_OR_RETURN(
        hetpar::v1::EncoderModel encoder,
        EncoderModelFromHfConfig(enc_config, enc_config_path, result.llm.hidden()));
    const int64_t tower_layers = encoder.layers();
    if (options.vision_feature_layer != 0) {
      // LLaVA's index into the tower's hidden states: 0 the embeddings, 1..L each layer's output
      // (before post_layernorm), negative from the end (-1 the last layer).
      const int64_t k = options.vision_feature_layer;
      const int64_t layers = k > 0 ? k : tower_layers + 1 + k;
      if (layers < 1 || layers > tower_layers) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--vision-feature-layer=", k, " is out of range: ", enc_config_path, " has ",
            tower_layers,
            " layers (num_hidden_layers), so LLaVA's vision_feature_layer names "
            "one of them as 1..",
            tower_layers, " or -", tower_layers, "..-1 (0, the embeddings, feeds no layer)"));
      }
      encoder.set_layers(layers);
      encoder.set_no_final_norm(true);
    }
    HETPAR_ASSIGN_OR_RETURN(TensorMap enc_tensors,
                            nn::ReadSafetensorsDirectory(options.encoder_dir));
    HETPAR_ASSIGN_OR_RETURN(
        encoder_params,
        TowerParametersFromHf(enc_tensors, encoder, options.encoder_dir, &result.notes));
    std::vector<nn::FullParameter> projector;
    if (!options.projector.empty()) {
      HETPAR_ASSIGN_OR_RETURN(nn::SafetensorsFile file, nn::ReadSafetensors(options.projector));
      TensorMap proj;
      for (auto& t : file.tensors) proj[t.name] = t.tensor;
      HETPAR_ASSIGN_OR_RETURN(projector,
                              ProjectorParametersFromHf(proj, encoder, options.projector));
      if (options.vision_feature_layer == 0) {
        result.notes.push_back(
            "the projector is imported as weights only: hetpar feeds it the tower's last layer "
            "after post_layernorm, while LLaVA feeds its projector an earlier layer's states "
            "(vision_feature_layer, -2 by default) without post_layernorm; pass LLaVA's "
            "vision_feature_layer as --vision-feature-layer to feed it the same, or train it "
            "(encoder.frozen with encoder.train_projector trains it alone) before relying on its "
            "outputs");
      }
    } else {
      // A fresh projector from hetpar's seeded initialisation (LLaVA's first stage trains it).
      encoder::EncoderOptions init;
      init.dtype = encoder_params.front().tensor.scalar_type();
      init.seed = options.seed;
      auto comm = nn::Communicator::CreateSingle();
      HETPAR_ASSIGN_OR_RETURN(auto fresh, encoder::VisionEncoder::Create(encoder, init, *comm));
      for (const auto& p : fresh->parameters().parameters()) {
        if (p.name.rfind("encoder.projector.", 0) == 0) {
          projector.push_back({p.name, p.tensor.detach().clone()});
        }
      }
      result.notes.push_back(
          absl::StrCat("the projector (encoder.projector.*) is initialised "
                       "fresh from seed ",
                       options.seed, "; pass --projector to import one"));
    }
    for (auto& p : projector) encoder_params.push_back(std::move(p));
    if (options.vision_feature_layer != 0) {
      const int64_t dropped = tower_layers - encoder.layers();
      result.notes.push_back(absl::StrCat(
          "--vision-feature-layer ", options.vision_feature_layer,
          ": the projector reads the output of layer ", encoder.layers(), " of ", tower_layers,
          " without post_layernorm, as LLaVA's with that vision_feature_layer and "
          "vision_feature_select_strategy 'full' (every patch row); left out post_layernorm",
          dropped > 0
              ? absl::StrCat(" and the last ", dropped, " layer", dropped > 1 ? "s" : "",
                             " (tensors encoder.layers.", encoder.layers(), " to ",
                             tower_layers - 1, "), so encoder.model.layers: ", encoder.layers())
              : "",
          "; encoder.model.no_final_norm: true"));
    }
    result.encoder = encoder;
  }

  // Write.
  std::error_code ec;
  fs::create_directories(options.out_dir, ec);
  if (ec) {
    return absl::PermissionDeniedError(
        absl::StrCat("cannot create ", options.out_dir, ": ", ec.message()));
  }
  // Every file is written into a staging directory beside them first, and renamed into place
  // once all are: a failed write (a full disk, a tokenizer that cannot be copied) leaves the
  // directory as it was.
  std::string staging = (fs::path(options.out_dir) / ".hetpar-import.XXXXXX").string();
  if (::mkdtemp(staging.data()) == nullptr) {
    return ErrnoStatus(errno, absl::StrCat("creating a staging directory in ", options.out_dir));
  }
  struct RemoveStaging {
    ~RemoveStaging() {
      std::error_code ignored;
      fs::remove_all(path, ignored);
    }
    std::string path;
  } remove_staging{staging};
  std::vector<std::string> staged;  // file names, renamed into out_dir at the end
  const std::string llm_path = staging + "/llm.hpar";
  HETPAR_RETURN_IF_ERROR(nn::WriteFullParameters(llm_params, llm_path));
  staged.push_back("llm.hpar");
  std::string yaml = absl::StrCat(
      "# hetpar convert from-hf --llm ", options.llm_dir,
      options.encoder_dir.empty() ? "" : " --encoder " + options.encoder_dir,
      "\n# The RunSpec sections of the imported model: copy them into a run's config (init_from "
      "and\n# tokenizer are absolute paths, so they hold wherever that config lives).\n");
  const std::string abs_out = fs::absolute(options.out_dir).lexically_normal().string();
  absl::StrAppend(&yaml, "llm:\n", LlmModelYaml(result.llm), "  init_from: ", abs_out,
                  "/llm.hpar\n");
  if (result.encoder.has_value()) {
    HETPAR_RETURN_IF_ERROR(nn::WriteFullParameters(encoder_params, staging + "/encoder.hpar"));
    staged.push_back("encoder.hpar");
    absl::StrAppend(&yaml, "encoder:\n", EncoderModelYaml(*result.encoder),
                    "  init_from: ", abs_out, "/encoder.hpar\n");
  }
  std::string tokenizer;
  // generation_config.json holds the bos/eos ids generation stops on; to-hf writes it back.
  for (const char* name :
       {"tokenizer.json", "tokenizer_config.json", "tokenizer.model", "generation_config.json"}) {
    const fs::path from = fs::path(options.llm_dir) / name;
    if (!fs::exists(from)) continue;
    const fs::path to = fs::path(staging) / name;
    fs::copy_file(from, to, fs::copy_options::overwrite_existing, ec);
    if (ec) {
      return absl::PermissionDeniedError(absl::StrCat("cannot copy ", from.string(), " into ",
                                                      options.out_dir, ": ", ec.message()));
    }
    staged.push_back(name);
    if (tokenizer.empty() && absl::StartsWith(name, "tokenizer.")) tokenizer = name;
  }
  if (!tokenizer.empty()) {
    absl::StrAppend(&yaml, "data:\n  tokenizer: ", abs_out, "/", tokenizer, "\n");
  }
  HETPAR_RETURN_IF_ERROR(WriteFileAtomically(staging + "/model.yaml", yaml));
  staged.push_back("model.yaml");
  for (const std::string& name : staged) {
    const fs::path to = fs::path(options.out_dir) / name;
    fs::rename(fs::path(staging) / name, to, ec);
    if (ec) {
      return absl::PermissionDeniedError(absl::StrCat(
          "moving ", name, " into ", options.out_dir, ": ", ec.message(), " (the files before it, ",
          result.written.empty() ? std::string("none") : absl::StrJoin(result.written, ", "),
          ", are in place)"));
    }
    result.written.push_back(to.string());
  }
  // An encoder of an earlier import, which the model.yaml now in place no longer describes: the
  // directory would not load with it (OpenModelDirectory refuses it).
  if (!result.encoder.has_value() && fs::exists(fs::path(options.out_dir) / "encoder.hpar")) {
    fs::remove(fs::path(options.out_dir) / "encoder.hpar", ec);
    if (ec) {
      return absl::PermissionDeniedError(absl::StrCat(
          "cannot remove ", options.out_dir, "/encoder.hpar of an earlier import: ", ec.message()));
    }
    result.notes.push_back(absl::StrCat("removed ", options.out_dir,
                                        "/encoder.hpar of an earlier import (no --encoder now)"));
  }
  return result;
}

absl::StatusOr<ModelDirectory> OpenModelDirectory(const std::string& dir) {
  ModelDirectory out;
  out.dir = dir;
  std::string yaml_path = dir + "/model.yaml";
  if (!fs::exists(yaml_path)) yaml_path = (fs::path(dir) / ".." / "config.yaml").lexically_normal();
  std::ifstream in(yaml_path);
  if (!in) {
    return absl::NotFoundError(absl::StrCat(
        dir,
        " is not a model directory: it has no model.yaml (hetpar convert from-hf writes one) "
        "and ",
        yaml_path, " (a run's config.yaml, for a run's model/ directory) is missing"));
  }
  std::stringstream text;
  text << in.rdbuf();
  HETPAR_ASSIGN_OR_RETURN(config::LoadedRunSpec loaded,
                          config::ParseRunSpecYaml(text.str(), yaml_path));
  if (!loaded.spec.has_llm() || !loaded.spec.llm().has_model()) {
    return absl::InvalidArgumentError(absl::StrCat(yaml_path, " has no llm.model section"));
  }
  out.llm = loaded.spec.llm().model();
  if (out.llm.kv_heads() == 0) out.llm.set_kv_heads(out.llm.heads());
  if (out.llm.rope_theta() == 0) out.llm.set_rope_theta(10000.0);
  if (out.llm.norm_eps() == 0) out.llm.set_norm_eps(1e-5);
  out.llm_path = dir + "/llm.hpar";
  if (!fs::exists(out.llm_path)) {
    return absl::NotFoundError(absl::StrCat(dir, " has no llm.hpar"));
  }
  if (fs::exists(dir + "/encoder.hpar")) {
    if (!loaded.spec.has_encoder() || !loaded.spec.encoder().has_model()) {
      return absl::InvalidArgumentError(
          absl::StrCat(dir, " has encoder.hpar but ", yaml_path, " has no encoder.model section"));
    }
    hetpar::v1::EncoderModel m = loaded.spec.encoder().model();
    if (m.channels() == 0) m.set_channels(3);
    if (m.activation().empty()) m.set_activation("gelu");
    if (m.norm_eps() == 0) m.set_norm_eps(1e-6);
    out.encoder = m;
    out.encoder_path = dir + "/encoder.hpar";
  }
  return out;
}

// The layers a model file holds (its parameters `prefix`N.*) against the config's count: a
// config edited to fewer layers would otherwise export a truncated model that loads without
// complaint, and one of more would fail on a missing parameter.
absl::Status CheckLayerCount(const std::vector<nn::FullParameter>& params,
                             const std::string& prefix, int64_t layers, const std::string& path,
                             const std::string& field) {
  std::set<int64_t> held;
  for (const nn::FullParameter& p : params) {
    if (!absl::StartsWith(p.name, prefix)) continue;
    const std::string rest = p.name.substr(prefix.size());
    int64_t index = 0;
    if (absl::SimpleAtoi(rest.substr(0, rest.find('.')), &index)) held.insert(index);
  }
  if (static_cast<int64_t>(held.size()) == layers &&
      (held.empty() || (*held.begin() == 0 && *held.rbegin() == layers - 1))) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(path, " holds ", held.size(), " layers (", prefix,
                                                 "N), but the model's config says ", field, "=",
                                                 layers));
}

// The bos/eos (and pad) ids an exported config.json names, without which transformers falls back
// to 1 and 2 and generation never stops on the model's own end token: from the
// generation_config.json from-hf kept, else from the model directory's tokenizer. Neither: none.
absl::Status AddSpecialTokenIds(const std::string& model_dir, json* config) {
  const std::string generation = model_dir + "/generation_config.json";
  if (fs::exists(generation)) {
    HETPAR_ASSIGN_OR_RETURN(json kept, ReadJsonFile(generation));
    for (const char* key : {"bos_token_id", "eos_token_id", "pad_token_id"}) {
      auto it = kept.find(key);
      if (it != kept.end() && !it->is_null()) (*config)[key] = *it;
    }
    return absl::OkStatus();
  }
  for (const char* name : {"tokenizer.json", "tokenizer.model"}) {
    const std::string path = model_dir + "/" + name;
    if (!fs::exists(path)) continue;
    HETPAR_ASSIGN_OR_RETURN(std::unique_ptr<data::Tokenizer> tokenizer,
                            data::Tokenizer::Load(path));
    if (tokenizer->bos_id() >= 0) (*config)["bos_token_id"] = tokenizer->bos_id();
    if (tokenizer->eos_id() >= 0) (*config)["eos_token_id"] = tokenizer->eos_id();
    return absl::OkStatus();
  }
  return absl::OkStatus();
}

absl::StatusOr<ExportResult> ExportToHf(const std::string& model_dir, const std::string& out_dir) {
  HETPAR_ASSIGN_OR_RETURN(ModelDirectory model, OpenModelDirectory(model_dir));
  ExportResult result;
  HETPAR_ASSIGN_OR_RETURN(std::vector<nn::FullParameter> llm_params,
                          nn::ReadFullParameters(model.llm_path));
  HETPAR_RETURN_IF_ERROR(CheckLayerCount(llm_params, "llm.layers.", model.llm.layers(),
                                         model.llm_path, "llm.model.layers"));
  // A config whose shapes the file does not have (heads, kv_heads edited) fails a reshape.
  const auto fits = [](const absl::Status& status, const std::string& path) {
    return status.ok() || absl::IsInvalidArgument(status)
               ? status
               : absl::InvalidArgumentError(absl::StrCat(
                     path,
                     " does not have the shapes the model's config gives: ", status.message()));
  };
  absl::StatusOr<TensorMap> converted_llm =
      nn::RunTorchOr("converting", [&] { return HfTensorsFromLlm(llm_params, model.llm); });
  HETPAR_RETURN_IF_ERROR(fits(converted_llm.status(), model.llm_path));
  TensorMap llm = *std::move(converted_llm);
  const std::string dtype = HfDtypeName(llm_params.front().tensor.scalar_type());
  TensorMap tower, projector;
  std::string enc_dtype;
  if (model.encoder.has_value()) {
    HETPAR_ASSIGN_OR_RETURN(std::vector<nn::FullParameter> enc_params,
                            nn::ReadFullParameters(model.encoder_path));
    HETPAR_RETURN_IF_ERROR(CheckLayerCount(enc_params, "encoder.layers.", model.encoder->layers(),
                                           model.encoder_path, "encoder.model.layers"));
    if (model.encoder->no_final_norm() && Find(enc_params, "encoder.norm.weight").ok()) {
      // Exported without it, the trained norm would be replaced by the identity without a word.
      return absl::InvalidArgumentError(absl::StrCat(
          model.encoder_path,
          " holds the tower's final norm (encoder.norm.*), but the model's config says "
          "encoder.model.no_final_norm=true"));
    }
    absl::StatusOr<TensorMap> converted_tower = nn::RunTorchOr(
        "converting", [&] { return HfTensorsFromTower(enc_params, *model.encoder); });
    HETPAR_RETURN_IF_ERROR(fits(converted_tower.status(), model.encoder_path));
    tower = *std::move(converted_tower);
    HETPAR_ASSIGN_OR_RETURN(projector, HfTensorsFromProjector(enc_params));
    enc_dtype = HfDtypeName(enc_params.front().tensor.scalar_type());
    if (model.encoder->no_final_norm()) {
      result.notes.push_back(
          "the tower has no final norm (encoder.model.no_final_norm): vision/ holds an identity "
          "post_layernorm (weight 1, bias 0) that LLaVA does not apply with vision_feature_layer "
          "-1, the projector's input; the SiglipVisionModel's last_hidden_state is normalised by "
          "it, unlike what hetpar's projector reads");
    }
  }
  const std::map<std::string, std::string> metadata = {{"format", "pt"}};
  HETPAR_ASSIGN_OR_RETURN(auto llm_list, ToList(llm));
  HETPAR_RETURN_IF_ERROR(
      nn::WriteSafetensors(llm_list, out_dir + "/llm/model.safetensors", metadata));
  json llm_config = HfConfigFromLlmModel(model.llm, dtype);
  HETPAR_RETURN_IF_ERROR(AddSpecialTokenIds(model_dir, &llm_config));
  HETPAR_RETURN_IF_ERROR(WriteJson(out_dir + "/llm/config.json", llm_config));
  result.written.push_back(out_dir + "/llm");
  for (const char* name :
       {"tokenizer.json", "tokenizer_config.json", "tokenizer.model", "generation_config.json"}) {
    const fs::path from = fs::path(model_dir) / name;
    if (!fs::exists(from)) continue;
    std::error_code ec;
    fs::copy_file(from, fs::path(out_dir) / "llm" / name, fs::copy_options::overwrite_existing, ec);
    if (ec) {
      return absl::PermissionDeniedError(
          absl::StrCat("cannot copy ", from.string(), ": ", ec.message()));
    }
  }
  if (model.encoder.has_value()) {
    HETPAR_ASSIGN_OR_RETURN(auto tower_list, ToList(tower));
    HETPAR_RETURN_IF_ERROR(
        nn::WriteSafetensors(tower_list, out_dir + "/vision/model.safetensors", metadata));
    HETPAR_RETURN_IF_ERROR(WriteJson(out_dir + "/vision/config.json",
                                     HfConfigFromEncoderModel(*model.encoder, enc_dtype)));
    result.written.push_back(out_dir + "/vision");
    HETPAR_ASSIGN_OR_RETURN(auto proj_list, ToList(projector));
    HETPAR_RETURN_IF_ERROR(
        nn::WriteSafetensors(proj_list, out_dir + "/projector.safetensors", metadata));
    result.written.push_back(out_dir + "/projector.safetensors");
  }
  return result;
}

}  // namespace hetpar::hf
