#include "coordinator/server.h"

#include <sys/resource.h>

#include <atomic>
#include <deque>
#include <map>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/control/grpc_status.h"
#include "common/logging.h"
#include "common/status.h"
#include "coordinator/kv_store.h"
#include "coordinator/limits.h"
#include "coordinator/output_sink.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "grpcpp/support/server_callback.h"
#include "hetpar/v1/coordinator.grpc.pb.h"

namespace hetpar::coordinator {
namespace {

double ProcessCpuSeconds() {
  struct rusage usage;
  if (getrusage(RUSAGE_SELF, &usage) != 0) return 0;
  auto seconds = [](const timeval& t) { return t.tv_sec + t.tv_usec * 1e-6; };
  return seconds(usage.ru_utime) + seconds(usage.ru_stime);
}

std::chrono::system_clock::time_point ChronoDeadline(absl::Time deadline) {
  return absl::ToChronoTime(deadline);
}

using SessionReactorBase = grpc::ServerBidiReactor<v1::WorkerMessage, v1::CoordinatorMessage>;

// The write side of one session stream, shared by the stream's reactor and the server's session
// table: a queue with one write in flight, and a Finish issued once the queue has drained. The
// reactor pointer is cleared when the reactor is done; later sends are dropped.
class SessionOutbox {
 public:
  explicit SessionOutbox(SessionReactorBase* reactor) : reactor_(reactor) {}

  void Send(v1::CoordinatorMessage message) {
    absl::MutexLock lock(&mu_);
    if (reactor_ == nullptr || finish_wanted_) return;
    queue_.push_back(std::move(message));
    if (!writing_) {
      writing_ = true;
      reactor_->StartWrite(&queue_.front());
    }
  }

  // Finishes the stream with `status` after the queued messages (first call wins).
  void Finish(grpc::Status status) {
    absl::MutexLock lock(&mu_);
    if (reactor_ == nullptr || finish_wanted_) return;
    finish_wanted_ = true;
    finish_status_ = std::move(status);
    if (!writing_) DoFinishLocked();
  }

  void OnWriteDone(bool ok) {
    absl::MutexLock lock(&mu_);
    queue_.pop_front();
    if (!ok) queue_.clear();
    if (!queue_.empty() && reactor_ != nullptr) {
      reactor_->StartWrite(&queue_.front());
      return;
    }
    writing_ = false;
    if (finish_wanted_) DoFinishLocked();
  }

  // Whether Finish has been issued (for the reader: stop reading).
  bool finishing() const {
    absl::MutexLock lock(&mu_);
    return finish_wanted_;
  }

  void Detach() {
    absl::MutexLock lock(&mu_);
    reactor_ = nullptr;
  }

 private:
  void DoFinishLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_ || reactor_ == nullptr) return;
    finished_ = true;
    reactor_->Finish(finish_status_);
  }

  mutable absl::Mutex mu_;
  SessionReactorBase* reactor_ ABSL_GUARDED_BY(mu_);
  std::deque<v1::CoordinatorMessage> queue_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finish_wanted_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status finish_status_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

// ------------------------------------------------------------------------------------------------

namespace internal {

// Everything the services share: the controller under the lock, the session table, the store.
class ServerCore {
 public:
  ServerCore(ServerOptions options, std::unique_ptr<RunController> controller,
             std::unique_ptr<OutputSink> outputs)
      : options_(std::move(options)),
        outputs_(std::move(outputs)),
        metadata_value_(std::string(kBearerPrefix) + options_.token),
        controller_(std::move(controller)),
        controller_options_(controller_->options()),
        kv_(controller_->generation()) {}

  ~ServerCore() { Shutdown(absl::Seconds(1)); }

  absl::Status Start();
  void Shutdown(absl::Duration grace);

  // Checks the run token of a call; logs and returns false when it is missing or wrong.
  bool Authorized(grpc::CallbackServerContext* context, const char* method) {
    const auto& metadata = context->client_metadata();
    auto it = metadata.find(kAuthMetadataKey);
    const char* problem = "missing run token";
    if (it != metadata.end()) {
      const std::string_view presented(it->second.data(), it->second.size());
      if (TokenMatches(metadata_value_, presented)) return true;
      problem = "wrong run token";
    }
    rejected_calls_.fetch_add(1, std::memory_order_relaxed);
    HETPAR_LOG(WARNING) << "rejected " << method << " from " << context->peer() << ": " << problem;
    return false;
  }

