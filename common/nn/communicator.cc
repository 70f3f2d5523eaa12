#include "common/nn/communicator.h"

#include <ATen/ATen.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef USE_C10D_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <atomic>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/logging.h"
#include "common/nn/torch_status.h"
#include "common/status.h"

namespace hetpar::nn {
namespace {

std::chrono::milliseconds ToChrono(absl::Duration duration) {
  return std::chrono::milliseconds(absl::ToInt64Milliseconds(duration));
}

c10d::ReduceOp ToC10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return c10d::ReduceOp::SUM;
    case ReduceOp::kMax:
      return c10d::ReduceOp::MAX;
  }
  return c10d::ReduceOp::SUM;
}

// libtorch 2.x records every collective in a process-wide ring buffer (c10d's FlightRecorder,
// sized by TORCH_FR_BUFFER_SIZE) for post-mortem dumps that hetpar never takes. With several Gloo
// groups issuing collectives from different threads of one process the recording corrupted
// memory: 6 of 20 runs of communicator_test's 3-rank cases crashed or hung inside
// FlightRecorder::recordWithResetEnabled, none of 20 with the buffer at 0. It is turned off
// before the first group is created.
//
// ProcessGroupNCCL's watchdog, on a communicator error or a timed-out collective, by default
// (TORCH_NCCL_ASYNC_ERROR_HANDLING=3) ends the process: a peer that dies would take its healthy
// peers with it. With 2 (CleanUpOnly) it aborts the communicator and the process goes on; the
// step driver then finds the group's error (CollectiveAborter::CheckGeneration) and fails the
// step on this rank. A value the user set is kept.
//
// Before that abort, the watchdog (torch 2.11) signals a flight-recorder dump through the store to
// every rank and sleeps 4 x TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC (15 s by default). The first
// group's heartbeat monitor of every rank then sees the signal, polls the store about once a
// second, and ends its process after TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC (8 minutes) unless that
// group is gone by then: healthy ranks of a long recovery would be ended too. With no recording
// there is nothing to dump, so hetpar turns the dump off (TORCH_NCCL_DUMP_ON_TIMEOUT=0) and the
// sleep down to 4 x 250 ms, unless the user set them.
void ConfigureProcessGroups() {
  static std::once_flag once;
  std::call_once(once, [] {
    ::setenv("TORCH_FR_BUFFER_SIZE", "0", /*overwrite=*/1);
    ::setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2", /*overwrite=*/0);
    ::setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "0", /*overwrite=*/0);
    ::setenv("TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC", "250", /*overwrite=*/0);
  });
}

// Gloo has kernels for float, double, half and the integer types, not for bfloat16.
bool NeedsUpcast(const at::Tensor& tensor, Backend backend) {
  return backend == Backend::kGloo && tensor.scalar_type() == at::kBFloat16;
}

// What the backend moves: `tensor` in float32 when Gloo cannot sum its bfloat16, and, for NCCL
// (which moves only CUDA tensors), a host tensor (a flag, step counts) on the current GPU.
at::Tensor ForBackend(const at::Tensor& tensor, Backend backend) {
  at::Tensor out = NeedsUpcast(tensor, backend) ? tensor.to(at::kFloat) : tensor;
  if (backend == Backend::kNccl && out.is_cpu()) {
    out = out.to(c10::impl::getDeviceGuardImpl(c10::kCUDA)->getDevice());
  }
  return out.contiguous();
}

}  // namespace

void CommGroup::CheckNotInterrupted(const char* what) const {
  // Gloo looks at the interrupt while it waits, when the work has not completed in a slice.
  if (backend_ != Backend::kNccl) return;
  if (interrupt_ != nullptr && interrupt_->raised()) {
    // The peers may have queued their part: the group is not used again.
    abandoned_.store(true);
    TORCH_CHECK(false, what, " interrupted: the coordinator aborted the step");
  }
}

