// Clients of the coordinator: what workers and the CLI link (target hetpar_control, part of the
// torch-free core; namespace hetpar::coordinator, the service these clients speak to).
//
//   ClientOptions client;
//   client.address = "10.0.0.1:50051";
//   client.token = token;
//   auto connection = CoordinatorConnection::Create(client);
//   WorkerSession::Options options;
//   options.registration = request;
//   auto session = WorkerSession::Start(*connection, options);
//   (*session)->WaitForRunStart(absl::Minutes(2));      // every rank registered: peers known
//   while (auto message = (*session)->Next(absl::Seconds(30))) { ... step plans, aborts ... }
//
// Every call has a deadline (ClientOptions::rpc_timeout unless it takes a timeout itself) and
// returns absl::Status; gRPC errors keep their code and name the RPC and the coordinator.
#ifndef HETPAR_COMMON_CONTROL_CLIENT_H_
#define HETPAR_COMMON_CONTROL_CLIENT_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/control/security.h"
#include "common/rendezvous/key_value_store.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "hetpar/v1/coordinator.grpc.pb.h"

namespace hetpar::coordinator {

struct ClientOptions {
  std::string address = "127.0.0.1:50051";
  std::string token;  // the run token (required)
  ClientTlsOptions tls;
  absl::Duration rpc_timeout = absl::Seconds(10);
  // Open a TCP connection of its own instead of sharing one with other channels to the same
  // address (many sessions in one process spread over several connections).
  bool dedicated_connection = false;
};

// InvalidArgument naming `address` when it has no port ("host", "host:"): gRPC would retry
// such an address until its deadline. CoordinatorConnection::Create checks it too.
absl::Status CheckCoordinatorAddress(std::string_view address);

// One channel to the coordinator with the run token attached to every call. Thread-safe;
// shared by the clients below.
class CoordinatorConnection {
 public:
  static absl::StatusOr<std::shared_ptr<CoordinatorConnection>> Create(ClientOptions options);
  CoordinatorConnection(const CoordinatorConnection&) = delete;
  CoordinatorConnection& operator=(const CoordinatorConnection&) = delete;

  // Adds the token and a deadline `timeout` from now.
  void PrepareContext(grpc::ClientContext* context, absl::Duration timeout) const;
  // Waits until the channel is connected; Unavailable naming the address otherwise, with the
  // last connection error gRPC gave. A TLS handshake that fails (a certificate this side does not
  // trust) ends the wait at once: waiting would not help.
  absl::Status WaitForConnected(absl::Duration timeout) const;
  // "<rpc> RPC to coordinator <address>", the context of error messages.
  std::string Where(std::string_view rpc) const;

  const ClientOptions& options() const { return options_; }
  const std::shared_ptr<grpc::Channel>& channel() const { return channel_; }
  v1::Coordinator::Stub& coordinator() const { return *coordinator_; }
  v1::KeyValue::Stub& key_value() const { return *key_value_; }
  v1::Admin::Stub& admin() const { return *admin_; }

 private:
  CoordinatorConnection() = default;
  ClientOptions options_;
  std::string metadata_value_;  // "Bearer <token>"
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Coordinator::Stub> coordinator_;
  std::unique_ptr<v1::KeyValue::Stub> key_value_;
  std::unique_ptr<v1::Admin::Stub> admin_;
};

// Status, Stop and Scale (the CLI). Thread-safe.
class AdminClient {
 public:
  explicit AdminClient(std::shared_ptr<CoordinatorConnection> connection)
      : connection_(std::move(connection)) {}
  absl::StatusOr<v1::StatusResponse> Status() const;
  // `checkpoint`: the step in flight commits with a checkpoint before the run stops.
  absl::StatusOr<v1::StopResponse> Stop(const std::string& reason, bool checkpoint = false) const;
  absl::StatusOr<v1::ScaleResponse> Scale(int64_t encoder_replicas) const;