  static grpc::Status Unauthenticated() {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "missing or wrong run token: pass the run's token (--token-file, "
                        "HETPAR_TOKEN or coordinator.token_file)");
  }

  // The key-value store for a request of `generation`. WithController moves the store to a new
  // generation just after the messages that announce it are queued: a worker that acts on one
  // at once may ask before that. A request ahead of the store therefore moves it to the
  // controller's generation first (never further: the controller is the authority).
  KeyValueStore& Kv(int64_t generation) {
    if (generation > kv_.generation()) {
      int64_t current = 0;
      {
        absl::MutexLock lock(&mu_);
        current = controller_->generation();
      }
      kv_.SetGeneration(current);
    }
    return kv_;
  }

  // Runs `fn(controller, now, actions)` under the lock, applies the actions, then moves the
  // key-value store to the controller's generation.
  template <typename Fn>
  auto WithController(Fn&& fn) {
    Actions actions;
    int64_t generation = 0;
    if constexpr (std::is_void_v<decltype(fn(*controller_, absl::Now(), &actions))>) {
      {
        absl::MutexLock lock(&mu_);
        fn(*controller_, absl::Now(), &actions);
        ApplyLocked(&actions);
        generation = controller_->generation();
      }
      kv_.SetGeneration(generation);
    } else {
      auto result = [&] {
        absl::MutexLock lock(&mu_);
        auto r = fn(*controller_, absl::Now(), &actions);
        ApplyLocked(&actions);
        generation = controller_->generation();
        return r;
      }();
      kv_.SetGeneration(generation);
      return result;
    }
  }

  // Queues the messages on the sessions, in order per worker; several messages for one worker
  // go as one batch (one write instead of several).
  void ApplyLocked(Actions* actions) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (actions->messages.size() == 1) {
      auto& [worker_id, message] = actions->messages.front();
      auto it = sessions_.find(worker_id);
      if (it != sessions_.end()) it->second->Send(std::move(message));
    } else if (!actions->messages.empty()) {
      absl::flat_hash_map<std::string, std::vector<v1::CoordinatorMessage*>> by_worker;
      std::vector<const std::string*> order;
      for (auto& [worker_id, message] : actions->messages) {
        auto& list = by_worker[worker_id];
        if (list.empty()) order.push_back(&worker_id);
        list.push_back(&message);
      }
      for (const std::string* worker_id : order) {
        auto it = sessions_.find(*worker_id);
        if (it == sessions_.end()) continue;
        std::vector<v1::CoordinatorMessage*>& list = by_worker[*worker_id];
        if (list.size() == 1) {
          it->second->Send(std::move(*list.front()));
          continue;
        }
        v1::CoordinatorMessage batch;
        auto* messages = batch.mutable_batch()->mutable_messages();
        messages->Reserve(static_cast<int>(list.size()));
        for (v1::CoordinatorMessage* m : list) *messages->Add() = std::move(*m);
        it->second->Send(std::move(batch));
      }
    }
    for (auto& [worker_id, status] : actions->end_sessions) {
      auto it = sessions_.find(worker_id);
      if (it == sessions_.end()) continue;
      it->second->Finish(ToGrpcStatus(status));
      sessions_.erase(it);
    }
  }

  // Session table (the reactor calls these).
  absl::Status OpenSession(const std::string& worker_id, std::shared_ptr<SessionOutbox> outbox) {
    return WithController([&](RunController& c, absl::Time now, Actions* actions) {
      absl::Status status = c.OpenSession(worker_id, now, actions);
      // Registered before the actions are applied, so the session gets its first messages.
      if (status.ok()) sessions_[worker_id] = std::move(outbox);
      return status;
    });
  }

  void SessionEnded(const std::string& worker_id, const std::string& why) {
    WithController([&](RunController& c, absl::Time now, Actions* actions) {
      sessions_.erase(worker_id);
      c.SessionEnded(worker_id, why, now, actions);
    });
  }

  absl::Status HandleMessage(const std::string& worker_id, const v1::WorkerMessage& message) {
    return WithController([&](RunController& c, absl::Time now, Actions* actions) {
      return c.HandleMessage(worker_id, message, now, actions);
    });
  }

  v1::StatusResponse Status() const {
    v1::StatusResponse status;
    {
      absl::MutexLock lock(&mu_);
      status = controller_->Status(absl::Now());
    }
    status.set_cpu_seconds(ProcessCpuSeconds());
    status.set_listen_address(address_);
    return status;
  }

