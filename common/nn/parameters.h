// Named, tensor-parallel-sliced parameters with layout-independent initialisation.
//
// Every parameter has a stable name ("llm.layers.0.attn.qkv.weight") and a full shape. Its
// values are a pure function of (run seed, name, full shape, init rule): row i of dim 0 is drawn
// from a generator seeded by (run seed, name, i) (a 1-D tensor is drawn whole). A TP rank then
// keeps its slice: equal contiguous parts of one dimension (`split_dim`), or the whole tensor
// when the parameter is replicated. So a rank of any TP size holds exactly the slice of the
// single-process model, and a rank only draws the rows its slice touches.
//
// ParameterSet owns a module's parameters in registration order. The tensors are autograd leaves;
// gradients accumulate in tensor.grad() as usual, in grad_dtype(): float32 for bfloat16 and
// float16 parameters (libtorch's grad_dtype, so the waves of a step add up in float32), the
// parameter's dtype otherwise. A checkpoint or parity tool walks parameters()
// and uses each entry's full_shape and slice to place the local tensor in the full one.
#ifndef HETPAR_COMMON_NN_PARAMETERS_H_
#define HETPAR_COMMON_NN_PARAMETERS_H_

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/nn/communicator.h"
#include "hetpar/v1/run_spec.pb.h"

namespace hetpar::nn {

// The torch dtype of a RunSpec dtype (run.dtype); DTYPE_UNSPECIFIED is an error.
absl::StatusOr<at::ScalarType> TorchDtype(hetpar::v1::Dtype dtype);
// The RunSpec spelling of a torch dtype ("float32", "float64", "bfloat16"), else torch's name.
std::string DtypeName(at::ScalarType dtype);

// How a parameter's full tensor is initialised.
struct InitRule {
  enum class Kind { kNormal, kConstant };
  Kind kind = Kind::kNormal;
  double mean = 0.0;  // kNormal: mean; kConstant: the value
  double std = 0.0;   // kNormal only

  static InitRule Normal(double std, double mean = 0.0) { return {Kind::kNormal, mean, std}; }
  static InitRule Constant(double value) { return {Kind::kConstant, value, 0.0}; }
};

// Which parameters the models draw at random.
enum class InitStyle {
  // Training: weights ~ N(0, std); biases 0; norm scales 1.
  kTraining,
  // Biases ~ N(0, 0.02) and norm scales ~ N(1, 0.1) too, so that tests see every parameter act
  // on the output (a zero bias would hide a bias applied in the wrong place).
  kAllRandom,
};

// How a parameter is split over the ranks of its TP group.
struct TpSlice {
  int split_dim = -1;  // -1: replicated, every rank holds the full tensor
  int64_t offset = 0;  // first index of this rank's part along split_dim
  int64_t length = 0;  // its length: full_shape[split_dim] / tp size (0 when replicated)
};

struct NamedParameter {
  std::string name;
  at::Tensor tensor;  // this rank's part; an autograd leaf that requires grad unless frozen
  std::vector<int64_t> full_shape;
  TpSlice slice;
  // Under sequence parallelism, a replicated parameter used on this rank's sequence shard only
  // (norm scales, biases added after a reduce-scatter) gets a partial gradient; the TP ranks'
  // gradients must be summed (ParameterSet::ReducePartialGrads) before an optimizer step.
  bool grad_partial_over_sequence = false;
  // False once frozen (ParameterSet::Freeze): no gradient, no optimizer state, no update.
  bool trainable = true;
  // An embedding table (ParameterSet::MarkEmbedding): weight decay applies to it only unless
  // optimizer.no_decay_embeddings is set.
  bool embedding = false;
};

// The 64-bit seed of a parameter: a hash of the run seed and the name (stable across builds and
// machines).
uint64_t ParameterSeed(int64_t run_seed, std::string_view name);

// This rank's part of the full tensor that (run_seed, name, full_shape, rule) defines: the rows
// [offset, offset + length) of split_dim, or all of it when split_dim is -1. Throws c10::Error on
// bad arguments (callers use ParameterSet::Add).
at::Tensor InitSlice(int64_t run_seed, std::string_view name,
                     const std::vector<int64_t>& full_shape, const InitRule& rule, int split_dim,
                     int64_t offset, int64_t length, at::ScalarType dtype);

class ParameterSet {
 public:
  ParameterSet(int64_t run_seed, at::ScalarType dtype, int tp_rank, int tp_size, InitStyle style)
      : run_seed_(run_seed), dtype_(dtype), tp_rank_(tp_rank), tp_size_(tp_size), style_(style) {}
  ParameterSet(const ParameterSet&) = delete;
  ParameterSet& operator=(const ParameterSet&) = delete;

