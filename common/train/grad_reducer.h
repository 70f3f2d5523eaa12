// Sums a module's gradients over its DP group in buckets that start while backward still runs.
//
// The gradients of the trainable parameters live in a few flat buffers (buckets of about
// `bucket_bytes`, filled in reverse registration order: the order backward produces them): at
// the start of a step every parameter's grad() becomes a view of its bucket, zeroed, and the
// waves of the step accumulate into it in place. Before the step's last backward the caller arms
// the reducer; from then on, a hook after each parameter's gradient accumulation counts the
// bucket's parameters, and a bucket whose gradients are all complete starts its all-reduce at
// once (asynchronously, on the backend's thread) while backward goes on with earlier layers.
// Finish starts whatever has not started (parameters that got no gradient in the last backward,
// a replica with no work) and waits for everything. No flat copy of all the gradients is made.
//
// Buckets start strictly in index order on every rank (a bucket ready early waits for the ones
// before it), so every DP rank issues the same collectives in the same order whatever the timing
// of its backward.
//
//   GradientReducer reducer(&model.parameters(), 25 << 20);
//   HETPAR_RETURN_IF_ERROR(reducer.BeginStep(dp.get()));
//   for (wave ...) { if (last) reducer.ArmLastBackward(); loss.backward(); }
//   HETPAR_RETURN_IF_ERROR(reducer.Finish());   // grads are the DP sums
//
// A step that fails between BeginStep and Finish calls Abandon (or leaves it to the next
// BeginStep): the collectives started are given up, the group abandoned, and the buckets
// replaced, since the backend may still write into them.
//
// Threads: the caller's, which is also the thread autograd runs CPU backward on. On CUDA the
// hooks run on autograd's device thread while the caller is blocked in backward(), so the two
// never run at once (backward() returns after the last hook). The hooks stay installed for the
// reducer's lifetime and do nothing unless armed.
#ifndef HETPAR_COMMON_TRAIN_GRAD_REDUCER_H_
#define HETPAR_COMMON_TRAIN_GRAD_REDUCER_H_

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "common/nn/communicator.h"
#include "common/nn/parameters.h"
#include "hetpar/v1/run_spec.pb.h"

namespace hetpar::train {

// run.grad_bucket_mib in bytes.
int64_t GradBucketBytes(const hetpar::v1::RunSpec& spec);

class GradientReducer {
 public:
  // `params` must outlive the reducer; only parameters trainable now are reduced (freeze before).
  GradientReducer(nn::ParameterSet* params, int64_t bucket_bytes);
  ~GradientReducer();
  GradientReducer(const GradientReducer&) = delete;
  GradientReducer& operator=(const GradientReducer&) = delete;

  // Zeroes the buckets and makes every trainable parameter's grad() a view of its bucket. `dp`
  // is the module's DP group for this step (it may have been re-formed since the last step).
  absl::Status BeginStep(nn::Communicator* dp);
  // The next backward is the step's last.
  void ArmLastBackward();
  // Starts the buckets not started yet, in order, and waits for all of them; afterwards every
  // trainable parameter's grad() holds the sum over the DP group. Disarms.
  absl::Status Finish();
  // Gives up the step's started collectives (see the header comment).
  void Abandon();

  int buckets() const { return static_cast<int>(buckets_.size()); }
  // Buckets started by the hooks during the last backward of the latest step (the rest were
  // started by Finish).
  int started_during_backward() const { return started_during_backward_; }

  // Called by the hooks.
  void OnAccumulated(int slot);

 private:
  struct Bucket {
    at::Tensor buffer;                    // flat, the parameters' grad dtype
    std::vector<int> slots;               // indices into slots_
    int ready = 0;                        // slots whose gradient is complete (armed only)
    c10::intrusive_ptr<c10d::Work> work;  // started and not waited for
  };
  struct Slot {
    const nn::NamedParameter* param = nullptr;
    int bucket = 0;
    int64_t offset = 0;  // in the bucket's buffer
    bool counted = false;
  };

  void AllocateBuffers();
  // Starts buckets next_to_start_.. while they are ready (all of them when `all`).
  void StartReady(bool all);

  nn::ParameterSet* params_;
  std::vector<Slot> slots_;
  std::vector<Bucket> buckets_;
  nn::Communicator* dp_ = nullptr;
  bool armed_ = false;
  bool in_step_ = false;
  int next_to_start_ = 0;
  int started_during_backward_ = 0;
};

}  // namespace hetpar::train

#endif  // HETPAR_COMMON_TRAIN_GRAD_REDUCER_H_