  v1::RunState state() const {
    absl::MutexLock lock(&mu_);
    return controller_->state();
  }

  std::vector<v1::StepTiming> TakeCommittedSteps() {
    absl::MutexLock lock(&mu_);
    return controller_->TakeCommittedSteps();
  }

  std::vector<std::string> CutAtStop() const {
    absl::MutexLock lock(&mu_);
    return controller_->cut_at_stop();
  }

  v1::RunState WaitForEnd(absl::Duration timeout) const {
    absl::MutexLock lock(&mu_);
    auto ended = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      return controller_->state() == v1::RUN_STATE_DONE ||
             controller_->state() == v1::RUN_STATE_FAILED;
    };
    mu_.AwaitWithTimeout(absl::Condition(&ended), timeout);
    return controller_->state();
  }

  // Session streams that have not sent their SessionOpen yet: ended at their deadline (the
  // heartbeat timeout) so a silent stream does not hold the server forever.
  void AddUnopened(const void* stream, std::shared_ptr<SessionOutbox> outbox) {
    absl::MutexLock lock(&unopened_mu_);
    unopened_[stream] = {std::move(outbox), absl::Now() + controller_options_.heartbeat_timeout};
  }
  void RemoveUnopened(const void* stream) {
    absl::MutexLock lock(&unopened_mu_);
    unopened_.erase(stream);
  }
  void ExpireUnopened(absl::Time now) {
    std::vector<std::shared_ptr<SessionOutbox>> expired;
    {
      absl::MutexLock lock(&unopened_mu_);
      for (auto it = unopened_.begin(); it != unopened_.end();) {
        if (it->second.second <= now) {
          expired.push_back(std::move(it->second.first));
          unopened_.erase(it++);
        } else {
          ++it;
        }
      }
    }
    for (auto& outbox : expired) {
      outbox->Finish(
          grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                       absl::StrCat("no SessionOpen within ",
                                    absl::FormatDuration(controller_options_.heartbeat_timeout),
                                    " of opening the session stream")));
    }
  }

  // A registered worker of this run (alive or not: a worker may send its outputs after it was
  // declared lost).
  bool KnownWorker(const std::string& worker_id) const {
    absl::MutexLock lock(&mu_);
    return controller_->membership().Find(worker_id) != nullptr;
  }

  void WatchdogLoop();

  ServerOptions options_;
  const std::unique_ptr<OutputSink> outputs_;  // PutOutput's files; null without a run directory
  const std::string metadata_value_;           // "Bearer <token>"
  std::string address_;
  int port_ = 0;

  mutable absl::Mutex mu_;
  std::unique_ptr<RunController> controller_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::shared_ptr<SessionOutbox>> sessions_ ABSL_GUARDED_BY(mu_);
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;

  const ControllerOptions controller_options_;  // resolved (timeouts from the RunSpec)
  KeyValueStore kv_;
  std::atomic<int64_t> rejected_calls_{0};
  absl::Mutex unopened_mu_;
  absl::flat_hash_map<const void*, std::pair<std::shared_ptr<SessionOutbox>, absl::Time>> unopened_
      ABSL_GUARDED_BY(unopened_mu_);

  std::unique_ptr<v1::Coordinator::CallbackService> coordinator_service_;
  std::unique_ptr<v1::KeyValue::CallbackService> kv_service_;
  std::unique_ptr<v1::Admin::CallbackService> admin_service_;
  std::unique_ptr<grpc::Server> server_;
  std::thread watchdog_;
  // Runs the planner's Prepare (opening the data set) without the lock; cancelled and joined
  // at shutdown.
  std::thread preparer_;
  StepPlanner* preparing_ = nullptr;  // the planner preparer_ prepares (the controller's)
  bool shut_down_ = false;
};

}  // namespace internal

