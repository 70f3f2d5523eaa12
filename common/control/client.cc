#include "common/control/client.h"

#include <zlib.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/control/grpc_status.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/support/channel_arguments.h"
#include "grpcpp/support/client_callback.h"

namespace hetpar::coordinator {
namespace {

// The largest reply a client takes: the coordinator sends at most 64 MiB (coordinator/limits.h,
// kMaxResponseBytes; assignments with thousands of peers, plans, rendezvous values of <= 1 MiB).
constexpr int kMaxReplyBytes = 64 << 20;

std::chrono::system_clock::time_point DeadlineAfter(absl::Duration timeout) {
  return absl::ToChronoTime(absl::Now() + timeout);
}

}  // namespace

// ------------------------------------------------------------------------------------------------
// CoordinatorConnection

absl::Status CheckCoordinatorAddress(std::string_view address) {
  // Refused at once: gRPC would retry an address without a port until the connect timeout.
  if (PortOf(address) <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("coordinator address '", std::string(address),
                     "' has no port (1 to 65535); expected host:port, e.g. 10.0.0.5:50051"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<CoordinatorConnection>> CoordinatorConnection::Create(
    ClientOptions options) {
  if (options.address.empty()) {
    return absl::InvalidArgumentError("coordinator address is empty; expected host:port");
  }
  if (absl::Status s = CheckCoordinatorAddress(options.address); !s.ok()) return s;
  if (absl::Status s = ValidateToken(options.token, "the client options"); !s.ok()) return s;
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials =
      MakeChannelCredentials(options.tls);
  if (!credentials.ok()) return credentials.status();
  grpc::ChannelArguments args;
  // The coordinator refuses requests over 8 MiB (kMaxRequestBytes); do not send larger ones.
  args.SetMaxReceiveMessageSize(kMaxReplyBytes);
  args.SetMaxSendMessageSize(8 << 20);
  // A worker may start before its coordinator: retry the connection at least every 2 s instead
  // of gRPC's default back-off of up to 2 minutes, so it joins soon after the coordinator is up.
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 200);
  if (!options.tls.server_name.empty()) args.SetSslTargetNameOverride(options.tls.server_name);
  if (options.dedicated_connection) args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  std::shared_ptr<CoordinatorConnection> connection(new CoordinatorConnection());
  connection->channel_ = grpc::CreateCustomChannel(options.address, *credentials, args);
  connection->coordinator_ = v1::Coordinator::NewStub(connection->channel_);
  connection->key_value_ = v1::KeyValue::NewStub(connection->channel_);
  connection->admin_ = v1::Admin::NewStub(connection->channel_);
  connection->metadata_value_ = std::string(kBearerPrefix) + options.token;
  connection->options_ = std::move(options);
  return connection;
}

void CoordinatorConnection::PrepareContext(grpc::ClientContext* context,
                                           absl::Duration timeout) const {
  context->AddMetadata(kAuthMetadataKey, metadata_value_);
  if (timeout != absl::InfiniteDuration()) context->set_deadline(DeadlineAfter(timeout));
}

absl::Status CoordinatorConnection::WaitForConnected(absl::Duration timeout) const {
  const absl::Time deadline = absl::Now() + timeout;
  std::string last_error;
  while (true) {
    // In slices: between them, what the last attempt failed on.
    const absl::Duration slice =
        std::max(absl::ZeroDuration(), std::min(deadline - absl::Now(), absl::Seconds(3)));
    if (channel_->WaitForConnected(DeadlineAfter(slice))) return absl::OkStatus();
    // A call that does not wait for the channel fails with the reason of its last attempt.
    grpc::ClientContext context;
    PrepareContext(&context, absl::Seconds(2));
    context.set_wait_for_ready(false);
    v1::StatusResponse ignored;
    const grpc::Status probe = admin_->Status(&context, v1::StatusRequest(), &ignored);
    if (probe.ok()) return absl::OkStatus();
    if (probe.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED) {
      last_error = probe.error_message();
    }
    const std::string lower = absl::AsciiStrToLower(last_error);
    for (const char* sign : {"handshake", "ssl", "tls", "certificate"}) {
      if (absl::StrContains(lower, sign)) {
        return absl::UnavailableError(absl::StrCat(
            "cannot connect securely to the coordinator at ", options_.address, ": ", last_error,
            options_.tls.ca_file.empty() && options_.tls.cert_file.empty()
                ? " (this side uses no TLS: --tls-ca and, for mutual TLS, --tls-cert/--tls-key)"
                : " (check --tls-ca against the coordinator's certificate, and --tls-cert/"
                  "--tls-key where it requires client certificates)"));
      }
    }
    if (absl::Now() >= deadline) break;
  }
  // A coordinator that serves TLS closes a connection without it, and a client without TLS sees
  // only that: said as a possibility, since a coordinator going down looks the same.
  const bool plaintext = options_.tls.ca_file.empty() && options_.tls.cert_file.empty();
  const bool closed = absl::StrContains(absl::AsciiStrToLower(last_error), "socket closed");
  return absl::UnavailableError(absl::StrCat(
      "cannot reach the coordinator at ", options_.address, " within ",
      absl::FormatDuration(timeout), ": is it running, and is the address right?",
      last_error.empty() ? "" : absl::StrCat(" (last error: ", last_error, ")"),
      plaintext && closed ? "; this side uses no TLS, and a coordinator that serves TLS closes "
                            "such connections: is it started with --tls-cert? then pass its CA "
                            "with --tls-ca"
                          : ""));
}

std::string CoordinatorConnection::Where(std::string_view rpc) const {
  return absl::StrCat(std::string(rpc), " RPC to coordinator ", options_.address);
}

// ------------------------------------------------------------------------------------------------
// AdminClient

absl::Status PutOutputFile(const CoordinatorConnection& connection, const std::string& worker_id,
                           const std::string& name, const std::string& local_path,
                           absl::Duration timeout) {
  std::ifstream in(local_path, std::ios::binary);
  std::error_code ec;
  const uintmax_t size = std::filesystem::file_size(local_path, ec);
  if (!in || ec) {
    return absl::NotFoundError(absl::StrCat("cannot read output ", name, " from ", local_path));
  }
  grpc::ClientContext context;
  connection.PrepareContext(&context, timeout);
  v1::PutOutputResponse response;
  std::unique_ptr<grpc::ClientWriter<v1::OutputChunk>> writer =
      connection.coordinator().PutOutput(&context, &response);
  constexpr size_t kChunkBytes = size_t{1} << 20;
  std::string buffer(kChunkBytes, '\0');
  uLong crc = crc32_z(0, Z_NULL, 0);
  uintmax_t sent = 0;
  bool first = true;
  bool written = true;
  while (written) {
    const size_t n = static_cast<size_t>(std::min<uintmax_t>(kChunkBytes, size - sent));
    if (n > 0 && !in.read(buffer.data(), static_cast<std::streamsize>(n))) {
      writer->WritesDone();
      (void)writer->Finish();
      return absl::DataLossError(absl::StrCat("reading output ", name, " from ", local_path,
                                              ": it ended after ", sent, " of ", size, " bytes"));
    }
    crc = crc32_z(crc, reinterpret_cast<const Bytef*>(buffer.data()), n);
    sent += n;
    v1::OutputChunk chunk;
    if (first) {
      chunk.set_worker_id(worker_id);
      chunk.set_name(name);
      chunk.set_total_bytes(size);
      first = false;
    }
    chunk.set_data(buffer.data(), n);
    if (sent == size) {
      chunk.set_last(true);
      chunk.set_crc32(static_cast<uint32_t>(crc));
      written = writer->Write(chunk);
      break;
    }
    written = writer->Write(chunk);
  }
  writer->WritesDone();
  const grpc::Status status = writer->Finish();  // the server's reason when a write failed
  if (!status.ok()) {
    return FromGrpcStatus(status, absl::StrCat(connection.Where("PutOutput"), " (", name, ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::StatusResponse> AdminClient::Status() const {
  grpc::ClientContext context;
  connection_->PrepareContext(&context, connection_->options().rpc_timeout);
  v1::StatusResponse response;
  grpc::Status status = connection_->admin().Status(&context, v1::StatusRequest(), &response);
  if (!status.ok()) return FromGrpcStatus(status, connection_->Where("Status"));
  return response;
}

absl::StatusOr<v1::StopResponse> AdminClient::Stop(const std::string& reason,
                                                   bool checkpoint) const {
  grpc::ClientContext context;
  connection_->PrepareContext(&context, connection_->options().rpc_timeout);
  v1::StopRequest request;
  request.set_reason(reason);
  request.set_checkpoint(checkpoint);
  v1::StopResponse response;
  grpc::Status status = connection_->admin().Stop(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status, connection_->Where("Stop"));
  return response;
}

absl::StatusOr<v1::ScaleResponse> AdminClient::Scale(int64_t encoder_replicas) const {
  grpc::ClientContext context;
  connection_->PrepareContext(&context, connection_->options().rpc_timeout);
  v1::ScaleRequest request;
  request.set_encoder_replicas(encoder_replicas);
  v1::ScaleResponse response;
  grpc::Status status = connection_->admin().Scale(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status, connection_->Where("Scale"));
  return response;
}

// ------------------------------------------------------------------------------------------------
// KeyValueClient

absl::Status KeyValueClient::Set(const std::string& key, const std::string& value) const {
  grpc::ClientContext context;
  connection_->PrepareContext(&context, connection_->options().rpc_timeout);
  v1::KvSetRequest request;
  request.set_generation(generation_);
  request.set_key(key);
  request.set_value(value);
  v1::KvSetResponse response;
  grpc::Status status = connection_->key_value().Set(&context, request, &response);
  return FromGrpcStatus(status, connection_->Where("KeyValue.Set"));
}

absl::StatusOr<std::string> KeyValueClient::Get(const std::string& key,
                                                absl::Duration timeout) const {
  grpc::ClientContext context;
  // The server answers DeadlineExceeded itself at `timeout`; the RPC deadline leaves it room.
  connection_->PrepareContext(&context, timeout + connection_->options().rpc_timeout);
  v1::KvGetRequest request;
  request.set_generation(generation_);
  request.set_key(key);
  request.set_timeout_ms(absl::ToInt64Milliseconds(timeout));
  v1::KvGetResponse response;
  grpc::Status status = connection_->key_value().Get(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status, connection_->Where("KeyValue.Get"));
  return std::move(*response.mutable_value());
}

absl::StatusOr<int64_t> KeyValueClient::Add(const std::string& key, int64_t delta) const {
  grpc::ClientContext context;
  connection_->PrepareContext(&context, connection_->options().rpc_timeout);
  v1::KvAddRequest request;
  request.set_generation(generation_);
  request.set_key(key);
  request.set_delta(delta);
  v1::KvAddResponse response;
  grpc::Status status = connection_->key_value().Add(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status, connection_->Where("KeyValue.Add"));
  return response.value();
}

absl::StatusOr<std::string> KeyValueClient::CompareSet(const std::string& key,
                                                       const std::string& expected,
                                                       const std::string& desired) const {
  grpc::ClientContext context;
  connection_->PrepareContext(&context, connection_->options().rpc_timeout);
  v1::KvCompareSetRequest request;
  request.set_generation(generation_);
  request.set_key(key);
  request.set_expected(expected);
  request.set_desired(desired);
  v1::KvCompareSetResponse response;
  grpc::Status status = connection_->key_value().CompareSet(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status, connection_->Where("KeyValue.CompareSet"));
  return std::move(*response.mutable_value());
}

absl::Status KeyValueClient::Wait(const std::vector<std::string>& keys,
                                  absl::Duration timeout) const {
  grpc::ClientContext context;
  connection_->PrepareContext(&context, timeout + connection_->options().rpc_timeout);
  v1::KvWaitRequest request;
  request.set_generation(generation_);
  for (const auto& key : keys) request.add_keys(key);
  request.set_timeout_ms(absl::ToInt64Milliseconds(timeout));
  v1::KvWaitResponse response;
  grpc::Status status = connection_->key_value().Wait(&context, request, &response);
  return FromGrpcStatus(status, connection_->Where("KeyValue.Wait"));
}

absl::StatusOr<bool> KeyValueClient::Check(const std::vector<std::string>& keys) const {
  grpc::ClientContext context;
  connection_->PrepareContext(&context, connection_->options().rpc_timeout);
  v1::KvCheckRequest request;
  request.set_generation(generation_);
  for (const auto& key : keys) request.add_keys(key);
  v1::KvCheckResponse response;
  grpc::Status status = connection_->key_value().Check(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status, connection_->Where("KeyValue.Check"));
  return response.all_exist();
}

absl::StatusOr<bool> KeyValueClient::Delete(const std::string& key) const {
  grpc::ClientContext context;
  connection_->PrepareContext(&context, connection_->options().rpc_timeout);
  v1::KvDeleteRequest request;
  request.set_generation(generation_);
  request.set_key(key);
  v1::KvDeleteResponse response;
  grpc::Status status = connection_->key_value().Delete(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status, connection_->Where("KeyValue.Delete"));
  return response.deleted();
}

absl::StatusOr<int64_t> KeyValueClient::NumKeys() const {
  grpc::ClientContext context;
  connection_->PrepareContext(&context, connection_->options().rpc_timeout);
  v1::KvNumKeysRequest request;
  request.set_generation(generation_);
  v1::KvNumKeysResponse response;
  grpc::Status status = connection_->key_value().NumKeys(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status, connection_->Where("KeyValue.NumKeys"));
  return response.num_keys();
}

// ------------------------------------------------------------------------------------------------
// WorkerSession::Stream: the session RPC. One write in flight at a time (queued behind it), one
// read always pending. A hold keeps the RPC open for writes from other threads until the worker
// closes, a write fails or the coordinator ends the stream.

class WorkerSession::Stream
    : public grpc::ClientBidiReactor<v1::WorkerMessage, v1::CoordinatorMessage> {
 public:
  explicit Stream(WorkerSession* owner) : owner_(owner) {}

  void Begin(const std::string& worker_id) {
    // No deadline: the session lives as long as the worker; heartbeats prove liveness.
    owner_->connection_->PrepareContext(&context_, absl::InfiniteDuration());
    owner_->connection_->coordinator().async()->Session(&context_, this);
    AddHold();
    v1::WorkerMessage open;
    open.mutable_open()->set_worker_id(worker_id);
    (void)Write(std::move(open));
    StartRead(&incoming_);
    StartCall();
  }

  absl::Status Write(v1::WorkerMessage message) {
    absl::MutexLock lock(&mu_);
    if (!accepting_) {
      return absl::FailedPreconditionError(
          absl::StrCat("the session with coordinator ", owner_->connection_->options().address,
                       " has ended; no more messages can be sent"));
    }
    queue_.push_back(std::move(message));
    if (!writing_) {
      writing_ = true;
      StartWrite(&queue_.front());
    }
    return absl::OkStatus();
  }

  // Half-close after the queued writes.
  void CloseWrites() {
    absl::MutexLock lock(&mu_);
    if (!accepting_) return;
    accepting_ = false;
    writes_done_wanted_ = true;
    MaybeReleaseLocked();
  }

  void Cancel() { context_.TryCancel(); }

  void OnWriteDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    queue_.pop_front();
    if (!ok) {
      accepting_ = false;
      queue_.clear();
    }
    if (!queue_.empty()) {
      StartWrite(&queue_.front());
      return;
    }
    writing_ = false;
    MaybeReleaseLocked();
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      absl::MutexLock lock(&mu_);
      read_ended_ = true;
      accepting_ = false;
      // Queued messages cannot be delivered any more; the one being written completes alone.
      while (queue_.size() > (writing_ ? 1u : 0u)) queue_.pop_back();
      MaybeReleaseLocked();
      return;
    }
    owner_->OnMessage(incoming_);
    StartRead(&incoming_);
  }

  void OnDone(const grpc::Status& status) override {
    owner_->OnStreamDone(FromGrpcStatus(status, owner_->connection_->Where("Session")));
  }

 private:
  void MaybeReleaseLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (accepting_ || writing_ || hold_released_) return;
    if (writes_done_wanted_ && !read_ended_) StartWritesDone();
    hold_released_ = true;
    RemoveHold();
  }

  WorkerSession* owner_;
  grpc::ClientContext context_;
  v1::CoordinatorMessage incoming_;
  absl::Mutex mu_;
  std::deque<v1::WorkerMessage> queue_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool accepting_ ABSL_GUARDED_BY(mu_) = true;
  bool writes_done_wanted_ ABSL_GUARDED_BY(mu_) = false;
  bool read_ended_ ABSL_GUARDED_BY(mu_) = false;
  bool hold_released_ ABSL_GUARDED_BY(mu_) = false;
};

// ------------------------------------------------------------------------------------------------
// WorkerSession

namespace {
constexpr char kStoppedBeforeStartPayload[] = "type.hetpar/stopped-before-start";
}  // namespace

bool IsStoppedBeforeStart(const absl::Status& status) {
  return status.GetPayload(kStoppedBeforeStartPayload).has_value();
}

WorkerSession::WorkerSession(std::shared_ptr<CoordinatorConnection> connection, Options options)
    : connection_(std::move(connection)), options_(std::move(options)) {}

absl::StatusOr<std::unique_ptr<WorkerSession>> WorkerSession::Start(
    std::shared_ptr<CoordinatorConnection> connection, Options options) {
  std::unique_ptr<WorkerSession> session(new WorkerSession(connection, std::move(options)));
  {
    grpc::ClientContext context;
    connection->PrepareContext(&context, connection->options().rpc_timeout);
    grpc::Status status = connection->coordinator().Register(
        &context, session->options_.registration, &session->registration_);
    if (!status.ok()) return FromGrpcStatus(status, connection->Where("Register"));
  }
  {
    absl::MutexLock lock(&session->mu_);
    session->assignment_ = session->registration_.assignment();
  }
  session->stream_ = std::make_unique<Stream>(session.get());
  session->stream_->Begin(session->worker_id());
  if (session->options_.heartbeats) {
    session->heartbeat_thread_ = std::thread([s = session.get()] { s->HeartbeatLoop(); });
  }
  return session;
}

WorkerSession::~WorkerSession() {
  if (stream_ != nullptr) (void)Close(connection_->options().rpc_timeout);
}

v1::Assignment WorkerSession::assignment() const {
  absl::MutexLock lock(&mu_);
  return assignment_;
}

int64_t WorkerSession::generation() const {
  absl::MutexLock lock(&mu_);
  return assignment_.generation();
}

absl::StatusOr<v1::Assignment> WorkerSession::WaitForRunStart(absl::Duration timeout) const {
  absl::MutexLock lock(&mu_);
  auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return assignment_.peers_complete() || ended_ || !stopped_.empty();
  };
  if (!mu_.AwaitWithTimeout(absl::Condition(&ready), timeout)) {
    return absl::DeadlineExceededError(
        absl::StrCat("the run did not start within ", absl::FormatDuration(timeout),
                     ": not every rank has registered with coordinator ",
                     connection_->options().address, " (see `hetpar status`)"));
  }
  if (!assignment_.peers_complete() && !stopped_.empty()) {
    absl::Status stopped =
        absl::CancelledError(absl::StrCat("the run stopped before it started: ", stopped_));
    stopped.SetPayload(kStoppedBeforeStartPayload, absl::Cord());
    return stopped;
  }
  if (!assignment_.peers_complete()) {
    return final_status_.ok() ? absl::UnavailableError("the coordinator ended the session")
                              : final_status_;
  }
  return assignment_;
}

absl::StatusOr<v1::CoordinatorMessage> WorkerSession::Next(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return !inbox_.empty() || ended_; };
  if (!mu_.AwaitWithTimeout(absl::Condition(&ready), timeout)) {
    return absl::DeadlineExceededError(absl::StrCat("no message from coordinator ",
                                                    connection_->options().address, " within ",
                                                    absl::FormatDuration(timeout)));
  }
  if (!inbox_.empty()) {
    v1::CoordinatorMessage message = std::move(inbox_.front());
    inbox_.pop_front();
    return message;
  }
  return final_status_.ok()
             ? absl::UnavailableError(absl::StrCat("coordinator ", connection_->options().address,
                                                   " ended the session"))
             : final_status_;
}

absl::Status WorkerSession::Send(v1::WorkerMessage message) {
  {
    absl::MutexLock lock(&mu_);
    last_sent_ = absl::Now();
  }
  return stream_->Write(std::move(message));
}

absl::Status WorkerSession::SendProgress(const v1::Progress& progress) {
  v1::WorkerMessage message;
  *message.mutable_progress() = progress;
  return Send(std::move(message));
}

absl::Status WorkerSession::SendGradNormPartial(const v1::GradNormPartial& partial) {
  v1::WorkerMessage message;
  *message.mutable_grad_norm_partial() = partial;
  return Send(std::move(message));
}

absl::Status WorkerSession::SendReport(const v1::StepReport& report) {
  v1::WorkerMessage message;
  *message.mutable_report() = report;
  return Send(std::move(message));
}

absl::Status WorkerSession::SendLeave(const std::string& reason) {
  v1::WorkerMessage message;
  message.mutable_leave()->set_reason(reason);
  return Send(std::move(message));
}

absl::Status WorkerSession::SendFailure(const std::string& error, bool ends_run) {
  v1::WorkerMessage message;
  message.mutable_failure()->set_error(error);
  message.mutable_failure()->set_ends_run(ends_run);
  return Send(std::move(message));
}

void WorkerSession::PauseHeartbeats(bool paused) {
  absl::MutexLock lock(&mu_);
  heartbeats_paused_ = paused;
}

void WorkerSession::Cancel() { stream_->Cancel(); }

bool WorkerSession::ended() const {
  absl::MutexLock lock(&mu_);
  return ended_;
}

absl::Status WorkerSession::Close(absl::Duration timeout) {
  {
    absl::MutexLock lock(&mu_);
    stop_heartbeats_ = true;
  }
  if (heartbeat_thread_.joinable()) heartbeat_thread_.join();
  stream_->CloseWrites();
  absl::MutexLock lock(&mu_);
  auto ended = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return ended_; };
  if (!mu_.AwaitWithTimeout(absl::Condition(&ended), timeout)) {
    stream_->Cancel();
    // A cancelled call always completes promptly.
    mu_.Await(absl::Condition(&ended));
  }
  // A lost coordinator's callback (a worker restarting itself) may still be running: it ends by
  // returning or by replacing the process, never by waiting on this thread.
  auto returned = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return on_lost_returned_; };
  mu_.Await(absl::Condition(&returned));
  return final_status_;
}

