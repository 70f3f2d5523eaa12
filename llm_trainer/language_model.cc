#include "llm_trainer/language_model.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <optional>
#include <string_view>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"
#include "common/nn/attention.h"
#include "common/nn/device_copy.h"
#include "common/nn/size_checks.h"
#include "common/nn/torch_status.h"
#include "common/plan/layout.h"
#include "common/plan/sequence_sharding.h"
#include "common/status.h"

namespace hetpar::llm {
namespace {

constexpr double kInitStd = 0.02;

using nn::CheckDivides;
using nn::CheckPositive;

std::string SampleName(const LlmSample& sample, size_t index) {
  return absl::StrCat("sample '", sample.id, "' (#", index, " of the microbatch)");
}

// x: [rows, heads, d]; cos, sin: [rows, 1, d]. Rotates the two halves of each head.
at::Tensor ApplyRope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  at::Tensor rotated = at::cat({x.narrow(-1, half, half).neg(), x.narrow(-1, 0, half)}, -1);
  return x * cos + rotated * sin;
}

// Where image rows land on one rank: row sources[k] of the image-rows tensor goes to row
// targets[k] of the rank's activations, which cover packed rows [first_row, first_row + n).
struct SpliceMap {
  std::vector<int64_t> targets;
  std::vector<int64_t> sources;
};

// The positions of each sample that a rank packs (CpLocalPositions), and where each sample starts
// in the packed rows.
struct LocalLayout {
  std::vector<std::vector<int64_t>> positions;  // per sample, increasing
  std::vector<int64_t> starts;                  // per sample, then the total
};

LocalLayout LayOut(const std::vector<LlmSample>& samples, int64_t seq_len, int64_t cp,
                   int64_t cp_rank) {
  LocalLayout layout;
  int64_t rows = 0;
  for (const LlmSample& sample : samples) {
    layout.starts.push_back(rows);
    layout.positions.push_back(
        CpLocalPositions(static_cast<int64_t>(sample.tokens.size()), seq_len, cp, cp_rank));
    rows += static_cast<int64_t>(layout.positions.back().size());
  }
  layout.starts.push_back(rows);
  return layout;
}

SpliceMap MapSplice(const std::vector<LlmSample>& samples, const LocalLayout& layout, int tp_rank,
                    int tp_size, bool sequence_parallel) {
  const int64_t rows = layout.starts.back();
  std::vector<int64_t> placeholders;  // packed row of each image row, in tensor order; -1: absent
  for (size_t s = 0; s < samples.size(); ++s) {
    const std::vector<int64_t>& local = layout.positions[s];
    for (int64_t position : samples[s].image_positions) {
      auto it = std::lower_bound(local.begin(), local.end(), position);
      placeholders.push_back(
          it != local.end() && *it == position ? layout.starts[s] + (it - local.begin()) : -1);
    }
  }
  int64_t first_row = 0;
  int64_t end_row = rows;
  if (sequence_parallel && tp_size > 1) {
    const nn::SequenceShard shard = nn::ShardSequence(rows, tp_rank, tp_size);
    first_row = shard.shard_rows * tp_rank;
    end_row = shard.end;
  }
  SpliceMap map;
  for (size_t k = 0; k < placeholders.size(); ++k) {
    if (placeholders[k] >= 0 && placeholders[k] >= first_row && placeholders[k] < end_row) {
      map.targets.push_back(placeholders[k] - first_row);
      map.sources.push_back(static_cast<int64_t>(k));
    }
  }
  return map;
}

}  // namespace

absl::StatusOr<at::Tensor> VocabParallelArgmax(const at::Tensor& local_logits, int64_t vocab_begin,
                                               const nn::CommGroup& tp) {
  if (!local_logits.defined() || local_logits.dim() != 2 || local_logits.size(1) < 1) {
    return absl::InvalidArgumentError(
        "vocab-parallel argmax: expected this rank's logits as [rows, vocab slice >= 1]");
  }
  HETPAR_ASSIGN_OR_RETURN(
      at::Tensor winner,
      nn::RunTorchOr(
          absl::StrCat("vocab-parallel argmax on TP rank ", tp.rank(), " of ", tp.size()),
          [&]() -> at::Tensor {
            at::NoGradGuard no_grad;
            const at::Tensor logits = local_logits.to(at::kDouble);
            // The local maximum and the smallest local column reaching it (an explicit
            // minimum, not at::max's index, so that ties are resolved by rule).
            const at::Tensor local_max = std::get<0>(logits.max(1));
            const at::Tensor columns =
                at::arange(logits.size(1), logits.options()).add(vocab_begin);
            const at::Tensor first =
                at::where(logits.eq(local_max.unsqueeze(1)), columns.unsqueeze(0), INFINITY)
                    .amin(1);
            at::Tensor global_max = local_max.clone();
            tp.AllReduce(global_max, nn::ReduceOp::kMax);
            // The smallest id among the ranks holding the global maximum, as the
            // maximum of negated ids; a NaN row votes +1, which beats every id.
            at::Tensor vote = at::where(local_max.eq(global_max), first.neg(), -INFINITY);
            vote = at::where(local_max.isnan(), at::full_like(vote, 1.0), vote);
            tp.AllReduce(vote, nn::ReduceOp::kMax);
            return vote;
          }));
  winner = winner.to(at::kCPU);  // the rows' verdicts, read on the host
  const double* vote = winner.data_ptr<double>();
  for (int64_t row = 0; row < winner.size(0); ++row) {
    if (vote[row] > 0) {
      return absl::InvalidArgumentError(absl::StrCat("vocab-parallel argmax: row ", row,
                                                     " has a NaN logit on some TP rank; its "
                                                     "argmax is undefined"));
    }
    if (!std::isfinite(vote[row])) {
      return absl::InternalError(
          absl::StrCat("vocab-parallel argmax: no TP rank holds the maximum of row ", row));
    }
  }
  return winner.neg().to(at::kLong);
}

