#include "common/transport/ucx/ucx_transport.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/uio.h>
#include <ucp/api/ucp.h>
#include <ucs/config/global_opts.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/logging.h"
#include "common/transport/address.h"
#include "common/transport/completion.h"
#include "common/transport/ucx/ucx_status.h"

namespace hetpar::transport::ucx {
namespace internal {
namespace {

constexpr std::string_view kBackend = "ucx";
// Wire tag: bit 63 control | bit 62 zero-copy descriptor | bit 61 service | bits 40..60 sender
// slot | user tag.
constexpr ucp_tag_t kControlTag = ucp_tag_t{1} << 63;
constexpr ucp_tag_t kZeroCopyBit = ucp_tag_t{1} << 62;
constexpr ucp_tag_t kServiceBit = ucp_tag_t{1} << 61;
constexpr int kSlotBits = 21;
static_assert(kTagBits + kSlotBits == 61, "the slot must end below the service bit");
constexpr uint64_t kMaxSlot = (uint64_t{1} << kSlotBits) - 1;
constexpr ucp_tag_t kFullMask = ~ucp_tag_t{0};
// Receives match a message whether it carries data or a zero-copy descriptor, in send order.
constexpr ucp_tag_t kDataMask = kFullMask & ~kZeroCopyBit;
constexpr uint32_t kControlMagic = 0x54435048;     // "HPCT"
constexpr uint32_t kDescriptorMagic = 0x44435048;  // "HPCD"

ucp_tag_t WireTag(uint64_t slot, Tag tag, bool service) {
  return (slot << kTagBits) | tag | (service ? kServiceBit : 0);
}

enum class ControlKind : uint32_t {
  kHello = 1,          // arg0/arg1: address and value of the sender's probe word; pid
  kGoodbye = 2,        // the sender closed the connection
  kGoodbyeAck = 3,     // the receiver of a goodbye will read no more of the sender's memory
  kZeroCopyReady = 4,  // the sender read our probe word: it can read our memory
  kZeroCopyDone = 5,   // arg0: send id; arg1: ZeroCopyResult
};

enum ZeroCopyResult : uint64_t { kCopied = 0, kTruncated = 1, kReadFailed = 2, kDropped = 3 };

// Sent on the single control tag, so the control messages of one connection stay in order.
struct ControlMessage {
  uint32_t magic = kControlMagic;
  uint32_t kind = 0;
  uint64_t instance_id = 0;  // the sender's instance
  uint64_t slot = 0;         // the PeerId the sender gave the receiver
  uint64_t arg0 = 0;
  uint64_t arg1 = 0;
  uint32_t pid = 0;
  uint32_t reserved = 0;
};

// Sent instead of the data of a large message to a peer on the same host: the receiver copies
// the bytes straight out of the sender's buffer (process_vm_readv) into its receive buffer.
struct ZeroCopyDescriptor {
  uint32_t magic = kDescriptorMagic;
  uint32_t pid = 0;
  uint64_t address = 0;
  uint64_t length = 0;
  uint64_t send_id = 0;
};

// Copies `length` bytes at `address` in process `pid` to `dst`; 0 or an errno.
int ReadPeerMemory(uint32_t pid, uint64_t address, void* dst, size_t length) {
  size_t done = 0;
  while (done < length) {
    iovec local{static_cast<char*>(dst) + done, length - done};
    iovec remote{reinterpret_cast<void*>(address + done), length - done};
    const ssize_t n = process_vm_readv(static_cast<pid_t>(pid), &local, 1, &remote, 1, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return errno;
    if (n == 0) return EIO;
    done += static_cast<size_t>(n);
  }
  return 0;
}

// Copies `length` bytes at `address` in process `pid` over `segments` in order; 0 or an errno.
int ReadPeerMemoryScatter(uint32_t pid, uint64_t address,
                          const std::vector<MutableBuffer>& segments, size_t length) {
  size_t done = 0;
  for (const MutableBuffer& segment : segments) {
    if (done == length) break;
    const size_t n = std::min(segment.size, length - done);
    if (n == 0) continue;
    if (int error = ReadPeerMemory(pid, address + done, segment.data, n); error != 0) return error;
    done += n;
  }
  return 0;
}

enum class OpKind { kSend, kRecv, kControlSend };

std::string Describe(OpKind kind, std::string_view peer_name, Tag tag, size_t size,
                     bool service = false) {
  return absl::StrCat(service ? "service " : "", kind == OpKind::kRecv ? "receive from" : "send to",
                      " peer '", std::string(peer_name), "' tag ", tag, " (", size, " bytes)");
}

std::string UcxDuration(absl::Duration duration) {
  return absl::StrCat(absl::ToInt64Microseconds(duration), "us");
}

}  // namespace

class Core;

// One send or receive. Owned by shared_ptr: the caller's Operation holds one reference and the
// progress thread holds another while UCX has the request.
struct UcxOp {
  OpKind kind = OpKind::kSend;
  PeerId peer = 0;
  Tag tag = 0;
  bool service = false;  // in the service tag space (SendService/RecvService)
  const void* src = nullptr;
  void* dst = nullptr;
  size_t size = 0;
  std::vector<MutableBuffer> segments;  // a scatter receive's, instead of dst
  std::vector<ucp_dt_iov_t> iov;        // the non-empty segments, as UCX takes them
  ucs_memory_type_t memory_type = UCS_MEMORY_TYPE_HOST;
  std::shared_ptr<Completion> completion;  // null for control sends
  ControlMessage control;                  // payload of a control send
  Core* core = nullptr;
  // Progress thread only:
  void* request = nullptr;
  bool zero_copy = false;                                    // a send that went as a descriptor
  ZeroCopyDescriptor descriptor;                             // what a zero-copy send sent
  std::array<uint8_t, sizeof(ZeroCopyDescriptor)> bounce{};  // landing area of small receives
  bool bounced = false;                                      // the receive was posted into `bounce`
};

// Progress-thread state of one connection.
struct PeerConn {
  enum class Stage { kOpen, kFlushing, kClosing, kClosed };

  Core* core = nullptr;
  PeerId id = 0;
  std::string name;
  uint64_t instance_id = 0;
  ucp_ep_h ep = nullptr;
  int64_t remote_slot = -1;    // the slot the peer gave us, from its hello
  bool peer_failed = false;    // the endpoint reported an error
  bool peer_left = false;      // the peer said goodbye
  bool goodbye_acked = false;  // the peer acknowledged our goodbye
  // Same-host zero copy: whether the peer can read our memory (it said so after reading our
  // probe word), and the sends it is reading now, by send id.
  bool zero_copy_to_peer = false;
  uint32_t zero_copy_from_pid = 0;  // the process we offered to copy from (0: none)
  uint64_t next_send_id = 1;
  absl::flat_hash_map<uint64_t, std::shared_ptr<UcxOp>> zero_copy_sends;
  absl::Status closed_status;  // non-OK once the connection is closing: why
  Stage stage = Stage::kOpen;
  bool flush_done = false;
  absl::Time flush_deadline;
  std::deque<std::shared_ptr<UcxOp>> waiting_sends;  // until the peer's hello
  absl::flat_hash_map<UcxOp*, std::shared_ptr<UcxOp>> in_flight;
  std::vector<std::shared_ptr<Completion>> close_waiters;
};

class Core {
 public:
  using Options = UcxTransport::Options;

  static absl::StatusOr<std::shared_ptr<Core>> Create(const Options& options);
  ~Core();

