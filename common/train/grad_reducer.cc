#include "common/train/grad_reducer.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/nn/torch_status.h"

namespace hetpar::train {
namespace {

// Tells the reducer that one parameter's gradient accumulation finished.
class AccumulatedHook : public torch::autograd::PostAccumulateGradHook {
 public:
  AccumulatedHook(GradientReducer* reducer, int slot) : reducer_(reducer), slot_(slot) {}
  void operator()(const torch::autograd::Variable& /*tensor*/) override {
    reducer_->OnAccumulated(slot_);
  }

 private:
  GradientReducer* reducer_;
  int slot_;
};

}  // namespace

int64_t GradBucketBytes(const hetpar::v1::RunSpec& spec) {
  return static_cast<int64_t>(spec.run().grad_bucket_mib() * 1024 * 1024);
}

GradientReducer::GradientReducer(nn::ParameterSet* params, int64_t bucket_bytes) : params_(params) {
  const int64_t element = c10::elementSize(params->grad_dtype());
  const int64_t capacity = std::max<int64_t>(1, bucket_bytes / element);
  // Reverse registration order: the order backward produces the gradients in.
  const std::vector<nn::NamedParameter>& list = params->parameters();
  int64_t filled = capacity;  // elements in the current bucket; starts "full": open one
  for (auto it = list.rbegin(); it != list.rend(); ++it) {
    if (!it->trainable) continue;
    const int64_t n = it->tensor.numel();
    if (filled > 0 && filled + n > capacity) {
      buckets_.emplace_back();
      filled = 0;
    }
    Slot slot;
    slot.param = &*it;
    slot.bucket = static_cast<int>(buckets_.size()) - 1;
    slot.offset = filled;
    filled += n;
    buckets_.back().slots.push_back(static_cast<int>(slots_.size()));
    slots_.push_back(slot);
  }
  for (size_t i = 0; i < slots_.size(); ++i) {
    torch::autograd::impl::set_post_acc_grad_hooks(
        slots_[i].param->tensor, std::make_unique<AccumulatedHook>(this, static_cast<int>(i)));
  }
  AllocateBuffers();
}

GradientReducer::~GradientReducer() {
  Abandon();
  for (const Slot& slot : slots_) {
    torch::autograd::impl::set_post_acc_grad_hooks(slot.param->tensor, nullptr);
  }
}

void GradientReducer::AllocateBuffers() {
  std::vector<int64_t> sizes(buckets_.size(), 0);
  for (const Slot& slot : slots_) sizes[slot.bucket] += slot.param->tensor.numel();
  for (size_t b = 0; b < buckets_.size(); ++b) {
    buckets_[b].buffer = at::zeros(
        {sizes[b]}, params_->parameters().front().tensor.options().dtype(params_->grad_dtype()));
  }
}

absl::Status GradientReducer::BeginStep(nn::Communicator* dp) {
  // A step that failed after starting collectives: its buckets may still be written.
  Abandon();
  dp_ = dp;
  armed_ = false;
  in_step_ = true;
  next_to_start_ = 0;
  started_during_backward_ = 0;
  return nn::RunTorch("preparing the gradient buckets", [&] {
    at::NoGradGuard no_grad;
    for (Bucket& bucket : buckets_) {
      bucket.buffer.zero_();
      bucket.ready = 0;
    }
    for (Slot& slot : slots_) {
      slot.counted = false;
      const at::Tensor& p = slot.param->tensor;
      p.mutable_grad() =
          buckets_[slot.bucket].buffer.narrow(0, slot.offset, p.numel()).view(p.sizes());
    }
  });
}

void GradientReducer::ArmLastBackward() { armed_ = in_step_; }

void GradientReducer::OnAccumulated(int index) {
  if (!armed_) return;
  Slot& slot = slots_[index];
  if (slot.counted) return;
  slot.counted = true;
  ++buckets_[slot.bucket].ready;
  const int before = next_to_start_;
  StartReady(/*all=*/false);
  started_during_backward_ += next_to_start_ - before;
}

void GradientReducer::StartReady(bool all) {
  while (next_to_start_ < static_cast<int>(buckets_.size())) {
    Bucket& bucket = buckets_[next_to_start_];
    if (!all && bucket.ready < static_cast<int>(bucket.slots.size())) return;
    // Autograd may have replaced a view by a tensor of its own (it does not when the gradient
    // is defined and accumulation runs without grad mode, as here); copy such a one in.
    for (int s : bucket.slots) {
      const Slot& slot = slots_[s];
      const at::Tensor& grad = slot.param->tensor.grad();
      at::Tensor view = bucket.buffer.narrow(0, slot.offset, slot.param->tensor.numel());
      if (!grad.defined()) continue;
      if (grad.data_ptr() != view.data_ptr()) {
        at::NoGradGuard no_grad;
        view.copy_(grad.reshape({-1}));
        slot.param->tensor.mutable_grad() = view.view(slot.param->tensor.sizes());
      }
    }
    bucket.work = dp_->group()->StartAllReduce(bucket.buffer);
    ++next_to_start_;
  }
}

absl::Status GradientReducer::Finish() {
  if (!in_step_) return absl::FailedPreconditionError("GradientReducer::Finish without BeginStep");
  armed_ = false;
  absl::Status status =
      nn::RunTorch(absl::StrCat("gradient all-reduce in group '", dp_->prefix(), "'"), [&] {
        StartReady(/*all=*/true);
        for (Bucket& bucket : buckets_) {
          dp_->group()->WaitFor(bucket.work, "gradient all-reduce");
          bucket.work.reset();
        }
      });
  if (!status.ok()) {
    Abandon();
    return status;
  }
  in_step_ = false;
  return absl::OkStatus();
}

void GradientReducer::Abandon() {
  armed_ = false;
  in_step_ = false;
  bool pending = false;
  for (Bucket& bucket : buckets_) {
    // A collective that completed holds nothing back; only one still running does.
    if (bucket.work && !bucket.work->isCompleted()) pending = true;
    bucket.work.reset();
  }
  if (!pending) return;
  // The backend may still write the old buffers: the group is given up and the buckets replaced.
  if (dp_ != nullptr) dp_->group()->Abandon();
  for (const Slot& slot : slots_) slot.param->tensor.mutable_grad() = at::Tensor();
  AllocateBuffers();
}

}  // namespace hetpar::train