std::vector<int64_t> ImageRowsReadByRank(const std::vector<LlmSample>& samples, int tp_rank,
                                         int tp_size, bool sequence_parallel) {
  return MapSplice(samples, LayOut(samples, 0, 1, 0), tp_rank, tp_size, sequence_parallel).sources;
}

std::vector<int64_t> CpLocalPositions(int64_t length, int64_t seq_len, int64_t cp,
                                      int64_t cp_rank) {
  std::vector<int64_t> positions;
  if (cp <= 1) {
    positions.resize(length);
    for (int64_t i = 0; i < length; ++i) positions[i] = i;
    return positions;
  }
  const int64_t chunk = seq_len / (2 * cp);
  const auto [early, late] = plan::LoadBalancedChunks(cp, cp_rank);
  for (int64_t c : {early, late}) {
    for (int64_t p = c * chunk; p < std::min((c + 1) * chunk, length); ++p) positions.push_back(p);
  }
  return positions;
}

absl::Status LanguageModel::SetContextParallel(nn::CommGroupPtr cp) {
  if (!cp.defined() || cp->size() == 1) {
    cp_.reset();
    return absl::OkStatus();
  }
  if (model_.seq_len() % (2 * cp->size()) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("llm.model.seq_len=", model_.seq_len(),
                     " is not a multiple of 2 x llm.layout.cp=", 2 * cp->size()));
  }
  cp_ = std::move(cp);
  return absl::OkStatus();
}

absl::StatusOr<LlmOptions> LlmOptionsFromSpec(const hetpar::v1::RunSpec& spec) {
  LlmOptions options;
  HETPAR_ASSIGN_OR_RETURN(options.dtype, nn::TorchDtype(spec.run().dtype()));
  options.seed = spec.run().seed();
  options.sequence_parallel = spec.llm().layout().sequence_parallel();
  return options;
}

LanguageModel::LanguageModel(const hetpar::v1::LlmModel& model, const LlmOptions& options,
                             nn::TensorParallel tp)
    : model_(model), options_(options), tp_(std::move(tp)) {}

absl::StatusOr<std::unique_ptr<LanguageModel>> LanguageModel::Create(
    const hetpar::v1::LlmModel& model, const LlmOptions& options, const nn::Communicator& tp) {
  hetpar::v1::LlmModel m = model;
  if (m.kv_heads() == 0) m.set_kv_heads(m.heads());
  if (m.rope_theta() == 0) m.set_rope_theta(10000);
  if (m.norm_eps() == 0) m.set_norm_eps(1e-5);
  HETPAR_RETURN_IF_ERROR(CheckPositive("llm.model.hidden", m.hidden()));
  HETPAR_RETURN_IF_ERROR(CheckPositive("llm.model.layers", m.layers()));
  HETPAR_RETURN_IF_ERROR(CheckPositive("llm.model.heads", m.heads()));
  HETPAR_RETURN_IF_ERROR(CheckPositive("llm.model.kv_heads", m.kv_heads()));
  HETPAR_RETURN_IF_ERROR(CheckPositive("llm.model.ffn", m.ffn()));
  HETPAR_RETURN_IF_ERROR(CheckPositive("llm.model.vocab", m.vocab()));
  HETPAR_RETURN_IF_ERROR(CheckPositive("llm.model.seq_len", m.seq_len()));
  if (!(m.rope_theta() > 0) || !(m.norm_eps() > 0)) {
    return absl::InvalidArgumentError(absl::StrCat("llm.model.rope_theta=", m.rope_theta(),
                                                   " and llm.model.norm_eps=", m.norm_eps(),
                                                   " must be > 0"));
  }
  HETPAR_RETURN_IF_ERROR(
      CheckDivides("llm.model.heads", m.heads(), "llm.model.hidden", m.hidden()));
  if ((m.hidden() / m.heads()) % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("llm.model.heads=", m.heads(), " gives an odd head size ",
                     m.hidden() / m.heads(), "; rotary embeddings need an even head size"));
  }
  HETPAR_RETURN_IF_ERROR(CheckDivides("llm.model.kv_heads", m.kv_heads(), "llm.model.heads",
                                      m.heads(), "grouped-query attention"));
  const int size = tp.size();
  HETPAR_RETURN_IF_ERROR(CheckDivides("llm.layout.tp", size, "llm.model.heads", m.heads(),
                                      "attention is split by heads"));
  HETPAR_RETURN_IF_ERROR(CheckDivides("llm.layout.tp", size, "llm.model.kv_heads", m.kv_heads(),
                                      "key/value heads are split too"));
  HETPAR_RETURN_IF_ERROR(CheckDivides("llm.layout.tp", size, "llm.model.ffn", m.ffn()));
  HETPAR_RETURN_IF_ERROR(CheckDivides("llm.layout.tp", size, "llm.model.vocab", m.vocab(),
                                      "the embedding and output head are split by vocabulary"));
  if (options.pp_stages < 1 || options.pp_stages > m.layers() || options.pp_stage < 0 ||
      options.pp_stage >= options.pp_stages) {
    return absl::InvalidArgumentError(absl::StrCat(
        "llm.layout.pp=", options.pp_stages, " (stage ", options.pp_stage,
        "): expected 1 to llm.model.layers=", m.layers(), " stages (each holds a layer)"));
  }
  auto lm = std::unique_ptr<LanguageModel>(
      new LanguageModel(m, options, nn::TensorParallel{tp.group(), options.sequence_parallel}));
  HETPAR_RETURN_IF_ERROR(lm->Build());
  return lm;
}