  // --- any thread ---
  const std::string& name() const { return options_.name; }
  std::string LocalAddress() const { return address_; }
  bool SupportsMemory(MemoryKind kind) const {
    switch (kind) {
      case MemoryKind::kHost:
        return true;
      case MemoryKind::kCuda:
        return cuda_supported_;
    }
    return false;
  }
  // Runs `command` on the progress thread; false once it is stopping.
  bool RunOnProgressThread(std::function<void()> command) { return Enqueue(std::move(command)); }
  UcxTransport::Stats stats() const {
    UcxTransport::Stats stats;
    stats.sends = sends_ok_.load(std::memory_order_relaxed);
    stats.receives = receives_ok_.load(std::memory_order_relaxed);
    stats.zero_copy_sends = zero_copy_sends_ok_.load(std::memory_order_relaxed);
    stats.zero_copy_receives = zero_copy_receives_ok_.load(std::memory_order_relaxed);
    return stats;
  }
  absl::StatusOr<PeerId> Connect(std::string_view peer_address, absl::Time deadline);
  // A scatter receive passes its (validated) segments and a null `dst`. `service` picks the
  // service tag space.
  absl::StatusOr<std::shared_ptr<UcxOp>> Post(OpKind kind, bool service, PeerId peer, Tag tag,
                                              const void* src, void* dst, size_t size,
                                              MemoryKind memory_kind, int device,
                                              std::vector<MutableBuffer> segments = {});
  absl::Status Disconnect(PeerId peer, absl::Time deadline);
  std::string PeerName(PeerId peer) const;
  void Cancel(const std::shared_ptr<UcxOp>& op);
  void Abandon(const std::shared_ptr<UcxOp>& op);
  // Stops the progress thread (saying goodbye to peers) and releases every UCX resource.
  // Idempotent; operations still referencing the core are done afterwards.
  void Close();
  const Options& options() const { return options_; }

  // --- UCX callbacks (progress thread) ---
  static void OnSendDone(void* request, ucs_status_t status, void* user_data);
  static void OnRecvDone(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info,
                         void* user_data);
  static void OnControlRecvDone(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info,
                                void* user_data);
  static void OnFlushDone(void* request, ucs_status_t status, void* user_data);
  static void OnCloseDone(void* request, ucs_status_t status, void* user_data);
  static void OnEndpointError(void* arg, ucp_ep_h ep, ucs_status_t status);

 private:
  struct PeerInfo {
    std::string name;
    uint64_t instance_id = 0;
    bool disconnected = false;
    absl::Status dead;
  };

  explicit Core(const Options& options) : options_(options) {}
  absl::Status Init();
  bool Enqueue(std::function<void()> command);
  void Wake();

  // --- progress thread ---
  void Loop();
  bool RunCommands();
  void Sleep();
  bool HasActiveWork() const;
  bool AllClosed() const;
  bool ProcessFailures();
  PeerConn* FindConn(PeerId peer);
  absl::Status CreateEndpoint(PeerId peer, const AddressEnvelope& envelope);
  void PostSend(const std::shared_ptr<UcxOp>& op);
  void PostRecv(const std::shared_ptr<UcxOp>& op);
  void IssueSend(PeerConn* conn, const std::shared_ptr<UcxOp>& op);
  void SendControl(PeerConn* conn, ControlKind kind, uint64_t arg0 = 0, uint64_t arg1 = 0);
  void PostControlRecv();
  bool HandleControl();
  // The peer's hello told us its slot (and how to probe its memory).
  void AcceptHello(PeerConn* conn, const ControlMessage& hello);
  PeerConn* ConnOfControl(const ControlMessage& message);
  bool ProcessReads();
  void OnOpDone(UcxOp* op, void* request, ucs_status_t status, size_t length, ucp_tag_t sender_tag);
  absl::Status OpStatus(const PeerConn& conn, const UcxOp& op, ucs_status_t status,
                        size_t length) const;
  void CancelOnProgressThread(const std::shared_ptr<UcxOp>& op);
  void PeerFailed(PeerConn* conn, absl::Status status);
  // Starts closing `conn` for `why`. `farewell` (kGoodbye, kGoodbyeAck, or 0 for none) is sent
  // and flushed first when the peer is alive.
  void StartClose(PeerConn* conn, absl::Status why, uint32_t farewell, absl::Time deadline);
  void ForceClose(PeerConn* conn);
  bool AdvanceCloses();
  void FinishCloseIfDone(PeerConn* conn);
  void SetPublicDead(PeerId peer, const absl::Status& status);

  const Options options_;
  uint64_t instance_id_ = 0;
  std::string address_;
  bool cuda_supported_ = false;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  int worker_fd_ = -1;
  int wake_fd_ = -1;
  int epoll_fd_ = -1;
  std::thread thread_;

  mutable absl::Mutex mu_;
  std::deque<std::function<void()>> commands_ ABSL_GUARDED_BY(mu_);
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;  // no more commands accepted
  PeerId next_peer_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<PeerId, PeerInfo> peer_info_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, PeerId> live_by_instance_ ABSL_GUARDED_BY(mu_);

