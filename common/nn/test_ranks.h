// Test helper: runs `size` ranks as threads of this process, each with its own Gloo process
// group over one in-memory store, and collects their failures. Unit tests use it for collectives
// and TP operators; the models' equivalence tests start real processes (tests/models/).
#ifndef HETPAR_COMMON_NN_TEST_RANKS_H_
#define HETPAR_COMMON_NN_TEST_RANKS_H_

#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/nn/communicator.h"

namespace hetpar::nn::testing {

// Waits until `count` threads have arrived (one use).
class ThreadLatch {
 public:
  explicit ThreadLatch(int count) : left_(count) {}
  void ArriveAndWait() {
    std::unique_lock<std::mutex> lock(mu_);
    if (--left_ == 0) {
      cv_.notify_all();
    } else {
      cv_.wait(lock, [this] { return left_ == 0; });
    }
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int left_;
};

// Calls fn(rank, communicator) on `size` threads and returns the first failure (by rank). A rank
// whose group cannot be formed reports that. Every group gets a fresh store prefix. No rank starts
// before every group is formed, and no group is torn down before every rank is done: a rank that
// finishes early would otherwise close its connections while a peer is still connecting.
inline absl::Status RunRanks(int size, const std::function<absl::Status(int, Communicator&)>& fn,
                             absl::Duration timeout = absl::Seconds(30)) {
  static std::atomic<int> next_group{0};
  const std::string prefix = absl::StrCat("test-group-", next_group.fetch_add(1));
  auto store = OpenHashStore();
  std::vector<absl::Status> results(size);
  std::vector<std::thread> threads;
  ThreadLatch formed(size);
  ThreadLatch done(size);
  for (int rank = 0; rank < size; ++rank) {
    threads.emplace_back([&, rank] {
      std::unique_ptr<Communicator> comm;
      if (size == 1) {
        comm = Communicator::CreateSingle();
      } else {
        CommunicatorOptions options;
        options.prefix = prefix;
        options.rank = rank;
        options.size = size;
        options.timeout = timeout;
        auto created = Communicator::Create(store, options);
        if (created.ok()) {
          comm = *std::move(created);
        } else {
          results[rank] = created.status();
        }
      }
      formed.ArriveAndWait();
      if (comm != nullptr) results[rank] = fn(rank, *comm);
      done.ArriveAndWait();
    });
  }
  for (auto& thread : threads) thread.join();
  for (int rank = 0; rank < size; ++rank) {
    if (!results[rank].ok()) {
      return absl::Status(results[rank].code(), absl::StrCat("rank ", rank, " of ", size, ": ",
                                                             std::string(results[rank].message())));
    }
  }
  return absl::OkStatus();
}

}  // namespace hetpar::nn::testing

#endif  // HETPAR_COMMON_NN_TEST_RANKS_H_