void CommGroup::Wait(const c10::intrusive_ptr<c10d::Work>& work, const char* what) const {
  if (backend_ == Backend::kNccl) {
    // NCCL: the caller's stream waits for the collective (Work::wait without a timeout) and the
    // host goes on queueing work. With a timeout, ProcessGroupNCCL's wait would hold the host
    // until the device had caught up, once per collective. A collective that never completes
    // is caught by ProcessGroupNCCL's watchdog after this group's timeout (its Options), and
    // the step's host read waits for the device meanwhile. The abort is looked at before the
    // collective is queued (CheckNotInterrupted) and again here, before the next one.
    CheckNotInterrupted(what);
    work->wait();
    return;
  }
  if (interrupt_ == nullptr) {
    bool done = false;
    try {
      // Throws (rather than returning false) when the timeout passes with the work pending.
      done = work->wait(timeout_);
    } catch (const std::exception&) {
      if (work->isCompleted()) {
        work->wait();  // its own error, if it failed
        return;
      }
    }
    if (!done) {
      // Still running in Gloo's thread: the group must not be destroyed under it (Release).
      abandoned_.store(true);
      TORCH_CHECK(false, what, " timed out: not complete within ", timeout_.count(), " ms");
    }
    return;
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  const auto slice = std::chrono::milliseconds(absl::ToInt64Milliseconds(kInterruptSlice));
  while (true) {
    try {
      // Work::wait with a timeout throws when it passes with the work still pending.
      if (work->wait(slice)) return;
    } catch (const std::exception&) {
      // Done meanwhile, or failed: its own outcome (its error, rethrown) instead of the slice's.
      if (work->isCompleted()) {
        work->wait();
        return;
      }
    }
    if (interrupt_->raised()) {
      abandoned_.store(true);
      TORCH_CHECK(false, what, " interrupted: the coordinator aborted the step");
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      abandoned_.store(true);
      TORCH_CHECK(false, what, " timed out: not complete within ", timeout_.count(), " ms");
    }
  }
}

void CommGroup::Release() {
  if (abandoned_.load() && c10d_backend_) {
    if (backend_ == Backend::kNccl) {
      // ncclCommAbort ends the collectives given up, so the group can be destroyed (a second
      // abort, after CollectiveAborter's, finds no communicator left).
      try {
        c10d_backend_->abort();
      } catch (const std::exception& e) {
        HETPAR_LOG(WARNING) << "aborting an abandoned NCCL group failed: " << e.what();
      }
    } else {
      // Gloo cannot abort: leaked on purpose, see Adopt.
      (void)c10d_backend_.release();
    }
  }
  c10d_backend_.reset();
}

void CommGroup::Adopt(CommGroup& fresh) {
  Release();
  c10d_backend_ = std::move(fresh.c10d_backend_);
  rank_ = fresh.rank_;
  size_ = fresh.size_;
  backend_ = fresh.backend_;
  timeout_ = fresh.timeout_;
  interrupt_ = fresh.interrupt_;
  abandoned_.store(false);
  fresh.size_ = 1;
}

absl::StatusOr<c10::intrusive_ptr<c10d::Store>> OpenFileStore(const std::string& path,
                                                              int world_size) {
  if (world_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("file store ", path, ": world_size=", world_size, ", expected >= 1"));
  }
  return RunTorchOr(absl::StrCat("opening file store ", path), [&] {
    return c10::intrusive_ptr<c10d::Store>(c10::make_intrusive<c10d::FileStore>(path, world_size));
  });
}