  // Progress thread only (and the creating/destroying thread before start / after join).
  std::map<PeerId, std::unique_ptr<PeerConn>> conns_;
  absl::flat_hash_map<uint64_t, ControlMessage> early_hellos_;  // by instance, before Connect
  absl::flat_hash_set<std::pair<uint64_t, uint64_t>> early_goodbyes_;  // (instance, slot)
  size_t in_flight_count_ = 0;
  std::vector<std::pair<ucp_ep_h, ucs_status_t>> failed_endpoints_;  // from the error callback
  // Receives that matched a zero-copy descriptor, read after ucp_worker_progress returns.
  struct PendingRead {
    std::shared_ptr<UcxOp> op;
    ZeroCopyDescriptor descriptor;
  };
  std::vector<PendingRead> pending_reads_;
  // A word peers read at connection time to learn whether they can read this process's memory.
  uint64_t probe_word_ = 0;
  // Written by the progress thread, read by stats().
  std::atomic<uint64_t> sends_ok_{0}, receives_ok_{0}, zero_copy_sends_ok_{0},
      zero_copy_receives_ok_{0};
  ControlMessage control_in_;
  void* control_request_ = nullptr;
  bool control_done_ = false;
  ucs_status_t control_status_ = UCS_OK;
  size_t control_length_ = 0;
  bool shutting_down_ = false;
  absl::Time shutdown_deadline_;
  bool released_ = false;
  // Set while ucp_worker_destroy runs: the callbacks it makes only free their requests.
  bool destroying_ = false;
};

// ---------------------------------------------------------------------------------------------
// Set-up and tear-down

absl::StatusOr<std::shared_ptr<Core>> Core::Create(const Options& options) {
  if (options.name.empty()) {
    return absl::InvalidArgumentError(
        "ucx transport: options.name is empty; expected a name peers can print, e.g. 'enc r1'");
  }
  if (options.name.size() > 1000) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ucx transport: options.name is ", options.name.size(), " bytes; expected at most 1000"));
  }
  std::shared_ptr<Core> core(new Core(options));
  absl::Status status = core->Init();
  if (!status.ok()) return status;
  return core;
}

absl::Status Core::Init() {
  const std::string where = absl::StrCat("ucx transport '", options_.name, "'");
  ucp_config_t* config = nullptr;
  ucs_status_t st = ucp_config_read(nullptr, nullptr, &config);
  if (st != UCS_OK) {
    return UcsToStatus(st,
                       absl::StrCat(where, ": reading the UCX_* environment (ucp_config_read)"));
  }
  // Faster failure detection than UCX's defaults, unless the user chose a value. How
  // ucp_config_modify names a transport's setting depends on the UCX that runs: up to 1.16 by its
  // name in the transport's table (KEEPIDLE reaches the tcp interfaces), from 1.17 on with the
  // transport's prefix, as in the variable (TCP_KEEPIDLE; 1.21 and newer reject KEEPIDLE, 1.17 to
  // 1.20 would accept it and apply it nowhere).
  unsigned ucx_major = 0, ucx_minor = 0, ucx_release = 0;
  ucp_get_version(&ucx_major, &ucx_minor, &ucx_release);
  const bool prefixed_keys = ucx_major > 1 || (ucx_major == 1 && ucx_minor >= 17);
  struct Default {
    const char* variable;  // what the user would set
    const char* key;       // what ucp_config_modify takes
    std::string value;
  };
  const Default defaults[] = {
      {"UCX_KEEPALIVE_INTERVAL", "KEEPALIVE_INTERVAL", UcxDuration(options_.keepalive_interval)},
      {"UCX_TCP_KEEPIDLE", prefixed_keys ? "TCP_KEEPIDLE" : "KEEPIDLE",
       UcxDuration(options_.tcp_keepidle)},
      {"UCX_TCP_KEEPINTVL", prefixed_keys ? "TCP_KEEPINTVL" : "KEEPINTVL",
       UcxDuration(options_.tcp_keepintvl)},
  };
  for (const Default& d : defaults) {
    if (std::getenv(d.variable) != nullptr) continue;
    st = ucp_config_modify(config, d.key, d.value.c_str());
    if (st != UCS_OK) {
      ucp_config_release(config);
      return UcsToStatus(st, absl::StrCat(where, ": setting ", d.variable, "=", d.value));
    }
  }
  // Each buffer's memory type from the GPU driver (a cuPointerGetAttributes per operation, only
  // where a CUDA transport loaded), not from UCX's memory-type cache,
  // unless the user chose (UCX_MEMTYPE_CACHE). The cache learns of allocations through UCX's hooks
  // on the CUDA allocation calls, and one it missed (libtorch's caching allocator allocating in a
  // way the hooks do not see) reads as host memory: UCX ignores the operation's memory-type
  // attribute for CUDA buffers and would copy from a device address on the host. The setting is
  // libucs's, global, and read when a context opens its CUDA memory domain (in ucp_init).
  if (std::getenv("UCX_MEMTYPE_CACHE") == nullptr) {
    st = ucs_global_opts_set_value("MEMTYPE_CACHE", "n");
    if (st != UCS_OK) {
      ucp_config_release(config);
      return UcsToStatus(st, absl::StrCat(where, ": setting UCX_MEMTYPE_CACHE=n"));
    }
  }
  ucp_params_t params{};
  params.field_mask =
      UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED | UCP_PARAM_FIELD_NAME;
  params.features = UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP;
  params.mt_workers_shared = 0;
  const std::string context_name = absl::StrCat("hetpar ", options_.name);
  params.name = context_name.c_str();
  st = ucp_init(&params, config, &context_);
  ucp_config_release(config);
  if (st != UCS_OK) {
    context_ = nullptr;
    return UcsToStatus(st, absl::StrCat(where,
                                        ": creating the UCX context (ucp_init; check "
                                        "UCX_TLS and the other UCX_* variables)"));
  }
  ucp_context_attr_t context_attr{};
  context_attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  if (ucp_context_query(context_, &context_attr) == UCS_OK) {
    cuda_supported_ = (context_attr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
  }

  ucp_worker_params_t worker_params{};
  worker_params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  worker_params.thread_mode = UCS_THREAD_MODE_SINGLE;
  st = ucp_worker_create(context_, &worker_params, &worker_);
  if (st != UCS_OK) {
    worker_ = nullptr;
    return UcsToStatus(st, absl::StrCat(where, ": creating the UCX worker (ucp_worker_create)"));
  }
  ucp_address_t* worker_address = nullptr;
  size_t worker_address_length = 0;
  st = ucp_worker_get_address(worker_, &worker_address, &worker_address_length);
  if (st != UCS_OK) {
    return UcsToStatus(st, absl::StrCat(where, ": reading the worker address"));
  }
  AddressEnvelope envelope;
  envelope.backend = std::string(kBackend);
  instance_id_ = NewInstanceId();
  probe_word_ = NewInstanceId();
  envelope.instance_id = instance_id_;
  envelope.name = options_.name;
  envelope.payload.assign(reinterpret_cast<const char*>(worker_address), worker_address_length);
  ucp_worker_release_address(worker_, worker_address);
  address_ = EncodeAddress(envelope);

  st = ucp_worker_get_efd(worker_, &worker_fd_);
  if (st != UCS_OK) {
    worker_fd_ = -1;
    return UcsToStatus(st, absl::StrCat(where, ": getting the worker's event fd"));
  }
  wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  if (wake_fd_ < 0 || epoll_fd_ < 0) {
    return absl::InternalError(
        absl::StrCat(where, ": creating the progress thread's eventfd/epoll: ", strerror(errno)));
  }
  for (int fd : {worker_fd_, wake_fd_}) {
    epoll_event event{};
    event.events = EPOLLIN;
    event.data.fd = fd;
    if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &event) != 0) {
      return absl::InternalError(
          absl::StrCat(where, ": adding fd ", fd, " to epoll: ", strerror(errno)));
    }
  }
  PostControlRecv();
  thread_ = std::thread([this] { Loop(); });
  return absl::OkStatus();
}

void Core::Close() {
  bool join = false;
  {
    absl::MutexLock lock(&mu_);
    if (!stopped_) {
      stopped_ = true;
      join = true;
      commands_.push_back([this] {
        shutting_down_ = true;
        shutdown_deadline_ = absl::Now() + options_.shutdown_timeout;
        for (auto& [id, conn] : conns_) {
          StartClose(conn.get(), absl::CancelledError("cancelled: the transport was destroyed"),
                     static_cast<uint32_t>(ControlKind::kGoodbye), shutdown_deadline_);
        }
      });
    }
  }
  if (join && thread_.joinable()) {
    Wake();
    thread_.join();
  }
  if (released_) return;
  released_ = true;
  if (worker_ != nullptr) {
    if (control_request_ != nullptr) {
      ucp_request_cancel(worker_, control_request_);
      for (int i = 0; i < 100 && control_request_ != nullptr; ++i) ucp_worker_progress(worker_);
    }
    // Whatever UCX did not finish by the shutdown deadline completes here, once the worker is
    // destroyed: until then UCX still holds the requests of endpoints that did not close by the
    // deadline (a send queued to a peer that stopped answering), and a caller woken earlier could
    // free a buffer UCX may still touch. As it destroys the worker UCX completes those requests,
    // calling back with their ops as user data: the ops stay alive until it returns, and those
    // callbacks only free their requests (destroying_).
    std::vector<std::shared_ptr<UcxOp>> held;
    std::vector<std::shared_ptr<Completion>> closes;
    for (auto& [id, conn] : conns_) {
      for (auto& [raw, op] : conn->in_flight) held.push_back(op);
      for (auto& op : conn->waiting_sends) held.push_back(op);
      for (auto& [id, op] : conn->zero_copy_sends) held.push_back(op);
      conn->zero_copy_sends.clear();
      conn->in_flight.clear();
      conn->waiting_sends.clear();
      closes.insert(closes.end(), conn->close_waiters.begin(), conn->close_waiters.end());
      conn->close_waiters.clear();
    }
    for (PendingRead& read : pending_reads_) held.push_back(read.op);
    pending_reads_.clear();
    destroying_ = true;
    ucp_worker_destroy(worker_);
    worker_ = nullptr;
    destroying_ = false;
    const absl::Status destroyed = absl::CancelledError("cancelled: the transport was destroyed");
    for (const std::shared_ptr<UcxOp>& op : held) {
      if (op->completion == nullptr) continue;  // a control message
      op->completion->Complete(absl::CancelledError(
          absl::StrCat(op->completion->description(), ": ", destroyed.message())));
    }
    for (const std::shared_ptr<Completion>& close : closes) close->Complete(absl::OkStatus());
  }
  if (context_ != nullptr) ucp_cleanup(context_);
  context_ = nullptr;
  if (epoll_fd_ >= 0) close(epoll_fd_);
  if (wake_fd_ >= 0) close(wake_fd_);
  epoll_fd_ = wake_fd_ = -1;
}

Core::~Core() { Close(); }

bool Core::Enqueue(std::function<void()> command) {
  {
    absl::MutexLock lock(&mu_);
    if (stopped_) return false;
    commands_.push_back(std::move(command));
  }
  Wake();
  return true;
}

void Core::Wake() {
  const uint64_t one = 1;
  ssize_t written = write(wake_fd_, &one, sizeof(one));
  (void)written;  // a full counter still wakes the thread
}

// ---------------------------------------------------------------------------------------------
// Calls from user threads

absl::StatusOr<PeerId> Core::Connect(std::string_view peer_address, absl::Time deadline) {
  auto envelope = DecodeAddress(peer_address, kBackend);
  if (!envelope.ok()) return envelope.status();
  if (envelope->payload.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("ucx address of '", envelope->name, "' has an empty worker address"));
  }
  PeerId peer = 0;
  auto done = std::make_shared<Completion>(
      absl::StrCat("connecting '", options_.name, "' to '", envelope->name, "'"));
  {
    absl::MutexLock lock(&mu_);
    if (stopped_) {
      return absl::FailedPreconditionError(
          absl::StrCat(done->description(), ": the transport is shutting down"));
    }
    auto live = live_by_instance_.find(envelope->instance_id);
    if (live != live_by_instance_.end()) {
      return absl::AlreadyExistsError(absl::StrCat("'", options_.name,
                                                   "' is already connected to '", envelope->name,
                                                   "' as peer ", live->second));
    }
    if (next_peer_ > kMaxSlot) {
      return absl::ResourceExhaustedError(
          absl::StrCat(done->description(), ": this transport has made ", kMaxSlot,
                       " connections, the most its tag layout can name; create a new transport"));
    }
    peer = next_peer_++;
    peer_info_[peer] = PeerInfo{envelope->name, envelope->instance_id, false, absl::OkStatus()};
    live_by_instance_[envelope->instance_id] = peer;
    commands_.push_back([this, peer, envelope = *envelope, done] {
      done->Complete(CreateEndpoint(peer, envelope));
    });
  }
  Wake();
  absl::Status status = done->Wait(deadline);
  if (!status.ok()) {
    absl::MutexLock lock(&mu_);
    peer_info_[peer].disconnected = true;
    live_by_instance_.erase(envelope->instance_id);
    return status;
  }
  return peer;
}

