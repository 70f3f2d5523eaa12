// Membership of a run: which worker holds which rank of which module.
//
// The RunSpec's layouts define the ranks. Non-colocated runs have encoder_world encoder slots
// (role encoder) and llm_world LLM slots (role llm); colocated runs have one slot per rank for
// role colocated, each a rank of both modules. A registering worker takes the lowest free slot
// of its role (or the one it asks for). A dead worker frees its slot; its record stays for
// Status.
//
// Pure bookkeeping: no clock, no I/O, no locking (RunController owns one and locks around it).
#ifndef HETPAR_COORDINATOR_MEMBERSHIP_H_
#define HETPAR_COORDINATOR_MEMBERSHIP_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "hetpar/v1/coordinator.pb.h"
#include "hetpar/v1/run_spec.pb.h"

namespace hetpar::coordinator {

// A module's grid: dp x tp x cp x pp ranks, tp fastest, then cp, dp, pp.
struct GridShape {
  int64_t dp = 1;
  int64_t tp = 1;
  int64_t cp = 1;
  int64_t pp = 1;
  int64_t size() const { return dp * tp * cp * pp; }
  static GridShape FromLayout(const v1::Layout& layout);
};

// The coordinates of `rank` in `grid` (0 <= rank < grid.size()).
v1::RankCoordinates CoordinatesOf(v1::Module module, const GridShape& grid, int64_t rank);

// "encoder", "llm", "colocated" (and "encoder rank 3" style descriptions below).
const char* RoleName(v1::WorkerRole role);
const char* ModuleName(v1::Module module);
// "encoder rank 3 (dp 1, tp 1)"; cp/pp are shown for the LLM only.
std::string DescribeRank(const v1::RankCoordinates& rank);
// A data-plane address for logs and status: itself when it is printable text ("host:port"),
// else "<N-byte address>" (UCX worker addresses are binary); "-" when empty.
std::string DataAddressText(const std::string& address);

struct WorkerRecord {
  std::string worker_id;
  v1::WorkerRole role = v1::WORKER_ROLE_UNSPECIFIED;
  int64_t slot = -1;  // rank within the role's module(s)
  // Rank in the step plans' world: encoder ranks, then LLM ranks (non-colocated); the slot
  // (colocated).
  int64_t world_rank = -1;
  std::vector<v1::RankCoordinates> ranks;
  std::string host;
  std::string data_address;
  std::vector<std::string> capabilities;
  int64_t generation = 0;  // generation it registered in
  absl::Time registered_at;
  absl::Time last_heartbeat;  // registration counts as the first heartbeat
  bool alive = true;
  bool session_open = false;
  // Admitted into a vacant replica of a running run: it takes no part in steps until its replica
  // joins (Membership::Activate) at a step boundary.
  bool joining = false;
  std::string dead_reason;
  v1::Progress progress;
  // The newest attempt generation whose abort its step driver took (Progress.ended).
  int64_t ended_generation = 0;

  // "enc-3 (encoder rank 3 (dp 3, tp 0), host a)".
  std::string Describe() const;
};

class Membership {
 public:
  // `spec` is a normalised, valid RunSpec.
  static absl::StatusOr<Membership> Create(const v1::RunSpec& spec);

  // Admits a worker into a free slot of its role: a slot of a replica in the run first, else one
  // of an open replica (the worker is then `joining`). InvalidArgument for a role this
  // run has no slots for, or a requested rank out of range; FailedPrecondition for a requested
  // rank of a replica out of the run and not open; ResourceExhausted when every slot of the role
  // is taken (or the requested one is). The worker's id is "<enc|llm|col><rank>-<serial>",
  // unique in the run.
  absl::StatusOr<WorkerRecord*> Admit(const v1::RegisterRequest& request, int64_t generation,
                                      absl::Time now);

  // nullptr when unknown (dead workers are still found).
  WorkerRecord* Find(const std::string& worker_id);
  const WorkerRecord* Find(const std::string& worker_id) const;

  // Marks a worker dead and frees its slot. No-op for a dead or unknown worker.
  void MarkDead(const std::string& worker_id, const std::string& reason);

