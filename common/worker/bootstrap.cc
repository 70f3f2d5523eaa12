#include "common/worker/bootstrap.h"

#include <algorithm>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/data/synth.h"
#include "common/logging.h"
#include "common/nn/ucx_progress_device.h"
#include "common/rendezvous/c10d_store.h"
#include "common/status.h"
#include "common/transport/nccl/nccl_transport.h"
#include "common/transport/ucx/ucx_transport.h"

namespace hetpar::worker {

std::string RoleName(Role role) {
  switch (role) {
    case Role::kEncoder:
      return "encoder";
    case Role::kLlm:
      return "llm";
    case Role::kColocated:
      return "colocated";
  }
  return "unknown";
}

WorkerContext::~WorkerContext() { StopOpeningData(); }

namespace {

// A registration refused for a reason that passes: the coordinator did not answer in time or is
// going away (UNAVAILABLE, DEADLINE_EXCEEDED), or the rank asked for is still held by a worker it
// has not yet found gone, typically this worker's own lost process (ALREADY_EXISTS). Any other
// refusal (a stopped run, a bad request, a wrong token, every rank taken) is final.
bool RegistrationMayPass(const absl::Status& status) {
  return absl::IsUnavailable(status) || absl::IsDeadlineExceeded(status) ||
         absl::IsAlreadyExists(status);
}

// Registers, trying again while the refusal may pass, until `deadline`: 1 s after the first
// refusal, then 1 s more each time up to 5 s.
absl::StatusOr<std::unique_ptr<coordinator::WorkerSession>> RegisterUntil(
    const std::shared_ptr<coordinator::CoordinatorConnection>& connection,
    const coordinator::WorkerSession::Options& options, absl::Time deadline) {
  for (int attempt = 1;; ++attempt) {
    absl::StatusOr<std::unique_ptr<coordinator::WorkerSession>> session =
        coordinator::WorkerSession::Start(connection, options);
    if (session.ok() || !RegistrationMayPass(session.status())) return session;
    const absl::Duration pause = absl::Seconds(std::min(attempt, 5));
    if (absl::Now() + pause > deadline) {
      return absl::Status(
          session.status().code(),
          absl::StrCat(session.status().message(), " (", attempt, attempt == 1 ? " try" : " tries",
                       " within --connect-timeout)"));
    }
    HETPAR_LOG(WARNING) << "registration refused: " << session.status().message()
                        << "; trying again in " << absl::FormatDuration(pause) << " (until "
                        << "--connect-timeout, "
                        << absl::FormatDuration(
                               absl::Trunc(deadline - absl::Now(), absl::Seconds(1)))
                        << " from now)";
    absl::SleepFor(pause);
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<WorkerContext>> WorkerContext::Bootstrap(
    const WorkerOptions& options) {
  std::unique_ptr<WorkerContext> ctx(new WorkerContext(options));
  const std::string role_name = RoleName(options.role);

  // 1. Data plane, then registration.
  transport::ucx::UcxTransport::Options transport_options;
  transport_options.name = absl::StrCat(role_name, " on ", options.host);
  // UCX always: its address is registered before the RunSpec is known. transport: nccl wraps it
  // below (same address; CUDA tensors then move by NCCL).
  std::unique_ptr<transport::ucx::UcxTransport> ucx;
  HETPAR_ASSIGN_OR_RETURN(ucx, transport::ucx::UcxTransport::Create(transport_options));

  coordinator::ClientOptions client;
  client.address = options.coordinator;
  client.token = options.token;
  client.tls = options.tls;
  HETPAR_ASSIGN_OR_RETURN(ctx->connection_, coordinator::CoordinatorConnection::Create(client));
  // Connecting and registering share the bound: a coordinator that accepts the connection but
  // cannot admit this worker yet is waited for as one that is not up yet.
  const absl::Time register_by = absl::Now() + options.connect_timeout;
  if (!ctx->connection_->WaitForConnected(absl::Seconds(1)).ok()) {
    HETPAR_LOG(INFO) << "waiting for the coordinator at " << options.coordinator << " (up to "
                     << absl::FormatDuration(options.connect_timeout) << ")";
    HETPAR_RETURN_IF_ERROR(ctx->connection_->WaitForConnected(options.connect_timeout));
  }
  HETPAR_LOG(INFO) << "data plane up; registering with the coordinator at " << options.coordinator;
  coordinator::WorkerSession::Options session_options;
  v1::RegisterRequest& request = session_options.registration;
  request.set_role(options.role == Role::kEncoder ? v1::WORKER_ROLE_ENCODER
                   : options.role == Role::kLlm   ? v1::WORKER_ROLE_LLM
                                                  : v1::WORKER_ROLE_COLOCATED);
  request.set_host(options.host);
  request.set_data_address(ucx->LocalAddress());
  request.add_capabilities("cpu");
  request.add_capabilities("ucx");
  if (options.requested_rank >= 0) request.set_requested_rank(options.requested_rank);
  session_options.on_lost = options.on_coordinator_lost;
  session_options.on_arrival = [interrupt = ctx->interrupt_, aborter = ctx->aborter_,
                                on_replica_left =
                                    options.on_replica_left](const v1::CoordinatorMessage& m) {
    if (m.has_abort()) {
      interrupt->Raise(m.abort().generation());
      // Does not block: the aborts run on the aborter's thread.
      aborter->AbortGeneration(m.abort().generation());
    }
    if (m.has_stop()) {
      interrupt->RaiseAll();
      if (m.stop().replica_left() && on_replica_left) on_replica_left();
    }
  };
  HETPAR_ASSIGN_OR_RETURN(ctx->session_,
                          RegisterUntil(ctx->connection_, session_options, register_by));
  // From here the coordinator holds a slot for this worker: what fails it is told on the session
  // (it names the worker's error, not "closed by the worker"), and a stop that came before the
  // run started closes the session as the stop asks.
  if (absl::Status s = ctx->Begin(options, std::move(ucx), role_name); !s.ok()) {
    if (coordinator::IsStoppedBeforeStart(s)) {
      HETPAR_LOG(INFO) << s.message();
      (void)ctx->Close(absl::Seconds(10));
    } else if (!ctx->session_->ended()) {
      if (absl::Status sent = ctx->session_->SendFailure(std::string(s.message()), IsEndsRun(s));
          sent.ok()) {
        (void)ctx->Close(absl::Seconds(10));
      } else {
        HETPAR_LOG(WARNING) << "cannot tell the coordinator why this worker fails: "
                            << StatusText(sent);
      }
    }
    return s;
  }
  return ctx;
}

absl::Status WorkerContext::Begin(const WorkerOptions& options,
                                  std::unique_ptr<transport::ucx::UcxTransport> ucx,
                                  const std::string& role_name) {
  WorkerContext* ctx = this;
  ctx->spec_ = ctx->session_->registration().spec();
  // Each kind of wait has its deadline: the RunSpec's failure section, unless --timeout
  // overrides both (300 s where the spec has none).
  const auto deadline = [&](double spec_s) {
    if (options.timeout > absl::ZeroDuration()) return options.timeout;
    return spec_s > 0 ? absl::Seconds(spec_s) : absl::Seconds(300);
  };
  ctx->peer_timeout_ = deadline(ctx->spec_.failure().peer_timeout_s());
  ctx->coordinator_timeout_ = deadline(ctx->spec_.failure().coordinator_timeout_s());
  // Before the first step, whose deadline the opening would otherwise count against (an index
  // built on a node with its own copy of the data set can take minutes).
  ctx->StartOpeningData();
  // Where this worker computes (run.device, run.dtype, the GPU of its local rank).
  int cuda_index = options.cuda_device;
  if (cuda_index < 0) {
    HETPAR_ASSIGN_OR_RETURN(cuda_index, nn::LocalCudaIndexFromEnvironment());
  }
  HETPAR_ASSIGN_OR_RETURN(ctx->execution_, nn::ExecutionContext::FromSpec(ctx->spec_, cuda_index));
  // UCX's progress thread drives its CUDA transports (copies, IPC, their event fds): it makes
  // this rank's GPU its current device, as this thread did, rather than GPU 0 (or none).
  HETPAR_RETURN_IF_ERROR(nn::SelectProgressThreadDevice(*ucx, ctx->execution_.device(),
                                                        absl::Now() + ctx->peer_timeout_));
  if (ctx->spec_.transport() == v1::TRANSPORT_KIND_NCCL) {
    transport::nccl::NcclTransport::Options nccl_options;
    nccl_options.cuda_device = ctx->execution_.device().index();
    nccl_options.init_timeout = ctx->peer_timeout_;
    HETPAR_ASSIGN_OR_RETURN(ctx->transport_,
                            transport::nccl::NcclTransport::Wrap(std::move(ucx), nccl_options));
    // Not a silent fall-back to host staging: the RunSpec asked for NCCL.
    if (!ctx->transport_->CanMove(transport::MemoryKind::kCuda)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "transport: nccl, but this worker cannot move CUDA memory by NCCL on ",
          ctx->execution_.device().str(), " (NCCL found no usable CUDA device); expected ucx"));
    }
  } else {
    ctx->transport_ = std::move(ucx);
  }

  // 2. Everyone is here: peers and the rendezvous store.
  // The coordinator starts the run once every rank has registered, or fails it (and says so
  // on this session) after coordinator.register_timeout_s: a worker that registered early
  // waits that long and its own coordinator timeout besides, not less.
  const double register_s = ctx->spec_.coordinator().register_timeout_s();
  const absl::Duration start_wait =
      ctx->coordinator_timeout_ + (register_s > 0 ? absl::Seconds(register_s) : absl::Seconds(120));
  HETPAR_ASSIGN_OR_RETURN(ctx->assignment_, ctx->session_->WaitForRunStart(start_wait));
  const int expected_ranks = options.role == Role::kColocated ? 2 : 1;
  if (ctx->assignment_.ranks_size() != expected_ranks) {
    return absl::FailedPreconditionError(
        absl::StrCat("the coordinator assigned ", ctx->assignment_.ranks_size(),
                     " module ranks to this ", role_name, " worker; expected ", expected_ranks));
  }
  std::string tag;
  for (v1::Module module : {v1::MODULE_ENCODER, v1::MODULE_LLM}) {
    if (const v1::RankCoordinates* c = ctx->Coordinates(module)) {
      absl::StrAppend(&tag, tag.empty() ? "" : " ", module == v1::MODULE_ENCODER ? "enc" : "llm",
                      " dp", c->dp(), " tp", c->tp());
      if (module == v1::MODULE_LLM && ctx->spec_.llm().layout().cp() > 1) {
        absl::StrAppend(&tag, " cp", c->cp());
      }
      if (module == v1::MODULE_LLM && ctx->spec_.llm().layout().pp() > 1) {
        absl::StrAppend(&tag, " pp", c->pp());
      }
    }
  }
  SetLogTag(absl::StrCat("r", ctx->world_rank(), " ", tag));
  HETPAR_LOG(INFO) << "registered as world rank " << ctx->world_rank() << ", generation "
                   << ctx->assignment_.generation() << ", " << ctx->assignment_.peers_size()
                   << " data-plane peers; computing on " << ctx->execution_.Describe();

  for (const v1::PeerInfo& peer : ctx->assignment_.peers()) {
    HETPAR_ASSIGN_OR_RETURN(
        transport::PeerId id,
        ctx->transport_->Connect(peer.data_address(), absl::Now() + ctx->peer_timeout_));
    ctx->peers_[peer.world_rank()] = id;
  }
  ctx->boundary_ = std::make_unique<train::BoundaryCommunicator>(ctx->transport_.get(), ctx->peers_,
                                                                 ctx->peer_timeout_);
  ctx->boundary_->SetInterrupt(ctx->interrupt_.get());
  ctx->boundary_->UseDevice(ctx->execution_.device());
  if (ctx->execution_.is_cuda()) {
    HETPAR_LOG(INFO) << "boundary messages "
                     << (ctx->boundary_->device_direct()
                             ? "in device memory, straight over the data plane"
                             : "through host memory (the data plane moves no CUDA memory here)");
  }
  return ctx->OpenStore(ctx->assignment_.generation());
}

absl::Status WorkerContext::OpenStore(int64_t generation) {
  auto key_value = std::make_shared<coordinator::KeyValueClient>(connection_, generation);
  HETPAR_ASSIGN_OR_RETURN(store_, rendezvous::OpenC10dStore(key_value, peer_timeout_));
  store_generation_ = generation;
  return absl::OkStatus();
}

std::vector<int64_t> WorkerContext::AssignedReplicas(v1::Module module) const {
  const auto& replicas =
      module == v1::MODULE_ENCODER ? assignment_.encoder_replicas() : assignment_.llm_replicas();
  return std::vector<int64_t>(replicas.begin(), replicas.end());
}

absl::Status WorkerContext::ConnectJoined(const v1::MembershipChange& change) {
  for (const v1::PeerInfo& peer : change.joined()) {
    absl::StatusOr<transport::PeerId> connected =
        transport_->Connect(peer.data_address(), absl::Now() + peer_timeout_);
    if (!connected.ok()) {
      return Annotate(connected.status(),
                      absl::StrCat("connecting to worker ", peer.worker_id(), " (world rank ",
                                   peer.world_rank(), "), which joined the run"));
    }
    const transport::PeerId id = *connected;
    // The lost worker's endpoint is left as it is: receives of an aborted attempt may still be
    // posted on it (the boundary withdraws them a step later).
    peers_[peer.world_rank()] = id;
    boundary_->SetPeer(peer.world_rank(), id);
    HETPAR_LOG(INFO) << "connected to " << peer.worker_id() << " on " << peer.host()
                     << ", world rank " << peer.world_rank() << ", which joined the run";
  }
  return absl::OkStatus();
}

const v1::RankCoordinates* WorkerContext::Coordinates(v1::Module module) const {
  for (const v1::RankCoordinates& coords : assignment_.ranks()) {
    if (coords.module() == module) return &coords;
  }
  return nullptr;
}

absl::StatusOr<std::unique_ptr<nn::Communicator>> WorkerContext::Group(const std::string& prefix,
                                                                       int64_t rank,
                                                                       int64_t size) const {
  if (size == 1) return nn::Communicator::CreateSingle();
  nn::CommunicatorOptions options;
  options.prefix = prefix;
  options.rank = static_cast<int>(rank);
  options.size = static_cast<int>(size);
  options.timeout = peer_timeout_;
  options.hostname = options_.host;
  options.interrupt = interrupt_.get();
  options.backend = execution_.collective_backend();
  HETPAR_ASSIGN_OR_RETURN(std::unique_ptr<nn::Communicator> group,
                          nn::Communicator::Create(store_, options));
  if (options.backend == nn::Backend::kNccl) {
    aborter_->Track(group->group()->c10d_backend(), store_generation_);
  }
  return group;
}

void WorkerContext::StartOpeningData(bool may_defer) {
  auto opening = std::make_shared<DataOpening>();
  data_opening_ = opening;
  data_opener_ = std::thread([opening, spec = spec_, may_defer] {
    // A synthetic data set not there yet is the coordinator's to generate, before it plans the
    // first step: two processes generating it where flock does not hold across nodes (NFS
    // without locks, Lustre without flock) would remove each other's images. Its opening waits
    // for the first step.
    if (may_defer && spec.data().synth().samples() > 0) {
      absl::StatusOr<bool> present = data::SyntheticDatasetPresent(spec);
      if (!present.ok() || !*present) {
        opening->deferred = true;
        opening->done.Notify();
        return;
      }
    }
    opening->result = data::BatchSource::Create(spec, &opening->cancel);
    opening->done.Notify();
  });
}

void WorkerContext::StopOpeningData() {
  if (data_opening_ != nullptr) data_opening_->cancel.store(true, std::memory_order_release);
  if (data_opener_.joinable()) data_opener_.join();
}

absl::StatusOr<const data::BatchSource*> WorkerContext::Data() {
  if (data_ != nullptr) return data_.get();
  if (data_opening_ == nullptr) StartOpeningData(/*may_defer=*/false);
  for (;;) {
    // On the opener's thread, not this one: an opening that waits on a lock another process
    // holds, or builds the index, ends this wait when the step is aborted or the session ends.
    if (!data_opening_->done.HasBeenNotified()) {
      HETPAR_LOG(INFO) << "waiting for the data set to open";
      while (!data_opening_->done.WaitForNotificationWithTimeout(kInterruptSlice)) {
        if (interrupt_->raised()) return InterruptedError();
        if (session_ != nullptr && session_->ended()) {
          return absl::UnavailableError(
              "the coordinator's session ended while the data set was opening");
        }
      }
    }
    data_opener_.join();
    if (!data_opening_->deferred) break;
    StartOpeningData(/*may_defer=*/false);
  }
  absl::StatusOr<std::unique_ptr<data::BatchSource>> result = std::move(data_opening_->result);
  data_opening_.reset();
  if (!result.ok()) return result.status();
  data_ = *std::move(result);
  return data_.get();
}

absl::Status WorkerContext::PutOutput(const std::string& name, const std::string& local_path) {
  return coordinator::PutOutputFile(*connection_, session_->worker_id(), name, local_path,
                                    coordinator_timeout_);
}

absl::Status WorkerContext::Close(absl::Duration timeout) { return session_->Close(timeout); }

}  // namespace hetpar::worker
