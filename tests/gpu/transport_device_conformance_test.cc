// The data-plane conformance suite on a GPU (label gpu): the CPU suite's checks
// (common/transport/conformance_test.cc) with buffers in CUDA memory, parameterised over backends
// x message sizes (0 B, 1 B, 4097 B, 1 MiB + 3, 32 MiB). Ranks are transports of this process.
//
//   - ucx: two UCX transports (three for the 4097 B case), every buffer on cuda:0; UCX moves them
//     with its CUDA transports (cuda_copy, cuda_ipc). Skips, saying so, when the UCX transport's
//     CanMove(kCuda) is false (a UCX without CUDA, or its CUDA module did not load).
//   - nccl: two NcclTransports, rank i on cuda:i (options.cuda_device). NCCL refuses two ranks
//     on one GPU, so these cases need 2 visible devices and a build with NCCL, and skip
//     otherwise. Two ranks of one process on two devices work because each transport initialises
//     its communicators non-blocking on its own progress thread. Only 0 B and 1 MiB + 3: every
//     case sets up fresh communicators. nccl_transport_device_test covers the two-process case
//     (on one GPU too, as two NCCL hosts) and a peer killed with SIGKILL.
//
// What is checked: every byte of all-to-all messages (patterns filled on the host per (sender,
// message), copied to the device, received into device buffers, copied back and compared byte for
// byte); per-(peer, tag) order with receives posted before and after the sends; a host send into a
// device receive and a device send into a host receive (UCX); truncation into a smaller device
// buffer (kOutOfRange naming the buffer size); cancel of an unmatched device receive (kCancelled,
// buffer untouched); a destroyed peer failing pending device operations with kUnavailable naming
// it within 5 s; and what each backend does with a `device` ordinal beyond the visible devices and
// with CUDA buffers on a transport whose CanMove(kCuda) is false.
//
// Known limits, asserted as they are:
//   - UCX, host send into a device receive: a host message of at least zero_copy_threshold
//     (32 KiB) to a same-host peer that offers zero copy goes as a zero-copy descriptor, which a
//     device receive never matches (it matches data messages only). Those sizes are checked with
//     a receiver that turns same-host zero copy off (UcxTransport::Options::same_host_zero_copy);
//     smaller ones with the default options.
//   - The NCCL backend moves host memory over UCX and device memory over its own protocol
//     (nccl_transport.h), so a host send never meets a device receive: the mixed-kind case skips.
//   - UCX does not look at ConstBuffer/MutableBuffer::device: UCX finds the GPU from the pointer,
//     so a wrong ordinal is accepted and the bytes move. The NCCL backend refuses any ordinal
//     other than options.cuda_device with kInvalidArgument.
//
// Every test skips in SetUp, saying why, when torch::cuda::is_available() is false.
#include <ATen/ATen.h>
#include <torch/cuda.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/nn/ucx_progress_device.h"
#include "common/transport/factory.h"
#include "common/transport/nccl/nccl_transport.h"
#include "common/transport/transport.h"
#include "common/transport/ucx/ucx_transport.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/gpu/require_cuda_ucx.h"