absl::Status LanguageModel::Build() {
  const int64_t hidden = model_.hidden();
  const int64_t head_dim = hidden / model_.heads();
  const int64_t qkv_rows = (model_.heads() + 2 * model_.kv_heads()) * head_dim;
  const bool sp = options_.sequence_parallel;
  parameters_ = std::make_unique<nn::ParameterSet>(options_.seed, options_.dtype, tp_.rank(),
                                                   tp_.size(), options_.init_style);
  nn::ParameterSet& p = *parameters_;
  const nn::InitRule weight = nn::InitRule::Normal(kInitStd);
  const nn::InitRule output_weight =
      nn::InitRule::Normal(kInitStd / std::sqrt(2.0 * static_cast<double>(model_.layers())));
  const auto [first_layer, end_layer] =
      plan::PipelineStageLayers(model_.layers(), options_.pp_stages, options_.pp_stage);
  if (first_stage()) {
    HETPAR_ASSIGN_OR_RETURN(embed_, p.Add("llm.embed.weight", {model_.vocab(), hidden}, 0, weight));
    HETPAR_RETURN_IF_ERROR(p.MarkEmbedding("llm.embed.weight"));
  }
  for (int64_t i = first_layer; i < end_layer; ++i) {
    const std::string n = absl::StrCat("llm.layers.", i, ".");
    Layer layer;
    HETPAR_ASSIGN_OR_RETURN(layer.attn_norm,
                            p.Add(n + "attn_norm.weight", {hidden}, -1, p.NormScaleInit(), sp));
    HETPAR_ASSIGN_OR_RETURN(layer.qkv, p.Add(n + "attn.qkv.weight", {qkv_rows, hidden}, 0, weight));
    HETPAR_ASSIGN_OR_RETURN(
        layer.proj,
        p.Add(n + "attn.proj.weight", {hidden, model_.heads() * head_dim}, 1, output_weight));
    HETPAR_ASSIGN_OR_RETURN(layer.mlp_norm,
                            p.Add(n + "mlp_norm.weight", {hidden}, -1, p.NormScaleInit(), sp));
    HETPAR_ASSIGN_OR_RETURN(layer.gate,
                            p.Add(n + "mlp.gate.weight", {model_.ffn(), hidden}, 0, weight));
    HETPAR_ASSIGN_OR_RETURN(layer.up,
                            p.Add(n + "mlp.up.weight", {model_.ffn(), hidden}, 0, weight));
    HETPAR_ASSIGN_OR_RETURN(layer.down,
                            p.Add(n + "mlp.down.weight", {hidden, model_.ffn()}, 1, output_weight));
    layers_.push_back(std::move(layer));
  }
  if (last_stage()) {
    HETPAR_ASSIGN_OR_RETURN(norm_, p.Add("llm.norm.weight", {hidden}, -1, p.NormScaleInit(), sp));
    HETPAR_ASSIGN_OR_RETURN(output_,
                            p.Add("llm.output.weight", {model_.vocab(), hidden}, 0, weight));
  }
  return nn::RunTorch("building rotary tables", [&] {
    const auto f64 = at::TensorOptions().dtype(at::kDouble);
    at::Tensor inv_freq =
        at::pow(model_.rope_theta(),
                at::arange(0, head_dim, 2, f64).div(static_cast<double>(head_dim)))
            .reciprocal();
    at::Tensor angles = at::outer(at::arange(model_.seq_len(), f64), inv_freq);
    at::Tensor table = at::cat({angles, angles}, -1);  // [seq_len, head_dim]
    rope_cos_ = table.cos().to(options_.device, options_.dtype);
    rope_sin_ = table.sin().to(options_.device, options_.dtype);
    // Parameters are drawn on the host; the model computes on its device.
    parameters_->MoveTo(options_.device);
  });
}