void WorkerSession::HeartbeatLoop() {
  const absl::Duration interval =
      absl::Seconds(std::max(0.01, registration_.assignment().heartbeat_interval_s()));
  const absl::Duration timeout =
      absl::Seconds(std::max(0.01, registration_.assignment().heartbeat_timeout_s()));
  int64_t seq = 0;
  while (true) {
    bool ask = false;
    int64_t generation = 0;
    {
      absl::MutexLock lock(&mu_);
      auto wake = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
        return stop_heartbeats_ || ended_ || beat_now_;
      };
      // Wake when the next heartbeat is due: `interval` after the last message sent, or at once
      // after an abort.
      const absl::Duration wait =
          std::clamp(last_sent_ + interval - absl::Now(), absl::Milliseconds(1), interval);
      (void)mu_.AwaitWithTimeout(absl::Condition(&wake), wait);
      if (stop_heartbeats_ || ended_) return;
      const bool due_now = beat_now_;
      beat_now_ = false;
      const absl::Time now = absl::Now();
      if (now - unanswered_since_ > timeout) {
        local_failure_ = absl::DeadlineExceededError(absl::StrCat(
            "the coordinator at ", connection_->options().address,
            " stopped answering: nothing "
            "received for ",
            absl::FormatDuration(absl::Trunc(now - unanswered_since_, absl::Milliseconds(100))),
            " after a heartbeat that asked for an ack (heartbeat_timeout ",
            absl::FormatDuration(timeout), ")"));
        break;
      }
      if (heartbeats_paused_ || (!due_now && now - last_sent_ < interval)) continue;
      ++seq;
      ask = options_.ack_every > 0 && seq % options_.ack_every == 0;
      if (ask && unanswered_since_ == absl::InfiniteFuture()) unanswered_since_ = now;
      generation = assignment_.generation();
    }
    v1::WorkerMessage message;
    v1::Heartbeat* heartbeat = message.mutable_heartbeat();
    heartbeat->set_seq(seq);
    heartbeat->set_client_time_ns(absl::GetCurrentTimeNanos());
    heartbeat->set_generation(generation);
    heartbeat->set_ack_requested(ask);
    if (!Send(std::move(message)).ok()) return;
  }
  // The coordinator stopped answering: end the stream; Next() reports local_failure_.
  stream_->Cancel();
}

