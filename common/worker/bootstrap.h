// A worker's start: everything between `main` and its first step, the same for every role.
//
//   1. Opens its data plane (UCX) and registers with the coordinator (role, host, data address).
//   2. Waits until every rank has registered (the assignment with peers), connects to its
//      peers (encoder ranks to the LLM's first-stage ranks and back, LLM ranks to their
//      neighbouring pipeline stages) and opens the
//      run's rendezvous store, through which the module runtimes form their TP and DP groups.
//
// The module runtimes then take what they need from the WorkerContext (coordinates, groups, the
// boundary communicator, the data set); the step driver takes the session. Owns all of it; one
// thread uses it.
#ifndef HETPAR_COMMON_WORKER_BOOTSTRAP_H_
#define HETPAR_COMMON_WORKER_BOOTSTRAP_H_

#include <c10/util/intrusive_ptr.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/control/client.h"
#include "common/data/batch_source.h"
#include "common/nn/collective_aborter.h"
#include "common/nn/communicator.h"
#include "common/nn/execution_context.h"
#include "common/step_interrupt.h"
#include "common/train/boundary.h"
#include "common/transport/transport.h"
#include "hetpar/v1/coordinator.pb.h"

namespace hetpar::transport::ucx {
class UcxTransport;
}  // namespace hetpar::transport::ucx

namespace hetpar::worker {

enum class Role { kEncoder, kLlm, kColocated };

std::string RoleName(Role role);

struct WorkerOptions {
  Role role = Role::kEncoder;
  std::string coordinator = "127.0.0.1:50051";
  std::string token;  // the run token
  coordinator::ClientTlsOptions tls;
  int64_t requested_rank = -1;  // -1: the coordinator picks
  std::string out_dir;          // run directory for the worker's files ("" = none)
  std::string host = "127.0.0.1";
  // Overrides the RunSpec's failure.peer_timeout_s and failure.coordinator_timeout_s (the bounds
  // of each wait for peers and for the coordinator); zero: the spec's.
  absl::Duration timeout = absl::ZeroDuration();
  // How long a worker started before its coordinator waits for it to answer.
  absl::Duration connect_timeout = absl::Seconds(300);
  int64_t trace_first = -1;  // the first traced step (trace::Recorder); -1: no trace
  // A file that exists while this worker trains with the run, from its first committed step
  // until its step driver returns, for a readiness probe ("" = none; --ready-file).
  std::string ready_file;
  // The GPU a run.device "cuda" run computes on; -1: HETPAR_CUDA_DEVICE, else LOCAL_RANK,
  // else 0 (nn::LocalCudaIndexFromEnvironment).
  int cuda_device = -1;
  // Called (on a gRPC thread) when the session loses the coordinator
  // (coordinator::WorkerSession::Options::on_lost); unset: the worker fails as the session
  // ends.
  std::function<void(const absl::Status&)> on_coordinator_lost;
  // Called (on the session's receiving thread) when a StopRun with replica_left arrives: the run
  // goes on without this worker's replica, before or after it started.
  std::function<void()> on_replica_left;
};

class WorkerContext {
 public:
  // Steps 1 and 2 above. Fails when the coordinator cannot be reached, refuses the registration,
  // or assigns this worker other module ranks than its role holds (one; two when colocated).
  static absl::StatusOr<std::unique_ptr<WorkerContext>> Bootstrap(const WorkerOptions& options);
  WorkerContext(const WorkerContext&) = delete;
  WorkerContext& operator=(const WorkerContext&) = delete;
  ~WorkerContext();

  const WorkerOptions& options() const { return options_; }
  const v1::RunSpec& spec() const { return spec_; }
  // Where this worker computes: run.device (cpu, or cuda:<cuda_device>), the precision policy of
  // run.dtype, and the collective backend of the groups from Group (Gloo or NCCL).
  const nn::ExecutionContext& execution() const { return execution_; }
  // The bound of each wait for peers (connections, the rendezvous, groups, boundary and pipeline
  // messages, collectives) and for the coordinator (its next message, an output written).
  absl::Duration peer_timeout() const { return peer_timeout_; }
  absl::Duration coordinator_timeout() const { return coordinator_timeout_; }
  const v1::Assignment& assignment() const { return assignment_; }
  // This worker joined a running run (Assignment.joining): its module's state comes from a live
  // replica before its first step, not from the RunSpec's initialisation or checkpoint.
  bool joining() const { return assignment_.joining(); }
  // The DP replicas of each module training in the assignment's generation (Assignment
  // .encoder_replicas, .llm_replicas): the module groups are first formed over them.
  std::vector<int64_t> AssignedReplicas(v1::Module module) const;
  // Workers joined the run (MembershipChange.joined): connects to each and makes it the peer of
  // its world rank (the boundary's too), in place of a lost worker that held it.
  absl::Status ConnectJoined(const v1::MembershipChange& change);
  int64_t world_rank() const { return assignment_.world_rank(); }
  // This worker's coordinates in `module`'s grid; nullptr when it holds no rank of it.
  const v1::RankCoordinates* Coordinates(v1::Module module) const;