bool LanguageModel::WholeModelHas(std::string_view name) const {
  if (name == "llm.embed.weight" || name == "llm.norm.weight" || name == "llm.output.weight") {
    return true;
  }
  // llm.layers.<i>.<p>: any layer of the model, with a parameter p that this stage's own first
  // layer has (every stage holds a layer, and every layer the same parameters).
  constexpr std::string_view kLayers = "llm.layers.";
  if (name.substr(0, kLayers.size()) != kLayers) return false;
  name.remove_prefix(kLayers.size());
  const size_t dot = name.find('.');
  int64_t layer = -1;
  const char* end = name.data() + (dot == std::string_view::npos ? 0 : dot);
  // Decimal digits only, with no leading zero: the index as Build writes it.
  if (dot == std::string_view::npos || dot == 0 || (dot > 1 && name[0] == '0') ||
      std::from_chars(name.data(), end, layer).ptr != end || layer < 0 ||
      layer >= model_.layers()) {
    return false;
  }
  name.remove_prefix(dot + 1);
  const int64_t own_layer =
      plan::PipelineStageLayers(model_.layers(), options_.pp_stages, options_.pp_stage).first;
  return parameters_->Find(std::string(kLayers) + std::to_string(own_layer) + "." +
                           std::string(name)) != nullptr;
}

absl::Status LanguageModel::Validate(const std::vector<LlmSample>& samples,
                                     const at::Tensor& image_rows, int64_t n_global) const {
  if (samples.empty()) return absl::InvalidArgumentError("llm forward: the microbatch is empty");
  if (n_global < 1) {
    return absl::InvalidArgumentError(absl::StrCat("llm forward: N_global=", n_global,
                                                   ", expected >= 1 (loss tokens in the "
                                                   "global batch)"));
  }
  int64_t expected_rows = 0;
  for (size_t s = 0; s < samples.size(); ++s) {
    const LlmSample& sample = samples[s];
    const int64_t length = static_cast<int64_t>(sample.tokens.size());
    const std::string name = SampleName(sample, s);
    if (length < 1 || length > model_.seq_len()) {
      return absl::InvalidArgumentError(absl::StrCat(
          name, " has ", length, " tokens, expected 1..llm.model.seq_len=", model_.seq_len()));
    }
    if (static_cast<int64_t>(sample.labels.size()) != length ||
        static_cast<int64_t>(sample.loss_mask.size()) != length) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, " has ", length, " tokens but ", sample.labels.size(), " labels and ",
                       sample.loss_mask.size(), " loss-mask entries; expected one each"));
    }
    for (int64_t i = 0; i < length; ++i) {
      if (sample.tokens[i] < 0 || sample.tokens[i] >= model_.vocab()) {
        return absl::InvalidArgumentError(absl::StrCat(name, ": token ", sample.tokens[i],
                                                       " at position ", i,
                                                       " is outside the "
                                                       "vocabulary [0, ",
                                                       model_.vocab(), ")"));
      }
      if (sample.loss_mask[i] && (sample.labels[i] < 0 || sample.labels[i] >= model_.vocab())) {
        return absl::InvalidArgumentError(
            absl::StrCat(name, ": label ", sample.labels[i], " at loss position ", i,
                         " is outside the vocabulary [0, ", model_.vocab(), ")"));
      }
    }
    const int64_t placeholders = static_cast<int64_t>(sample.image_positions.size());
    if (placeholders != sample.image_rows) {
      return absl::InvalidArgumentError(absl::StrCat(
          name, " has ", placeholders, " image placeholder tokens but ", sample.image_rows,
          " image rows were assigned to it; each image row needs one placeholder"));
    }
    int64_t previous = -1;
    for (int64_t position : sample.image_positions) {
      if (position <= previous || position >= length) {
        return absl::InvalidArgumentError(absl::StrCat(name, ": image position ", position,
                                                       " is not increasing inside [0, ", length,
                                                       ") (previous ", previous, ")"));
      }
      previous = position;
    }
    expected_rows += sample.image_rows;
  }
  const int64_t given_rows = image_rows.defined() ? image_rows.size(0) : 0;
  if (image_rows.defined() && (image_rows.dim() != 2 || image_rows.size(1) != model_.hidden())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "llm forward: image rows have shape [", absl::StrJoin(image_rows.sizes(), ", "),
        "], expected [rows, llm.model.hidden=", model_.hidden(), "]"));
  }
  if (given_rows != expected_rows) {
    return absl::InvalidArgumentError(absl::StrCat(
        "llm forward: the image-rows tensor has ", given_rows, " rows but the microbatch's ",
        samples.size(), " samples have ", expected_rows, " image placeholder tokens"));
  }
  if (image_rows.defined() && given_rows > 0 && image_rows.scalar_type() != options_.dtype) {
    return absl::InvalidArgumentError(
        absl::StrCat("llm forward: image rows have dtype ", nn::DtypeName(image_rows.scalar_type()),
                     ", expected the model dtype ", nn::DtypeName(options_.dtype)));
  }
  if (image_rows.defined() && given_rows > 0 && image_rows.device() != options_.device) {
    return absl::InvalidArgumentError(
        absl::StrCat("llm forward: image rows are on ", image_rows.device().str(),
                     ", expected the model's device ", options_.device.str()));
  }
  return absl::OkStatus();
}