namespace hetpar::transport {
namespace {

using ::testing::HasSubstr;

constexpr absl::Duration kWait = absl::Seconds(20);
constexpr absl::Duration kPeerDeathBound = absl::Seconds(5);
constexpr size_t kMiB = size_t{1} << 20;

enum class Flavor { kUcx, kNccl };

std::string FlavorName(Flavor flavor) { return flavor == Flavor::kUcx ? "ucx" : "nccl"; }

struct Param {
  Flavor flavor;
  size_t size;  // message size in bytes
  int ranks;    // transports in this process
};

void PrintTo(const Param& param, std::ostream* os) {
  *os << FlavorName(param.flavor) << ", " << param.size << " B, " << param.ranks << " ranks";
}

std::string ParamName(const ::testing::TestParamInfo<Param>& info) {
  return absl::StrCat(FlavorName(info.param.flavor), "_", info.param.size, "B_", info.param.ranks,
                      "ranks");
}

// Why this process cannot run the suite, or "" when a CUDA device is visible.
std::string NoCudaReason() {
  if (torch::cuda::is_available()) return "";
  std::string reason = absl::StrCat(
      "no CUDA device: torch::cuda::is_available() is false, "
      "torch::cuda::device_count() = ",
      torch::cuda::device_count());
  if (const char* visible = std::getenv("CUDA_VISIBLE_DEVICES"); visible != nullptr) {
    absl::StrAppend(&reason, ", CUDA_VISIBLE_DEVICES='", visible, "'");
  }
  return reason;
}

// On a GPU its progress thread works on cuda:`device`, as a worker's does.
absl::StatusOr<std::unique_ptr<ucx::UcxTransport>> CreateUcx(const std::string& name,
                                                             bool same_host_zero_copy = true,
                                                             int device = 0) {
  ucx::UcxTransport::Options options;
  options.name = name;
  options.same_host_zero_copy = same_host_zero_copy;
  absl::StatusOr<std::unique_ptr<ucx::UcxTransport>> ucx = ucx::UcxTransport::Create(options);
  if (ucx.ok() && torch::cuda::is_available()) {
    if (absl::Status s = hetpar::nn::SelectProgressThreadDevice(
            **ucx, c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(device)),
            absl::Now() + absl::Seconds(30));
        !s.ok()) {
      return s;
    }
  }
  return ucx;
}

// A transport of `flavor` whose device buffers live on `device`.
absl::StatusOr<std::unique_ptr<Transport>> Create(Flavor flavor, const std::string& name,
                                                  int device) {
  auto ucx = CreateUcx(name, /*same_host_zero_copy=*/true, device);
  if (!ucx.ok()) return ucx.status();
  if (flavor == Flavor::kUcx) return std::unique_ptr<Transport>(std::move(ucx).value());
  nccl::NcclTransport::Options options;
  options.cuda_device = device;
  options.init_timeout = absl::Seconds(30);
  auto wrapped = nccl::NcclTransport::Wrap(std::move(ucx).value(), options);
  if (!wrapped.ok()) return wrapped.status();
  return std::unique_ptr<Transport>(std::move(wrapped).value());
}

// Deterministic bytes of message `seed`, different for every (seed, offset).
std::vector<uint8_t> Message(uint64_t seed, size_t size) {
  std::vector<uint8_t> bytes(size);
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  size_t i = 0;
  for (; i + 8 <= size; i += 8) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    std::memcpy(bytes.data() + i, &x, 8);
  }
  for (; i < size; ++i) bytes[i] = static_cast<uint8_t>((x >> (8 * (i % 8))) ^ i ^ seed);
  return bytes;
}

uint64_t Seed(int src, int dst, uint64_t tag, int seq) {
  return (uint64_t(src) << 48) ^ (uint64_t(dst) << 40) ^ (tag << 16) ^ uint64_t(seq);
}

// `bytes` in a kByte tensor on cuda:`device`, filled on the host and copied over (a synchronous
// copy: the bytes are on the device when this returns).
at::Tensor OnDevice(const std::vector<uint8_t>& bytes, int device) {
  at::Tensor host = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  if (!bytes.empty()) std::memcpy(host.data_ptr(), bytes.data(), bytes.size());
  at::Tensor on_device = host.to(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device)));
  torch::cuda::synchronize(device);
  return on_device;
}

at::Tensor Filled(size_t size, uint8_t value, int device) {
  return OnDevice(std::vector<uint8_t>(size, value), device);
}

// The tensor's bytes, copied back to the host.
std::vector<uint8_t> ToHost(const at::Tensor& tensor) {
  at::Tensor host = tensor.cpu().contiguous();
  std::vector<uint8_t> bytes(static_cast<size_t>(host.numel()));
  if (!bytes.empty()) std::memcpy(bytes.data(), host.data_ptr(), bytes.size());
  return bytes;
}

ConstBuffer DeviceSource(const at::Tensor& tensor) {
  return {tensor.data_ptr(), static_cast<size_t>(tensor.numel()), MemoryKind::kCuda,
          static_cast<int>(tensor.get_device())};
}

MutableBuffer DeviceTarget(const at::Tensor& tensor) {
  return {tensor.data_ptr(), static_cast<size_t>(tensor.numel()), MemoryKind::kCuda,
          static_cast<int>(tensor.get_device())};
}

