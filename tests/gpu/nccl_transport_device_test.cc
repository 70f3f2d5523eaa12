// The NCCL backend on real GPUs (label gpu): this process and a peer process (nccl_device_peer)
// move device buffers over NCCL send/recv. Every byte of messages of several sizes arrives and
// comes back, messages of one tag in order; a message larger than the device receive fails that
// receive with kOutOfRange while the send completes; a peer killed with SIGKILL fails the pending
// and later device operations with kUnavailable naming it.
//
// With two or more GPUs the processes use cuda:0 and cuda:1. With one GPU both use cuda:0 and each
// gets its own NCCL_HOSTID: NCCL refuses two ranks of one host on one GPU, so it is told they are
// two hosts and joins them over its own socket transport on loopback (NCCL_SOCKET_IFNAME=lo,
// NCCL_IB_DISABLE=1, NCCL_NET=Socket, NCCL_NET_PLUGIN=none unless the environment sets them).
// That path moves the bytes through host memory, so it checks hetpar's NCCL mover (set-up,
// send/recv, events, abort), not NCCL's fast transports. The case records which mode ran
// ("gpus"). Skips, saying why, without a CUDA device, in a build without NCCL, or with one GPU
// that another process cannot share (an exclusive compute mode). The protocol itself is checked on
// every machine by the conformance suite (flavor nccl_protocol).
#include <cuda_runtime_api.h>
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "bench/built_path.h"
#include "common/atomic_file.h"
#include "common/transport/nccl/loopback.h"
#include "common/transport/nccl/nccl_transport.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/gpu/nccl_device_script.h"
#include "tests/util/subprocess.h"