absl::StatusOr<LlmForwardResult> LanguageModel::Forward(const std::vector<LlmSample>& samples,
                                                        const at::Tensor& image_rows,
                                                        int64_t n_global) {
  if (options_.pp_stages > 1) {
    return absl::FailedPreconditionError(
        "llm forward: this model is one pipeline stage; use ForwardStage");
  }
  HETPAR_RETURN_IF_ERROR(Validate(samples, image_rows, n_global));
  return nn::RunTorchOr(
      absl::StrCat("llm forward on TP rank ", tp_.rank(), " of ", tp_.size()),
      [&] { return LossOf(samples, StageHidden(samples, image_rows, at::Tensor()), n_global); });
}

absl::StatusOr<LlmStageResult> LanguageModel::ForwardStage(const std::vector<LlmSample>& samples,
                                                           const at::Tensor& image_rows,
                                                           const at::Tensor& input,
                                                           int64_t n_global) {
  const std::string where = absl::StrCat("llm stage ", options_.pp_stage, " of ",
                                         options_.pp_stages, " on TP rank ", tp_.rank());
  if (first_stage()) {
    HETPAR_RETURN_IF_ERROR(Validate(samples, image_rows, n_global));
  } else {
    // A later stage reads no image rows: check the samples alone.
    std::vector<LlmSample> text = samples;
    for (LlmSample& sample : text) {
      sample.image_positions.clear();
      sample.image_rows = 0;
    }
    HETPAR_RETURN_IF_ERROR(Validate(text, at::Tensor(), n_global));
    const int64_t expected = StageRows(samples);
    if (!input.defined() || input.dim() != 2 || input.size(0) != expected ||
        input.size(1) != model_.hidden() || input.scalar_type() != options_.dtype) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": the input from the previous stage has shape [",
          input.defined() ? absl::StrJoin(input.sizes(), ", ") : std::string("undefined"),
          "], expected [", expected, ", ", model_.hidden(), "] in ",
          nn::DtypeName(options_.dtype)));
    }
  }
  return nn::RunTorchOr(where, [&] {
    LlmStageResult result;
    at::Tensor h = StageHidden(samples, image_rows, input);
    if (!last_stage()) {
      result.output = h;
      return result;
    }
    LlmForwardResult loss = LossOf(samples, h, n_global);
    result.loss = loss.loss;
    result.loss_tokens = loss.loss_tokens;
    return result;
  });
}

int64_t LanguageModel::StageRows(const std::vector<LlmSample>& samples) const {
  const int64_t rows = LayOut(samples, model_.seq_len(), cp_size(), cp_rank()).starts.back();
  return tp_.sharded() ? nn::ShardSequence(rows, tp_.rank(), tp_.size()).shard_rows : rows;
}

LlmForwardResult LanguageModel::LossOf(const std::vector<LlmSample>& samples, const at::Tensor& h,
                                       int64_t n_global) {
  const int64_t vocab_begin = model_.vocab() / tp_.size() * tp_.rank();
  std::vector<int64_t> loss_rows, loss_labels;
  const LocalLayout layout = LayOut(samples, model_.seq_len(), cp_size(), cp_rank());
  for (size_t s = 0; s < samples.size(); ++s) {
    const std::vector<int64_t>& local = layout.positions[s];
    for (size_t i = 0; i < local.size(); ++i) {
      if (samples[s].loss_mask[local[i]]) {
        loss_rows.push_back(layout.starts[s] + static_cast<int64_t>(i));
        loss_labels.push_back(samples[s].labels[local[i]]);
      }
    }
  }
  at::Tensor selected = h.index_select(0, nn::IndexTensor(loss_rows, options_.device));
  at::Tensor logits = nn::ColumnParallelLinear(selected, output_, at::Tensor());
  at::Tensor token_loss = nn::VocabParallelCrossEntropy(
      logits, nn::IndexTensor(loss_labels, options_.device), vocab_begin, tp_.group);
  LlmForwardResult result;
  result.loss = token_loss.sum().div(static_cast<double>(n_global));
  result.loss_tokens = static_cast<int64_t>(loss_rows.size());
  return result;
}