// Compares every byte; names the first mismatch.
::testing::AssertionResult SameBytes(const std::vector<uint8_t>& expected,
                                     const std::vector<uint8_t>& actual, const std::string& what) {
  if (expected.size() != actual.size()) {
    return ::testing::AssertionFailure()
           << what << ": size " << actual.size() << ", expected " << expected.size();
  }
  for (size_t i = 0; i < expected.size(); ++i) {
    if (expected[i] != actual[i]) {
      return ::testing::AssertionFailure() << what << ": mismatch at byte " << i << ": got "
                                           << int{actual[i]} << ", expected " << int{expected[i]};
    }
  }
  return ::testing::AssertionSuccess();
}

absl::Time Deadline() { return absl::Now() + kWait; }

class DeviceConformanceTest : public ::testing::TestWithParam<Param> {
 protected:
  void SetUp() override {
    if (std::string why = NoCudaReason(); !why.empty()) GTEST_SKIP() << why;
    const Param& p = GetParam();
    if (p.flavor == Flavor::kNccl) {
      if (!nccl::NcclTransport::BuiltWithNccl()) {
        GTEST_SKIP() << "this build has no NCCL (configured without libtorch's CUDA or NCCL)";
      }
      if (static_cast<int>(torch::cuda::device_count()) < p.ranks) {
        GTEST_SKIP() << "the NCCL backend needs one CUDA device per rank (NCCL refuses two ranks "
                     << "on one GPU): " << p.ranks << " ranks, " << torch::cuda::device_count()
                     << " visible devices";
      }
    }
    for (int i = 0; i < p.ranks; ++i) {
      auto transport = Create(p.flavor, absl::StrCat("rank", i), device(i));
      ASSERT_TRUE(transport.ok()) << transport.status();
      if (!(*transport)->CanMove(MemoryKind::kCuda)) {
        if (p.flavor == Flavor::kUcx) {
          const char* why =
              "this UCX has no CUDA support: UcxTransport::CanMove(kCuda) is false (a UCX built "
              "without CUDA, or its CUDA transport module did not load)";
          if (hetpar::testing::CudaUcxRequired()) FAIL() << why << " on a machine with a GPU";
          GTEST_SKIP() << why;
        }
        GTEST_SKIP() << "this NCCL transport cannot move CUDA memory on cuda:" << device(i);
      }
      ranks_.push_back(std::move(transport).value());
    }
    peer_.assign(p.ranks, std::vector<PeerId>(p.ranks, 0));
    const absl::Time deadline = Deadline();
    for (int i = 0; i < p.ranks; ++i) {
      for (int j = 0; j < p.ranks; ++j) {
        if (i == j) continue;
        auto peer = ranks_[i]->Connect(ranks_[j]->LocalAddress(), deadline);
        ASSERT_TRUE(peer.ok()) << peer.status();
        peer_[i][j] = *peer;
      }
    }
  }

  // The GPU of rank `i`: cuda:0 for every UCX rank, cuda:i for NCCL ranks.
  int device(int i) const { return GetParam().flavor == Flavor::kNccl ? i : 0; }

  // One device message i -> j with every byte checked on arrival.
  void ExpectDeviceRoundTrip(int i, int j, Tag tag, size_t size, uint64_t seed) {
    const std::vector<uint8_t> expected = Message(seed, size);
    at::Tensor out = OnDevice(expected, device(i));
    at::Tensor in = Filled(size, 0xEE, device(j));
    auto recv = ranks_[j]->Recv(peer_[j][i], tag, DeviceTarget(in));
    ASSERT_TRUE(recv.ok()) << recv.status();
    auto send = ranks_[i]->Send(peer_[i][j], tag, DeviceSource(out));
    ASSERT_TRUE(send.ok()) << send.status();
    absl::Status received = (*recv)->Wait(Deadline());
    ASSERT_TRUE(received.ok()) << received;
    absl::Status sent = (*send)->Wait(Deadline());
    ASSERT_TRUE(sent.ok()) << sent;
    EXPECT_EQ((*recv)->bytes(), size);
    EXPECT_TRUE(
        SameBytes(expected, ToHost(in), absl::StrCat("rank", i, "->rank", j, " tag ", tag)));
  }

  std::vector<std::unique_ptr<Transport>> ranks_;
  std::vector<std::vector<PeerId>> peer_;  // peer_[i][j]: rank j as seen from rank i
};

