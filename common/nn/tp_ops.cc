#include "common/nn/tp_ops.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

namespace hetpar::nn {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr const char* kGroupKey = "group";
constexpr const char* kRowsKey = "rows";

void SaveGroup(AutogradContext* ctx, const CommGroupPtr& group) {
  ctx->saved_data[kGroupKey] = at::IValue::make_capsule(group);
}

CommGroupPtr LoadGroup(AutogradContext* ctx) {
  return c10::static_intrusive_pointer_cast<CommGroup>(ctx->saved_data[kGroupKey].toCapsule());
}

at::Tensor PadRows(const at::Tensor& x, int64_t padded_rows) {
  const int64_t rows = x.size(0);
  if (rows == padded_rows) return x.contiguous();
  std::vector<int64_t> shape = x.sizes().vec();
  shape[0] = padded_rows - rows;
  return at::cat({x, at::zeros(shape, x.options())}, 0);
}

// f: identity forward, all-reduce backward.
struct CopyToTp : public torch::autograd::Function<CopyToTp> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const CommGroupPtr& group) {
    SaveGroup(ctx, group);
    return x;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    at::Tensor grad = grads[0].clone(at::MemoryFormat::Contiguous);
    LoadGroup(ctx)->AllReduce(grad);
    return {grad, at::Tensor()};
  }
};

// g: all-reduce forward, identity backward.
struct ReduceFromTp : public torch::autograd::Function<ReduceFromTp> {
  static at::Tensor forward(AutogradContext*, const at::Tensor& x, const CommGroupPtr& group) {
    at::Tensor sum = x.clone(at::MemoryFormat::Contiguous);
    group->AllReduce(sum);
    return sum;
  }
  static variable_list backward(AutogradContext*, variable_list grads) {
    return {grads[0], at::Tensor()};
  }
};

struct ScatterToSp : public torch::autograd::Function<ScatterToSp> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const CommGroupPtr& group) {
    SaveGroup(ctx, group);
    ctx->saved_data[kRowsKey] = x.size(0);
    const SequenceShard shard = ShardSequence(x.size(0), group->rank(), group->size());
    return PadRows(x, shard.padded_rows)
        .narrow(0, shard.shard_rows * group->rank(), shard.shard_rows)
        .clone(at::MemoryFormat::Contiguous);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const int64_t rows = ctx->saved_data[kRowsKey].toInt();
    at::Tensor full = LoadGroup(ctx)->AllGatherRows(grads[0].contiguous());
    return {full.narrow(0, 0, rows), at::Tensor()};
  }
};

struct GatherFromSp : public torch::autograd::Function<GatherFromSp> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& shard, int64_t rows,
                            const CommGroupPtr& group) {
    SaveGroup(ctx, group);
    ctx->saved_data[kRowsKey] = rows;
    const SequenceShard expected = ShardSequence(rows, group->rank(), group->size());
    TORCH_CHECK(shard.size(0) == expected.shard_rows, "sequence shard has ", shard.size(0),
                " rows; expected ", expected.shard_rows, " (", rows, " rows over ", group->size(),
                " ranks)");
    return group->AllGatherRows(shard.contiguous()).narrow(0, 0, rows).contiguous();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const CommGroupPtr group = LoadGroup(ctx);
    const SequenceShard shard =
        ShardSequence(ctx->saved_data[kRowsKey].toInt(), group->rank(), group->size());
    return {group->ReduceScatterRows(PadRows(grads[0], shard.padded_rows)), at::Tensor(),
            at::Tensor()};
  }
};

struct ReduceScatterToSp : public torch::autograd::Function<ReduceScatterToSp> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& partial,
                            const CommGroupPtr& group) {
    SaveGroup(ctx, group);
    ctx->saved_data[kRowsKey] = partial.size(0);
    const SequenceShard shard = ShardSequence(partial.size(0), group->rank(), group->size());
    return group->ReduceScatterRows(PadRows(partial, shard.padded_rows));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const int64_t rows = ctx->saved_data[kRowsKey].toInt();
    at::Tensor full = LoadGroup(ctx)->AllGatherRows(grads[0].contiguous());
    return {full.narrow(0, 0, rows), at::Tensor()};
  }
};

at::ScalarType ComputeType(at::ScalarType dtype) {
  return dtype == at::kBFloat16 ? at::kFloat : dtype;
}