at::Tensor LanguageModel::StageHidden(const std::vector<LlmSample>& samples,
                                      const at::Tensor& image_rows, const at::Tensor& input) {
  const auto i64 = at::TensorOptions().dtype(at::kLong).device(options_.device);
  const int64_t hidden = model_.hidden();
  const int64_t head_dim = hidden / model_.heads();
  const int64_t group = model_.heads() / model_.kv_heads();
  const int64_t local_heads = model_.heads() / tp_.size();
  const int64_t local_kv = model_.kv_heads() / tp_.size();
  const int64_t vocab_begin = model_.vocab() / tp_.size() * tp_.rank();
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));

  // Pack the samples: row r of the sequence is (sample, position), for the positions this CP
  // rank holds (all of them without CP).
  const int64_t cp = cp_size();
  const LocalLayout layout = LayOut(samples, model_.seq_len(), cp, cp_rank());
  const std::vector<int64_t>& starts = layout.starts;
  const int64_t rows = starts.back();
  std::vector<int64_t> ids, positions;
  for (size_t s = 0; s < samples.size(); ++s) {
    for (int64_t p : layout.positions[s]) {
      ids.push_back(samples[s].tokens[p]);
      positions.push_back(p);
    }
  }

  // Context parallelism: where each rank's keys and values land in the all-gather (every rank
  // padded to the largest rank's rows), and, per sample, the gathered rows of its positions in
  // order.
  int64_t gather_rows = 0;          // rows per rank in the all-gather
  std::vector<int64_t> full_index;  // gathered row of each (sample, position), samples packed
  std::vector<int64_t> full_starts;
  if (cp > 1) {
    std::vector<LocalLayout> all;
    for (int64_t r = 0; r < cp; ++r) {
      all.push_back(LayOut(samples, model_.seq_len(), cp, r));
      gather_rows = std::max(gather_rows, all.back().starts.back());
    }
    gather_rows = std::max<int64_t>(gather_rows, 1);
    for (size_t s = 0; s < samples.size(); ++s) {
      full_starts.push_back(static_cast<int64_t>(full_index.size()));
      const int64_t length = static_cast<int64_t>(samples[s].tokens.size());
      std::vector<int64_t> row_of(length, -1);
      for (int64_t r = 0; r < cp; ++r) {
        const std::vector<int64_t>& local = all[r].positions[s];
        for (size_t i = 0; i < local.size(); ++i) {
          row_of[local[i]] = r * gather_rows + all[r].starts[s] + static_cast<int64_t>(i);
        }
      }
      full_index.insert(full_index.end(), row_of.begin(), row_of.end());
    }
    full_starts.push_back(static_cast<int64_t>(full_index.size()));
  }

  // The first stage: the embedding, then image rows in place of their placeholders (in this
  // rank's rows only). A later stage: the previous stage's activations.
  at::Tensor x = input;
  if (first_stage()) {
    x = nn::LeaveTensorParallel(
        nn::VocabParallelEmbedding(nn::IndexTensor(ids, options_.device), embed_, vocab_begin),
        tp_);
    const SpliceMap splice =
        MapSplice(samples, layout, tp_.rank(), tp_.size(), tp_.sequence_parallel);
    if (!splice.targets.empty()) {
      x = x.index_copy(
          0, nn::IndexTensor(splice.targets, options_.device),
          image_rows.index_select(0, nn::IndexTensor(splice.sources, options_.device)));
    }
  }

  const at::Tensor position_ids = nn::IndexTensor(positions, options_.device);
  const at::Tensor cos = rope_cos_.index_select(0, position_ids).unsqueeze(1);
  const at::Tensor sin = rope_sin_.index_select(0, position_ids).unsqueeze(1);
  // Without CP a sample's queries and keys are its positions in order, and attention is causal
  // with no mask. With CP the queries are this rank's positions of the sample and the keys all of
  // its positions, so causality is a mask, built once per sample: true where the key's position is
  // at most the query's (SDPA's boolean mask marks the pairs that take part, the opposite of
  // masked_fill's).
  std::vector<at::Tensor> cp_masks;
  if (cp > 1) {
    cp_masks.reserve(samples.size());
    for (size_t s = 0; s < samples.size(); ++s) {
      const at::Tensor query = position_ids.narrow(0, starts[s], starts[s + 1] - starts[s]);
      const at::Tensor key = at::arange(full_starts[s + 1] - full_starts[s], i64);
      cp_masks.push_back(key.unsqueeze(0).le(query.unsqueeze(1)));
    }
  }
  const at::Tensor full_rows = nn::IndexTensor(full_index, options_.device);

  // Varlen flash attention: the samples' cumulative row starts (int32, on the device) and the
  // longest sample; undefined where the per-run path computes attention instead.
  at::Tensor varlen_starts;
  int64_t longest = 0;
  const bool flash_dtype = options_.dtype == at::kBFloat16 || options_.dtype == at::kHalf;
  if (options_.varlen_attention && !varlen_failed_ && options_.device.is_cuda() && cp == 1 &&
      flash_dtype && head_dim % 8 == 0 && head_dim <= 256) {
    std::vector<int32_t> starts32(starts.begin(), starts.end());
    for (size_t s = 0; s + 1 < starts.size(); ++s) {
      longest = std::max(longest, starts[s + 1] - starts[s]);
    }
    // ToDevice copies the host values into pinned memory before it returns.
    varlen_starts = nn::ToDevice(
        at::from_blob(starts32.data(), {static_cast<int64_t>(starts32.size())}, at::kInt),
        options_.device);
  }

  for (const Layer& layer : layers_) {
    at::Tensor h =
        nn::EnterTensorParallel(nn::RmsNorm(x, layer.attn_norm, model_.norm_eps()), rows, tp_);
    at::Tensor qkv = nn::ColumnParallelLinear(h, layer.qkv, at::Tensor())
                         .view({rows, local_kv, group + 2, head_dim});
    at::Tensor q =
        ApplyRope(qkv.narrow(2, 0, group).reshape({rows, local_heads, head_dim}), cos, sin);
    at::Tensor k = ApplyRope(qkv.select(2, group), cos, sin);  // [rows, local_kv, d]
    at::Tensor v = qkv.select(2, group + 1);
    // Keys and values of every position of the microbatch: this rank's, or all CP ranks'.
    at::Tensor all_k = k, all_v = v;
    std::vector<int64_t> kv_starts = starts;
    if (cp > 1) {
      at::Tensor mine = at::stack({k, v}, 1).reshape({rows, 2 * local_kv * head_dim});
      if (rows < gather_rows) {
        mine = at::cat({mine, at::zeros({gather_rows - rows, mine.size(1)}, mine.options())});
      }
      const at::Tensor gathered = nn::GatherFromSequenceParallel(mine, gather_rows * cp, cp_)
                                      .index_select(0, full_rows)
                                      .view({-1, 2, local_kv, head_dim});
      all_k = gathered.select(1, 0);
      all_v = gathered.select(1, 1);
      kv_starts = full_starts;
    }
    // On CUDA (bfloat16, float16, no CP) one varlen flash kernel over the packed rows: the
    // cumulative starts keep each sample's causal attention within itself, query head h reads kv
    // head h / group, and the output is already in the packed layout. Its backward is ATen's
    // (_flash_attention_backward). A GPU without the kernel fails the first call: the per-run
    // path below from then on (a later failure is the step's).
    at::Tensor attended;  // [rows, local_heads * head_dim]
    if (varlen_starts.defined()) {
      try {
        attended = std::get<0>(at::_flash_attention_forward(q, k, v, varlen_starts, varlen_starts,
                                                            longest, longest,
                                                            /*dropout_p=*/0.0, /*is_causal=*/true,
                                                            /*return_debug_mask=*/false, scale))
                       .reshape({rows, local_heads * head_dim});
        ++varlen_layers_;
      } catch (const c10::Error& e) {
        // Only the first call may fall back: once the kernel has run here, an error (out of
        // memory, a host sync under a sync check) is the step's.
        if (&layer != &layers_.front() || varlen_layers_ > 0) throw;
        HETPAR_LOG(WARNING) << "llm attention: the varlen flash kernel does not run here ("
                            << e.what_without_backtrace()
                            << "); one SDPA call per run of equal-length samples instead";
        varlen_failed_ = true;
        varlen_starts = at::Tensor();
      }
    }
    // at::scaled_dot_product_attention per packed sample, so that a sample attends only within
    // itself; a run of consecutive samples of one length (and, with CP, one key length) is one
    // call over a batch dimension, a view of the packed rows without a copy. enable_gqa: query
    // head h reads kv head h / group (the fused QKV weight's grouping) without copying K and V.
    // On the CPU this is ATen's flash kernel: its softmax accumulates in float32 for bfloat16 and
    // in the dtype for float32 and float64, and only the output and the log-sum-exp are kept for
    // backward. On CUDA (float32, CP, or without the varlen kernel) it is one flash,
    // memory-efficient or cuDNN kernel launch per run.
    if (!attended.defined()) {
      std::vector<at::Tensor> outputs;
      outputs.reserve(samples.size());
      for (size_t s = 0; s < samples.size();) {
        const int64_t length = starts[s + 1] - starts[s];
        const int64_t kv_length = kv_starts[s + 1] - kv_starts[s];
        // CP masks differ per sample: one sample per call there.
        size_t end = s + 1;
        while (cp == 1 && end < samples.size() && starts[end + 1] - starts[end] == length &&
               kv_starts[end + 1] - kv_starts[end] == kv_length) {
          ++end;
        }
        const int64_t n = static_cast<int64_t>(end - s);
        // [n, heads, L, d] queries; [n, kv, Lk, d] keys and values.
        const at::Tensor qs = q.narrow(0, starts[s], n * length)
                                  .view({n, length, local_heads, head_dim})
                                  .transpose(1, 2);
        const at::Tensor ks = all_k.narrow(0, kv_starts[s], n * kv_length)
                                  .view({n, kv_length, local_kv, head_dim})
                                  .transpose(1, 2);
        const at::Tensor vs = all_v.narrow(0, kv_starts[s], n * kv_length)
                                  .view({n, kv_length, local_kv, head_dim})
                                  .transpose(1, 2);
        const std::optional<at::Tensor> mask =
            cp > 1 ? std::optional<at::Tensor>(cp_masks[s]) : std::nullopt;
        const at::Tensor run =
            nn::GroupedQueryAttention(qs, ks, vs, mask, /*is_causal=*/cp == 1, scale);
        outputs.push_back(run.transpose(1, 2).reshape({n * length, local_heads * head_dim}));
        s = end;
      }
      attended = at::cat(outputs, 0);
    }
    x = x + nn::RowParallelLinear(attended, layer.proj, at::Tensor(), tp_);

    h = nn::EnterTensorParallel(nn::RmsNorm(x, layer.mlp_norm, model_.norm_eps()), rows, tp_);
    at::Tensor inner = at::silu(nn::ColumnParallelLinear(h, layer.gate, at::Tensor())) *
                       nn::ColumnParallelLinear(h, layer.up, at::Tensor());
    x = x + nn::RowParallelLinear(inner, layer.down, at::Tensor(), tp_);
  }

  if (!last_stage()) return x;
  return nn::EnterTensorParallel(nn::RmsNorm(x, norm_, model_.norm_eps()), rows, tp_);
}

