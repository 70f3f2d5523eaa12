#include "common/transport/nccl/nccl_mover.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstring>
#include <deque>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/logging.h"

namespace hetpar::transport::nccl::internal {
namespace {

// How long an aborted transfer's event may stay pending before it is reported done anyway.
constexpr absl::Duration kAbortGrace = absl::Seconds(2);

// The one place ncclResult_t and cudaError_t become Status.
absl::Status NcclToStatus(ncclResult_t result, ncclComm_t comm, std::string_view what) {
  std::string detail = ncclGetErrorString(result);
  if (comm != nullptr) {
    const char* last = ncclGetLastError(comm);
    if (last != nullptr && last[0] != '\0') absl::StrAppend(&detail, ": ", last);
  }
  const std::string message = absl::StrCat(std::string(what), ": NCCL ", detail);
  switch (result) {
    case ncclSuccess:
      return absl::OkStatus();
    case ncclInvalidArgument:
    case ncclInvalidUsage:
      return absl::InvalidArgumentError(message);
    case ncclRemoteError:
    case ncclSystemError:
      return absl::UnavailableError(message);
    default:
      return absl::InternalError(message);
  }
}

absl::Status CudaToStatus(cudaError_t error, std::string_view what) {
  if (error == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(std::string(what), ": CUDA ", cudaGetErrorName(error),
                                          " (", cudaGetErrorString(error), ")"));
}

// Whether a peer's channels were aborted, shared with its transfers.
struct AbortState {
  bool aborted = false;
  absl::Time aborted_at;
  absl::Status why;
};

// One ncclSend or ncclRecv. Non-blocking communicators may take a call in the background
// (ncclInProgress); no other call goes to that communicator until it is in, so the calls of one
// direction stay in the order the protocol posted them.
struct CallState {
  enum class Stage { kWaiting, kEnqueuing, kRecorded };
  bool is_send = false;
  const void* src = nullptr;
  void* dst = nullptr;
  size_t size = 0;
  cudaEvent_t event = nullptr;
  // The GPU of the event: a thread that polls or destroys it makes it current first (the
  // transport's Close runs on the thread that destroys it, which may have none, or GPU 0).
  int device = 0;
  Stage stage = Stage::kWaiting;
  absl::Status failed;
  std::shared_ptr<AbortState> abort;

  ~CallState() {
    if (event == nullptr) return;
    cudaSetDevice(device);
    cudaEventDestroy(event);
  }
};

// One direction with one peer: a 2-rank communicator (rank 0 sends, rank 1 receives) and its
// stream.
struct Channel {
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  int peer_rank = 0;
  std::shared_ptr<CallState> enqueuing;
  std::deque<std::shared_ptr<CallState>> waiting;
};

class NcclTransfer final : public MoverTransfer {
 public:
  explicit NcclTransfer(std::shared_ptr<CallState> call) : call_(std::move(call)) {}

  std::optional<absl::Status> Poll() override {
    if (!call_->failed.ok()) return call_->failed;
    if (call_->stage != CallState::Stage::kRecorded) {
      if (call_->abort->aborted) return call_->abort->why;
      return std::nullopt;
    }
    cudaSetDevice(call_->device);
    const cudaError_t result = cudaEventQuery(call_->event);
    if (result == cudaSuccess) return absl::OkStatus();
    if (result == cudaErrorNotReady) {
      if (call_->abort->aborted && absl::Now() - call_->abort->aborted_at > kAbortGrace) {
        return call_->abort->why;
      }
      return std::nullopt;
    }
    return CudaToStatus(result, call_->is_send ? "waiting for ncclSend (cudaEventQuery)"
                                               : "waiting for ncclRecv (cudaEventQuery)");
  }

 private:
  std::shared_ptr<CallState> call_;
};

class NcclMover final : public DeviceMover {
 public:
  NcclMover(int device, std::string local_name)
      : device_(device), local_name_(std::move(local_name)) {}

  ~NcclMover() override {
    for (auto& [id, peer] : peers_)
      Abort(peer, absl::CancelledError("the transport was destroyed"));
    for (auto& [id, peer] : peers_) {
      for (Channel* channel : {&peer.send, &peer.recv}) {
        if (channel->stream != nullptr) cudaStreamDestroy(channel->stream);
      }
    }
  }

  MemoryKind kind() const override { return MemoryKind::kCuda; }

  absl::StatusOr<std::string> CreatePeerSetup(PeerId /*peer*/) override {
    ncclUniqueId ids[2];
    for (ncclUniqueId& id : ids) {
      const ncclResult_t result = ncclGetUniqueId(&id);
      if (result != ncclSuccess) return NcclToStatus(result, nullptr, "ncclGetUniqueId");
    }
    return std::string(reinterpret_cast<const char*>(ids), sizeof(ids));
  }