void WorkerSession::OnMessage(const v1::CoordinatorMessage& message) {
  if (message.kind_case() == v1::CoordinatorMessage::kBatch) {
    for (const auto& inner : message.batch().messages()) OnMessage(inner);
    return;
  }
  // Before it is queued: whoever waits on peers for the step it ends learns of it first.
  if (options_.on_arrival) options_.on_arrival(message);
  {
    absl::MutexLock lock(&mu_);
    unanswered_since_ = absl::InfiniteFuture();
    switch (message.kind_case()) {
      case v1::CoordinatorMessage::kAssignment:
        assignment_ = message.assignment();
        break;
      case v1::CoordinatorMessage::kMembershipChange:
        assignment_.set_generation(message.membership_change().generation());
        assignment_.set_peers_complete(false);
        break;
      case v1::CoordinatorMessage::kAbort:
        beat_now_ = true;
        break;
      case v1::CoordinatorMessage::kStop:
        if (!message.stop().run_failed() && stopped_.empty()) {
          stopped_ = message.stop().reason().empty() ? "stop" : message.stop().reason();
        }
        break;
      case v1::CoordinatorMessage::kHeartbeatAck:
      case v1::CoordinatorMessage::kStepPlan:
      case v1::CoordinatorMessage::kGradNorm:
      case v1::CoordinatorMessage::kCommit:
      case v1::CoordinatorMessage::kBatch:
      case v1::CoordinatorMessage::KIND_NOT_SET:
        break;
    }
    if (!options_.on_message && message.kind_case() != v1::CoordinatorMessage::kHeartbeatAck) {
      inbox_.push_back(message);
    }
  }
  // Outside the lock: the handler may call back into the session.
  if (options_.on_message) options_.on_message(message);
}

void WorkerSession::OnStreamDone(const absl::Status& status) {
  absl::Status lost;
  {
    absl::MutexLock lock(&mu_);
    ended_ = true;
    final_status_ = local_failure_.ok() ? status : local_failure_;
    // Not while this side closes: the coordinator broke the stream off (it died, or its machine
    // or the network went away) or stopped answering.
    if (!stop_heartbeats_ &&
        (absl::IsUnavailable(final_status_) || absl::IsDeadlineExceeded(local_failure_))) {
      lost = final_status_;
    }
    // Declared dead (a heartbeat gap, or stuck in a step): the session is over as if the
    // coordinator were lost, and the same restart registers the worker again; it also ends a
    // process whose step hangs, which would never read the session's end.
    if (!stop_heartbeats_ && absl::IsAborted(final_status_) &&
        absl::StrContains(final_status_.message(), kDeclaredDeadPrefix)) {
      lost = final_status_;
    }
  }
  if (!lost.ok() && options_.on_lost) options_.on_lost(lost);
  absl::MutexLock lock(&mu_);
  on_lost_returned_ = true;
}

}  // namespace hetpar::coordinator
