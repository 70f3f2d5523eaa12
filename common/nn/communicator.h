// Process groups for a module's tensor-parallel (and data-parallel) ranks.
//
// A Communicator is one c10d process group, created from a rendezvous store and a key prefix: all
// ranks that call Create with the same store, prefix and size form one group. Several groups
// (TP, DP; a new one per membership generation) share one store by using different prefixes.
//
//   HETPAR_ASSIGN_OR_RETURN(auto store, nn::OpenTcpStore("10.0.0.1", 29500, rank == 0, world, t));
//   nn::CommunicatorOptions options;
//   options.prefix = "gen3/llm/replica0/tp";
//   options.rank = tp_rank;
//   options.size = tp_size;
//   HETPAR_ASSIGN_OR_RETURN(auto tp, nn::Communicator::Create(store, options));
//
// Backends: Gloo on CPU tensors; NCCL on CUDA tensors when libtorch is built with NCCL (the
// USE_C10D_NCCL definition libtorch exports), else Create(kNccl) is Unimplemented. A group of
// size 1 needs no store (CreateSingle) and all its collectives are the identity. An NCCL group
// also takes host tensors (flags, step counts) and moves them through the current GPU.
//
// Tensors of any floating dtype are accepted; Gloo has no bfloat16 kernels, so bfloat16 tensors
// are reduced in float32 and rounded back once (sums are then at least as accurate as in
// bfloat16).
//
// Every collective waits at most `timeout`; a rank that does not arrive, or a peer whose
// connection drops, fails the call (DeadlineExceeded / Unavailable) instead of hanging.
//
// Threading: one group's collectives must be called in the same order on every rank, from one
// thread at a time (c10d's rule). The Communicator owns the group; CommGroup references held by
// autograd graphs keep the group alive until those graphs are gone.
#ifndef HETPAR_COMMON_NN_COMMUNICATOR_H_
#define HETPAR_COMMON_NN_COMMUNICATOR_H_

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/util/intrusive_ptr.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/step_interrupt.h"

namespace hetpar::nn {

enum class Backend { kGloo, kNccl };

enum class ReduceOp { kSum, kMax };

// A rendezvous store for tests and single-machine runs: a file every rank can open.
absl::StatusOr<c10::intrusive_ptr<c10d::Store>> OpenFileStore(const std::string& path,
                                                              int world_size);

// A c10d TCP store: rank 0 passes is_server=true and listens on `port` (0 picks a free port; read
// it back with TcpStorePort); the others connect to host:port. Waits at most `timeout` for the
// server and for `world_size` clients.
absl::StatusOr<c10::intrusive_ptr<c10d::Store>> OpenTcpStore(const std::string& host, int port,
                                                             bool is_server, int world_size,
                                                             absl::Duration timeout);

// The port a TCP store from OpenTcpStore listens on (InvalidArgument for other stores).
absl::StatusOr<int> TcpStorePort(const c10::intrusive_ptr<c10d::Store>& store);

// An in-memory store for groups whose ranks are threads of one process.
c10::intrusive_ptr<c10d::Store> OpenHashStore();

// Gloo rendezvous still running on threads of their own (see CommunicatorOptions::interrupt):
// given up by their callers, each ends within its timeouts. A process that exits before then
// should skip its static destructors (std::_Exit), which such a thread could otherwise meet.
int RendezvousThreadsRunning();

struct CommunicatorOptions {
  std::string prefix;  // keys of this group in the store; unique per group and generation
  int rank = 0;
  int size = 1;
  Backend backend = Backend::kGloo;
  // Deadline of the rendezvous and of every collective.
  absl::Duration timeout = absl::Seconds(60);
  // Address Gloo binds and advertises to peers.
  std::string hostname = "127.0.0.1";
  // When set, a collective waiting on its peers gives up once it is raised (the coordinator
  // aborted the step); the group is then abandoned (see CommGroup::Adopt). Once it has been armed
  // (a step's attempt, StepInterrupt::Arm), a Gloo rendezvous gives up too: Create returns
  // Aborted and leaves the rendezvous to end on a thread of its own (a peer that died after
  // publishing its address is otherwise waited for over the whole timeout, in Gloo's connect).
  const StepInterrupt* interrupt = nullptr;
};

// The shared state of a group, reference-counted so that autograd nodes can hold it. Its methods
// throw c10::Error (or Gloo's exceptions) like the rest of libtorch: they are called inside
// forward and backward passes; Communicator wraps them for Status-returning callers.
class CommGroup : public torch::CustomClassHolder {
 public:
  CommGroup(c10::intrusive_ptr<c10d::Backend> c10d_backend, int rank, int size, Backend backend,
            std::chrono::milliseconds timeout);
  ~CommGroup() override;

  int rank() const { return rank_; }
  int size() const { return size_; }