absl::StatusOr<at::Tensor> LanguageModel::LocalLogits(const std::vector<LlmSample>& samples,
                                                      const at::Tensor& image_rows) {
  HETPAR_RETURN_IF_ERROR(Validate(samples, image_rows, /*n_global=*/1));
  if (cp_size() > 1 || options_.pp_stages > 1) {
    return absl::FailedPreconditionError(
        "llm logits: a context-parallel model or a pipeline stage holds only part of the model's "
        "work; predictions run on a model without context or pipeline parallelism");
  }
  return nn::RunTorchOr(
      absl::StrCat("llm logits on TP rank ", tp_.rank(), " of ", tp_.size()), [&] {
        at::NoGradGuard no_grad;
        return nn::ColumnParallelLinear(StageHidden(samples, image_rows, at::Tensor()), output_,
                                        at::Tensor());
      });
}

absl::StatusOr<std::vector<std::vector<int32_t>>> LanguageModel::Predict(
    const std::vector<LlmSample>& samples, const at::Tensor& image_rows) {
  HETPAR_ASSIGN_OR_RETURN(at::Tensor logits, LocalLogits(samples, image_rows));
  const int64_t vocab_begin = model_.vocab() / tp_.size() * tp_.rank();
  HETPAR_ASSIGN_OR_RETURN(at::Tensor ids, VocabParallelArgmax(logits, vocab_begin, *tp_.group));
  ids = ids.to(at::kCPU);
  const int64_t* id = ids.data_ptr<int64_t>();
  std::vector<std::vector<int32_t>> out;
  out.reserve(samples.size());
  for (const LlmSample& sample : samples) {
    const size_t length = sample.tokens.size();
    out.emplace_back(id, id + length);
    id += length;
  }
  return out;
}

