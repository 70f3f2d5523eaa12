// What a launcher (hetpar run, a Kubernetes pod, a Slurm step) tells a worker about its place,
// apart from the coordinator: which module rank to ask for and which address to advertise.
//
//   HETPAR_ASSIGN_OR_RETURN(std::optional<int64_t> rank, worker::RequestedRank(ranks));
//   HETPAR_ASSIGN_OR_RETURN(std::string host, worker::InterfaceAddress("eth0"));
//
// Torch-free; used by every worker binary's main and tested on its own.
#ifndef HETPAR_COMMON_WORKER_LAUNCH_OPTIONS_H_
#define HETPAR_COMMON_WORKER_LAUNCH_OPTIONS_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/statusor.h"

namespace hetpar::worker {

// A module rank, given directly (--rank) or as a replica's (pod's, node's) index and the rank
// inside it: rank = replica * ranks_per_replica + local_rank. A Kubernetes pod hosts one DP
// replica's ranks, one container each; it knows its index but cannot do arithmetic. -1 means
// not given.
//
// With pipeline stages (pipeline_stages S > 1; `replicas` N, the module's DP size, then given
// too) the module's ranks run stage by stage (the LLM's rank order has pp outermost), so a
// replica's R ranks are P = R / S ranks in each stage: local rank l is rank l % P of stage l / P,
// and rank = (l / P) * N * P + replica * P + l % P.
struct RankRequest {
  int64_t rank = -1;
  int64_t replica = -1;
  int64_t ranks_per_replica = -1;
  int64_t local_rank = -1;
  int64_t replicas = -1;
  int64_t pipeline_stages = 1;
};

// The rank to request, or nullopt (the coordinator picks the lowest free one). InvalidArgument
// naming the flags when they are mixed, half given or out of range.
absl::StatusOr<std::optional<int64_t>> RequestedRank(const RankRequest& request);

// The first IPv4 address of the network interface `name` (e.g. "eth0", "ib0", "lo"). NotFound
// listing the interfaces that have one when `name` has none.
absl::StatusOr<std::string> InterfaceAddress(const std::string& name);

}  // namespace hetpar::worker

#endif  // HETPAR_COMMON_WORKER_LAUNCH_OPTIONS_H_