absl::StatusOr<std::shared_ptr<UcxOp>> Core::Post(OpKind kind, bool service, PeerId peer, Tag tag,
                                                  const void* src, void* dst, size_t size,
                                                  MemoryKind memory_kind, int device,
                                                  std::vector<MutableBuffer> segments) {
  auto op = std::make_shared<UcxOp>();
  op->kind = kind;
  op->peer = peer;
  op->tag = tag;
  op->service = service;
  op->src = src;
  op->dst = dst;
  op->size = size;
  const bool scatter = !segments.empty();
  op->segments = std::move(segments);
  for (const MutableBuffer& segment : op->segments) {
    if (segment.size > 0) op->iov.push_back({segment.data, segment.size});
  }
  op->core = this;
  {
    absl::MutexLock lock(&mu_);
    auto info = peer_info_.find(peer);
    const std::string what = Describe(
        kind,
        info == peer_info_.end() ? absl::StrCat("<unknown peer ", peer, ">") : info->second.name,
        tag, size, service);
    if (info == peer_info_.end()) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": '", options_.name, "' has no peer ",
                                                     peer, "; expected a PeerId from Connect"));
    }
    if (auto s = ValidateTag(tag, what); !s.ok()) return s;
    if (auto s = scatter
                     ? absl::OkStatus()
                     : ValidateBuffer(kind == OpKind::kSend ? src : dst, size, memory_kind, what);
        !s.ok()) {
      return s;
    }
    if (memory_kind == MemoryKind::kCuda) {
      if (!cuda_supported_) {
        return absl::UnimplementedError(absl::StrCat(
            what, ": this UCX (", ucp_get_version_string(),
            ") has no CUDA memory support: its CUDA transport module did not load (no GPU "
            "driver, libcuda.so.1, on this machine, or a UCX built without CUDA); device ",
            device, " memory cannot be moved"));
      }
      op->memory_type = UCS_MEMORY_TYPE_CUDA;
    }
    if (info->second.disconnected) {
      return absl::FailedPreconditionError(
          absl::StrCat(what, ": peer ", peer, " was disconnected by this transport"));
    }
    if (!info->second.dead.ok()) {
      return absl::UnavailableError(
          absl::StrCat(what, ": ", std::string(info->second.dead.message())));
    }
    if (stopped_) {
      return absl::CancelledError(absl::StrCat(what, ": the transport is shutting down"));
    }
    op->completion = std::make_shared<Completion>(what);
    if (kind == OpKind::kSend) {
      commands_.push_back([this, op] { PostSend(op); });
    } else {
      commands_.push_back([this, op] { PostRecv(op); });
    }
  }
  Wake();
  return op;
}

absl::Status Core::Disconnect(PeerId peer, absl::Time deadline) {
  std::shared_ptr<Completion> done;
  {
    absl::MutexLock lock(&mu_);
    auto info = peer_info_.find(peer);
    if (info == peer_info_.end()) {
      return absl::InvalidArgumentError(absl::StrCat("disconnect: '", options_.name,
                                                     "' has no peer ", peer,
                                                     "; expected a PeerId from Connect"));
    }
    if (info->second.disconnected) return absl::OkStatus();
    info->second.disconnected = true;
    auto live = live_by_instance_.find(info->second.instance_id);
    if (live != live_by_instance_.end() && live->second == peer) live_by_instance_.erase(live);
    done = std::make_shared<Completion>(
        absl::StrCat("disconnecting '", options_.name, "' from peer '", info->second.name, "'"));
    if (stopped_) return absl::OkStatus();
    commands_.push_back([this, peer, deadline, done] {
      PeerConn* conn = FindConn(peer);
      if (conn == nullptr) {
        done->Complete(absl::OkStatus());
        return;
      }
      conn->close_waiters.push_back(done);
      StartClose(
          conn,
          absl::CancelledError(absl::StrCat("cancelled: peer ", peer, " was disconnected locally")),
          static_cast<uint32_t>(ControlKind::kGoodbye), deadline);
      FinishCloseIfDone(conn);
    });
  }
  Wake();
  return done->Wait(deadline);
}

std::string Core::PeerName(PeerId peer) const {
  absl::MutexLock lock(&mu_);
  auto info = peer_info_.find(peer);
  if (info == peer_info_.end()) return absl::StrCat("<unknown peer ", peer, ">");
  return info->second.name;
}

void Core::Cancel(const std::shared_ptr<UcxOp>& op) {
  if (op->completion->done()) return;
  Enqueue([this, op] { CancelOnProgressThread(op); });
}

void Core::Abandon(const std::shared_ptr<UcxOp>& op) {
  Enqueue([this, op] {
    PeerConn* conn = FindConn(op->peer);
    if (conn == nullptr || op->completion->done()) return;
    absl::Status why = absl::UnavailableError(absl::StrCat(
        "peer '", conn->name, "' is unavailable: the connection was torn down because ",
        op->completion->description(), " was destroyed before it finished"));
    SetPublicDead(conn->id, why);
    StartClose(conn, why, static_cast<uint32_t>(ControlKind::kGoodbye),
               absl::Now() + options_.shutdown_timeout);
  });
}

// ---------------------------------------------------------------------------------------------
// Progress thread

void Core::Loop() {
  absl::Time last_event = absl::Now();
  const int progress_batch = 256;
  while (true) {
    bool active = RunCommands();
    for (int i = 0; i < progress_batch && ucp_worker_progress(worker_) != 0; ++i) active = true;
    active |= ProcessFailures();
    active |= ProcessReads();
    active |= HandleControl();
    active |= AdvanceCloses();
    if (shutting_down_ && (AllClosed() || absl::Now() >= shutdown_deadline_)) break;
    const absl::Time now = absl::Now();
    if (active) {
      last_event = now;
      continue;
    }
    if (HasActiveWork() && now - last_event < options_.spin) continue;
    Sleep();
    last_event = absl::Now();
  }
}

bool Core::RunCommands() {
  std::deque<std::function<void()>> batch;
  {
    absl::MutexLock lock(&mu_);
    batch.swap(commands_);
  }
  for (auto& command : batch) command();
  return !batch.empty();
}

void Core::Sleep() {
  ucs_status_t st = ucp_worker_arm(worker_);
  if (st == UCS_ERR_BUSY) return;  // events arrived meanwhile: progress again
  int timeout_ms = static_cast<int>(
      std::clamp<int64_t>(absl::ToInt64Milliseconds(options_.keepalive_interval) / 4, 1, 50));
  if (shutting_down_) timeout_ms = 1;
  for (const auto& [id, conn] : conns_) {
    if (conn->stage == PeerConn::Stage::kFlushing) timeout_ms = 1;
  }
  if (st != UCS_OK) timeout_ms = 1;  // cannot arm: poll on a short timer instead
  epoll_event events[4];
  int n = epoll_wait(epoll_fd_, events, 4, timeout_ms);
  (void)n;
  uint64_t value = 0;
  ssize_t got = read(wake_fd_, &value, sizeof(value));
  (void)got;
}

bool Core::HasActiveWork() const {
  if (in_flight_count_ > 0) return true;
  for (const auto& [id, conn] : conns_) {
    if (!conn->zero_copy_sends.empty()) return true;
    if (conn->stage == PeerConn::Stage::kFlushing || conn->stage == PeerConn::Stage::kClosing) {
      return true;
    }
  }
  return false;
}