namespace {

// ------------------------------------------------------------------------------------------------
// Coordinator service

class SessionReactor : public SessionReactorBase {
 public:
  SessionReactor(internal::ServerCore* impl, grpc::CallbackServerContext* context)
      : impl_(impl), context_(context), outbox_(std::make_shared<SessionOutbox>(this)) {
    if (!impl_->Authorized(context, "Coordinator.Session")) {
      Finish(internal::ServerCore::Unauthenticated());
      return;
    }
    impl_->AddUnopened(this, outbox_);
    StartRead(&incoming_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      // The worker half-closed its side or the call was cancelled.
      if (opened_) ReportEnded(context_->IsCancelled() ? "cancelled" : "closed by the worker");
      outbox_->Finish(grpc::Status::OK);
      return;
    }
    if (outbox_->finishing()) return;
    absl::Status status;
    if (!opened_) {
      impl_->RemoveUnopened(this);
      if (incoming_.kind_case() != v1::WorkerMessage::kOpen) {
        status = absl::InvalidArgumentError(
            "the first message of a session must be SessionOpen with the worker_id from Register");
      } else {
        worker_id_ = incoming_.open().worker_id();
        status = impl_->OpenSession(worker_id_, outbox_);
        opened_ = status.ok();
      }
    } else {
      status = impl_->HandleMessage(worker_id_, incoming_);
    }
    if (!status.ok()) {
      HETPAR_LOG(WARNING) << "ending session of "
                          << (worker_id_.empty() ? "?" : Printable(worker_id_)) << " from "
                          << context_->peer() << ": " << status.message();
      if (opened_) ReportEnded(std::string(status.message()));
      outbox_->Finish(ToGrpcStatus(status));
      return;
    }
    StartRead(&incoming_);
  }

  void OnWriteDone(bool ok) override { outbox_->OnWriteDone(ok); }

  void OnDone() override {
    outbox_->Detach();
    impl_->RemoveUnopened(this);
    if (opened_) ReportEnded("stream closed");
    delete this;
  }

 private:
  void ReportEnded(const std::string& why) {
    if (ended_reported_.exchange(true)) return;
    impl_->SessionEnded(worker_id_, why);
  }

  internal::ServerCore* impl_;
  grpc::CallbackServerContext* context_;
  std::shared_ptr<SessionOutbox> outbox_;
  v1::WorkerMessage incoming_;
  // Written by the read reaction only; OnDone runs after every other reaction.
  bool opened_ = false;
  std::string worker_id_;
  std::atomic<bool> ended_reported_{false};
};

// PutOutput: one file of a worker's outputs, chunk by chunk into the run directory.
class PutOutputReactor : public grpc::ServerReadReactor<v1::OutputChunk> {
 public:
  PutOutputReactor(internal::ServerCore* impl, grpc::CallbackServerContext* context,
                   v1::PutOutputResponse* response)
      : impl_(impl), context_(context), response_(response) {
    if (!impl_->Authorized(context, "Coordinator.PutOutput")) {
      Finish(internal::ServerCore::Unauthenticated());
      return;
    }
    if (impl_->outputs_ == nullptr) {
      Finish(grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                          "this coordinator has no run directory (run.out_dir) to write outputs "
                          "into"));
      return;
    }
    StartRead(&chunk_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      if (finished_) {
        Finish(grpc::Status::OK);
      } else {
        Fail(absl::DataLossError(
            absl::StrCat("output ", upload_ == nullptr ? std::string("?") : upload_->name(),
                         ": the stream ended before its last chunk",
                         context_->IsCancelled() ? " (cancelled)" : "")));
      }
      return;
    }
    if (absl::Status s = Take(); !s.ok()) {
      Fail(s);
      return;
    }
    StartRead(&chunk_);
  }

  void OnDone() override { delete this; }

 private:
  absl::Status Take() {
    if (finished_) {
      return absl::InvalidArgumentError(
          absl::StrCat("output ", upload_->name(), ": a chunk after the last one"));
    }
    if (upload_ == nullptr) {
      if (!impl_->KnownWorker(chunk_.worker_id())) {
        return absl::PermissionDeniedError(absl::StrCat(
            "output ", chunk_.name().substr(0, 200), " from '", Printable(chunk_.worker_id()),
            "', which is not a registered worker of this run"));
      }
      absl::StatusOr<std::unique_ptr<OutputSink::Upload>> upload =
          impl_->outputs_->Begin(chunk_.name(), chunk_.total_bytes());
      if (!upload.ok()) return upload.status();
      upload_ = *std::move(upload);
      worker_id_ = chunk_.worker_id();
      total_bytes_ = chunk_.total_bytes();
    }
    HETPAR_RETURN_IF_ERROR(upload_->Append(chunk_.data()));
    // An upload in progress keeps a stopping run's deadline ahead of it.
    impl_->WithController(
        [](RunController& c, absl::Time now, Actions*) { c.OutputProgress(now); });
    if (chunk_.last()) {
      HETPAR_RETURN_IF_ERROR(upload_->Finish(chunk_.crc32()));
      response_->set_bytes(total_bytes_);
      HETPAR_LOG(INFO) << "output " << upload_->name() << " (" << response_->bytes()
                       << " bytes) from " << worker_id_;
      finished_ = true;
    }
    return absl::OkStatus();
  }