// Every rank sends messages to every other rank, all receives posted before the sends; every byte
// of every message is copied back and checked.
TEST_P(DeviceConformanceTest, AllToAllEveryByteArrives) {
  const Param& p = GetParam();
  const size_t size = p.size;
  const int count = size >= 16 * kMiB ? 1 : size >= kMiB ? 2 : 3;
  struct Expected {
    std::string name;
    std::vector<uint8_t> bytes;
    at::Tensor in;
  };
  std::vector<Expected> expected;
  std::vector<at::Tensor> outs;
  std::vector<std::unique_ptr<Operation>> recvs, sends;
  for (int dst = 0; dst < p.ranks; ++dst) {
    for (int src = 0; src < p.ranks; ++src) {
      if (src == dst) continue;
      for (int seq = 0; seq < count; ++seq) {
        const Tag tag = 100 + seq;
        expected.push_back({absl::StrCat("rank", src, "->rank", dst, " tag ", tag),
                            Message(Seed(src, dst, tag, seq), size),
                            Filled(size, 0xEE, device(dst))});
        auto recv = ranks_[dst]->Recv(peer_[dst][src], tag, DeviceTarget(expected.back().in));
        ASSERT_TRUE(recv.ok()) << recv.status();
        recvs.push_back(std::move(recv).value());
      }
    }
  }
  for (int src = 0; src < p.ranks; ++src) {
    for (int dst = 0; dst < p.ranks; ++dst) {
      if (src == dst) continue;
      for (int seq = 0; seq < count; ++seq) {
        const Tag tag = 100 + seq;
        outs.push_back(OnDevice(Message(Seed(src, dst, tag, seq), size), device(src)));
        auto send = ranks_[src]->Send(peer_[src][dst], tag, DeviceSource(outs.back()));
        ASSERT_TRUE(send.ok()) << send.status();
        sends.push_back(std::move(send).value());
      }
    }
  }
  const absl::Time deadline = Deadline();
  for (size_t k = 0; k < recvs.size(); ++k) {
    absl::Status status = recvs[k]->Wait(deadline);
    ASSERT_TRUE(status.ok()) << expected[k].name << ": " << status;
    EXPECT_EQ(recvs[k]->bytes(), size) << expected[k].name;
    EXPECT_TRUE(SameBytes(expected[k].bytes, ToHost(expected[k].in), expected[k].name));
  }
  for (auto& send : sends) {
    absl::Status status = send->Wait(deadline);
    EXPECT_TRUE(status.ok()) << status;
    EXPECT_EQ(send->bytes(), size);
  }
}

// Messages of one sender with one tag arrive in send order, interleaved with another tag, with
// half the receives posted before the sends and half after.
TEST_P(DeviceConformanceTest, MessagesOfOneTagStayInOrder) {
  const Param& p = GetParam();
  const size_t size = std::max<size_t>(p.size, 8);  // room for distinct contents
  const int per_tag = size >= 16 * kMiB ? 2 : 4;
  const int src = 1, dst = 0;
  const Tag tags[2] = {7, 9};
  std::vector<std::vector<uint8_t>> expected;
  std::vector<at::Tensor> outs, ins;
  for (int k = 0; k < 2 * per_tag; ++k) ins.push_back(Filled(size, 0, device(dst)));
  std::vector<std::unique_ptr<Operation>> recvs(2 * per_tag), sends;
  auto post_recv = [&](int k) {
    auto recv = ranks_[dst]->Recv(peer_[dst][src], tags[k % 2], DeviceTarget(ins[k]));
    ASSERT_TRUE(recv.ok()) << recv.status();
    recvs[k] = std::move(recv).value();
  };
  for (int k = 0; k < per_tag; ++k) post_recv(k);
  for (int k = 0; k < 2 * per_tag; ++k) {
    const Tag tag = tags[k % 2];
    expected.push_back(Message(Seed(src, dst, tag, k / 2), size));
    outs.push_back(OnDevice(expected.back(), device(src)));
    auto send = ranks_[src]->Send(peer_[src][dst], tag, DeviceSource(outs.back()));
    ASSERT_TRUE(send.ok()) << send.status();
    sends.push_back(std::move(send).value());
  }
  for (int k = per_tag; k < 2 * per_tag; ++k) post_recv(k);
  absl::Status received = WaitAll(recvs, Deadline());
  ASSERT_TRUE(received.ok()) << received;
  absl::Status sent = WaitAll(sends, Deadline());
  ASSERT_TRUE(sent.ok()) << sent;
  for (int k = 0; k < 2 * per_tag; ++k) {
    // Receive k is the (k / 2)-th receive of tag k % 2: it holds that tag's (k / 2)-th message.
    EXPECT_TRUE(SameBytes(expected[k], ToHost(ins[k]),
                          absl::StrCat("tag ", tags[k % 2], " message ", k / 2)));
  }
}

