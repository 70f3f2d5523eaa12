// The coordinator's gRPC server: the Coordinator (Register, Session), KeyValue and Admin
// services over one RunController and one KeyValueStore, on the gRPC callback API.
//
// Threads: gRPC's callback threads run the handlers; one watchdog thread ticks the controller
// (heartbeat, registration, step and stop deadlines) and expires key-value waits every `tick`.
// The handlers are thin: check the run token, translate, call the controller under the server's
// lock, and queue the controller's messages on the sessions' write queues (still under the lock,
// so every worker receives its messages in the controller's order).
//
// Lock order: the server's lock, then a session's write-queue lock. The key-value store has its
// own lock and is never called with the server's lock held.
#ifndef HETPAR_COORDINATOR_SERVER_H_
#define HETPAR_COORDINATOR_SERVER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/control/security.h"
#include "coordinator/run_controller.h"
#include "coordinator/step_orchestrator.h"
#include "hetpar/v1/coordinator.pb.h"
#include "hetpar/v1/run_spec.pb.h"

namespace hetpar::coordinator {
namespace internal {
class ServerCore;
}  // namespace internal

struct ServerOptions {
  // host:port to listen on; port 0 picks a free port (see CoordinatorServer::address()).
  std::string listen_address = "127.0.0.1:50051";
  std::string token;  // the run token every RPC must carry (required)
  ServerTlsOptions tls;
  ControllerOptions controller;
  absl::Duration tick = absl::Milliseconds(100);
};

class CoordinatorServer {
 public:
  // Binds and starts serving. `planner` may be null (no steps are run).
  static absl::StatusOr<std::unique_ptr<CoordinatorServer>> Create(
      const v1::RunSpec& spec, ServerOptions options,
      std::unique_ptr<StepPlanner> planner = nullptr);
  CoordinatorServer(const CoordinatorServer&) = delete;
  CoordinatorServer& operator=(const CoordinatorServer&) = delete;
  ~CoordinatorServer();  // Shutdown(1 s)

  // The bound address, with the port actually chosen ("127.0.0.1:41873").
  const std::string& address() const;
  int port() const;

  v1::RunState state() const;
  v1::StatusResponse Status() const;
  // With options.controller.keep_committed_steps: the timings of the steps committed since the
  // last call, oldest first (ControllerOptions).
  std::vector<v1::StepTiming> TakeCommittedSteps();
  v1::StopResponse Stop(const std::string& reason, bool checkpoint = false);
  // The workers whose sessions the stop's deadline ended (RunController::cut_at_stop).
  std::vector<std::string> CutAtStop() const;
  // Key-value Wait and Get calls waiting for their keys now (lets a test see a reader block).
  int64_t pending_key_value_waits() const;
  // Waits up to `timeout` for the run to be done or failed; returns the state then.
  v1::RunState WaitForEnd(absl::Duration timeout) const;
  // Ends every session, stops accepting calls and cancels those still running after `grace`.
  void Shutdown(absl::Duration grace);

 private:
  explicit CoordinatorServer(std::unique_ptr<internal::ServerCore> impl);
  std::unique_ptr<internal::ServerCore> impl_;
};

}  // namespace hetpar::coordinator

#endif  // HETPAR_COORDINATOR_SERVER_H_