  coordinator::WorkerSession& session() { return *session_; }
  train::BoundaryCommunicator& boundary() { return *boundary_; }
  // The data plane and the connected peers (Assignment.peers) by world rank: the pipeline
  // stages' link (train::StageLink) uses them beside the boundary.
  transport::Transport& transport() { return *transport_; }
  const std::map<int64_t, transport::PeerId>& peers() const { return peers_; }

  // Raised as the coordinator's abort of the step in flight (or its stop) arrives: every wait on
  // peers of this worker (the boundary, the pipeline link, the groups from Group) gives up then.
  // The step driver arms it at each step's start.
  StepInterrupt& interrupt() { return *interrupt_; }
  // The NCCL groups this worker formed, by generation (their aborts and their errors).
  nn::CollectiveAborter& aborter() { return *aborter_; }

  // The rendezvous store of `generation` (each generation has its own keyspace on the
  // coordinator): the groups formed after it meet there. Before a step of a new generation.
  absl::Status OpenStore(int64_t generation);
  // The generation whose store Group uses.
  int64_t store_generation() const { return store_generation_; }

  // The c10d group `prefix` in which this worker is `rank` of `size`, formed through the run's
  // rendezvous store (a group of one needs no store); waits at most peer_timeout(). An NCCL
  // group is aborted when the coordinator aborts a step of store_generation().
  absl::StatusOr<std::unique_ptr<nn::Communicator>> Group(const std::string& prefix, int64_t rank,
                                                          int64_t size) const;

  // The run's data set. Its opening (a synthetic data set generated, the index read or built:
  // data::BatchSource::Create) starts on a thread of its own as soon as the worker has the
  // RunSpec, beside the wait for the run's start and the coordinator's own opening; the first
  // call waits for it. (A synthetic data set that is not there yet is the coordinator's to
  // generate: it is opened at the first call, as the coordinator has planned a step by then.) An
  // abort of the step (or a stop) ends the wait with Aborted, not the opening; an opening that
  // failed is tried again at the next call.
  absl::StatusOr<const data::BatchSource*> Data();

  // Sends the local file `local_path` into the coordinator's run directory as output `name`
  // (coordinator::PutOutputFile); waits at most coordinator_timeout().
  absl::Status PutOutput(const std::string& name, const std::string& local_path);

  // Says goodbye to the coordinator (waits at most `timeout` for it to end the session).
  absl::Status Close(absl::Duration timeout);

 private:
  explicit WorkerContext(WorkerOptions options) : options_(std::move(options)) {}
  // Starts opening the data set on data_opener_ (Data). `may_defer`: a synthetic data set not
  // generated yet is left to the coordinator (the worker is starting); else it is opened (the
  // first step has come, so the coordinator has made it).
  void StartOpeningData(bool may_defer = true);
  // Cancels an opening in flight and waits for its thread.
  void StopOpeningData();
  // Bootstrap once the session is open: the device, the data plane over `ucx`, the run's start,
  // the peers and the store.
  absl::Status Begin(const WorkerOptions& options,
                     std::unique_ptr<transport::ucx::UcxTransport> ucx,
                     const std::string& role_name);

  WorkerOptions options_;
  // Destroyed in reverse order: the data set, the store and the boundary go before the session,
  // the connection and the transport they use.
  std::unique_ptr<transport::Transport> transport_;
  std::shared_ptr<coordinator::CoordinatorConnection> connection_;
  std::unique_ptr<coordinator::WorkerSession> session_;
  v1::RunSpec spec_;
  nn::ExecutionContext execution_ = nn::ExecutionContext::Cpu();
  absl::Duration peer_timeout_ = absl::Seconds(300);
  absl::Duration coordinator_timeout_ = absl::Seconds(300);
  v1::Assignment assignment_;
  std::map<int64_t, transport::PeerId> peers_;
  std::unique_ptr<train::BoundaryCommunicator> boundary_;
  c10::intrusive_ptr<c10d::Store> store_;
  int64_t store_generation_ = 0;
  std::shared_ptr<StepInterrupt> interrupt_ = std::make_shared<StepInterrupt>();
  // Aborts the NCCL groups of a generation whose step the coordinator aborted (on NCCL no wait
  // of this worker sees the interrupt once a collective is queued; see nn::CollectiveAborter).
  std::shared_ptr<nn::CollectiveAborter> aborter_ = std::make_shared<nn::CollectiveAborter>();
  std::unique_ptr<data::BatchSource> data_;
  // An opening of the data set in flight or done (shared with its thread).
  struct DataOpening {
    std::atomic<bool> cancel{false};
    absl::Notification done;
    // The synthetic data set was not there yet: Data opens it again, without deferring, the
    // coordinator having made it.
    bool deferred = false;
    absl::StatusOr<std::unique_ptr<data::BatchSource>> result;
  };
  std::shared_ptr<DataOpening> data_opening_;
  std::thread data_opener_;
};

}  // namespace hetpar::worker

#endif  // HETPAR_COMMON_WORKER_BOOTSTRAP_H_