namespace hetpar::transport {
namespace {

using ::hetpar::testing::ChildProcess;
using ::testing::HasSubstr;

constexpr absl::Duration kWait = absl::Seconds(120);

// A device buffer freed on destruction.
struct DeviceBuffer {
  explicit DeviceBuffer(size_t n) : size(n) { EXPECT_EQ(cudaMalloc(&data, n), cudaSuccess); }
  ~DeviceBuffer() { cudaFree(data); }
  void* data = nullptr;
  size_t size = 0;
};

TEST(NcclTransportDeviceTest, TwoProcessesMoveDeviceBuffers) {
  if (!nccl::NcclTransport::BuiltWithNccl()) {
    GTEST_SKIP() << "this build has no NCCL (configured without libtorch's CUDA or NCCL)";
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices < 1) {
    GTEST_SKIP() << "no CUDA device (cudaGetDeviceCount: " << devices << ")";
  }
  const bool one_gpu = devices == 1;
  const int peer_device = one_gpu ? 0 : 1;
  std::vector<std::string> peer_flags = {"--device", std::to_string(peer_device)};
  if (one_gpu) {
    int mode = cudaComputeModeDefault;
    ASSERT_EQ(cudaDeviceGetAttribute(&mode, cudaDevAttrComputeMode, 0), cudaSuccess);
    if (mode != cudaComputeModeDefault) {
      GTEST_SKIP() << "one GPU in compute mode " << mode
                   << " (not default): a second process cannot share it";
    }
    // Two "hosts" on one GPU; set before this process's first NCCL call. The peer inherits all
    // but the host id. NCCL's own socket transport on loopback, whatever plugin or fabric is
    // installed; warnings in the peer's log.
    ASSERT_EQ(setenv("NCCL_HOSTID", "hetpar-nccl-test", 1), 0);
    for (const auto& [name, value] : transport::nccl::kLoopbackEnvironment) {
      ASSERT_EQ(setenv(name, value, /*overwrite=*/0), 0) << name;
    }
    ASSERT_EQ(setenv("NCCL_DEBUG", "WARN", /*overwrite=*/0), 0);
    peer_flags.insert(peer_flags.end(), {"--nccl-hostid", "hetpar-nccl-peer"});
  }
  ::testing::Test::RecordProperty(
      "gpus", one_gpu ? "one GPU, two NCCL hosts over sockets" : "cuda:0 and cuda:1");
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  char pattern[] = "/tmp/hetpar-nccl-XXXXXX";
  ASSERT_NE(mkdtemp(pattern), nullptr);
  const std::string dir = pattern;

  ucx::UcxTransport::Options ucx_options;
  ucx_options.name = "nccl-test";
  auto ucx = ucx::UcxTransport::Create(ucx_options);
  ASSERT_TRUE(ucx.ok()) << ucx.status();
  nccl::NcclTransport::Options options;
  options.cuda_device = 0;
  options.init_timeout = absl::Seconds(60);
  auto transport = nccl::NcclTransport::Wrap(std::move(ucx).value(), options);
  ASSERT_TRUE(transport.ok()) << transport.status();
  ASSERT_TRUE((*transport)->CanMove(MemoryKind::kCuda));
  ASSERT_TRUE(WriteFileAtomically(dir + "/test.addr", (*transport)->LocalAddress()).ok());
  std::vector<std::string> peer_argv = {
      hetpar::bench::BuiltPath("HETPAR_NCCL_DEVICE_PEER", HETPAR_NCCL_DEVICE_PEER), "--dir", dir};
  peer_argv.insert(peer_argv.end(), peer_flags.begin(), peer_flags.end());
  auto child = ChildProcess::Start(peer_argv, dir + "/peer.log");
  ASSERT_TRUE(child.ok()) << child.status();
  std::string peer_address;
  ASSERT_TRUE(testing::WaitForFile(dir + "/peer.addr", absl::Seconds(60), &peer_address))
      << testing::ReadTextFile(dir + "/peer.log");
  auto peer = (*transport)->Connect(peer_address, absl::Now() + kWait);
  ASSERT_TRUE(peer.ok()) << peer.status();
  EXPECT_EQ((*transport)->PeerName(*peer), "nccl-peer");

  // 1. Every byte goes out and comes back; replies of one tag in order.
  std::vector<std::unique_ptr<DeviceBuffer>> outs, ins;
  std::vector<std::vector<uint8_t>> expected;
  std::vector<std::unique_ptr<Operation>> recvs, sends;
  for (int k = 0; k < kEchoCount; ++k) {
    const size_t size = kEchoSizes[k];
    expected.emplace_back(size);
    for (size_t i = 0; i < size; ++i) expected[k][i] = EchoByte(k, i);
    outs.push_back(std::make_unique<DeviceBuffer>(size));
    ins.push_back(std::make_unique<DeviceBuffer>(size));
    ASSERT_EQ(cudaMemcpy(outs[k]->data, expected[k].data(), size, cudaMemcpyHostToDevice),
              cudaSuccess);
    ASSERT_EQ(cudaMemset(ins[k]->data, 0xEE, size), cudaSuccess);
    // NCCL's streams do not wait for the default stream: the fills land first.
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    auto recv = (*transport)
                    ->Recv(*peer, kEchoTags[k] + kEchoReply,
                           MutableBuffer{ins[k]->data, size, MemoryKind::kCuda, 0});
    ASSERT_TRUE(recv.ok()) << recv.status();
    recvs.push_back(std::move(recv).value());
  }
  for (int k = 0; k < kEchoCount; ++k) {
    auto send = (*transport)
                    ->Send(*peer, kEchoTags[k],
                           ConstBuffer{outs[k]->data, kEchoSizes[k], MemoryKind::kCuda, 0});
    ASSERT_TRUE(send.ok()) << send.status();
    sends.push_back(std::move(send).value());
  }
  absl::Status sent = WaitAll(sends, absl::Now() + kWait);
  ASSERT_TRUE(sent.ok()) << sent << "\n" << testing::ReadTextFile(dir + "/peer.log");
  for (int k = 0; k < kEchoCount; ++k) {
    absl::Status status = recvs[k]->Wait(absl::Now() + kWait);
    ASSERT_TRUE(status.ok()) << status;
    EXPECT_EQ(recvs[k]->bytes(), kEchoSizes[k]);
    std::vector<uint8_t> back(kEchoSizes[k]);
    ASSERT_EQ(cudaMemcpy(back.data(), ins[k]->data, back.size(), cudaMemcpyDeviceToHost),
              cudaSuccess);
    for (size_t i = 0; i < back.size(); ++i) {
      ASSERT_EQ(back[i], expected[k][i])
          << "message " << k << " (tag " << kEchoTags[k] << "): mismatch at byte " << i;
    }
  }

  // 2. Truncation: the peer's receive fails kOutOfRange; the send completes.
  DeviceBuffer big(kTruncMessage);
  uint8_t report = 0xFF;
  auto report_recv = (*transport)->Recv(*peer, kReportTag, MutableBuffer::Host(&report, 1));
  ASSERT_TRUE(report_recv.ok());
  auto trunc_send =
      (*transport)
          ->Send(*peer, kTruncTag, ConstBuffer{big.data, kTruncMessage, MemoryKind::kCuda, 0});
  ASSERT_TRUE(trunc_send.ok()) << trunc_send.status();
  EXPECT_TRUE((*trunc_send)->Wait(absl::Now() + kWait).ok());
  ASSERT_TRUE((*report_recv)->Wait(absl::Now() + kWait).ok());
  EXPECT_EQ(report, static_cast<uint8_t>(absl::StatusCode::kOutOfRange))
      << testing::ReadTextFile(dir + "/peer.log");
  EXPECT_THAT(testing::ReadTextFile(dir + "/peer.log"),
              HasSubstr(absl::StrCat("larger than the ", kTruncBuffer, "-byte receive buffer")));

  // 3. The peer is killed: a pending device receive and a later device send fail kUnavailable.
  DeviceBuffer never(64);
  auto pending =
      (*transport)->Recv(*peer, kIdleTag, MutableBuffer{never.data, 64, MemoryKind::kCuda, 0});
  ASSERT_TRUE(pending.ok());
  ASSERT_TRUE(child->Signal(SIGKILL));
  const absl::Time killed = absl::Now();
  absl::Status status = (*pending)->Wait(killed + absl::Seconds(30));
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("peer 'nccl-peer'"));
  auto later =
      (*transport)->Send(*peer, kIdleTag, ConstBuffer{never.data, 64, MemoryKind::kCuda, 0});
  absl::Status later_status = later.ok() ? (*later)->Wait(absl::Now() + kWait) : later.status();
  EXPECT_EQ(later_status.code(), absl::StatusCode::kUnavailable) << later_status;
  EXPECT_TRUE(child->Wait(30).ok());
  for (const char* file : {"peer.addr", "test.addr", "peer.log"}) {
    std::remove((dir + "/" + file).c_str());
  }
  rmdir(dir.c_str());
}

}  // namespace
}  // namespace hetpar::transport