  // In place; every rank ends with the same values.
  void AllReduce(at::Tensor& tensor, ReduceOp op = ReduceOp::kSum) const;
  // Concatenation along dim 0 of every rank's `tensor` (equal shapes), in rank order.
  at::Tensor AllGatherRows(const at::Tensor& tensor) const;
  // `tensor` has size() * m rows; returns rows [rank * m, (rank + 1) * m) summed over ranks.
  at::Tensor ReduceScatterRows(const at::Tensor& tensor) const;
  // In place; every rank ends with root's values.
  void Broadcast(at::Tensor& tensor, int root) const;
  void Barrier() const;

  // Starts an in-place sum of `tensor` (contiguous, float32 or float64) over the group and
  // returns at once; `tensor` must not be touched until WaitFor(work) returns. Null work (the
  // identity) for a group of one. Started collectives run in the order they were started.
  c10::intrusive_ptr<c10d::Work> StartAllReduce(at::Tensor& tensor) const;
  // Waits for a started collective like the blocking ones wait (deadline, interrupt; on NCCL
  // the stream waits, not the host); a null work returns at once.
  void WaitFor(const c10::intrusive_ptr<c10d::Work>& work, const char* what) const;
  // Gives up the collectives started and not waited for (a step that failed half-way): the
  // backend may still run them, so the group is abandoned (see Adopt).
  void Abandon() const { abandoned_.store(true); }

  // The c10d backend (ProcessGroupGloo, ProcessGroupNCCL) doing the collectives; null when
  // size() == 1. The one place hetpar meets c10d's process-group API.
  const c10::intrusive_ptr<c10d::Backend>& c10d_backend() const { return c10d_backend_; }

  void set_interrupt(const StepInterrupt* interrupt) { interrupt_ = interrupt; }
  // Whether a collective of this group was given up (interrupted or past its deadline) while
  // its backend may still be running it.
  bool abandoned() const { return abandoned_.load(); }
  // Takes over `fresh`'s process group, rank and size (a group formed anew for a new
  // generation), so that everything holding this group (models, autograd nodes) uses the new
  // one; `fresh` is left empty. Call between steps. An abandoned Gloo process group is never
  // destroyed: its backend thread may still be blocked in the collective given up, and
  // destroying it would wait for that thread. An abandoned NCCL one is aborted
  // (ProcessGroupNCCL::abort, ncclCommAbort), then destroyed.
  void Adopt(CommGroup& fresh);

 private:
  // Gloo: waits for `work` within timeout_, in slices when an interrupt is set. NCCL: makes the
  // current CUDA stream wait for it and returns without waiting on the host (the result is
  // there for work queued after it on that stream); a collective that hangs is
  // ProcessGroupNCCL's watchdog's, after timeout_.
  // NCCL: throws (c10::Error) when the interrupt is raised, before a collective is queued (once
  // queued, the stream waits for it). Gloo: nothing (Wait looks at the interrupt).
  void CheckNotInterrupted(const char* what) const;
  void Wait(const c10::intrusive_ptr<c10d::Work>& work, const char* what) const;
  void Release();

  c10::intrusive_ptr<c10d::Backend> c10d_backend_;  // null when size_ == 1
  int rank_;
  int size_;
  Backend backend_;
  std::chrono::milliseconds timeout_;
  const StepInterrupt* interrupt_ = nullptr;
  mutable std::atomic<bool> abandoned_{false};
};

using CommGroupPtr = c10::intrusive_ptr<CommGroup>;

// Owner of one process group. Non-copyable; the factory fails with the reason when the
// rendezvous or the backend cannot be set up.
class Communicator {
 public:
  static absl::StatusOr<std::unique_ptr<Communicator>> Create(
      const c10::intrusive_ptr<c10d::Store>& store, const CommunicatorOptions& options);
  // A group of one rank: no store, no process group; every collective is the identity.
  static std::unique_ptr<Communicator> CreateSingle();

  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return group_->rank(); }
  int size() const { return group_->size(); }
  const std::string& prefix() const { return prefix_; }
  const CommGroupPtr& group() const { return group_; }

  absl::Status AllReduce(at::Tensor& tensor, ReduceOp op = ReduceOp::kSum);
  absl::StatusOr<at::Tensor> AllGatherRows(const at::Tensor& tensor);
  absl::StatusOr<at::Tensor> ReduceScatterRows(const at::Tensor& tensor);
  absl::Status Broadcast(at::Tensor& tensor, int root);
  absl::Status Barrier();

  // This communicator becomes `fresh` (CommGroup::Adopt), keeping its identity for those who
  // hold it.
  void Adopt(Communicator& fresh);

 private:
  Communicator(CommGroupPtr group, std::string prefix)
      : group_(std::move(group)), prefix_(std::move(prefix)) {}

  CommGroupPtr group_;
  std::string prefix_;
};

}  // namespace hetpar::nn

#endif  // HETPAR_COMMON_NN_COMMUNICATOR_H_