absl::StatusOr<c10::intrusive_ptr<c10d::Store>> OpenTcpStore(const std::string& host, int port,
                                                             bool is_server, int world_size,
                                                             absl::Duration timeout) {
  if (port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("tcp store ", host, ":", port, ": port out of range 0..65535"));
  }
  if (!is_server && port == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("tcp store ", host, ": a client needs the server's port, got 0"));
  }
  if (world_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat("tcp store ", host, ":", port,
                                                   ": world_size=", world_size, ", expected >= 1"));
  }
  c10d::TCPStoreOptions options;
  options.port = static_cast<std::uint16_t>(port);
  options.isServer = is_server;
  options.numWorkers = static_cast<std::size_t>(world_size);
  options.waitWorkers = false;
  options.timeout = ToChrono(timeout);
  return RunTorchOr(
      absl::StrCat("opening tcp store ", host, ":", port, is_server ? " (server)" : " (client)"),
      [&] {
        return c10::intrusive_ptr<c10d::Store>(c10::make_intrusive<c10d::TCPStore>(host, options));
      });
}

absl::StatusOr<int> TcpStorePort(const c10::intrusive_ptr<c10d::Store>& store) {
  const auto* tcp = dynamic_cast<const c10d::TCPStore*>(store.get());
  if (tcp == nullptr) return absl::InvalidArgumentError("store is not a TCP store");
  return static_cast<int>(tcp->getPort());
}

c10::intrusive_ptr<c10d::Store> OpenHashStore() { return c10::make_intrusive<c10d::HashStore>(); }

CommGroup::CommGroup(c10::intrusive_ptr<c10d::Backend> c10d_backend, int rank, int size,
                     Backend backend, std::chrono::milliseconds timeout)
    : c10d_backend_(std::move(c10d_backend)),
      rank_(rank),
      size_(size),
      backend_(backend),
      timeout_(timeout) {}

CommGroup::~CommGroup() { Release(); }

void CommGroup::AllReduce(at::Tensor& tensor, ReduceOp op) const {
  if (size_ == 1) return;
  TORCH_CHECK(tensor.is_contiguous(), "AllReduce needs a contiguous tensor");
  std::vector<at::Tensor> buffers{ForBackend(tensor, backend_)};
  c10d::AllreduceOptions options;
  options.reduceOp = ToC10d(op);
  options.timeout = timeout_;
  CheckNotInterrupted("all-reduce");
  Wait(c10d_backend_->allreduce(buffers, options), "all-reduce");
  if (!buffers[0].is_same(tensor)) tensor.copy_(buffers[0]);
}

at::Tensor CommGroup::AllGatherRows(const at::Tensor& tensor) const {
  if (size_ == 1) return tensor;
  at::Tensor input = ForBackend(tensor, backend_);
  std::vector<at::Tensor> inputs{input};
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int r = 0; r < size_; ++r) outputs[0].push_back(at::empty_like(input));
  c10d::AllgatherOptions options;
  options.timeout = timeout_;
  CheckNotInterrupted("all-gather");
  Wait(c10d_backend_->allgather(outputs, inputs, options), "all-gather");
  return at::cat(outputs[0], 0).to(tensor.device(), tensor.scalar_type());
}

at::Tensor CommGroup::ReduceScatterRows(const at::Tensor& tensor) const {
  if (size_ == 1) return tensor;
  TORCH_CHECK(tensor.dim() >= 1 && tensor.size(0) % size_ == 0,
              "ReduceScatterRows: ", tensor.dim() >= 1 ? tensor.size(0) : 0,
              " rows do not split into ", size_, " equal parts");
  at::Tensor input = ForBackend(tensor, backend_);
  const int64_t rows = input.size(0) / size_;
  std::vector<int64_t> shape = input.sizes().vec();
  at::Tensor output;
  if (backend_ == Backend::kNccl) {
    shape[0] = rows;
    output = at::empty(shape, input.options());
    c10d::ReduceScatterOptions options;
    options.timeout = timeout_;
    CheckNotInterrupted("reduce-scatter");
    Wait(c10d_backend_->_reduce_scatter_base(output, input, options), "reduce-scatter");
  } else {
    // Gloo in this libtorch has no reduce-scatter: exchange the row blocks all-to-all (block r of
    // every rank lands on rank r) and sum them here, in rank order.
    at::Tensor exchanged = at::empty_like(input);
    std::vector<int64_t> equal_splits;
    c10d::AllToAllOptions options;
    options.timeout = timeout_;
    CheckNotInterrupted("reduce-scatter (all-to-all)");
    Wait(c10d_backend_->alltoall_base(exchanged, input, equal_splits, equal_splits, options),
         "reduce-scatter (all-to-all)");
    shape[0] = rows;
    shape.insert(shape.begin(), size_);
    output = exchanged.view(shape).sum(0);
  }
  return output.to(tensor.device(), tensor.scalar_type());
}