  // Creates, initialises and registers a parameter; returns this rank's tensor. split_dim -1 is
  // replicated; otherwise full_shape[split_dim] must divide by the TP size. Names are unique.
  absl::StatusOr<at::Tensor> Add(const std::string& name, std::vector<int64_t> full_shape,
                                 int split_dim, const InitRule& rule,
                                 bool grad_partial_over_sequence = false);

  // Marks the registered parameter `name` as an embedding table (NamedParameter::embedding);
  // NotFound for an unknown name.
  absl::Status MarkEmbedding(std::string_view name);

  // Init rules for biases and norm scales under this set's InitStyle.
  InitRule BiasInit() const;
  InitRule NormScaleInit() const;

  // Every parameter in registration order, with its TP slicing.
  const std::vector<NamedParameter>& parameters() const { return parameters_; }
  // nullptr when absent.
  const NamedParameter* Find(std::string_view name) const;

  int64_t LocalNumel() const;  // elements held by this rank
  int64_t FullNumel() const;   // elements of the full model

  // Freezes every parameter whose name starts with `prefix` and is not under one of `except`
  // (prefixes too): it stops requiring grad, so autograd records nothing for it. Returns how
  // many it froze.
  int64_t Freeze(std::string_view prefix, const std::vector<std::string>& except = {});
  // Elements of this rank's trainable parameters.
  int64_t TrainableLocalNumel() const;
  bool AnyTrainable() const;

  // Drops every gradient (grad() becomes undefined).
  void ZeroGrad();
  // Moves every parameter to `device` in place (Tensor::set_data), so that every holder of a
  // parameter's tensor (the model's layers, autograd) sees it there; drops the gradients. Models
  // call it once built: parameters are drawn on the host.
  void MoveTo(const c10::Device& device);
  // Sums over the TP group, in one all-reduce, the gradients of parameters marked
  // grad_partial_over_sequence (trainable ones). A parameter without a gradient counts as zero.
  absl::Status ReducePartialGrads(const CommGroup& tp);

  int64_t run_seed() const { return run_seed_; }
  at::ScalarType dtype() const { return dtype_; }
  // The dtype gradients accumulate in: float32 for bfloat16 and float16 parameters, else dtype().
  at::ScalarType grad_dtype() const { return GradDtypeOf(dtype_); }
  static at::ScalarType GradDtypeOf(at::ScalarType dtype) {
    return dtype == at::kBFloat16 || dtype == at::kHalf ? at::kFloat : dtype;
  }
  // A zero gradient for `param` (its shape, grad_dtype()).
  at::Tensor ZeroGradient(const NamedParameter& param) const;
  int tp_rank() const { return tp_rank_; }
  int tp_size() const { return tp_size_; }

 private:
  int64_t run_seed_;
  at::ScalarType dtype_;
  int tp_rank_;
  int tp_size_;
  InitStyle style_;
  std::vector<NamedParameter> parameters_;
};

// The full tensor of `param` assembled from the `local` parts of every rank of `tp` (all-gather
// along split_dim); `local` itself when replicated. Every rank of `tp` must call it.
absl::StatusOr<at::Tensor> GatherFullTensor(Communicator& tp, const NamedParameter& param,
                                            const at::Tensor& local);

}  // namespace hetpar::nn

#endif  // HETPAR_COMMON_NN_PARAMETERS_H_
