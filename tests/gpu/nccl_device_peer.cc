// The peer process of nccl_transport_device_test: an NCCL transport on its GPU that echoes
// device messages back to the test process, reports a truncation, and then idles until killed.
//
//   nccl_device_peer --dir DIR --device N [--nccl-hostid ID]
//
// --nccl-hostid sets NCCL_HOSTID before NCCL starts: on a machine with one GPU the test gives this
// process and itself different host ids, so that NCCL takes them for two hosts (and joins them
// over its socket transport) instead of refusing two ranks on one GPU.
//
// It writes its address to DIR/peer.addr (atomically, by rename), waits for DIR/test.addr and
// connects. Then, all in device memory on cuda:N:
//   1. receives kEchoCount messages (kEchoSizes[i] bytes, tags kEchoTags[i]) and sends each back
//      with tag + kEchoReply, in the order received;
//   2. receives on kTruncTag into a kTruncBuffer-byte buffer and reports the receive's status code
//      as one host byte on kReportTag;
//   3. posts a device receive on kIdleTag that never completes and waits to be killed.
// Exit 3 with "error: ..." on stdout when something fails.
#include <cuda_runtime_api.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "common/atomic_file.h"
#include "common/transport/nccl/nccl_transport.h"
#include "tests/gpu/nccl_device_script.h"
#include "tests/util/subprocess.h"

namespace hetpar::transport {
namespace {

int Fail(const std::string& what) {
  std::cout << "error: " << what << std::endl;
  return 3;
}

int Run(int argc, char** argv) {
  std::string dir;
  std::string nccl_hostid;
  int device = -1;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--dir") {
      dir = argv[i + 1];
    } else if (flag == "--device") {
      device = std::atoi(argv[i + 1]);
    } else if (flag == "--nccl-hostid") {
      nccl_hostid = argv[i + 1];
    } else {
      return Fail("unknown flag " + flag);
    }
  }
  if (dir.empty() || device < 0) return Fail("usage: --dir DIR --device N [--nccl-hostid ID]");
  if (!nccl_hostid.empty() && setenv("NCCL_HOSTID", nccl_hostid.c_str(), 1) != 0) {
    return Fail("setenv NCCL_HOSTID failed");
  }
  if (cudaSetDevice(device) != cudaSuccess) return Fail("cudaSetDevice failed");
  ucx::UcxTransport::Options ucx_options;
  ucx_options.name = "nccl-peer";
  auto ucx = ucx::UcxTransport::Create(ucx_options);
  if (!ucx.ok()) return Fail(std::string(ucx.status().message()));
  nccl::NcclTransport::Options options;
  options.cuda_device = device;
  auto transport = nccl::NcclTransport::Wrap(std::move(ucx).value(), options);
  if (!transport.ok()) return Fail(std::string(transport.status().message()));
  if (!WriteFileAtomically(dir + "/peer.addr", (*transport)->LocalAddress()).ok()) {
    return Fail("cannot write " + dir + "/peer.addr");
  }
  std::string test_address;
  if (!testing::WaitForFile(dir + "/test.addr", absl::Seconds(60), &test_address)) {
    return Fail("no " + dir + "/test.addr within 60 s");
  }
  auto peer = (*transport)->Connect(test_address, absl::Now() + absl::Seconds(60));
  if (!peer.ok()) return Fail(std::string(peer.status().message()));
  const absl::Duration wait = absl::Seconds(120);

  // 1. Echo.
  std::vector<void*> buffers(kEchoCount, nullptr);
  std::vector<std::unique_ptr<Operation>> recvs;
  for (int i = 0; i < kEchoCount; ++i) {
    if (cudaMalloc(&buffers[i], kEchoSizes[i]) != cudaSuccess) return Fail("cudaMalloc failed");
    auto recv = (*transport)
                    ->Recv(*peer, kEchoTags[i],
                           MutableBuffer{buffers[i], kEchoSizes[i], MemoryKind::kCuda, device});
    if (!recv.ok()) return Fail(std::string(recv.status().message()));
    recvs.push_back(std::move(recv).value());
  }
  std::vector<std::unique_ptr<Operation>> sends;
  for (int i = 0; i < kEchoCount; ++i) {
    absl::Status status = recvs[i]->Wait(absl::Now() + wait);
    if (!status.ok()) return Fail(std::string(status.message()));
    auto send = (*transport)
                    ->Send(*peer, kEchoTags[i] + kEchoReply,
                           ConstBuffer{buffers[i], recvs[i]->bytes(), MemoryKind::kCuda, device});
    if (!send.ok()) return Fail(std::string(send.status().message()));
    sends.push_back(std::move(send).value());
  }
  if (absl::Status s = WaitAll(sends, absl::Now() + wait); !s.ok()) {
    return Fail(std::string(s.message()));
  }

  // 2. Truncation, reported in host memory (UCX).
  void* small = nullptr;
  if (cudaMalloc(&small, kTruncBuffer) != cudaSuccess) return Fail("cudaMalloc failed");
  auto trunc =
      (*transport)
          ->Recv(*peer, kTruncTag, MutableBuffer{small, kTruncBuffer, MemoryKind::kCuda, device});
  if (!trunc.ok()) return Fail(std::string(trunc.status().message()));
  const absl::Status trunc_status = (*trunc)->Wait(absl::Now() + wait);
  std::cout << "truncated receive: " << trunc_status << std::endl;
  const uint8_t code = static_cast<uint8_t>(trunc_status.code());
  auto report = (*transport)->Send(*peer, kReportTag, ConstBuffer::Host(&code, 1));
  if (!report.ok()) return Fail(std::string(report.status().message()));
  if (absl::Status s = (*report)->Wait(absl::Now() + wait); !s.ok()) {
    return Fail(std::string(s.message()));
  }

  // 3. Idle with a device receive pending until the test kills this process.
  auto idle =
      (*transport)
          ->Recv(*peer, kIdleTag, MutableBuffer{small, kTruncBuffer, MemoryKind::kCuda, device});
  if (!idle.ok()) return Fail(std::string(idle.status().message()));
  absl::Status idle_status = (*idle)->Wait(absl::Now() + absl::Seconds(300));
  return Fail("the idle receive ended: " + std::string(idle_status.message()));
}

}  // namespace
}  // namespace hetpar::transport

int main(int argc, char** argv) { return hetpar::transport::Run(argc, argv); }