struct VocabParallelCe : public torch::autograd::Function<VocabParallelCe> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits,
                            const at::Tensor& targets, int64_t vocab_begin,
                            const CommGroupPtr& group) {
    TORCH_CHECK(logits.dim() == 2, "vocab-parallel cross-entropy: logits must be [rows, vocab/tp]");
    TORCH_CHECK(targets.dim() == 1 && targets.size(0) == logits.size(0),
                "vocab-parallel cross-entropy: ", targets.numel(), " targets for ", logits.size(0),
                " rows of logits");
    const int64_t local_vocab = logits.size(1);
    at::Tensor x = logits.to(ComputeType(logits.scalar_type()));
    at::Tensor max = std::get<0>(x.max(1)).contiguous();
    group->AllReduce(max, ReduceOp::kMax);
    at::Tensor shifted = x - max.unsqueeze(1);
    at::Tensor exp = shifted.exp();
    at::Tensor sum_exp = exp.sum(1).contiguous();
    group->AllReduce(sum_exp);
    at::Tensor local_target = targets - vocab_begin;
    at::Tensor in_range = (local_target >= 0).logical_and(local_target < local_vocab);
    at::Tensor index = local_target.masked_fill(in_range.logical_not(), 0).unsqueeze(1);
    at::Tensor target_logit =
        (shifted.gather(1, index).squeeze(1) * in_range.to(x.scalar_type())).contiguous();
    group->AllReduce(target_logit);
    at::Tensor loss = sum_exp.log() - target_logit;
    at::Tensor softmax = exp.div_(sum_exp.unsqueeze(1));
    ctx->save_for_backward({softmax, index, in_range});
    ctx->saved_data["dtype"] = static_cast<int64_t>(logits.scalar_type());
    return loss;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& softmax = saved[0];
    const at::Tensor& index = saved[1];
    const at::Tensor& in_range = saved[2];
    at::Tensor grad = softmax.clone();
    grad.scatter_add_(1, index, in_range.to(grad.scalar_type()).neg().unsqueeze(1));
    grad.mul_(grads[0].to(grad.scalar_type()).unsqueeze(1));
    const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt());
    return {grad.to(dtype), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

SequenceShard ShardSequence(int64_t rows, int rank, int size) {
  SequenceShard shard;
  shard.rows = rows;
  shard.padded_rows = (rows + size - 1) / size * size;
  shard.shard_rows = shard.padded_rows / size;
  shard.begin = std::min(rows, shard.shard_rows * rank);
  shard.end = std::min(rows, shard.shard_rows * (rank + 1));
  return shard;
}

at::Tensor CopyToTensorParallel(const at::Tensor& x, const CommGroupPtr& group) {
  if (group->size() == 1) return x;
  return CopyToTp::apply(x, group);
}

at::Tensor ReduceFromTensorParallel(const at::Tensor& x, const CommGroupPtr& group) {
  if (group->size() == 1) return x;
  return ReduceFromTp::apply(x, group);
}

at::Tensor ScatterToSequenceParallel(const at::Tensor& x, const CommGroupPtr& group) {
  if (group->size() == 1) return x;
  return ScatterToSp::apply(x, group);
}

at::Tensor GatherFromSequenceParallel(const at::Tensor& shard, int64_t rows,
                                      const CommGroupPtr& group) {
  if (group->size() == 1) return shard;
  return GatherFromSp::apply(shard, rows, group);
}

at::Tensor ReduceScatterToSequenceParallel(const at::Tensor& partial, const CommGroupPtr& group) {
  if (group->size() == 1) return partial;
  return ReduceScatterToSp::apply(partial, group);
}

at::Tensor EnterTensorParallel(const at::Tensor& x, int64_t rows, const TensorParallel& tp) {
  if (tp.sharded()) return GatherFromSequenceParallel(x, rows, tp.group);
  return CopyToTensorParallel(x, tp.group);
}

at::Tensor LeaveTensorParallel(const at::Tensor& partial, const TensorParallel& tp) {
  if (tp.sharded()) return ReduceScatterToSequenceParallel(partial, tp.group);
  return ReduceFromTensorParallel(partial, tp.group);
}

at::Tensor ToSequenceLayout(const at::Tensor& x, const TensorParallel& tp) {
  if (tp.sharded()) return ScatterToSequenceParallel(x, tp.group);
  return x;
}

at::Tensor ColumnParallelLinear(const at::Tensor& input, const at::Tensor& weight,
                                const at::Tensor& bias) {
  return at::linear(input, weight, bias);
}

at::Tensor RowParallelLinear(const at::Tensor& input, const at::Tensor& weight,
                             const at::Tensor& bias, const TensorParallel& tp) {
  at::Tensor out = LeaveTensorParallel(at::linear(input, weight), tp);
  return bias.defined() ? out + bias : out;
}

at::Tensor VocabParallelEmbedding(const at::Tensor& ids, const at::Tensor& weight,
                                  int64_t vocab_begin) {
  const int64_t local_vocab = weight.size(0);
  at::Tensor local = ids - vocab_begin;
  at::Tensor outside = (local < 0).logical_or(local >= local_vocab);
  at::Tensor rows = at::embedding(weight, local.masked_fill(outside, 0));
  return rows.masked_fill(outside.unsqueeze(1), 0);
}

at::Tensor VocabParallelCrossEntropy(const at::Tensor& logits, const at::Tensor& targets,
                                     int64_t vocab_begin, const CommGroupPtr& group) {
  return VocabParallelCe::apply(logits, targets, vocab_begin, group);
}

at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& scale, double eps) {
  at::Tensor xf = x.to(ComputeType(x.scalar_type()));
  at::Tensor normed = xf * at::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return normed.to(x.scalar_type()) * scale;
}

at::Tensor LayerNorm(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& bias,
                     double eps) {
  const at::ScalarType compute = ComputeType(x.scalar_type());
  if (compute == x.scalar_type()) return at::layer_norm(x, {x.size(-1)}, scale, bias, eps);
  return at::layer_norm(x.to(compute), {x.size(-1)}, scale.to(compute), bias.to(compute), eps)
      .to(x.scalar_type());
}

}  // namespace hetpar::nn
