#include "common/worker/launch_options.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>

#include <cerrno>
#include <cstring>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace hetpar::worker {

absl::StatusOr<std::optional<int64_t>> RequestedRank(const RankRequest& r) {
  const bool any_replica = r.replica >= 0 || r.ranks_per_replica >= 0 || r.local_rank >= 0;
  if (r.rank >= 0 && any_replica) {
    return absl::InvalidArgumentError(
        "--rank and --replica/--ranks-per-replica/--local-rank both given; use one way to name "
        "the rank");
  }
  if (r.rank >= 0) return r.rank;
  if (!any_replica) return std::nullopt;
  if (r.replica < 0 || r.ranks_per_replica < 0 || r.local_rank < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--replica, --ranks-per-replica and --local-rank go together; got replica=", r.replica,
        " ranks-per-replica=", r.ranks_per_replica, " local-rank=", r.local_rank,
        " (-1: not given)"));
  }
  if (r.ranks_per_replica == 0 || r.local_rank >= r.ranks_per_replica) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--local-rank=", r.local_rank, " must be below --ranks-per-replica=", r.ranks_per_replica));
  }
  if (r.pipeline_stages <= 1) return r.replica * r.ranks_per_replica + r.local_rank;
  if (r.ranks_per_replica % r.pipeline_stages != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--ranks-per-replica=", r.ranks_per_replica,
                     " does not split into --pipeline-stages=", r.pipeline_stages));
  }
  if (r.replicas <= r.replica) {
    return absl::InvalidArgumentError(absl::StrCat("--pipeline-stages=", r.pipeline_stages,
                                                   " needs --replicas (the module's DP "
                                                   "replicas) above --replica=",
                                                   r.replica, "; got replicas=", r.replicas,
                                                   " (-1: not given)"));
  }
  const int64_t per_stage = r.ranks_per_replica / r.pipeline_stages;
  return (r.local_rank / per_stage) * r.replicas * per_stage + r.replica * per_stage +
         r.local_rank % per_stage;
}

absl::StatusOr<std::string> InterfaceAddress(const std::string& name) {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot list network interfaces: ", std::strerror(errno)));
  }
  std::string found;
  std::set<std::string> others;
  for (ifaddrs* a = list; a != nullptr; a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET) continue;
    if (name != a->ifa_name) {
      others.insert(a->ifa_name);
      continue;
    }
    char text[INET_ADDRSTRLEN] = {};
    const auto* in = reinterpret_cast<const sockaddr_in*>(a->ifa_addr);
    if (::inet_ntop(AF_INET, &in->sin_addr, text, sizeof(text)) != nullptr) {
      found = text;
      break;
    }
  }
  ::freeifaddrs(list);
  if (found.empty()) {
    return absl::NotFoundError(
        absl::StrCat("network interface '", name,
                     "' has no IPv4 address; interfaces with one: ", absl::StrJoin(others, ", ")));
  }
  return found;
}

}  // namespace hetpar::worker