bool Core::AllClosed() const {
  for (const auto& [id, conn] : conns_) {
    if (conn->stage != PeerConn::Stage::kClosed) return false;
    for (const auto& [raw, op] : conn->in_flight) {
      if (op->completion == nullptr || !op->completion->done()) return false;
    }
  }
  return true;
}

bool Core::ProcessFailures() {
  if (failed_endpoints_.empty()) return false;
  std::vector<std::pair<ucp_ep_h, ucs_status_t>> failed;
  failed.swap(failed_endpoints_);
  for (const auto& [ep, status] : failed) {
    for (auto& [id, conn] : conns_) {
      if (conn->ep != ep) continue;
      absl::Status translated = UcsToStatus(
          status, absl::StrCat("peer '", conn->name, "' is unavailable: its connection failed"));
      PeerFailed(conn.get(), absl::UnavailableError(translated.message()));
    }
  }
  return true;
}

PeerConn* Core::FindConn(PeerId peer) {
  auto it = conns_.find(peer);
  return it == conns_.end() ? nullptr : it->second.get();
}

void Core::SetPublicDead(PeerId peer, const absl::Status& status) {
  absl::MutexLock lock(&mu_);
  auto info = peer_info_.find(peer);
  if (info == peer_info_.end()) return;
  if (info->second.dead.ok()) info->second.dead = status;
  auto live = live_by_instance_.find(info->second.instance_id);
  if (live != live_by_instance_.end() && live->second == peer) live_by_instance_.erase(live);
}

absl::Status Core::CreateEndpoint(PeerId peer, const AddressEnvelope& envelope) {
  auto conn = std::make_unique<PeerConn>();
  conn->core = this;
  conn->id = peer;
  conn->name = envelope.name;
  conn->instance_id = envelope.instance_id;
  ucp_ep_params_t params{};
  params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER;
  params.address = reinterpret_cast<const ucp_address_t*>(envelope.payload.data());
  params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  params.err_handler.cb = &Core::OnEndpointError;
  params.err_handler.arg = this;
  ucs_status_t st = ucp_ep_create(worker_, &params, &conn->ep);
  PeerConn* raw = conn.get();
  conns_[peer] = std::move(conn);
  if (st != UCS_OK) {
    raw->ep = nullptr;
    raw->stage = PeerConn::Stage::kClosed;
    absl::Status status = UcsToStatus(
        st, absl::StrCat("connecting '", options_.name, "' to '", envelope.name,
                         "': creating the UCX endpoint from its address (ucp_ep_create)"));
    raw->peer_failed = true;
    raw->closed_status = absl::UnavailableError(status.message());
    SetPublicDead(peer, raw->closed_status);
    return status;
  }
  SendControl(raw, ControlKind::kHello, reinterpret_cast<uint64_t>(&probe_word_), probe_word_);
  auto early = early_hellos_.find(envelope.instance_id);
  if (early != early_hellos_.end()) {
    const ControlMessage hello = early->second;
    early_hellos_.erase(early);
    AcceptHello(raw, hello);
    if (early_goodbyes_.erase({envelope.instance_id, hello.slot}) > 0) {
      raw->peer_left = true;
      StartClose(
          raw,
          absl::UnavailableError(absl::StrCat(
              "peer '", raw->name, "' is unavailable: it disconnected from '", options_.name, "'")),
          /*farewell=*/0, absl::Now());
      SetPublicDead(peer, raw->closed_status);
    }
  }
  return absl::OkStatus();
}

void Core::AcceptHello(PeerConn* conn, const ControlMessage& hello) {
  conn->remote_slot = static_cast<int64_t>(hello.slot);
  // Same-host zero copy: if this process can read the peer's probe word, it can read the
  // peer's send buffers; tell the peer so it sends descriptors instead of data.
  if (options_.same_host_zero_copy && hello.pid != 0) {
    uint64_t value = 0;
    if (ReadPeerMemory(hello.pid, hello.arg0, &value, sizeof(value)) == 0 && value == hello.arg1) {
      conn->zero_copy_from_pid = hello.pid;
      SendControl(conn, ControlKind::kZeroCopyReady);
    }
  }
  std::deque<std::shared_ptr<UcxOp>> waiting;
  waiting.swap(conn->waiting_sends);
  for (auto& op : waiting) IssueSend(conn, op);
}

void Core::PostSend(const std::shared_ptr<UcxOp>& op) {
  PeerConn* conn = FindConn(op->peer);
  if (conn == nullptr || !conn->closed_status.ok()) {
    const absl::Status why = conn == nullptr
                                 ? absl::UnavailableError("the connection was never set up")
                                 : conn->closed_status;
    op->completion->Complete(absl::Status(
        why.code(), absl::StrCat(op->completion->description(), ": ", std::string(why.message()))));
    return;
  }
  if (conn->remote_slot < 0) {
    conn->waiting_sends.push_back(op);
    return;
  }
  IssueSend(conn, op);
}

void Core::IssueSend(PeerConn* conn, const std::shared_ptr<UcxOp>& op) {
  ucp_tag_t wire_tag = kControlTag;
  const void* data = &op->control;
  size_t length = op->size;
  if (op->kind == OpKind::kSend) {
    wire_tag = WireTag(static_cast<uint64_t>(conn->remote_slot), op->tag, op->service);
    data = op->src;
    if (conn->zero_copy_to_peer && op->memory_type == UCS_MEMORY_TYPE_HOST &&
        op->size >= options_.zero_copy_threshold) {
      op->zero_copy = true;
      op->descriptor.pid = static_cast<uint32_t>(getpid());
      op->descriptor.address = reinterpret_cast<uint64_t>(op->src);
      op->descriptor.length = op->size;
      op->descriptor.send_id = conn->next_send_id++;
      conn->zero_copy_sends[op->descriptor.send_id] = op;
      wire_tag |= kZeroCopyBit;
      data = &op->descriptor;
      length = sizeof(ZeroCopyDescriptor);
    }
  }
  conn->in_flight[op.get()] = op;
  ++in_flight_count_;
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                       UCP_OP_ATTR_FIELD_MEMORY_TYPE | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
  param.cb.send = &Core::OnSendDone;
  param.user_data = op.get();
  // Host memory skips UCX's detection of the buffer. A CUDA type does not: UCX's protocols (v2,
  // its default) still look the buffer up, its GPU included, which their choice of CUDA IPC or a
  // copy needs.
  param.memory_type = op->zero_copy ? UCS_MEMORY_TYPE_HOST : op->memory_type;
  void* request = ucp_tag_send_nbx(conn->ep, data, length, wire_tag, &param);
  if (UCS_PTR_IS_ERR(request)) {
    OnOpDone(op.get(), nullptr, UCS_PTR_STATUS(request), 0, 0);
  } else if (conn->in_flight.contains(op.get())) {
    op->request = request;
  }
}

void Core::SendControl(PeerConn* conn, ControlKind kind, uint64_t arg0, uint64_t arg1) {
  auto op = std::make_shared<UcxOp>();
  op->kind = OpKind::kControlSend;
  op->peer = conn->id;
  op->core = this;
  op->control.kind = static_cast<uint32_t>(kind);
  op->control.instance_id = instance_id_;
  op->control.slot = conn->id;
  op->control.arg0 = arg0;
  op->control.arg1 = arg1;
  op->control.pid = static_cast<uint32_t>(getpid());
  op->size = sizeof(ControlMessage);
  IssueSend(conn, op);
}