 private:
  std::shared_ptr<CoordinatorConnection> connection_;
};

// Sends the local file `local_path` as output `name` of worker `worker_id` (OutputChunk
// documents the names) to the coordinator, which writes it into its run directory (PutOutput),
// in chunks of 1 MiB with the file's size and CRC-32; waits up to `timeout` for it to be
// written. Errors name the file and the RPC.
absl::Status PutOutputFile(const CoordinatorConnection& connection, const std::string& worker_id,
                           const std::string& name, const std::string& local_path,
                           absl::Duration timeout);

// The rendezvous key-value store of one generation on the coordinator's key-value service (see
// coordinator/kv_store.h for semantics), behind the rendezvous interface that the torch layer
// adapts to c10d. Thread-safe.
class KeyValueClient : public rendezvous::KeyValueStore {
 public:
  KeyValueClient(std::shared_ptr<CoordinatorConnection> connection, int64_t generation)
      : connection_(std::move(connection)), generation_(generation) {}

  int64_t generation() const { return generation_; }
  absl::Status Set(const std::string& key, const std::string& value) const override;
  absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout) const override;
  absl::StatusOr<int64_t> Add(const std::string& key, int64_t delta) const override;
  absl::StatusOr<std::string> CompareSet(const std::string& key, const std::string& expected,
                                         const std::string& desired) const override;
  absl::Status Wait(const std::vector<std::string>& keys, absl::Duration timeout) const override;
  absl::StatusOr<bool> Check(const std::vector<std::string>& keys) const override;
  absl::StatusOr<bool> Delete(const std::string& key) const override;
  absl::StatusOr<int64_t> NumKeys() const override;

 private:
  std::shared_ptr<CoordinatorConnection> connection_;
  int64_t generation_;
};

// Progress.phase of a worker that has begun its final outputs after the stop (the wait for its
// last checkpoint, the model's gather, the upload): the coordinator then gives it as long as a
// step before the stop's deadline.
inline constexpr char kOutputsPhase[] = "outputs";

// WaitForRunStart's status when the run stopped before it started (see there).
bool IsStoppedBeforeStart(const absl::Status& status);

// A worker's membership in a run: Register, then the session stream. Messages from the
// coordinator are queued for Next() (or handed to Options::on_message). Thread-safe.
//
// Heartbeats: a thread of the session sends one whenever nothing else was sent for
// Assignment.heartbeat_interval_s (any message proves the worker alive), and one at once when an
// abort arrives (the coordinator waits to hear from every worker of an aborted attempt before it
// plans the next). Every ack_every-th
// heartbeat asks for an ack; when the coordinator then sends nothing at all for
// heartbeat_timeout_s, the session ends with DeadlineExceeded ("the coordinator stopped
// answering") instead of waiting forever.
class WorkerSession {
 public:
  struct Options {
    v1::RegisterRequest registration;
    // When set, called for every coordinator message on a gRPC thread instead of queueing it
    // for Next(). Must not block.
    std::function<void(const v1::CoordinatorMessage&)> on_message;
    // When set, called for every coordinator message on a gRPC thread before it is queued (or
    // handed to on_message). Must not block.
    std::function<void(const v1::CoordinatorMessage&)> on_arrival;
    bool heartbeats = true;
    int ack_every = 5;  // ask for an ack every this many heartbeats; 0: never
    // When set, called once, on a gRPC thread, when the coordinator is lost: the stream broke off
    // (UNAVAILABLE) or the coordinator stopped answering heartbeats, and this side was not
    // closing; also when the coordinator ended the session because it declared this worker dead
    // (kDeclaredDeadPrefix). Gets the session's final status. Must not block for long.
    std::function<void(const absl::Status&)> on_lost;
  };

  // Registers, opens the session stream and starts heartbeats.
  static absl::StatusOr<std::unique_ptr<WorkerSession>> Start(
      std::shared_ptr<CoordinatorConnection> connection, Options options);
  WorkerSession(const WorkerSession&) = delete;
  WorkerSession& operator=(const WorkerSession&) = delete;
  // Closes the session (as Close with the connection's rpc_timeout).
  ~WorkerSession();

