// The decoder-only LLM, tensor-parallel over a TP group, with image rows spliced into its input.
//
// A microbatch is a list of samples packed into one sequence of rows (sample after sample);
// attention is causal inside each sample and never crosses samples; rotary positions restart at
// 0 in each sample.
//
//   token ids -> vocab-parallel embedding -> image rows replace the rows of image placeholders
//     -> `layers` pre-norm blocks: x += Attn(RMSNorm(x)); x += SwiGLU(RMSNorm(x))
//        attention: causal, RoPE, grouped-query when kv_heads < heads, split by heads over TP
//     -> final RMSNorm -> vocab-parallel output head (only at loss positions)
//     -> vocab-parallel cross-entropy per loss token
//   loss = sum over the microbatch's loss tokens / N_global
//
// N_global is the number of loss tokens in the whole global batch (all microbatches, all DP
// replicas): with it every microbatch's loss adds up to the global mean and no gradient depends
// on the DP size or the number of microbatches.
//
// Image rows: one [n_image_rows, hidden] tensor per microbatch holding the blocks of every image
// of every sample, in sample order (and image order within a sample). Sample s takes the next
// `image_rows` rows and puts them, in order, at its `image_positions`. The gradient with respect
// to these rows is what goes back to the encoder: pass a leaf with requires_grad(true) and read
// its grad() after Backward (or pass the encoder's output itself, in one process, and the
// gradient flows on into the encoder). Without sequence parallelism every TP rank reads every row
// and gets the full gradient. With it a rank reads only the rows whose placeholders fall in its
// sequence shard (ImageRowsReadByRank; the others may hold anything, e.g. zeros), its gradient
// covers those rows (zeros elsewhere, or undefined when it reads none), and the sum over the TP
// ranks is the full gradient (image_rows_grad_is_partial()).
//
// Parameter names (stable; init seeds and checkpoints use them), d = hidden / heads,
// g = heads / kv_heads:
//   llm.embed.weight [vocab, hidden]                       split on dim 0 (vocabulary)
//   llm.layers.<i>.attn_norm.weight [hidden]
//   llm.layers.<i>.attn.qkv.weight [(heads + 2*kv_heads)*d, hidden]   split on dim 0; rows
//       grouped by kv head: group j owns rows [(g+2)*d*j, (g+2)*d*(j+1)) = its g query heads,
//       then its key head, then its value head (so any TP size that divides kv_heads slices it)
//   llm.layers.<i>.attn.proj.weight [hidden, heads*d]      split on dim 1
//   llm.layers.<i>.mlp_norm.weight [hidden]
//   llm.layers.<i>.mlp.gate.weight [ffn, hidden]           split on dim 0
//   llm.layers.<i>.mlp.up.weight [ffn, hidden]             split on dim 0
//   llm.layers.<i>.mlp.down.weight [hidden, ffn]           split on dim 1
//   llm.norm.weight [hidden]
//   llm.output.weight [vocab, hidden]                      split on dim 0 (vocabulary)
//
// dtypes: float32, float64, bfloat16. Norms, softmax and cross-entropy run in float32 for
// bfloat16; the loss is float64 for a float64 model and float32 otherwise.
//
// Context parallelism (SetContextParallel, cp > 1): each sample, as padded to seq_len positions,
// is cut into 2*cp chunks and CP rank i holds chunks i and 2*cp-1-i (plan/sequence_sharding.h,
// the split the boundary plan routes image rows by). A rank packs only the positions it holds;
// norms, projections and the MLP run on them alone. Attention all-gathers every layer's keys and
// values over the CP group (one all-gather of the microbatch's K and V; its backward a
// reduce-scatter that returns to each rank the gradient of its own keys and values) and each
// query attends to the keys at positions up to its own. All-gather rather than a ring: one
// collective per layer instead of cp-1 ring steps, and a result that does not depend on the
// order of partial sums (a ring has not been measured against it). The loss covers this rank's
// loss positions only: the sum over CP ranks is the replica's loss, and parameter gradients are
// summed over the CP ranks as over DP replicas. The image rows tensor holds every image row of
// the microbatch; a CP rank reads only those whose placeholders lie in its positions
// (CpLocalPositions; the other rows may hold anything) and its gradient covers those.
//
// Threading: one thread drives a LanguageModel (its collectives follow the TP group's order).
#ifndef HETPAR_LLM_TRAINER_LANGUAGE_MODEL_H_
#define HETPAR_LLM_TRAINER_LANGUAGE_MODEL_H_

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/nn/communicator.h"
#include "common/nn/parameters.h"
#include "common/nn/tp_ops.h"
#include "hetpar/v1/run_spec.pb.h"