  void Fail(const absl::Status& status) {
    HETPAR_LOG(WARNING) << "refused an output from " << context_->peer() << ": "
                        << status.message();
    upload_.reset();  // leaves nothing behind
    Finish(ToGrpcStatus(status));
  }

  internal::ServerCore* impl_;
  grpc::CallbackServerContext* context_;
  v1::PutOutputResponse* response_;
  v1::OutputChunk chunk_;
  std::unique_ptr<OutputSink::Upload> upload_;
  std::string worker_id_;
  uint64_t total_bytes_ = 0;
  bool finished_ = false;
};

class CoordinatorServiceImpl final : public v1::Coordinator::CallbackService {
 public:
  explicit CoordinatorServiceImpl(internal::ServerCore* impl) : impl_(impl) {}

  grpc::ServerUnaryReactor* Register(grpc::CallbackServerContext* context,
                                     const v1::RegisterRequest* request,
                                     v1::RegisterResponse* response) override {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    if (!impl_->Authorized(context, "Coordinator.Register")) {
      reactor->Finish(internal::ServerCore::Unauthenticated());
      return reactor;
    }
    absl::StatusOr<v1::RegisterResponse> result =
        impl_->WithController([&](RunController& c, absl::Time now, Actions* actions) {
          return c.Register(*request, now, actions);
        });
    if (!result.ok()) {
      HETPAR_LOG(WARNING) << "refused the registration of a worker of role "
                          << RoleName(request->role()) << " from " << context->peer() << ": "
                          << result.status().message();
      reactor->Finish(ToGrpcStatus(result.status()));
      return reactor;
    }
    *response = *std::move(result);
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

  grpc::ServerBidiReactor<v1::WorkerMessage, v1::CoordinatorMessage>* Session(
      grpc::CallbackServerContext* context) override {
    return new SessionReactor(impl_, context);
  }

  grpc::ServerReadReactor<v1::OutputChunk>* PutOutput(grpc::CallbackServerContext* context,
                                                      v1::PutOutputResponse* response) override {
    return new PutOutputReactor(impl_, context, response);
  }

 private:
  internal::ServerCore* impl_;
};

// ------------------------------------------------------------------------------------------------
// KeyValue service

// A unary call that completes when a key-value wait ends. The wait id is taken before the wait
// starts: once the wait may have completed (and the call finished and been deleted), the reactor
// touches nothing of itself.
class KvWaitReactor : public grpc::ServerUnaryReactor {
 public:
  explicit KvWaitReactor(KeyValueStore* kv) : kv_(kv), id_(kv->NewWaitId()) {}
  KeyValueStore::WaitId id() const { return id_; }
  void OnCancel() override { kv_->Cancel(id_); }
  void OnDone() override { delete this; }

 private:
  KeyValueStore* kv_;
  const KeyValueStore::WaitId id_;
};

class KeyValueServiceImpl final : public v1::KeyValue::CallbackService {
 public:
  explicit KeyValueServiceImpl(internal::ServerCore* impl) : impl_(impl) {}

  grpc::ServerUnaryReactor* Set(grpc::CallbackServerContext* context,
                                const v1::KvSetRequest* request, v1::KvSetResponse*) override {
    return Simple(context, "KeyValue.Set", [&] {
      return impl_->Kv(request->generation())
          .Set(request->generation(), request->key(), request->value());
    });
  }

  grpc::ServerUnaryReactor* Get(grpc::CallbackServerContext* context,
                                const v1::KvGetRequest* request,
                                v1::KvGetResponse* response) override {
    if (request->timeout_ms() <= 0) {
      return Simple(context, "KeyValue.Get", [&]() -> absl::Status {
        absl::StatusOr<std::string> value =
            impl_->Kv(request->generation()).Get(request->generation(), request->key());
        if (!value.ok()) return value.status();
        response->set_value(*std::move(value));
        return absl::OkStatus();
      });
    }
    if (!impl_->Authorized(context, "KeyValue.Get")) return Unauthenticated(context);
    auto* reactor = new KvWaitReactor(&impl_->kv_);
    impl_->Kv(request->generation())
        .GetAsync(reactor->id(), request->generation(), request->key(),
                  absl::Now() + absl::Milliseconds(request->timeout_ms()),
                  [reactor, response](absl::StatusOr<std::string> value) {
                    if (value.ok()) response->set_value(*std::move(value));
                    reactor->Finish(ToGrpcStatus(value.status()));
                  });
    return reactor;
  }

