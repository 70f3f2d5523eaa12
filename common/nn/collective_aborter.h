// Aborts a worker's NCCL process groups when the coordinator aborts the step they serve.
//
// On NCCL, hetpar does not wait for a collective on the host (CommGroup::Wait): the stream waits,
// and the step's one host read (ModuleState::EndStep) waits for the stream. A peer that died
// leaves its group's collective running on the GPU forever, and that read with it, until
// ProcessGroupNCCL's watchdog ends the process after the group's timeout: one lost worker would
// take its healthy peers with it. The coordinator's StepAbort names the generation whose groups
// the failed attempt used (the next attempt forms new ones); aborting that generation's
// communicators (ProcessGroupNCCL::abort, ncclCommAbort) ends their kernels, the read returns,
// the step is discarded, and the worker goes on in the next generation.
//
// Gloo groups are not tracked: their waits see the step's interrupt themselves.
//
// A collective can also fail without an abort from the coordinator: NCCL reports an error of the
// communicator (a peer's connection closed) or the group's timeout passes. ProcessGroupNCCL's
// watchdog then aborts the communicator; by default it also ends the process, which hetpar turns
// off (TORCH_NCCL_ASYNC_ERROR_HANDLING=2, CleanUpOnly, unless set: nn::Communicator). The step's
// host read then returns with what the aborted collectives left, so the step driver asks
// CheckGeneration after each step's compute, and a group that reports an error fails the step on
// this rank instead of its gradients reaching the coordinator.
//
//   CollectiveAborter aborter;
//   aborter.Track(group->c10d_backend(), generation);  // the worker, as it forms an NCCL group
//   aborter.AbortGeneration(abort.generation());       // the session's thread, on a StepAbort
//
// Thread-safe. AbortGeneration does not block: the aborts run on the aborter's own thread (an
// abort may take up to the group's timeout), which the destructor joins.
#ifndef HETPAR_COMMON_NN_COLLECTIVE_ABORTER_H_
#define HETPAR_COMMON_NN_COLLECTIVE_ABORTER_H_

#include <cstdint>
#include <deque>
#include <set>
#include <thread>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace hetpar::nn {

class CollectiveAborter {
 public:
  CollectiveAborter();
  // Waits for the aborts already started.
  ~CollectiveAborter();
  CollectiveAborter(const CollectiveAborter&) = delete;
  CollectiveAborter& operator=(const CollectiveAborter&) = delete;

  // Remembers `backend` (weakly: the group owns it) as one of generation `generation`'s. A
  // backend its group has released is destroyed on the next Track or AbortGeneration (a weak
  // reference holds back c10's destructor call), not at its release.
  void Track(const c10::intrusive_ptr<c10d::Backend>& backend, int64_t generation);
  // Starts aborting every tracked backend of `generation` still alive, and forgets them; a
  // backend of that generation tracked later (its group formed after the abort arrived) is
  // aborted as it is tracked. Returns how many it started on; a generation's backends are
  // aborted once.
  int AbortGeneration(int64_t generation);
  // OK, or the first error a live tracked backend of `generation` reports (c10d::Backend::
  // getError: a timeout, a communicator error, a peer's error), naming it. Does not block.
  absl::Status CheckGeneration(int64_t generation);
  // Waits until every abort started has returned (and the released backends are destroyed).
  void WaitIdle();
  // Backends aborted so far (their abort() returned).
  int64_t aborted() const;

 private:
  struct Tracked {
    c10::weak_intrusive_ptr<c10d::Backend> backend;
    int64_t generation;
  };
  // Moves the entries whose backend has been released out of tracked_.
  std::vector<Tracked> TakeReleased() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Run();

  mutable absl::Mutex mu_;
  std::vector<Tracked> tracked_ ABSL_GUARDED_BY(mu_);
  std::set<int64_t> aborted_generations_ ABSL_GUARDED_BY(mu_);
  std::deque<c10::intrusive_ptr<c10d::Backend>> queue_ ABSL_GUARDED_BY(mu_);
  // Weak references for Run to drop: the last one runs its backend's destructor (c10 destroys
  // an object once neither strong nor weak references remain), which must not happen on
  // AbortGeneration's caller.
  std::vector<c10::weak_intrusive_ptr<c10d::Backend>> released_ ABSL_GUARDED_BY(mu_);
  bool aborting_ ABSL_GUARDED_BY(mu_) = false;  // Run is inside an abort()
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  int64_t aborted_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread thread_;
};

}  // namespace hetpar::nn

#endif  // HETPAR_COMMON_NN_COLLECTIVE_ABORTER_H_