namespace hetpar::llm {

// One training sample as the LLM sees it.
struct LlmSample {
  std::string id;                        // names the sample in errors
  std::vector<int64_t> tokens;           // token ids (text and image placeholders), 1..seq_len
  std::vector<int64_t> labels;           // target id at each position (the next token)
  std::vector<uint8_t> loss_mask;        // 1 where the position's label counts in the loss
  std::vector<int64_t> image_positions;  // increasing positions of image placeholder tokens
  int64_t image_rows = 0;                // rows of the image tensor that belong to this sample
};

// The rows of a microbatch's image-rows tensor that TP rank `tp_rank` of `tp_size` reads, in
// increasing order: all of them without sequence parallelism, else those whose placeholder lies
// in the rank's sequence shard (the packed rows padded to a multiple of tp_size, split in equal
// contiguous shards; see nn::ShardSequence).
std::vector<int64_t> ImageRowsReadByRank(const std::vector<LlmSample>& samples, int tp_rank,
                                         int tp_size, bool sequence_parallel);

// Positions of a sample of `length` tokens that CP rank `cp_rank` of `cp` holds when sequences
// are padded to `seq_len` (chunks cp_rank and 2*cp-1-cp_rank of seq_len / (2*cp) positions),
// increasing. cp = 1: all of them.
std::vector<int64_t> CpLocalPositions(int64_t length, int64_t seq_len, int64_t cp, int64_t cp_rank);

struct LlmOptions {
  at::ScalarType dtype = at::kFloat;
  // Where the parameters live and the model computes (nn::ExecutionContext::device); inputs
  // (image rows, a later stage's input) must be there too.
  c10::Device device = c10::kCPU;
  int64_t seed = 1234;  // run seed; parameter seeds derive from it and their names
  bool sequence_parallel = false;
  nn::InitStyle init_style = nn::InitStyle::kTraining;
  // Pipeline stage this model is (plan::PipelineStageLayers): stage 0 holds the embedding, the last
  // stage the final norm and the output head, each stage its share of the layers. The default
  // is the whole model.
  int64_t pp_stage = 0;
  int64_t pp_stages = 1;
  // On CUDA in bfloat16 or float16 without CP: the attention of all of a microbatch's packed
  // samples in one varlen flash kernel (cumulative sequence lengths, no mask, no padding). False,
  // or where that kernel cannot run (another dtype, CP, a head size it lacks, a GPU without
  // it): one SDPA call per run of equal-length samples, as on the CPU.
  bool varlen_attention = true;
};

// Options of a RunSpec: run.dtype, run.seed and llm.layout.sequence_parallel.
absl::StatusOr<LlmOptions> LlmOptionsFromSpec(const hetpar::v1::RunSpec& spec);

struct LlmForwardResult {
  at::Tensor loss;          // scalar: sum of token losses / N_global, attached to autograd
  int64_t loss_tokens = 0;  // loss tokens of this microbatch
};

// One pipeline stage's forward of a microbatch: the last stage's loss, or the activations every
// other stage hands on ([rows, hidden] in the sequence layout: this rank's rows under SP).
struct LlmStageResult {
  at::Tensor output;        // not the last stage: what the next stage takes as `input`
  at::Tensor loss;          // the last stage: as LlmForwardResult
  int64_t loss_tokens = 0;  // the last stage
};

// The argmax over the vocabulary of logits split by vocabulary over `tp`: `local_logits` is this
// rank's [rows, vocab / tp] slice, whose column j is token `vocab_begin + j`. Returns the global
// token id of each row's largest logit (int64 [rows]), the same on every rank; of equal maxima
// the smallest id wins, as in an argmax of the full logits. Only [rows] values cross the group
// (an all-reduce of the row maxima, then one of the winning ids). A row with a NaN logit on any
// rank has no maximum: InvalidArgument naming the row. Every rank of `tp` must call it.
absl::StatusOr<at::Tensor> VocabParallelArgmax(const at::Tensor& local_logits, int64_t vocab_begin,
                                               const nn::CommGroup& tp);

class LanguageModel {
 public:
  // Builds and initialises this rank's part of the model over the TP group `tp` (the model keeps
  // a reference to the group, not to `tp`). Sizes that do not split over the group are
  // InvalidArgument naming the field.
  static absl::StatusOr<std::unique_ptr<LanguageModel>> Create(const hetpar::v1::LlmModel& model,
                                                               const LlmOptions& options,
                                                               const nn::Communicator& tp);

  LanguageModel(const LanguageModel&) = delete;
  LanguageModel& operator=(const LanguageModel&) = delete;

  // Forward of one microbatch. `image_rows` is [sum of samples' image_rows, hidden] in the model
  // dtype, or undefined when no sample has images. Every TP rank passes the same samples and
  // rows. Errors (InvalidArgument) name the sample and what is wrong.
  absl::StatusOr<LlmForwardResult> Forward(const std::vector<LlmSample>& samples,
                                           const at::Tensor& image_rows, int64_t n_global);