  grpc::ServerUnaryReactor* Add(grpc::CallbackServerContext* context,
                                const v1::KvAddRequest* request,
                                v1::KvAddResponse* response) override {
    return Simple(context, "KeyValue.Add", [&]() -> absl::Status {
      absl::StatusOr<int64_t> value =
          impl_->Kv(request->generation())
              .Add(request->generation(), request->key(), request->delta());
      if (!value.ok()) return value.status();
      response->set_value(*value);
      return absl::OkStatus();
    });
  }

  grpc::ServerUnaryReactor* CompareSet(grpc::CallbackServerContext* context,
                                       const v1::KvCompareSetRequest* request,
                                       v1::KvCompareSetResponse* response) override {
    return Simple(context, "KeyValue.CompareSet", [&]() -> absl::Status {
      absl::StatusOr<std::string> value = impl_->Kv(request->generation())
                                              .CompareSet(request->generation(), request->key(),
                                                          request->expected(), request->desired());
      if (!value.ok()) return value.status();
      response->set_value(*std::move(value));
      return absl::OkStatus();
    });
  }

  grpc::ServerUnaryReactor* Wait(grpc::CallbackServerContext* context,
                                 const v1::KvWaitRequest* request, v1::KvWaitResponse*) override {
    if (!impl_->Authorized(context, "KeyValue.Wait")) return Unauthenticated(context);
    if (request->timeout_ms() <= 0) {
      grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
      reactor->Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                   absl::StrCat("KeyValue.Wait timeout_ms=", request->timeout_ms(),
                                                "; expected > 0 (every wait has a deadline)")));
      return reactor;
    }
    auto* reactor = new KvWaitReactor(&impl_->kv_);
    impl_->Kv(request->generation())
        .Wait(reactor->id(), request->generation(),
              std::vector<std::string>(request->keys().begin(), request->keys().end()),
              absl::Now() + absl::Milliseconds(request->timeout_ms()),
              [reactor](absl::Status status) { reactor->Finish(ToGrpcStatus(status)); });
    return reactor;
  }

  grpc::ServerUnaryReactor* Check(grpc::CallbackServerContext* context,
                                  const v1::KvCheckRequest* request,
                                  v1::KvCheckResponse* response) override {
    return Simple(context, "KeyValue.Check", [&]() -> absl::Status {
      absl::StatusOr<bool> exist =
          impl_->Kv(request->generation())
              .Check(request->generation(),
                     std::vector<std::string>(request->keys().begin(), request->keys().end()));
      if (!exist.ok()) return exist.status();
      response->set_all_exist(*exist);
      return absl::OkStatus();
    });
  }

  grpc::ServerUnaryReactor* Delete(grpc::CallbackServerContext* context,
                                   const v1::KvDeleteRequest* request,
                                   v1::KvDeleteResponse* response) override {
    return Simple(context, "KeyValue.Delete", [&]() -> absl::Status {
      absl::StatusOr<bool> deleted =
          impl_->Kv(request->generation()).Delete(request->generation(), request->key());
      if (!deleted.ok()) return deleted.status();
      response->set_deleted(*deleted);
      return absl::OkStatus();
    });
  }

  grpc::ServerUnaryReactor* NumKeys(grpc::CallbackServerContext* context,
                                    const v1::KvNumKeysRequest* request,
                                    v1::KvNumKeysResponse* response) override {
    return Simple(context, "KeyValue.NumKeys", [&]() -> absl::Status {
      absl::StatusOr<int64_t> n = impl_->Kv(request->generation()).NumKeys(request->generation());
      if (!n.ok()) return n.status();
      response->set_num_keys(*n);
      return absl::OkStatus();
    });
  }

 private:
  template <typename Fn>
  grpc::ServerUnaryReactor* Simple(grpc::CallbackServerContext* context, const char* method,
                                   Fn&& fn) {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    if (!impl_->Authorized(context, method)) {
      reactor->Finish(internal::ServerCore::Unauthenticated());
      return reactor;
    }
    reactor->Finish(ToGrpcStatus(fn()));
    return reactor;
  }

  grpc::ServerUnaryReactor* Unauthenticated(grpc::CallbackServerContext* context) {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(internal::ServerCore::Unauthenticated());
    return reactor;
  }

  internal::ServerCore* impl_;
};

// ------------------------------------------------------------------------------------------------
// Admin service