c10::intrusive_ptr<c10d::Work> CommGroup::StartAllReduce(at::Tensor& tensor) const {
  if (size_ == 1) return {};
  TORCH_CHECK(tensor.is_contiguous(), "StartAllReduce needs a contiguous tensor");
  TORCH_CHECK(!NeedsUpcast(tensor, backend_), "StartAllReduce: Gloo cannot sum ",
              tensor.scalar_type(), " in place");
  std::vector<at::Tensor> buffers{tensor};
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp::SUM;
  options.timeout = timeout_;
  CheckNotInterrupted("all-reduce");
  return c10d_backend_->allreduce(buffers, options);
}

void CommGroup::WaitFor(const c10::intrusive_ptr<c10d::Work>& work, const char* what) const {
  if (work) Wait(work, what);
}

void CommGroup::Broadcast(at::Tensor& tensor, int root) const {
  if (size_ == 1) return;
  TORCH_CHECK(tensor.is_contiguous(), "Broadcast needs a contiguous tensor");
  TORCH_CHECK(root >= 0 && root < size_, "Broadcast root ", root, " is not a rank of a group of ",
              size_);
  std::vector<at::Tensor> buffers{ForBackend(tensor, backend_)};
  c10d::BroadcastOptions options;
  options.rootRank = root;
  options.timeout = timeout_;
  CheckNotInterrupted("broadcast");
  Wait(c10d_backend_->broadcast(buffers, options), "broadcast");
  if (!buffers[0].is_same(tensor)) tensor.copy_(buffers[0]);
}

void CommGroup::Barrier() const {
  if (size_ == 1) return;
  c10d::BarrierOptions options;
  options.timeout = timeout_;
  // NCCL's barrier is an all-reduce on a GPU: this rank's (the current device), not the one
  // ProcessGroupNCCL would guess from the group rank.
  if (backend_ == Backend::kNccl) {
    options.device = c10::impl::getDeviceGuardImpl(c10::kCUDA)->getDevice();
  }
  CheckNotInterrupted("barrier");
  Wait(c10d_backend_->barrier(options), "barrier");
}

