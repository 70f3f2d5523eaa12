// Megatron-style tensor-parallel operators and layers (autograd-aware).
//
// Activations are 2-D `[rows, features]`: the rows of a packed sequence (the tokens of every
// sample or image of a microbatch, one after another). A TP group of size t splits weights:
//
//   column-parallel linear  W [out, in] split on dim 0: input replicated, output split by features
//   row-parallel linear     W [out, in] split on dim 1: input split by features, output a partial
//                           sum that is all-reduced (or reduce-scattered, with SP)
//   vocab-parallel embedding / cross-entropy: the vocabulary split in t contiguous ranges
//
// The conjugate operators (Megatron's f and g) move tensors in and out of TP regions:
//
//   CopyToTensorParallel            forward identity,    backward all-reduce
//   ReduceFromTensorParallel        forward all-reduce,  backward identity
//
// With sequence parallelism the parts outside TP regions (norms, residual adds) run on a
// contiguous shard of the rows, and the all-reduces become reduce-scatters and all-gathers:
//
//   ScatterToSequenceParallel       forward keep own shard,   backward all-gather
//   GatherFromSequenceParallel      forward all-gather,       backward reduce-scatter
//   ReduceScatterToSequenceParallel forward reduce-scatter,   backward all-gather
//
// The rows are padded with zeros to a multiple of t (see ShardSequence), so any row count works;
// padding rows never reach an output and get zero gradient.
//
// These functions throw c10::Error on failure (they run inside autograd); callers wrap whole
// forward/backward passes in RunTorch (torch_status.h). Collectives follow the order of the
// calls, which is the same on every rank of a group because every rank runs the same graph.
#ifndef HETPAR_COMMON_NN_TP_OPS_H_
#define HETPAR_COMMON_NN_TP_OPS_H_

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "common/nn/communicator.h"

namespace hetpar::nn {

// A module's TP group and whether it runs sequence parallelism.
struct TensorParallel {
  CommGroupPtr group;
  bool sequence_parallel = false;

  int rank() const { return group->rank(); }
  int size() const { return group->size(); }
  // True when activations outside TP regions are row shards (SP on a group of more than one).
  bool sharded() const { return sequence_parallel && group->size() > 1; }
};

// How the `rows` rows of a packed sequence are split over a group of `size` ranks under sequence
// parallelism: padded to a multiple of size, then equal contiguous shards.
struct SequenceShard {
  int64_t rows = 0;         // real rows of the full sequence
  int64_t padded_rows = 0;  // rows rounded up to a multiple of size
  int64_t shard_rows = 0;   // padded_rows / size
  int64_t begin = 0;        // first row of this rank's shard
  int64_t end = 0;          // one past its last real row (begin <= end <= rows)
};
SequenceShard ShardSequence(int64_t rows, int rank, int size);

at::Tensor CopyToTensorParallel(const at::Tensor& x, const CommGroupPtr& group);
at::Tensor ReduceFromTensorParallel(const at::Tensor& x, const CommGroupPtr& group);
// x: the full [rows, ...] (replicated). Returns this rank's [shard_rows, ...] shard.
at::Tensor ScatterToSequenceParallel(const at::Tensor& x, const CommGroupPtr& group);
// shard: [shard_rows, ...]. Returns the full [rows, ...] on every rank.
at::Tensor GatherFromSequenceParallel(const at::Tensor& shard, int64_t rows,
                                      const CommGroupPtr& group);
// partial: [rows, ...], a partial sum on each rank. Returns this rank's shard of the sum.
at::Tensor ReduceScatterToSequenceParallel(const at::Tensor& partial, const CommGroupPtr& group);

// Into a TP region: the replicated (or, with SP, row-sharded) x becomes the full [rows, ...]
// input of a column-parallel layer.
at::Tensor EnterTensorParallel(const at::Tensor& x, int64_t rows, const TensorParallel& tp);
// Out of a TP region: sums the partial outputs of a row-parallel layer, into the replicated
// [rows, ...] (or, with SP, this rank's shard).
at::Tensor LeaveTensorParallel(const at::Tensor& partial, const TensorParallel& tp);
// To the row layout outside TP regions: x replicated [rows, ...] -> itself, or its shard with SP.
at::Tensor ToSequenceLayout(const at::Tensor& x, const TensorParallel& tp);

// y = x W^T + b with W [out/t, in] and b [out/t] (b may be undefined).
at::Tensor ColumnParallelLinear(const at::Tensor& input, const at::Tensor& weight,
                                const at::Tensor& bias);
// y = sum over ranks of x_r W_r^T, then + b; W [out, in/t], b [out] replicated (may be undefined).
at::Tensor RowParallelLinear(const at::Tensor& input, const at::Tensor& weight,
                             const at::Tensor& bias, const TensorParallel& tp);

// Embedding rows of `ids` ([rows], int64) from this rank's vocabulary range
// [vocab_begin, vocab_begin + weight.size(0)); rows of other ranks' ids are zero. The sum over
// ranks (LeaveTensorParallel) is the full embedding.
at::Tensor VocabParallelEmbedding(const at::Tensor& ids, const at::Tensor& weight,
                                  int64_t vocab_begin);

// Per-row cross-entropy of logits split by vocabulary: logits [rows, vocab/t] for this rank's
// range starting at vocab_begin, targets [rows] (int64, full-vocabulary ids). Returns [rows],
// the same on every rank. No rank ever holds full-vocabulary logits. Computed in float32 for
// bfloat16 logits (the result is float32 then), else in the logits' dtype.
at::Tensor VocabParallelCrossEntropy(const at::Tensor& logits, const at::Tensor& targets,
                                     int64_t vocab_begin, const CommGroupPtr& group);

// Normalisations over the last dim; bfloat16 inputs are normalised in float32.
at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& scale, double eps);
at::Tensor LayerNorm(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& bias,
                     double eps);

}  // namespace hetpar::nn

#endif  // HETPAR_COMMON_NN_TP_OPS_H_