  // DP replica `dp` of `module` leaves the run (non-colocated runs): its ranks are no longer
  // expected, and no worker is admitted into them. Its live workers, if any, stay until marked
  // dead. No-op for a replica out of range or already retired.
  void RetireReplica(v1::Module module, int64_t dp);
  // The DP replicas of `module` still in the run, increasing (every replica until one retires).
  std::vector<int64_t> Replicas(v1::Module module) const;

  // DP replicas of `module` out of the run that admit workers (non-colocated runs). Opening a
  // replica in the run is a no-op; closing one frees nothing (its joining workers stay until
  // marked dead).
  void SetOpen(v1::Module module, int64_t dp, bool open);
  std::vector<int64_t> OpenReplicas(v1::Module module) const;
  // Every rank of open replica `dp` of `module` is held by a live joining worker with an open
  // session.
  bool ReadyToJoin(v1::Module module, int64_t dp) const;
  // Open replica `dp` of `module` joins the run: it is in Replicas again, closed, and its workers
  // are no longer joining. Returns them, in rank order.
  std::vector<WorkerRecord*> Activate(v1::Module module, int64_t dp);
  // Live workers registered into open replicas, waiting to join.
  int64_t joining_workers() const;
  // The DP replica of `worker` in `module` (its dp coordinate); -1 when it has no rank there.
  static int64_t ReplicaOf(const WorkerRecord& worker, v1::Module module);

  // Every slot of the run (those of retired replicas aside) holds a live worker.
  bool Complete() const;
  // Every slot of DP replica `dp` of `module` holds a live worker (non-colocated runs).
  bool ReplicaComplete(v1::Module module, int64_t dp) const;
  int64_t expected_workers() const { return expected_workers_; }
  int64_t alive_workers() const;
  // One line per empty slot (retired replicas aside), in role and rank order: "encoder rank 1 (dp
  // 1, tp 0)".
  std::vector<std::string> Missing() const;

  // What other workers need to know of `worker`.
  v1::PeerInfo PeerInfoOf(const WorkerRecord& worker) const;
  // The live workers `worker` exchanges boundary and pipeline tensors with (Assignment.peers).
  std::vector<const WorkerRecord*> PeersOf(const WorkerRecord& worker) const;

  // All records, live and dead, in admission order.
  const std::vector<std::unique_ptr<WorkerRecord>>& workers() const { return workers_; }
  // Live workers in role, then rank order.
  std::vector<WorkerRecord*> LiveWorkers() const;
  // Those of them in the run (joining workers, and those of encoder replicas that left the pool,
  // aside): the workers a step needs.
  std::vector<WorkerRecord*> TrainingWorkers() const;

  v1::Placement placement() const { return placement_; }
  const GridShape& encoder_grid() const { return encoder_grid_; }
  const GridShape& llm_grid() const { return llm_grid_; }
  // The roles this run has slots for, in order.
  std::vector<v1::WorkerRole> roles() const;

 private:
  Membership() = default;
  std::vector<v1::RankCoordinates> RanksOfSlot(v1::WorkerRole role, int64_t slot) const;
  // Whether `slot` of `role` belongs to a retired replica; to an open one.
  bool Retired(v1::WorkerRole role, int64_t slot) const;
  bool Open(v1::WorkerRole role, int64_t slot) const;

  v1::Placement placement_ = v1::PLACEMENT_NON_COLOCATED;
  GridShape encoder_grid_;
  GridShape llm_grid_;
  int64_t expected_workers_ = 0;
  // role -> slot -> the live worker holding it (nullptr when free).
  std::map<v1::WorkerRole, std::vector<WorkerRecord*>> slots_;
  std::vector<std::unique_ptr<WorkerRecord>> workers_;
  absl::flat_hash_map<std::string, WorkerRecord*> by_id_;
  int64_t next_serial_ = 0;
  // By dp (non-colocated runs).
  std::vector<bool> retired_encoder_replicas_;
  std::vector<bool> retired_llm_replicas_;
  std::vector<bool> open_encoder_replicas_;  // by dp; only retired ones are open
  std::vector<bool> open_llm_replicas_;
  // The slots of `module`'s replica `dp`, increasing (its role's slots of that dp coordinate).
  std::vector<int64_t> SlotsOfReplica(v1::Module module, int64_t dp) const;
};

}  // namespace hetpar::coordinator

#endif  // HETPAR_COORDINATOR_MEMBERSHIP_H_