absl::Status LanguageModel::Backward(const at::Tensor& loss) {
  if (!loss.defined() || loss.numel() != 1 || !loss.requires_grad()) {
    return absl::FailedPreconditionError(
        "llm backward: expected the scalar loss of a Forward with gradients enabled");
  }
  return nn::RunTorch(absl::StrCat("llm backward on TP rank ", tp_.rank(), " of ", tp_.size()),
                      [&] { loss.backward(); });
}

absl::Status LanguageModel::BackwardStage(const at::Tensor& output, const at::Tensor& output_grad) {
  if (!output.defined() || !output.requires_grad() || !output_grad.defined() ||
      !output.sizes().equals(output_grad.sizes())) {
    return absl::FailedPreconditionError(
        absl::StrCat("llm stage ", options_.pp_stage,
                     " backward: expected the output of a ForwardStage with "
                     "gradients enabled and a gradient of its shape"));
  }
  return nn::RunTorch(absl::StrCat("llm stage ", options_.pp_stage, " backward on TP rank ",
                                   tp_.rank(), " of ", tp_.size()),
                      [&] { output.backward(output_grad); });
}

absl::Status LanguageModel::FinishGradients() {
  if (!tp_.sharded()) return absl::OkStatus();
  return parameters_->ReducePartialGrads(*tp_.group);
}

}  // namespace hetpar::llm