  const v1::RegisterResponse& registration() const { return registration_; }
  const std::string& worker_id() const { return registration_.assignment().worker_id(); }
  // The latest Assignment (from Register, then from the stream).
  v1::Assignment assignment() const;
  int64_t generation() const;

  // Waits for an Assignment with peers_complete (every rank registered) and returns it. A stop
  // that comes first (`hetpar stop` while the run waits for its ranks, or a stop while this
  // worker waits to join) gives a status for which IsStoppedBeforeStart holds: the worker closes
  // its session, as the stop asks, and exits as after any stop. A failed run's stop does not.
  absl::StatusOr<v1::Assignment> WaitForRunStart(absl::Duration timeout) const;
  // The next coordinator message. DeadlineExceeded after `timeout`; once the stream has ended
  // and the queue is empty, the stream's final status (Unavailable when it ended with OK).
  absl::StatusOr<v1::CoordinatorMessage> Next(absl::Duration timeout);

  absl::Status Send(v1::WorkerMessage message);
  absl::Status SendProgress(const v1::Progress& progress);
  absl::Status SendGradNormPartial(const v1::GradNormPartial& partial);
  absl::Status SendReport(const v1::StepReport& report);
  // Asks the coordinator to let this worker leave the run (v1::Leave): it answers with a StopRun
  // (leave_run for an encoder replica that may leave, else the whole run's stop).
  absl::Status SendLeave(const std::string& reason);
  // Tells the coordinator why this worker is about to exit (v1::WorkerFailure); `ends_run`: the
  // cause would meet every replica (a checkpoint that cannot be written), so the run fails.
  absl::Status SendFailure(const std::string& error, bool ends_run);

  // Stops (true) or resumes sending heartbeats while keeping the stream open, as a hung worker.
  void PauseHeartbeats(bool paused);
  // Ends the stream from this side (as a crashed worker would) without a goodbye.
  void Cancel();
  // Half-closes the stream and waits up to `timeout` for the coordinator to end it; returns the
  // final status. The stream is cancelled at the deadline.
  absl::Status Close(absl::Duration timeout);
  bool ended() const;

 private:
  class Stream;
  WorkerSession(std::shared_ptr<CoordinatorConnection> connection, Options options);
  void HeartbeatLoop();
  void OnMessage(const v1::CoordinatorMessage& message);
  void OnStreamDone(const absl::Status& status);

  std::shared_ptr<CoordinatorConnection> connection_;
  Options options_;
  v1::RegisterResponse registration_;
  std::unique_ptr<Stream> stream_;
  std::thread heartbeat_thread_;

  mutable absl::Mutex mu_;
  v1::Assignment assignment_ ABSL_GUARDED_BY(mu_);
  std::deque<v1::CoordinatorMessage> inbox_ ABSL_GUARDED_BY(mu_);
  bool ended_ ABSL_GUARDED_BY(mu_) = false;
  // The reason of a StopRun (not a failed run's) received; empty: none yet.
  std::string stopped_ ABSL_GUARDED_BY(mu_);
  // OnStreamDone has returned from Options::on_lost (which may never return: a worker's restart
  // replaces the process). Close waits for it, so that the session, and the callback with what it
  // captured, are not destroyed under a restart that is still using them.
  bool on_lost_returned_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status final_status_ ABSL_GUARDED_BY(mu_);
  bool stop_heartbeats_ ABSL_GUARDED_BY(mu_) = false;
  bool heartbeats_paused_ ABSL_GUARDED_BY(mu_) = false;
  // An abort arrived: the next heartbeat goes out at once (the coordinator plans the next
  // attempt once every worker of the aborted one has been heard from).
  bool beat_now_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time last_sent_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  // When an ack was asked for and nothing has come from the coordinator since.
  absl::Time unanswered_since_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  absl::Status local_failure_ ABSL_GUARDED_BY(mu_);  // why this side ended the stream
};

}  // namespace hetpar::coordinator

#endif  // HETPAR_COMMON_CONTROL_CLIENT_H_