  // A pipeline stage's forward (options.pp_stages > 1; the whole model is the one stage too).
  // The first stage takes `image_rows` as Forward does; a later stage takes `input`, the previous
  // stage's output (pass a leaf that requires grad and send its grad() back after the backward
  // of this stage's output). The last stage returns the loss, the others their output: its
  // backward is output.backward(gradient from the next stage).
  absl::StatusOr<LlmStageResult> ForwardStage(const std::vector<LlmSample>& samples,
                                              const at::Tensor& image_rows, const at::Tensor& input,
                                              int64_t n_global);
  // Rows of the activations between stages for `samples` on this rank: a non-last stage's output
  // and a later stage's input (this CP rank's packed positions, this TP rank's shard under SP).
  int64_t StageRows(const std::vector<LlmSample>& samples) const;
  // Backpropagates a non-last stage's `output` with `output_grad`, its gradient from the next
  // stage: parameter gradients accumulate, and so does the gradient of the stage's input.
  absl::Status BackwardStage(const at::Tensor& output, const at::Tensor& output_grad);
  // Whether the whole model (every pipeline stage of it) has a parameter of this name; a stage
  // loading the whole model's file skips the others' parameters, and only those (init_from).
  bool WholeModelHas(std::string_view name) const;
  bool first_stage() const { return options_.pp_stage == 0; }
  bool last_stage() const { return options_.pp_stage == options_.pp_stages - 1; }

  // Backpropagates a loss returned by Forward: parameter gradients accumulate, and so does the
  // gradient of the image rows passed to that Forward.
  absl::Status Backward(const at::Tensor& loss);

  // Once per step, after the last Backward: sums over the TP group the gradients that sequence
  // parallelism leaves partial (the norm scales). No-op without SP.
  absl::Status FinishGradients();

  // This rank's vocabulary slice of the logits at every position of the packed samples, without
  // autograd: [sum of sample lengths, vocab / tp], column j is token vocab / tp * rank + j.
  // Inputs and errors as for Forward (labels and the loss mask are not used).
  absl::StatusOr<at::Tensor> LocalLogits(const std::vector<LlmSample>& samples,
                                         const at::Tensor& image_rows);

  // The predicted token id (the argmax of the logits) at every position of every sample, without
  // autograd. Computed vocab-parallel (VocabParallelArgmax): no rank holds full-vocabulary
  // logits, every TP rank returns the same ids, and ties go to the smallest id, as a tp=1 argmax.
  absl::StatusOr<std::vector<std::vector<int32_t>>> Predict(const std::vector<LlmSample>& samples,
                                                            const at::Tensor& image_rows);

  // True when each TP rank's gradient of the image rows covers only its sequence shard.
  bool image_rows_grad_is_partial() const { return tp_.sharded(); }

  // Runs context-parallel over `cp` (this rank's CP group, same TP rank on every member); a group
  // of one leaves the model as it is; sequence parallelism, if on, then splits each CP rank's
  // rows over the TP group. InvalidArgument when seq_len does not split into 2 x cp chunks. Call
  // before the first Forward; every member calls it.
  absl::Status SetContextParallel(nn::CommGroupPtr cp);
  int64_t cp_size() const { return cp_.defined() ? cp_->size() : 1; }
  int64_t cp_rank() const { return cp_.defined() ? cp_->rank() : 0; }

  // The varlen flash kernel (LlmOptions::varlen_attention) failed on its first call here, and
  // attention runs one SDPA call per run of equal-length samples instead.
  bool varlen_attention_failed() const { return varlen_failed_; }
  // Layer calls that ran the varlen flash kernel so far (tests: the kernel did run).
  int64_t varlen_attention_layers() const { return varlen_layers_; }
  nn::ParameterSet& parameters() { return *parameters_; }
  const nn::ParameterSet& parameters() const { return *parameters_; }
  const hetpar::v1::LlmModel& model() const { return model_; }
  const LlmOptions& options() const { return options_; }

 private:
  struct Layer {
    at::Tensor attn_norm, qkv, proj, mlp_norm, gate, up, down;
  };

  LanguageModel(const hetpar::v1::LlmModel& model, const LlmOptions& options,
                nn::TensorParallel tp);
  absl::Status Build();
  absl::Status Validate(const std::vector<LlmSample>& samples, const at::Tensor& image_rows,
                        int64_t n_global) const;
  // The loss of the final-norm activations `h` of the packed rows this CP rank holds.
  LlmForwardResult LossOf(const std::vector<LlmSample>& samples, const at::Tensor& h,
                          int64_t n_global);
  // The stage's layers over the packed rows this CP rank holds: from the embedding and the
  // image rows on the first stage, else from `input`. The last stage ends with the final norm
  // ([rows, hidden] on every TP rank); the others return the sequence layout.
  at::Tensor StageHidden(const std::vector<LlmSample>& samples, const at::Tensor& image_rows,
                         const at::Tensor& input);

  hetpar::v1::LlmModel model_;
  LlmOptions options_;
  nn::TensorParallel tp_;
  nn::CommGroupPtr cp_;  // null without context parallelism
  std::unique_ptr<nn::ParameterSet> parameters_;
  at::Tensor embed_;
  std::vector<Layer> layers_;
  at::Tensor norm_;
  at::Tensor output_;
  at::Tensor rope_cos_, rope_sin_;  // [seq_len, head_dim] in the model dtype
  // The varlen kernel failed once (a GPU without flash attention): the per-run path from then on.
  bool varlen_failed_ = false;
  int64_t varlen_layers_ = 0;
};

}  // namespace hetpar::llm

#endif  // HETPAR_LLM_TRAINER_LANGUAGE_MODEL_H_