void Core::PostRecv(const std::shared_ptr<UcxOp>& op) {
  PeerConn* conn = FindConn(op->peer);
  if (conn == nullptr || !conn->closed_status.ok()) {
    const absl::Status why = conn == nullptr
                                 ? absl::UnavailableError("the connection was never set up")
                                 : conn->closed_status;
    op->completion->Complete(absl::Status(
        why.code(), absl::StrCat(op->completion->description(), ": ", std::string(why.message()))));
    return;
  }
  conn->in_flight[op.get()] = op;
  ++in_flight_count_;
  // A descriptor must fit wherever the message lands: receives smaller than one land in a
  // bounce area and are copied out.
  void* landing = op->dst;
  size_t landing_size = op->size;
  if (op->memory_type == UCS_MEMORY_TYPE_HOST && op->size < sizeof(ZeroCopyDescriptor)) {
    op->bounced = true;
    landing = op->bounce.data();
    landing_size = op->bounce.size();
  }
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                       UCP_OP_ATTR_FIELD_MEMORY_TYPE | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
  param.cb.recv = &Core::OnRecvDone;
  param.user_data = op.get();
  param.memory_type = op->memory_type;
  if (!op->bounced && !op->segments.empty()) {
    // Scatter: UCX writes the message over the segments itself.
    param.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE;
    param.datatype = ucp_dt_make_iov();
    landing = op->iov.data();
    landing_size = op->iov.size();
  }
  void* request =
      ucp_tag_recv_nbx(worker_, landing, landing_size, WireTag(op->peer, op->tag, op->service),
                       op->memory_type == UCS_MEMORY_TYPE_HOST ? kDataMask : kFullMask, &param);
  if (UCS_PTR_IS_ERR(request)) {
    OnOpDone(op.get(), nullptr, UCS_PTR_STATUS(request), 0, 0);
  } else if (conn->in_flight.contains(op.get())) {
    op->request = request;
  }
}

void Core::OnSendDone(void* request, ucs_status_t status, void* user_data) {
  auto* op = static_cast<UcxOp*>(user_data);
  op->core->OnOpDone(op, request, status, op->size, 0);
}

void Core::OnRecvDone(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info,
                      void* user_data) {
  auto* op = static_cast<UcxOp*>(user_data);
  op->core->OnOpDone(op, request, status, info != nullptr ? info->length : 0,
                     info != nullptr ? info->sender_tag : 0);
}

void Core::OnOpDone(UcxOp* op, void* request, ucs_status_t status, size_t length,
                    ucp_tag_t sender_tag) {
  if (request != nullptr) ucp_request_free(request);
  // The transport is being released: Close completes the op once the worker is gone.
  if (destroying_) return;
  PeerConn* conn = FindConn(op->peer);
  std::shared_ptr<UcxOp> hold;
  if (conn != nullptr) {
    auto it = conn->in_flight.find(op);
    if (it != conn->in_flight.end()) {
      hold = std::move(it->second);
      conn->in_flight.erase(it);
      --in_flight_count_;
    }
  }
  op->request = nullptr;
  if (op->kind == OpKind::kControlSend || conn == nullptr) {
    if (conn != nullptr) FinishCloseIfDone(conn);
    return;
  }
  if (op->zero_copy) {
    // The descriptor is out; the send completes when the peer reports its copy (or fails).
    if (status != UCS_OK) {
      conn->zero_copy_sends.erase(op->descriptor.send_id);
      op->completion->Complete(OpStatus(*conn, *op, status, 0));
    }
    FinishCloseIfDone(conn);
    return;
  }
  if (op->kind == OpKind::kRecv && status == UCS_OK && (sender_tag & kZeroCopyBit) != 0) {
    ZeroCopyDescriptor descriptor;
    if (op->bounced || op->segments.empty()) {
      std::memcpy(&descriptor, op->bounced ? op->bounce.data() : op->dst, sizeof(descriptor));
    } else {
      GatherCopy(op->segments, &descriptor, sizeof(descriptor));
    }
    pending_reads_.push_back({hold, descriptor});
    return;
  }
  if (op->kind == OpKind::kRecv && op->bounced && status == UCS_OK) {
    if (length > op->size) {
      status = UCS_ERR_MESSAGE_TRUNCATED;
    } else if (!op->segments.empty()) {
      ScatterCopy(op->bounce.data(), length, op->segments);
    } else if (length > 0) {
      std::memcpy(op->dst, op->bounce.data(), length);
    }
  }
  absl::Status result = OpStatus(*conn, *op, status, length);
  if (result.ok()) (op->kind == OpKind::kSend ? sends_ok_ : receives_ok_).fetch_add(1);
  op->completion->Complete(std::move(result), length);
  FinishCloseIfDone(conn);
}

bool Core::ProcessReads() {
  if (pending_reads_.empty()) return false;
  std::vector<PendingRead> reads;
  reads.swap(pending_reads_);
  for (PendingRead& read : reads) {
    UcxOp& op = *read.op;
    PeerConn* conn = FindConn(op.peer);
    const ZeroCopyDescriptor& d = read.descriptor;
    const std::string& what = op.completion->description();
    ZeroCopyResult result = kCopied;
    absl::Status status;
    if (d.magic != kDescriptorMagic) {
      result = kDropped;
      status = absl::InternalError(
          absl::StrCat(what, ": a zero-copy descriptor from the peer is malformed (magic ", d.magic,
                       "); expected ", kDescriptorMagic));
    } else if (!conn->closed_status.ok()) {
      result = kDropped;
      status = absl::Status(conn->closed_status.code(),
                            absl::StrCat(what, ": ", std::string(conn->closed_status.message())));
    } else if (d.pid != conn->zero_copy_from_pid) {
      // Only the process whose memory we probed may be copied from.
      result = kReadFailed;
      status = absl::InternalError(absl::StrCat(
          what, ": a zero-copy descriptor names process ", d.pid, "; expected process ",
          conn->zero_copy_from_pid, " (the one its hello came from)"));
    } else if (d.length > op.size) {
      result = kTruncated;
      status = absl::OutOfRangeError(absl::StrCat(
          what, ": the message is larger than the ", op.size, "-byte receive buffer (it is ",
          d.length, " bytes); truncated, buffer contents unspecified"));
    } else if (int error = op.segments.empty()
                               ? ReadPeerMemory(d.pid, d.address, op.dst, d.length)
                               : ReadPeerMemoryScatter(d.pid, d.address, op.segments, d.length);
               error != 0) {
      result = kReadFailed;
      const std::string failure = absl::StrCat("copying ", d.length, " bytes out of its process ",
                                               d.pid, " failed: ", strerror(error));
      // The sender's memory cannot be read any more: its process is gone or going (ESRCH,
      // EFAULT while it exits), or it withdrew access. Either way the peer is unusable.
      status = absl::UnavailableError(
          absl::StrCat(what, ": peer '", conn->name, "' is unavailable: ", failure));
    }
    if (result != kDropped) SendControl(conn, ControlKind::kZeroCopyDone, d.send_id, result);
    if (status.ok()) {
      receives_ok_.fetch_add(1);
      zero_copy_receives_ok_.fetch_add(1);
    }
    op.completion->Complete(std::move(status), static_cast<size_t>(d.length));
    FinishCloseIfDone(conn);
  }
  return true;
}

absl::Status Core::OpStatus(const PeerConn& conn, const UcxOp& op, ucs_status_t status,
                            size_t length) const {
  const std::string& what = op.completion->description();
  if (status == UCS_OK) return absl::OkStatus();
  if (conn.peer_failed || (!conn.closed_status.ok() && status != UCS_ERR_MESSAGE_TRUNCATED)) {
    return absl::Status(conn.closed_status.code(),
                        absl::StrCat(what, ": ", std::string(conn.closed_status.message())));
  }
  if (IsPeerFailure(status)) {
    absl::Status failure = UcsToStatus(
        status, absl::StrCat("peer '", conn.name, "' is unavailable: its connection failed"));
    return absl::UnavailableError(absl::StrCat(what, ": ", std::string(failure.message())));
  }
  if (status == UCS_ERR_CANCELED) return absl::CancelledError(absl::StrCat(what, ": cancelled"));
  if (status == UCS_ERR_MESSAGE_TRUNCATED) {
    return absl::OutOfRangeError(
        absl::StrCat(what, ": the message is larger than the ", op.size, "-byte receive buffer",
                     length > op.size ? absl::StrCat(" (it is ", length, " bytes)") : "",
                     "; truncated, buffer contents unspecified"));
  }
  return UcsToStatus(status, what);
}

void Core::CancelOnProgressThread(const std::shared_ptr<UcxOp>& op) {
  PeerConn* conn = FindConn(op->peer);
  if (conn == nullptr || op->completion->done()) return;
  for (auto it = conn->waiting_sends.begin(); it != conn->waiting_sends.end(); ++it) {
    if (*it == op) {
      conn->waiting_sends.erase(it);
      op->completion->Complete(
          absl::CancelledError(absl::StrCat(op->completion->description(), ": cancelled")));
      return;
    }
  }
  // Receives that have not matched are withdrawn (the callback reports UCS_ERR_CANCELED); UCX
  // ignores cancellation of sends and of matched receives, which then finish normally.
  if (op->kind == OpKind::kRecv && op->request != nullptr) {
    ucp_request_cancel(worker_, op->request);
  }
}