namespace {

// FormBackendInterruptibly's threads that have not ended yet.
std::atomic<int> g_rendezvous_threads{0};

// The rendezvous of `options`' process group over `store` (the caller checked the options);
// `what` names it in errors.
absl::StatusOr<c10::intrusive_ptr<c10d::Backend>> FormBackend(
    const c10::intrusive_ptr<c10d::Store>& store, const CommunicatorOptions& options,
    const std::string& what) {
  const auto timeout = ToChrono(options.timeout);
  return RunTorchOr(what, [&]() -> absl::StatusOr<c10::intrusive_ptr<c10d::Backend>> {
    auto prefixed = c10::make_intrusive<c10d::PrefixStore>(options.prefix, store);
    prefixed->setTimeout(timeout);
    switch (options.backend) {
      case Backend::kGloo: {
        auto gloo_options = c10d::ProcessGroupGloo::Options::create(timeout);
        gloo_options->devices.push_back(
            c10d::ProcessGroupGloo::createDeviceForHostname(options.hostname));
        gloo_options->threads = 1;
        return c10::intrusive_ptr<c10d::Backend>(c10::make_intrusive<c10d::ProcessGroupGloo>(
            prefixed, options.rank, options.size, gloo_options));
      }
      case Backend::kNccl: {
#ifdef USE_C10D_NCCL
        auto nccl_options = c10d::ProcessGroupNCCL::Options::create();
        nccl_options->timeout = timeout;
        auto nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(prefixed, options.rank,
                                                                options.size, nccl_options);
        // The communicator now, as the group forms (every rank of it is here, under the
        // store's timeout), not at the group's first collective: for the DP group that is a
        // gradient bucket's all-reduce, inside backward on autograd's device thread, where
        // nothing sees the coordinator's abort and a communicator not made yet cannot be
        // aborted.
        nccl->eagerConnectSingleDevice(c10::impl::getDeviceGuardImpl(c10::kCUDA)->getDevice());
        return c10::intrusive_ptr<c10d::Backend>(std::move(nccl));
#else
        return absl::UnimplementedError(
            "backend nccl: this build's libtorch has no NCCL (USE_C10D_NCCL is not defined); "
            "use gloo or build against a CUDA libtorch");
#endif
      }
    }
    return absl::InvalidArgumentError("unknown backend");
  });
}

// FormBackend on a thread of its own, given up when `interrupt` is raised. Gloo's rendezvous
// waits for its peers' addresses in the store and then for their connections, each for the
// whole timeout, and nothing ends either wait early: the key-value store's waits end when the
// coordinator moves to the next generation, but a peer that died after publishing its address
// is waited for in Gloo's connect. A rendezvous given up ends on its thread within its own
// timeouts and then frees what it formed. NCCL's stays on the caller's thread: its communicator
// is made on the caller's current device.
absl::StatusOr<c10::intrusive_ptr<c10d::Backend>> FormBackendInterruptibly(
    const c10::intrusive_ptr<c10d::Store>& store, const CommunicatorOptions& options,
    const std::string& what) {
  struct Formation {
    absl::Mutex mu;
    bool done ABSL_GUARDED_BY(mu) = false;
    absl::StatusOr<c10::intrusive_ptr<c10d::Backend>> result ABSL_GUARDED_BY(mu);
  };
  auto formation = std::make_shared<Formation>();
  CommunicatorOptions own = options;
  own.interrupt = nullptr;  // the caller's, which may be gone when the thread ends
  g_rendezvous_threads.fetch_add(1);
  std::thread([formation, store = c10::intrusive_ptr<c10d::Store>(store), own, what]() mutable {
    {
      absl::StatusOr<c10::intrusive_ptr<c10d::Backend>> result = FormBackend(store, own, what);
      absl::MutexLock lock(&formation->mu);
      formation->result = std::move(result);
      formation->done = true;
    }
    // A group its caller gave up is freed here, before the thread counts as ended.
    formation.reset();
    store.reset();
    g_rendezvous_threads.fetch_sub(1);
  }).detach();
  // A backstop only: the store's waits and Gloo's connect each end within the timeout.
  const absl::Time deadline = absl::Now() + 2 * options.timeout + absl::Seconds(30);
  const absl::Status waited = WaitInSlices(
      [&](absl::Time until) {
        absl::MutexLock lock(&formation->mu);
        return formation->mu.AwaitWithDeadline(absl::Condition(&formation->done), until)
                   ? absl::OkStatus()
                   : absl::DeadlineExceededError(
                         absl::StrCat(what, " did not end within ",
                                      absl::FormatDuration(2 * options.timeout), " and 30s"));
      },
      deadline, options.interrupt);
  if (!waited.ok()) {
    if (!absl::IsAborted(waited)) return waited;
    return absl::AbortedError(absl::StrCat(what, " given up: ", waited.message()));
  }
  absl::MutexLock lock(&formation->mu);
  return std::move(formation->result);
}

}  // namespace

int RendezvousThreadsRunning() { return g_rendezvous_threads.load(); }

