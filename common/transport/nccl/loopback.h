// NCCL's own socket transport on loopback, whatever network plugin or fabric is installed: how
// processes that NCCL takes for hosts of their own (each with its own NCCL_HOSTID) reach each
// other on one machine, so that ranks of one communicator may share a GPU. Header only: `hetpar
// run --nccl-host-per-worker` sets these in its workers' environment and the one-GPU NCCL test in
// its own, each only where the environment does not set it already.
#ifndef HETPAR_COMMON_TRANSPORT_NCCL_LOOPBACK_H_
#define HETPAR_COMMON_TRANSPORT_NCCL_LOOPBACK_H_

#include <utility>

namespace hetpar::transport::nccl {

inline constexpr std::pair<const char*, const char*> kLoopbackEnvironment[] = {
    {"NCCL_SOCKET_IFNAME", "lo"},
    {"NCCL_IB_DISABLE", "1"},
    {"NCCL_NET", "Socket"},
    {"NCCL_NET_PLUGIN", "none"},
};

}  // namespace hetpar::transport::nccl

#endif  // HETPAR_COMMON_TRANSPORT_NCCL_LOOPBACK_H_