// A device send into a host receive and a host send into a device receive move the same bytes.
TEST_P(DeviceConformanceTest, HostAndDeviceBuffersMeet) {
  const Param& p = GetParam();
  if (p.flavor == Flavor::kNccl) {
    GTEST_SKIP() << "the NCCL backend moves host memory over UCX and device memory over its own "
                 << "protocol (nccl_transport.h): a host send never meets a device receive";
  }
  const size_t size = p.size;
  // Device -> host.
  {
    const std::vector<uint8_t> expected = Message(Seed(0, 1, 30, 0), size);
    at::Tensor out = OnDevice(expected, device(0));
    std::vector<uint8_t> in(size, 0xEE);
    auto recv = ranks_[1]->Recv(peer_[1][0], 30, MutableBuffer::Host(in.data(), in.size()));
    ASSERT_TRUE(recv.ok()) << recv.status();
    auto send = ranks_[0]->Send(peer_[0][1], 30, DeviceSource(out));
    ASSERT_TRUE(send.ok()) << send.status();
    absl::Status received = (*recv)->Wait(Deadline());
    ASSERT_TRUE(received.ok()) << received;
    absl::Status sent = (*send)->Wait(Deadline());
    ASSERT_TRUE(sent.ok()) << sent;
    EXPECT_EQ((*recv)->bytes(), size);
    EXPECT_TRUE(SameBytes(expected, in, "device send into a host receive"));
  }
  // Host -> device. At or above zero_copy_threshold a host send to a same-host peer that offers
  // zero copy is a descriptor that no device receive matches (file comment), so those sizes go
  // to a receiver that does not offer it.
  const bool zero_copy_size = size >= ucx::UcxTransport::Options().zero_copy_threshold;
  std::unique_ptr<ucx::UcxTransport> no_zero_copy;
  Transport* receiver = ranks_[0].get();
  PeerId sender_at_receiver = peer_[0][1], receiver_at_sender = peer_[1][0];
  if (zero_copy_size) {
    auto created = CreateUcx("rank0-no-zero-copy", /*same_host_zero_copy=*/false);
    ASSERT_TRUE(created.ok()) << created.status();
    no_zero_copy = std::move(created).value();
    auto at_receiver = no_zero_copy->Connect(ranks_[1]->LocalAddress(), Deadline());
    ASSERT_TRUE(at_receiver.ok()) << at_receiver.status();
    auto at_sender = ranks_[1]->Connect(no_zero_copy->LocalAddress(), Deadline());
    ASSERT_TRUE(at_sender.ok()) << at_sender.status();
    receiver = no_zero_copy.get();
    sender_at_receiver = *at_receiver;
    receiver_at_sender = *at_sender;
  }
  const std::vector<uint8_t> expected = Message(Seed(1, 0, 31, 0), size);
  at::Tensor in = Filled(size, 0xEE, device(0));
  auto recv = receiver->Recv(sender_at_receiver, 31, DeviceTarget(in));
  ASSERT_TRUE(recv.ok()) << recv.status();
  auto send =
      ranks_[1]->Send(receiver_at_sender, 31, ConstBuffer::Host(expected.data(), expected.size()));
  ASSERT_TRUE(send.ok()) << send.status();
  absl::Status received = (*recv)->Wait(Deadline());
  ASSERT_TRUE(received.ok()) << received;
  absl::Status sent = (*send)->Wait(Deadline());
  ASSERT_TRUE(sent.ok()) << sent;
  EXPECT_EQ((*recv)->bytes(), size);
  EXPECT_TRUE(SameBytes(expected, ToHost(in), "host send into a device receive"));
  if (no_zero_copy != nullptr) {
    EXPECT_EQ(no_zero_copy->stats().zero_copy_receives, 0u);
  }
}