absl::StatusOr<std::unique_ptr<Communicator>> Communicator::Create(
    const c10::intrusive_ptr<c10d::Store>& store, const CommunicatorOptions& options) {
  const std::string where = absl::StrCat("group '", options.prefix, "'");
  if (options.size < 1 || options.rank < 0 || options.rank >= options.size) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": rank=", options.rank,
                                                   " size=", options.size,
                                                   ", expected size >= 1 and 0 <= rank < size"));
  }
  if (options.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": timeout=", absl::FormatDuration(options.timeout), ", expected > 0"));
  }
  if (options.size == 1) {
    auto group = c10::make_intrusive<CommGroup>(c10::intrusive_ptr<c10d::Backend>(), 0, 1,
                                                options.backend, ToChrono(options.timeout));
    return std::unique_ptr<Communicator>(new Communicator(std::move(group), options.prefix));
  }
  if (!store) return absl::InvalidArgumentError(absl::StrCat(where, ": no rendezvous store"));
  if (options.prefix.empty()) {
    return absl::InvalidArgumentError(
        "a process group needs a non-empty store prefix (unique per group and generation)");
  }
  const auto timeout = ToChrono(options.timeout);
  ConfigureProcessGroups();
  const bool interruptible = options.interrupt != nullptr && options.interrupt->armed() &&
                             options.backend == Backend::kGloo;
  const std::string what =
      absl::StrCat(where, ": rendezvous of rank ", options.rank, " of ", options.size);
  auto process_group = interruptible ? FormBackendInterruptibly(store, options, what)
                                     : FormBackend(store, options, what);
  if (!process_group.ok()) return process_group.status();
  auto group = c10::make_intrusive<CommGroup>(*std::move(process_group), options.rank, options.size,
                                              options.backend, timeout);
  group->set_interrupt(options.interrupt);
  auto communicator =
      std::unique_ptr<Communicator>(new Communicator(std::move(group), options.prefix));
  if (options.backend == Backend::kGloo) {
    // Gloo's full mesh may be complete on the rank that connected before its peer has read the
    // connection: a rank that then closed the group at once (a replica with no outputs to send)
    // would fail its peer's rendezvous with "Connection closed by peer". A barrier ends the
    // formation on every rank together.
    at::Tensor barrier = at::ones({1}, at::kFloat);
    if (absl::Status s = communicator->AllReduce(barrier); !s.ok()) {
      return Annotate(s, absl::StrCat(what, ", its closing barrier"));
    }
  }
  return communicator;
}

void Communicator::Adopt(Communicator& fresh) {
  group_->Adopt(*fresh.group_);
  prefix_ = fresh.prefix_;
}

std::unique_ptr<Communicator> Communicator::CreateSingle() {
  auto group = c10::make_intrusive<CommGroup>(c10::intrusive_ptr<c10d::Backend>(), 0, 1,
                                              Backend::kGloo, std::chrono::milliseconds(60000));
  return std::unique_ptr<Communicator>(new Communicator(std::move(group), ""));
}

absl::Status Communicator::AllReduce(at::Tensor& tensor, ReduceOp op) {
  return RunTorch(absl::StrCat("all-reduce in group '", prefix_, "'"),
                  [&] { group_->AllReduce(tensor, op); });
}

absl::StatusOr<at::Tensor> Communicator::AllGatherRows(const at::Tensor& tensor) {
  return RunTorchOr(absl::StrCat("all-gather in group '", prefix_, "'"),
                    [&] { return group_->AllGatherRows(tensor); });
}

absl::StatusOr<at::Tensor> Communicator::ReduceScatterRows(const at::Tensor& tensor) {
  return RunTorchOr(absl::StrCat("reduce-scatter in group '", prefix_, "'"),
                    [&] { return group_->ReduceScatterRows(tensor); });
}

absl::Status Communicator::Broadcast(at::Tensor& tensor, int root) {
  return RunTorch(absl::StrCat("broadcast in group '", prefix_, "'"),
                  [&] { group_->Broadcast(tensor, root); });
}

absl::Status Communicator::Barrier() {
  return RunTorch(absl::StrCat("barrier in group '", prefix_, "'"), [&] { group_->Barrier(); });
}

}  // namespace hetpar::nn