class AdminServiceImpl final : public v1::Admin::CallbackService {
 public:
  explicit AdminServiceImpl(internal::ServerCore* impl) : impl_(impl) {}

  grpc::ServerUnaryReactor* Status(grpc::CallbackServerContext* context, const v1::StatusRequest*,
                                   v1::StatusResponse* response) override {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    if (!impl_->Authorized(context, "Admin.Status")) {
      reactor->Finish(internal::ServerCore::Unauthenticated());
      return reactor;
    }
    *response = impl_->Status();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

  grpc::ServerUnaryReactor* Stop(grpc::CallbackServerContext* context,
                                 const v1::StopRequest* request,
                                 v1::StopResponse* response) override {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    if (!impl_->Authorized(context, "Admin.Stop")) {
      reactor->Finish(internal::ServerCore::Unauthenticated());
      return reactor;
    }
    HETPAR_LOG(INFO) << "stop requested by " << context->peer()
                     << (request->reason().empty() ? "" : ": " + request->reason());
    absl::StatusOr<v1::StopResponse> stopped = impl_->WithController(
        [&](RunController& c, absl::Time now,
            Actions* actions) -> absl::StatusOr<v1::StopResponse> {
          // Asked for, a checkpoint that cannot be written refuses the stop: the run goes on
          // rather than end without the checkpoint the caller counts on.
          if (request->checkpoint() && c.spec().checkpoint().dir().empty()) {
            return absl::FailedPreconditionError(
                "the run writes no checkpoints (checkpoint.dir is not set): nothing to stop "
                "with; the run goes on (stop it without --checkpoint to stop it without one)");
          }
          return c.Stop(request->reason(), request->checkpoint(), now, actions);
        });
    if (stopped.ok()) *response = *std::move(stopped);
    reactor->Finish(ToGrpcStatus(stopped.status()));
    return reactor;
  }

  grpc::ServerUnaryReactor* Scale(grpc::CallbackServerContext* context,
                                  const v1::ScaleRequest* request,
                                  v1::ScaleResponse* response) override {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    if (!impl_->Authorized(context, "Admin.Scale")) {
      reactor->Finish(internal::ServerCore::Unauthenticated());
      return reactor;
    }
    absl::StatusOr<v1::ScaleResponse> result =
        impl_->WithController([&](RunController& c, absl::Time now, Actions* actions) {
          return c.Scale(*request, now, actions);
        });
    if (result.ok()) *response = *std::move(result);
    reactor->Finish(ToGrpcStatus(result.status()));
    return reactor;
  }

 private:
  internal::ServerCore* impl_;
};

}  // namespace

// ------------------------------------------------------------------------------------------------
// ServerCore

absl::Status internal::ServerCore::Start() {
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials =
      MakeServerCredentials(options_.tls);
  if (!credentials.ok()) return credentials.status();
  coordinator_service_ = std::make_unique<CoordinatorServiceImpl>(this);
  kv_service_ = std::make_unique<KeyValueServiceImpl>(this);
  admin_service_ = std::make_unique<AdminServiceImpl>(this);
  // The standard gRPC health service (grpc.health.v1.Health), without the run token, for
  // readiness and liveness probes: SERVING while the server runs.
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options_.listen_address, *credentials, &port_);
  // A second coordinator on the same port must fail, not share the port.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // Bounded on purpose (coordinator/limits.h): a larger request is refused by gRPC with
  // RESOURCE_EXHAUSTED before it is parsed.
  builder.SetMaxReceiveMessageSize(kMaxRequestBytes);
  builder.SetMaxSendMessageSize(kMaxResponseBytes);
  builder.RegisterService(coordinator_service_.get());
  builder.RegisterService(kv_service_.get());
  builder.RegisterService(admin_service_.get());
  server_ = builder.BuildAndStart();
  if (server_ == nullptr || port_ == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", options_.listen_address,
                     ": the address is in use or not local (expected host:port; port 0 picks a "
                     "free one)"));
  }
  if (grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService()) {
    health->SetServingStatus(true);
  }
  const size_t colon = options_.listen_address.rfind(':');
  address_ = absl::StrCat(options_.listen_address.substr(0, colon), ":", port_);
  watchdog_ = std::thread([this] { WatchdogLoop(); });
  StepPlanner* to_prepare = nullptr;
  {
    absl::MutexLock lock(&mu_);
    to_prepare = controller_->planner_to_prepare();
  }
  if (to_prepare != nullptr) {
    // File and data-set I/O stays off the lock: heartbeats and registrations are served while
    // the data index is read or a synthetic data set is generated; no step starts before.
    preparing_ = to_prepare;
    preparer_ = std::thread([this, to_prepare] {
      const absl::Status status = to_prepare->Prepare();
      WithController([&](RunController& c, absl::Time now, Actions* actions) {
        c.PlannerPrepared(status, now, actions);
      });
    });
  }
  return absl::OkStatus();
}