// A message larger than the device receive buffer fails it with kOutOfRange naming the buffer's
// size; the send finishes and the connection keeps working.
TEST_P(DeviceConformanceTest, TruncationIntoASmallerDeviceBufferIsReported) {
  const size_t size = std::max<size_t>(GetParam().size, 2);
  at::Tensor out = OnDevice(Message(11, size), device(0));
  at::Tensor in = Filled(size - 1, 0, device(1));
  auto recv = ranks_[1]->Recv(peer_[1][0], 5, DeviceTarget(in));
  ASSERT_TRUE(recv.ok()) << recv.status();
  auto send = ranks_[0]->Send(peer_[0][1], 5, DeviceSource(out));
  ASSERT_TRUE(send.ok()) << send.status();
  absl::Status status = (*recv)->Wait(Deadline());
  EXPECT_EQ(status.code(), absl::StatusCode::kOutOfRange) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("rank0"));
  EXPECT_THAT(std::string(status.message()),
              HasSubstr(absl::StrCat("larger than the ", size - 1, "-byte receive buffer")));
  EXPECT_THAT(std::string(status.message()), HasSubstr("truncated"));
  EXPECT_EQ((*recv)->bytes(), 0u);
  absl::Status send_status = (*send)->Wait(Deadline());
  EXPECT_NE(send_status.code(), absl::StatusCode::kDeadlineExceeded) << send_status;
  ExpectDeviceRoundTrip(0, 1, 5, size, 12);
}

// Cancel withdraws an unmatched device receive: kCancelled, its buffer untouched, and the next
// message of that tag goes to the next receive.
TEST_P(DeviceConformanceTest, CancelWithdrawsAnUnmatchedDeviceReceive) {
  const size_t size = GetParam().size;
  at::Tensor stale = Filled(size, 0x11, device(1));
  auto cancelled = ranks_[1]->Recv(peer_[1][0], 8, DeviceTarget(stale));
  ASSERT_TRUE(cancelled.ok()) << cancelled.status();
  (*cancelled)->Cancel();
  absl::Status status = (*cancelled)->Wait(Deadline());
  EXPECT_EQ(status.code(), absl::StatusCode::kCancelled) << status;
  EXPECT_TRUE((*cancelled)->Done());
  ExpectDeviceRoundTrip(0, 1, 8, size, 14);
  EXPECT_TRUE(
      SameBytes(std::vector<uint8_t>(size, 0x11), ToHost(stale), "the cancelled receive's buffer"));
}

// Destroying a peer fails the pending device receive (and a device send it never took) with
// kUnavailable naming it within kPeerDeathBound; later device operations fail too.
TEST_P(DeviceConformanceTest, DestroyedPeerFailsPendingDeviceOperations) {
  const Param& p = GetParam();
  const size_t size = std::max<size_t>(p.size, 1);
  at::Tensor in = Filled(size, 0, device(0));
  at::Tensor out = OnDevice(Message(21, p.size), device(0));
  auto pending_recv = ranks_[0]->Recv(peer_[0][1], 10, DeviceTarget(in));
  ASSERT_TRUE(pending_recv.ok()) << pending_recv.status();
  // Rank 1 never posts this receive.
  auto pending_send = ranks_[0]->Send(peer_[0][1], 11, DeviceSource(out));
  ASSERT_TRUE(pending_send.ok()) << pending_send.status();
  ranks_[1].reset();
  const absl::Time start = absl::Now();
  absl::Status status = (*pending_recv)->Wait(start + kPeerDeathBound);
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("peer 'rank1'"));
  absl::Status send_status = (*pending_send)->Wait(start + kPeerDeathBound);
  EXPECT_LT(absl::Now() - start, kPeerDeathBound);
  // A UCX eager send may have completed locally before the peer went (UCX buffered it); a
  // rendezvous one (1 MiB and up) and every NCCL send wait for the receiver.
  if (p.flavor == Flavor::kNccl || p.size >= kMiB) {
    EXPECT_EQ(send_status.code(), absl::StatusCode::kUnavailable) << send_status;
    EXPECT_THAT(std::string(send_status.message()), HasSubstr("peer 'rank1'"));
  } else {
    EXPECT_TRUE(send_status.ok() || send_status.code() == absl::StatusCode::kUnavailable)
        << send_status;
  }
  auto later = ranks_[0]->Send(peer_[0][1], 10, DeviceSource(out));
  absl::Status later_status = later.ok() ? (*later)->Wait(Deadline()) : later.status();
  EXPECT_EQ(later_status.code(), absl::StatusCode::kUnavailable) << later_status;
  EXPECT_THAT(std::string(later_status.message()), HasSubstr("peer 'rank1'"));
  if (p.ranks > 2) ExpectDeviceRoundTrip(2, 0, 10, p.size, 16);
}

