#include "common/nn/collective_aborter.h"

#include <algorithm>
#include <exception>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/logging.h"

namespace hetpar::nn {

CollectiveAborter::CollectiveAborter() : thread_([this] { Run(); }) {}

CollectiveAborter::~CollectiveAborter() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  thread_.join();
}

void CollectiveAborter::Track(const c10::intrusive_ptr<c10d::Backend>& backend,
                              int64_t generation) {
  if (!backend) return;
  std::vector<Tracked> released;
  {
    absl::MutexLock lock(&mu_);
    released = TakeReleased();
    if (aborted_generations_.count(generation) != 0) {
      // Its group formed after the generation's abort arrived: aborted at once.
      queue_.push_back(backend);
    } else {
      tracked_.push_back({c10::weak_intrusive_ptr<c10d::Backend>(backend), generation});
    }
  }
  // Dropped here, outside the lock: the last weak reference runs the backend's destructor.
}

std::vector<CollectiveAborter::Tracked> CollectiveAborter::TakeReleased() {
  std::vector<Tracked> released;
  std::vector<Tracked> kept;
  for (Tracked& t : tracked_) (t.backend.expired() ? released : kept).push_back(std::move(t));
  tracked_ = std::move(kept);
  return released;
}

int CollectiveAborter::AbortGeneration(int64_t generation) {
  absl::MutexLock lock(&mu_);
  aborted_generations_.insert(generation);
  for (Tracked& t : TakeReleased()) released_.push_back(std::move(t.backend));
  int started = 0;
  std::vector<Tracked> kept;
  for (Tracked& t : tracked_) {
    if (t.generation != generation) {
      kept.push_back(std::move(t));
      continue;
    }
    // A strong reference keeps the backend alive until its abort has returned, even if its
    // group releases it meanwhile (a new generation's groups replacing it).
    if (c10::intrusive_ptr<c10d::Backend> backend = t.backend.lock()) {
      queue_.push_back(std::move(backend));
      ++started;
    }
    released_.push_back(std::move(t.backend));
  }
  tracked_ = std::move(kept);
  return started;
}

absl::Status CollectiveAborter::CheckGeneration(int64_t generation) {
  std::vector<c10::intrusive_ptr<c10d::Backend>> live;
  {
    absl::MutexLock lock(&mu_);
    for (const Tracked& t : tracked_) {
      if (t.generation != generation) continue;
      if (c10::intrusive_ptr<c10d::Backend> backend = t.backend.lock()) {
        live.push_back(std::move(backend));
      }
    }
  }
  for (const c10::intrusive_ptr<c10d::Backend>& backend : live) {
    c10d::ErrorType error = c10d::ErrorType::SUCCESS;
    try {
      error = backend->getError();
    } catch (const std::exception&) {
      continue;  // a backend that keeps no error state (not NCCL)
    }
    if (error == c10d::ErrorType::SUCCESS) continue;
    const char* what = error == c10d::ErrorType::TIMEOUT        ? "a collective timed out"
                       : error == c10d::ErrorType::REMOTE_ERROR ? "a peer reported an error"
                                                                : "the communicator failed";
    return absl::UnavailableError(absl::StrCat("the ", backend->getBackendName(), " group of rank ",
                                               backend->getRank(), " of ", backend->getSize(),
                                               " (generation ", generation, "): ", what,
                                               "; its collectives of this step did not complete"));
  }
  return absl::OkStatus();
}

void CollectiveAborter::WaitIdle() {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](CollectiveAborter* a) ABSL_EXCLUSIVE_LOCKS_REQUIRED(a->mu_) {
        return a->queue_.empty() && a->released_.empty() && !a->aborting_;
      },
      this));
}

int64_t CollectiveAborter::aborted() const {
  absl::MutexLock lock(&mu_);
  return aborted_;
}

void CollectiveAborter::Run() {
  while (true) {
    c10::intrusive_ptr<c10d::Backend> backend;
    std::vector<c10::weak_intrusive_ptr<c10d::Backend>> released;
    {
      absl::MutexLock lock(&mu_);
      // On stopping, the aborts already queued still run: a group left hanging would hold the
      // worker's exit.
      mu_.Await(absl::Condition(
          +[](CollectiveAborter* a) ABSL_EXCLUSIVE_LOCKS_REQUIRED(a->mu_) {
            return !a->queue_.empty() || !a->released_.empty() || a->stopping_;
          },
          this));
      if (queue_.empty() && released_.empty()) return;
      released.swap(released_);
      if (!queue_.empty()) {
        backend = std::move(queue_.front());
        queue_.pop_front();
      }
      aborting_ = true;
    }
    // The last weak references run the destructors of backends their groups let go, here
    // rather than on the thread that called AbortGeneration.
    released.clear();
    const bool aborting = static_cast<bool>(backend);
    if (aborting) {
      HETPAR_LOG(WARNING) << "aborting the communicators of a " << backend->getSize()
                          << "-rank group (rank " << backend->getRank() << ") of the aborted step";
      try {
        backend->abort();
      } catch (const std::exception& e) {
        HETPAR_LOG(WARNING) << "aborting the group's communicators failed: " << e.what();
      }
      backend.reset();  // the last reference, when its group has already let it go
    }
    absl::MutexLock lock(&mu_);
    aborting_ = false;
    if (aborting) ++aborted_;
  }
}

}  // namespace hetpar::nn