  absl::Status StartPeer(PeerId id, std::string_view peer_name, std::string_view setup,
                         bool creator) override {
    const std::string what = Between(peer_name);
    if (setup.size() != 2 * sizeof(ncclUniqueId)) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": the setup is ", setup.size(),
                                                     " bytes; expected two ncclUniqueIds (",
                                                     2 * sizeof(ncclUniqueId), " bytes)"));
    }
    ncclUniqueId ids[2];
    std::memcpy(ids, setup.data(), sizeof(ids));
    if (absl::Status s = CudaToStatus(cudaSetDevice(device_),
                                      absl::StrCat(what, ": cudaSetDevice(", device_, ")"));
        !s.ok()) {
      return s;
    }
    Peer& peer = peers_[id];
    peer.name = std::string(peer_name);
    peer.abort = std::make_shared<AbortState>();
    // The creator's sends use ids[0] and the other side's ids[1]; in each, rank 0 sends.
    const ncclUniqueId& send_id = creator ? ids[0] : ids[1];
    const ncclUniqueId& recv_id = creator ? ids[1] : ids[0];
    peer.send.peer_rank = 1;
    peer.recv.peer_rank = 0;
    for (auto [channel, unique_id, rank, direction] :
         {std::tuple{&peer.send, &send_id, 0, "send"},
          std::tuple{&peer.recv, &recv_id, 1, "recv"}}) {
      // On a failure the communicator already started (the send one, its set-up under way on
      // NCCL's thread) is aborted: the peer's channels never become ready, so nothing else would.
      if (absl::Status s =
              CudaToStatus(cudaStreamCreateWithFlags(&channel->stream, cudaStreamNonBlocking),
                           absl::StrCat(what, ": creating the ", direction, " stream"));
          !s.ok()) {
        Abort(peer, s);
        return s;
      }
      ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
      config.blocking = 0;
      const ncclResult_t result =
          ncclCommInitRankConfig(&channel->comm, 2, *unique_id, rank, &config);
      if (result != ncclSuccess && result != ncclInProgress) {
        absl::Status s = InitError(result, channel->comm, peer_name);
        Abort(peer, s);
        return s;
      }
    }
    return absl::OkStatus();
  }

  absl::StatusOr<bool> PollPeer(PeerId id) override {
    auto it = peers_.find(id);
    if (it == peers_.end()) return false;
    Peer& peer = it->second;
    if (peer.abort->aborted) return peer.abort->why;
    bool ready = true;
    for (Channel* channel : {&peer.send, &peer.recv}) {
      ncclResult_t async = ncclSuccess;
      const ncclResult_t result = ncclCommGetAsyncError(channel->comm, &async);
      if (result != ncclSuccess) {
        return NcclToStatus(result, channel->comm,
                            absl::StrCat(Between(peer.name), ": ncclCommGetAsyncError"));
      }
      if (async == ncclInProgress) {
        ready = false;
      } else if (async != ncclSuccess) {
        if (!peer.ready) return InitError(async, channel->comm, peer.name);
        return NcclToStatus(async, channel->comm,
                            absl::StrCat(Between(peer.name), ": asynchronous NCCL error"));
      }
    }
    if (ready) peer.ready = true;
    return peer.ready;
  }

  absl::StatusOr<std::unique_ptr<MoverTransfer>> PostSend(PeerId id, const void* data, size_t size,
                                                          int /*device*/) override {
    auto call = std::make_shared<CallState>();
    call->is_send = true;
    call->src = data;
    call->size = size;
    return Post(id, std::move(call));
  }

  absl::StatusOr<std::unique_ptr<MoverTransfer>> PostRecv(
      PeerId id, const std::vector<MutableBuffer>& segments, size_t size, int /*device*/) override {
    if (segments.size() != 1) {
      return absl::UnimplementedError(
          absl::StrCat("ncclRecv takes one buffer; got ", segments.size(), " segments"));
    }
    auto call = std::make_shared<CallState>();
    call->dst = segments[0].data;
    call->size = size;
    return Post(id, std::move(call));
  }

  void AbortPeer(PeerId id) override {
    auto it = peers_.find(id);
    if (it == peers_.end()) return;
    Abort(it->second, absl::CancelledError(absl::StrCat("the NCCL communicators with peer '",
                                                        it->second.name, "' were aborted")));
  }

  void Progress() override {
    for (auto& [id, peer] : peers_) {
      if (peer.abort->aborted) continue;
      for (Channel* channel : {&peer.send, &peer.recv}) Advance(peer, channel);
    }
  }

 private:
  struct Peer {
    std::string name;
    Channel send, recv;
    bool ready = false;
    std::shared_ptr<AbortState> abort;
  };

  std::string Between(std::string_view peer_name) const {
    return absl::StrCat("NCCL channels between '", local_name_, "' (cuda:", device_, ") and '",
                        std::string(peer_name), "'");
  }

  absl::Status InitError(ncclResult_t result, ncclComm_t comm, std::string_view peer_name) const {
    absl::Status status =
        NcclToStatus(result, comm, absl::StrCat(Between(peer_name), ": ncclCommInitRankConfig"));
    if (result == ncclInvalidUsage) {
      // NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU detected").
      return absl::FailedPreconditionError(absl::StrCat(
          std::string(status.message()),
          ". NCCL refuses two ranks on one GPU (\"Duplicate GPU detected\"): '", local_name_,
          "' and '", std::string(peer_name),
          "' are likely on the same GPU. The nccl transport needs one GPU per process; use "
          "transport ucx (CUDA UCX) when processes share a GPU"));
    }
    return status;
  }

  absl::StatusOr<std::unique_ptr<MoverTransfer>> Post(PeerId id, std::shared_ptr<CallState> call) {
    auto it = peers_.find(id);
    if (it == peers_.end() || !it->second.ready) {
      return absl::FailedPreconditionError(
          absl::StrCat("NCCL channels with peer ", id, " are not ready"));
    }
    Peer& peer = it->second;
    call->abort = peer.abort;
    call->device = device_;
    cudaSetDevice(device_);
    if (absl::Status s =
            CudaToStatus(cudaEventCreateWithFlags(&call->event, cudaEventDisableTiming),
                         "creating a completion event");
        !s.ok()) {
      return s;
    }
    Channel* channel = call->is_send ? &peer.send : &peer.recv;
    channel->waiting.push_back(call);
    Advance(peer, channel);
    return std::unique_ptr<MoverTransfer>(new NcclTransfer(std::move(call)));
  }

  // Issues the channel's waiting calls in order while its communicator takes them.
  void Advance(Peer& peer, Channel* channel) {
    if (channel->enqueuing != nullptr) {
      ncclResult_t async = ncclSuccess;
      ncclCommGetAsyncError(channel->comm, &async);
      if (async == ncclInProgress) return;
      std::shared_ptr<CallState> call = std::move(channel->enqueuing);
      channel->enqueuing = nullptr;
      if (async != ncclSuccess) {
        call->failed = NcclToStatus(async, channel->comm, Between(peer.name));
        return;
      }
      Record(call.get(), channel);
    }
    while (!channel->waiting.empty()) {
      std::shared_ptr<CallState> call = std::move(channel->waiting.front());
      channel->waiting.pop_front();
      cudaSetDevice(device_);
      const ncclResult_t result =
          call->is_send ? ncclSend(call->src, call->size, ncclUint8, channel->peer_rank,
                                   channel->comm, channel->stream)
                        : ncclRecv(call->dst, call->size, ncclUint8, channel->peer_rank,
                                   channel->comm, channel->stream);
      if (result == ncclInProgress) {
        call->stage = CallState::Stage::kEnqueuing;
        channel->enqueuing = std::move(call);
        return;
      }
      if (result != ncclSuccess) {
        call->failed = NcclToStatus(
            result, channel->comm,
            absl::StrCat(Between(peer.name), call->is_send ? ": ncclSend" : ": ncclRecv"));
        continue;
      }
      Record(call.get(), channel);
    }
  }

  void Record(CallState* call, Channel* channel) {
    const cudaError_t error = cudaEventRecord(call->event, channel->stream);
    if (error != cudaSuccess) {
      call->failed = CudaToStatus(error, "cudaEventRecord after an NCCL call");
      return;
    }
    call->stage = CallState::Stage::kRecorded;
  }

  void Abort(Peer& peer, absl::Status why) {
    if (peer.abort->aborted) return;
    peer.abort->aborted = true;
    peer.abort->aborted_at = absl::Now();
    peer.abort->why = std::move(why);
    cudaSetDevice(device_);
    for (Channel* channel : {&peer.send, &peer.recv}) {
      if (channel->comm != nullptr) {
        const ncclResult_t result = ncclCommAbort(channel->comm);
        if (result != ncclSuccess) {
          HETPAR_LOG(WARNING) << NcclToStatus(result, nullptr,
                                              absl::StrCat(Between(peer.name), ": ncclCommAbort"));
        }
        channel->comm = nullptr;
      }
      channel->enqueuing = nullptr;
      channel->waiting.clear();
    }
  }

  const int device_;
  const std::string local_name_;
  std::map<PeerId, Peer> peers_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceMover>> CreateNcclMover(int cuda_device,
                                                             const std::string& local_name) {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    return CudaToStatus(error, absl::StrCat("nccl transport '", local_name,
                                            "': no usable CUDA device (cudaGetDeviceCount)"));
  }
  if (cuda_device < 0 || cuda_device >= count) {
    return absl::InvalidArgumentError(
        absl::StrCat("nccl transport '", local_name, "': options.cuda_device is ", cuda_device,
                     "; this process sees ", count, " CUDA device(s)"));
  }
  return std::unique_ptr<DeviceMover>(new NcclMover(cuda_device, local_name));
}

}  // namespace hetpar::transport::nccl::internal