std::vector<Param> Params() {
  std::vector<Param> params = {
      {Flavor::kUcx, 0, 2},
      {Flavor::kUcx, 1, 2},
      {Flavor::kUcx, 4097, 3},
      {Flavor::kUcx, kMiB + 3, 2},
      {Flavor::kUcx, 32 * kMiB, 2},
      // Fresh NCCL communicators per case: two sizes only.
      {Flavor::kNccl, 0, 2},
      {Flavor::kNccl, kMiB + 3, 2},
  };
  return params;
}

INSTANTIATE_TEST_SUITE_P(Backends, DeviceConformanceTest, ::testing::ValuesIn(Params()), ParamName);

// Buffers the backends refuse (or, where the current behaviour is to accept, what happens).
class DeviceBufferRefusalTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (std::string why = NoCudaReason(); !why.empty()) GTEST_SKIP() << why;
  }
};

struct ConnectedPair {
  std::unique_ptr<Transport> a, b;
  PeerId b_at_a = 0, a_at_b = 0;
};

ConnectedPair Connect(std::unique_ptr<Transport> a, std::unique_ptr<Transport> b) {
  ConnectedPair pair{std::move(a), std::move(b)};
  auto b_at_a = pair.a->Connect(pair.b->LocalAddress(), Deadline());
  auto a_at_b = pair.b->Connect(pair.a->LocalAddress(), Deadline());
  EXPECT_TRUE(b_at_a.ok()) << b_at_a.status();
  EXPECT_TRUE(a_at_b.ok()) << a_at_b.status();
  if (b_at_a.ok()) pair.b_at_a = *b_at_a;
  if (a_at_b.ok()) pair.a_at_b = *a_at_b;
  return pair;
}

// `device` set to an ordinal beyond the visible devices, on a real cuda:0 buffer.
TEST_F(DeviceBufferRefusalTest, DeviceOrdinalBeyondTheVisibleDevices) {
  const int bogus = static_cast<int>(torch::cuda::device_count()) + 3;
  const std::vector<uint8_t> expected = Message(41, 4097);
  at::Tensor out = OnDevice(expected, 0);
  at::Tensor in = Filled(expected.size(), 0xEE, 0);
  ConstBuffer source = DeviceSource(out);
  MutableBuffer target = DeviceTarget(in);
  source.device = bogus;
  target.device = bogus;

  // UCX: the ordinal is not consulted (UCX finds the GPU from the pointer); the bytes move.
  auto a = CreateUcx("ucx-a");
  auto b = CreateUcx("ucx-b");
  ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
  if ((*a)->CanMove(MemoryKind::kCuda)) {
    ConnectedPair ucx = Connect(std::move(a).value(), std::move(b).value());
    auto recv = ucx.b->Recv(ucx.a_at_b, 1, target);
    ASSERT_TRUE(recv.ok()) << recv.status();
    auto send = ucx.a->Send(ucx.b_at_a, 1, source);
    ASSERT_TRUE(send.ok()) << send.status();
    absl::Status received = (*recv)->Wait(Deadline());
    ASSERT_TRUE(received.ok()) << received;
    absl::Status sent = (*send)->Wait(Deadline());
    ASSERT_TRUE(sent.ok()) << sent;
    EXPECT_TRUE(SameBytes(expected, ToHost(in), "UCX, device ordinal ignored"));
  }

  // NCCL: anything but options.cuda_device is refused when posted. A plain UCX peer is enough:
  // the check comes before the NCCL channels.
  if (nccl::NcclTransport::BuiltWithNccl()) {
    auto ucx = CreateUcx("nccl-a");
    auto plain = CreateUcx("plain-b");
    ASSERT_TRUE(ucx.ok() && plain.ok()) << ucx.status() << plain.status();
    nccl::NcclTransport::Options options;
    options.cuda_device = 0;
    auto wrapped = nccl::NcclTransport::Wrap(std::move(ucx).value(), options);
    ASSERT_TRUE(wrapped.ok()) << wrapped.status();
    ASSERT_TRUE((*wrapped)->CanMove(MemoryKind::kCuda));
    ConnectedPair nccl = Connect(std::move(wrapped).value(), std::move(plain).value());
    const std::string on_device = absl::StrCat("the buffer is on device ", bogus);
    auto send = nccl.a->Send(nccl.b_at_a, 1, source);
    EXPECT_EQ(send.status().code(), absl::StatusCode::kInvalidArgument) << send.status();
    EXPECT_THAT(std::string(send.status().message()), HasSubstr(on_device));
    EXPECT_THAT(std::string(send.status().message()), HasSubstr("options.cuda_device"));
    auto recv = nccl.a->Recv(nccl.b_at_a, 1, target);
    EXPECT_EQ(recv.status().code(), absl::StatusCode::kInvalidArgument) << recv.status();
    EXPECT_THAT(std::string(recv.status().message()), HasSubstr(on_device));
  }
  EXPECT_TRUE(SameBytes(expected, ToHost(out), "the send buffer"));
}