void Core::OnEndpointError(void* arg, ucp_ep_h ep, ucs_status_t status) {
  // Handled after ucp_worker_progress returns (ProcessFailures), outside UCX's call stack.
  static_cast<Core*>(arg)->failed_endpoints_.emplace_back(ep, status);
}

void Core::PeerFailed(PeerConn* conn, absl::Status status) {
  if (conn->peer_failed) return;
  conn->peer_failed = true;
  SetPublicDead(conn->id, status);
  if (conn->stage == PeerConn::Stage::kOpen) {
    StartClose(conn, status, /*farewell=*/0, absl::Now());
  } else {
    conn->closed_status = status;
    if (conn->stage == PeerConn::Stage::kFlushing) ForceClose(conn);
  }
}

void Core::StartClose(PeerConn* conn, absl::Status why, uint32_t farewell, absl::Time deadline) {
  if (conn->stage != PeerConn::Stage::kOpen) return;
  conn->closed_status = why;
  std::deque<std::shared_ptr<UcxOp>> waiting;
  waiting.swap(conn->waiting_sends);
  for (auto& op : waiting) {
    op->completion->Complete(absl::Status(
        why.code(), absl::StrCat(op->completion->description(), ": ", std::string(why.message()))));
  }
  std::vector<std::shared_ptr<UcxOp>> receives;
  for (auto& [raw, op] : conn->in_flight) {
    if (op->kind == OpKind::kRecv && op->request != nullptr) receives.push_back(op);
  }
  for (auto& op : receives) {
    if (op->request != nullptr) ucp_request_cancel(worker_, op->request);
  }
  if (conn->ep == nullptr) {
    conn->stage = PeerConn::Stage::kClosed;
    FinishCloseIfDone(conn);
    return;
  }
  if (farewell != 0 && !conn->peer_failed) {
    SendControl(conn, static_cast<ControlKind>(farewell));
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    param.cb.send = &Core::OnFlushDone;
    param.user_data = conn;
    void* request = ucp_ep_flush_nbx(conn->ep, &param);
    if (UCS_PTR_IS_PTR(request)) {
      conn->stage = PeerConn::Stage::kFlushing;
      conn->flush_deadline = deadline;
      return;
    }
    conn->flush_done = true;
    if (farewell == static_cast<uint32_t>(ControlKind::kGoodbye) &&
        !conn->zero_copy_sends.empty()) {
      // The peer may still be copying from our buffers: wait for its goodbye ack.
      conn->stage = PeerConn::Stage::kFlushing;
      conn->flush_deadline = deadline;
      return;
    }
  }
  ForceClose(conn);
}

void Core::OnFlushDone(void* request, ucs_status_t /*status*/, void* user_data) {
  auto* conn = static_cast<PeerConn*>(user_data);
  conn->flush_done = true;
  ucp_request_free(request);
}

void Core::ForceClose(PeerConn* conn) {
  conn->stage = PeerConn::Stage::kClosing;
  // Sends the peer was copying end here: it has acknowledged our goodbye (it reads no more),
  // failed, or did not answer by the deadline.
  for (auto& [id, op] : conn->zero_copy_sends) {
    op->completion->Complete(absl::Status(
        conn->closed_status.code(), absl::StrCat(op->completion->description(), ": ",
                                                 std::string(conn->closed_status.message()))));
  }
  conn->zero_copy_sends.clear();
  ucp_ep_h ep = conn->ep;
  conn->ep = nullptr;
  ucp_request_param_t param{};
  param.op_attr_mask =
      UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.flags = UCP_EP_CLOSE_FLAG_FORCE;
  param.cb.send = &Core::OnCloseDone;
  param.user_data = conn;
  void* request = ucp_ep_close_nbx(ep, &param);
  if (!UCS_PTR_IS_PTR(request)) {
    conn->stage = PeerConn::Stage::kClosed;
    FinishCloseIfDone(conn);
  }
}

void Core::OnCloseDone(void* request, ucs_status_t /*status*/, void* user_data) {
  auto* conn = static_cast<PeerConn*>(user_data);
  ucp_request_free(request);
  if (conn->core->destroying_) return;
  conn->stage = PeerConn::Stage::kClosed;
  conn->core->FinishCloseIfDone(conn);
}

bool Core::AdvanceCloses() {
  bool changed = false;
  const absl::Time now = absl::Now();
  for (auto& [id, conn] : conns_) {
    if (conn->stage == PeerConn::Stage::kFlushing) {
      const bool peer_done_reading = conn->zero_copy_sends.empty() || conn->goodbye_acked;
      if ((conn->flush_done && peer_done_reading) || conn->peer_failed ||
          now >= conn->flush_deadline) {
        ForceClose(conn.get());
        changed = true;
      }
    }
    if (conn->stage == PeerConn::Stage::kClosed && !conn->in_flight.empty()) {
      // The endpoint is gone, so nothing writes into these buffers any more; receives that UCX
      // matched before the failure are reported now rather than left waiting.
      for (auto& [raw, op] : conn->in_flight) {
        if (op->completion != nullptr && !op->completion->done()) {
          op->completion->Complete(
              absl::Status(conn->closed_status.code(),
                           absl::StrCat(op->completion->description(), ": ",
                                        std::string(conn->closed_status.message()))));
          changed = true;
        }
      }
      FinishCloseIfDone(conn.get());
    }
  }
  return changed;
}

void Core::FinishCloseIfDone(PeerConn* conn) {
  if (conn->stage != PeerConn::Stage::kClosed || conn->close_waiters.empty()) return;
  bool ops_done = true;
  for (auto& [raw, op] : conn->in_flight) {
    if (op->completion != nullptr && !op->completion->done()) ops_done = false;
  }
  if (!ops_done) return;
  for (auto& waiter : conn->close_waiters) waiter->Complete(absl::OkStatus());
  conn->close_waiters.clear();
}

void Core::PostControlRecv() {
  control_done_ = false;
  ucp_request_param_t param{};
  param.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
  param.cb.recv = &Core::OnControlRecvDone;
  param.user_data = this;
  void* request =
      ucp_tag_recv_nbx(worker_, &control_in_, sizeof(control_in_), kControlTag, kFullMask, &param);
  if (UCS_PTR_IS_ERR(request)) {
    HETPAR_LOG(ERROR) << "ucx transport '" << options_.name
                      << "': cannot post the control receive: "
                      << ucs_status_string(UCS_PTR_STATUS(request));
    return;
  }
  if (!control_done_) control_request_ = request;
}

void Core::OnControlRecvDone(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info,
                             void* user_data) {
  auto* core = static_cast<Core*>(user_data);
  core->control_status_ = status;
  core->control_length_ = info != nullptr ? info->length : 0;
  core->control_done_ = true;
  core->control_request_ = nullptr;
  ucp_request_free(request);
}

PeerConn* Core::ConnOfControl(const ControlMessage& message) {
  PeerConn* found = nullptr;
  for (auto& [id, conn] : conns_) {
    if (conn->instance_id == message.instance_id &&
        conn->remote_slot == static_cast<int64_t>(message.slot)) {
      found = conn.get();  // the latest connection wins
    }
  }
  return found;
}