void internal::ServerCore::WatchdogLoop() {
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      auto stop = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return shutting_down_; };
      if (mu_.AwaitWithTimeout(absl::Condition(&stop), options_.tick)) return;
    }
    WithController(
        [](RunController& c, absl::Time now, Actions* actions) { c.Tick(now, actions); });
    kv_.ExpireWaits(absl::Now());
    ExpireUnopened(absl::Now());
  }
}

void internal::ServerCore::Shutdown(absl::Duration grace) {
  if (shut_down_) return;
  shut_down_ = true;
  {
    absl::MutexLock lock(&mu_);
    shutting_down_ = true;
    for (auto& [worker_id, outbox] : sessions_) {
      outbox->Finish(
          grpc::Status(grpc::StatusCode::UNAVAILABLE, "the coordinator is shutting down"));
    }
    sessions_.clear();
  }
  if (watchdog_.joinable()) watchdog_.join();
  if (preparer_.joinable()) {
    // A wait for another process's data set generation (up to hours) is not waited out.
    preparing_->CancelPreparation();
    preparer_.join();
  }
  if (server_ != nullptr) {
    if (grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService()) {
      health->Shutdown();  // NOT_SERVING from now on
    }
    server_->Shutdown(ChronoDeadline(absl::Now() + grace));
    server_.reset();
  }
  // Waits that outlived the server are ended by their cancellation; nothing is left pending.
  kv_.SetGeneration(-1);
}

// ------------------------------------------------------------------------------------------------
// CoordinatorServer

absl::StatusOr<std::unique_ptr<CoordinatorServer>> CoordinatorServer::Create(
    const v1::RunSpec& spec, ServerOptions options, std::unique_ptr<StepPlanner> planner) {
  if (absl::Status s = ValidateToken(options.token, "the coordinator options"); !s.ok()) return s;
  options.controller.listen_address = options.listen_address;
  absl::StatusOr<std::unique_ptr<RunController>> controller =
      RunController::Create(spec, options.controller, std::move(planner), absl::Now());
  if (!controller.ok()) return controller.status();
  std::unique_ptr<OutputSink> outputs;
  if (!spec.run().out_dir().empty()) {
    outputs = std::make_unique<OutputSink>(spec.run().out_dir(), spec.llm().layout().pp());
  }
  auto impl = std::make_unique<internal::ServerCore>(std::move(options), *std::move(controller),
                                                     std::move(outputs));
  if (absl::Status s = impl->Start(); !s.ok()) return s;
  return std::unique_ptr<CoordinatorServer>(new CoordinatorServer(std::move(impl)));
}

CoordinatorServer::CoordinatorServer(std::unique_ptr<internal::ServerCore> impl)
    : impl_(std::move(impl)) {}
CoordinatorServer::~CoordinatorServer() = default;

const std::string& CoordinatorServer::address() const { return impl_->address_; }
int CoordinatorServer::port() const { return impl_->port_; }
v1::RunState CoordinatorServer::state() const { return impl_->state(); }
v1::StatusResponse CoordinatorServer::Status() const { return impl_->Status(); }
std::vector<v1::StepTiming> CoordinatorServer::TakeCommittedSteps() {
  return impl_->TakeCommittedSteps();
}
std::vector<std::string> CoordinatorServer::CutAtStop() const { return impl_->CutAtStop(); }
int64_t CoordinatorServer::pending_key_value_waits() const { return impl_->kv_.pending_waits(); }

v1::StopResponse CoordinatorServer::Stop(const std::string& reason, bool checkpoint) {
  return impl_->WithController([&](RunController& c, absl::Time now, Actions* actions) {
    return c.Stop(reason, checkpoint, now, actions);
  });
}

v1::RunState CoordinatorServer::WaitForEnd(absl::Duration timeout) const {
  return impl_->WaitForEnd(timeout);
}

void CoordinatorServer::Shutdown(absl::Duration grace) { impl_->Shutdown(grace); }

}  // namespace hetpar::coordinator