// A real CUDA buffer posted to a transport whose CanMove(kCuda) is false is refused with
// kUnimplemented saying why, on send and on receive.
TEST_F(DeviceBufferRefusalTest, CudaBufferOnATransportThatCannotMoveIt) {
  at::Tensor buffer = Filled(64, 0x33, 0);
  auto expect_refused = [&](ConnectedPair& pair, const std::string& why) {
    ASSERT_FALSE(pair.a->CanMove(MemoryKind::kCuda));
    EXPECT_TRUE(pair.a->CanMove(MemoryKind::kHost));
    auto send = pair.a->Send(pair.b_at_a, 1, DeviceSource(buffer));
    EXPECT_EQ(send.status().code(), absl::StatusCode::kUnimplemented) << send.status();
    EXPECT_THAT(std::string(send.status().message()), HasSubstr(why));
    auto recv = pair.a->Recv(pair.b_at_a, 1, DeviceTarget(buffer));
    EXPECT_EQ(recv.status().code(), absl::StatusCode::kUnimplemented) << recv.status();
    EXPECT_THAT(std::string(recv.status().message()), HasSubstr(why));
  };
  {
    auto a = CreateTransport(Backend::kInproc, "inproc-a");
    auto b = CreateTransport(Backend::kInproc, "inproc-b");
    ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
    ConnectedPair inproc = Connect(std::move(a).value(), std::move(b).value());
    expect_refused(inproc, "the in-process backend moves host memory only");
  }
  {
    auto ucx_a = CreateUcx("protocol-a");
    auto ucx_b = CreateUcx("protocol-b");
    ASSERT_TRUE(ucx_a.ok() && ucx_b.ok()) << ucx_a.status() << ucx_b.status();
    nccl::NcclTransport::Options options;
    options.host_through_protocol_for_testing = true;
    auto a = nccl::NcclTransport::Wrap(std::move(ucx_a).value(), options);
    auto b = nccl::NcclTransport::Wrap(std::move(ucx_b).value(), options);
    ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
    ConnectedPair protocol = Connect(std::move(a).value(), std::move(b).value());
    expect_refused(protocol, "host_through_protocol_for_testing");
  }
  {
    // On a GPU machine the libucx-cu13 UCX moves CUDA memory; a UCX without CUDA refuses it.
    auto a = CreateUcx("ucx-a");
    auto b = CreateUcx("ucx-b");
    ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
    if (!(*a)->CanMove(MemoryKind::kCuda)) {
      ConnectedPair ucx = Connect(std::move(a).value(), std::move(b).value());
      expect_refused(ucx, "has no CUDA memory support");
    }
  }
  EXPECT_TRUE(SameBytes(std::vector<uint8_t>(64, 0x33), ToHost(buffer), "the refused buffer"));
}

}  // namespace
}  // namespace hetpar::transport