bool Core::HandleControl() {
  bool handled = false;
  while (control_done_) {
    handled = true;
    if (control_status_ == UCS_ERR_CANCELED) {
      control_done_ = false;
      return handled;
    }
    const ControlMessage message = control_in_;
    const bool valid = control_status_ == UCS_OK && control_length_ == sizeof(ControlMessage) &&
                       message.magic == kControlMagic;
    PostControlRecv();
    if (!valid) {
      HETPAR_LOG(WARNING) << "ucx transport '" << options_.name
                          << "': ignoring a malformed control message of " << control_length_
                          << " bytes (status " << ucs_status_string(control_status_) << ")";
      continue;
    }
    switch (static_cast<ControlKind>(message.kind)) {
      case ControlKind::kHello: {
        if (message.slot == 0 || message.slot > kMaxSlot) {
          HETPAR_LOG(WARNING) << "ucx transport '" << options_.name
                              << "': ignoring a hello naming slot " << message.slot
                              << "; expected 1.." << kMaxSlot;
          break;
        }
        PeerConn* target = nullptr;
        for (auto& [id, conn] : conns_) {
          if (conn->instance_id == message.instance_id && conn->remote_slot < 0 &&
              conn->stage == PeerConn::Stage::kOpen) {
            target = conn.get();
          }
        }
        if (target == nullptr) {
          early_hellos_[message.instance_id] = message;
        } else {
          AcceptHello(target, message);
        }
        break;
      }
      case ControlKind::kGoodbye: {
        PeerConn* target = ConnOfControl(message);
        if (target == nullptr) {
          early_goodbyes_.insert({message.instance_id, message.slot});
          break;
        }
        // No more reads of the peer's memory from here on (ProcessReads checks the status);
        // the ack lets the peer release its buffers.
        target->peer_left = true;
        absl::Status left = absl::UnavailableError(
            absl::StrCat("peer '", target->name, "' is unavailable: it disconnected from '",
                         options_.name, "'"));
        SetPublicDead(target->id, left);
        StartClose(target, left, static_cast<uint32_t>(ControlKind::kGoodbyeAck),
                   absl::Now() + options_.shutdown_timeout);
        break;
      }
      case ControlKind::kGoodbyeAck: {
        if (PeerConn* target = ConnOfControl(message)) target->goodbye_acked = true;
        break;
      }
      case ControlKind::kZeroCopyReady: {
        if (PeerConn* target = ConnOfControl(message)) target->zero_copy_to_peer = true;
        break;
      }
      case ControlKind::kZeroCopyDone: {
        PeerConn* target = ConnOfControl(message);
        if (target == nullptr) break;
        auto it = target->zero_copy_sends.find(message.arg0);
        if (it == target->zero_copy_sends.end()) break;
        std::shared_ptr<UcxOp> op = std::move(it->second);
        target->zero_copy_sends.erase(it);
        if (message.arg1 == kReadFailed) {
          op->completion->Complete(absl::InternalError(absl::StrCat(
              op->completion->description(), ": peer '", target->name,
              "' could not copy the data out of this process (process_vm_readv failed there)")));
        } else {
          // Copied, or refused as too large for the peer's buffer (the receiver reports that).
          sends_ok_.fetch_add(1);
          if (message.arg1 == kCopied) zero_copy_sends_ok_.fetch_add(1);
          op->completion->Complete(absl::OkStatus(), op->size);
        }
        FinishCloseIfDone(target);
        break;
      }
      default:
        HETPAR_LOG(WARNING) << "ucx transport '" << options_.name
                            << "': ignoring a control message of unknown kind " << message.kind;
    }
  }
  return handled;
}

}  // namespace internal

// -----------------------------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<UcxTransport>> UcxTransport::Create(const Options& options) {
  auto core = internal::Core::Create(options);
  if (!core.ok()) return core.status();
  return std::unique_ptr<UcxTransport>(new UcxTransport(std::move(core).value()));
}

UcxTransport::UcxTransport(std::shared_ptr<internal::Core> core) : core_(std::move(core)) {}

UcxTransport::~UcxTransport() { core_->Close(); }

const std::string& UcxTransport::name() const { return core_->name(); }

std::string UcxTransport::LocalAddress() const { return core_->LocalAddress(); }

bool UcxTransport::CanMove(MemoryKind kind) const { return core_->SupportsMemory(kind); }

UcxTransport::Stats UcxTransport::stats() const { return core_->stats(); }

absl::Status UcxTransport::RunOnProgressThread(std::function<void()> fn, absl::Time deadline) {
  auto ran = std::make_shared<absl::Notification>();
  if (!core_->RunOnProgressThread([fn = std::move(fn), ran] {
        fn();
        ran->Notify();
      })) {
    return absl::UnavailableError(absl::StrCat("UCX transport ", name(), " is shutting down"));
  }
  if (!ran->WaitForNotificationWithDeadline(deadline)) {
    return absl::DeadlineExceededError(
        absl::StrCat("UCX transport ", name(), ": its progress thread did not run the call by ",
                     absl::FormatTime(deadline)));
  }
  return absl::OkStatus();
}

absl::StatusOr<PeerId> UcxTransport::Connect(std::string_view peer_address, absl::Time deadline) {
  return core_->Connect(peer_address, deadline);
}

absl::StatusOr<std::unique_ptr<Operation>> UcxTransport::Send(PeerId peer, Tag tag,
                                                              ConstBuffer buffer) {
  return PostSend(/*service=*/false, peer, tag, buffer);
}

absl::StatusOr<std::unique_ptr<Operation>> UcxTransport::Recv(PeerId peer, Tag tag,
                                                              MutableBuffer buffer) {
  return PostRecv(/*service=*/false, peer, tag, buffer);
}

absl::StatusOr<std::unique_ptr<Operation>> UcxTransport::RecvScatter(
    PeerId peer, Tag tag, std::vector<MutableBuffer> segments) {
  return PostRecvScatter(/*service=*/false, peer, tag, std::move(segments));
}

absl::StatusOr<std::unique_ptr<Operation>> UcxTransport::SendService(PeerId peer, Tag tag,
                                                                     ConstBuffer buffer) {
  return PostSend(/*service=*/true, peer, tag, buffer);
}

absl::StatusOr<std::unique_ptr<Operation>> UcxTransport::RecvService(PeerId peer, Tag tag,
                                                                     MutableBuffer buffer) {
  return PostRecv(/*service=*/true, peer, tag, buffer);
}

absl::StatusOr<std::unique_ptr<Operation>> UcxTransport::RecvScatterService(
    PeerId peer, Tag tag, std::vector<MutableBuffer> segments) {
  return PostRecvScatter(/*service=*/true, peer, tag, std::move(segments));
}

absl::StatusOr<std::unique_ptr<Operation>> UcxTransport::PostSend(bool service, PeerId peer,
                                                                  Tag tag, ConstBuffer buffer) {
  auto op = core_->Post(internal::OpKind::kSend, service, peer, tag, buffer.data, nullptr,
                        buffer.size, buffer.kind, buffer.device);
  if (!op.ok()) return op.status();
  return std::unique_ptr<Operation>(new CompletionOperation<internal::Core, internal::UcxOp>(
      core_, std::move(op).value(), core_->options().abandon_timeout,
      core_->options().shutdown_timeout));
}

absl::StatusOr<std::unique_ptr<Operation>> UcxTransport::PostRecv(bool service, PeerId peer,
                                                                  Tag tag, MutableBuffer buffer) {
  auto op = core_->Post(internal::OpKind::kRecv, service, peer, tag, nullptr, buffer.data,
                        buffer.size, buffer.kind, buffer.device);
  if (!op.ok()) return op.status();
  return std::unique_ptr<Operation>(new CompletionOperation<internal::Core, internal::UcxOp>(
      core_, std::move(op).value(), core_->options().abandon_timeout,
      core_->options().shutdown_timeout));
}

absl::StatusOr<std::unique_ptr<Operation>> UcxTransport::PostRecvScatter(
    bool service, PeerId peer, Tag tag, std::vector<MutableBuffer> segments) {
  const size_t total = TotalSize(segments);
  if (absl::Status s = ValidateSegments(
          segments,
          internal::Describe(internal::OpKind::kRecv, core_->PeerName(peer), tag, total, service));
      !s.ok()) {
    return s;
  }
  auto op = core_->Post(internal::OpKind::kRecv, service, peer, tag, nullptr, nullptr, total,
                        MemoryKind::kHost, -1, std::move(segments));
  if (!op.ok()) return op.status();
  return std::unique_ptr<Operation>(new CompletionOperation<internal::Core, internal::UcxOp>(
      core_, std::move(op).value(), core_->options().abandon_timeout,
      core_->options().shutdown_timeout));
}

absl::Status UcxTransport::Disconnect(PeerId peer, absl::Time deadline) {
  return core_->Disconnect(peer, deadline);
}

std::string UcxTransport::PeerName(PeerId peer) const { return core_->PeerName(peer); }

}  // namespace hetpar::transport::ucx
