// Behaviour specific to the NCCL backend that runs without a GPU: wrapping a UCX transport, host
// memory passing straight through to it, CUDA memory refused with the reason where NCCL or a GPU
// is missing, and the protocol's withdrawal of cancelled sends. The shared semantics of the
// protocol are in the conformance suite (flavor nccl_protocol); real NCCL in tests/gpu/.
#include "common/transport/nccl/nccl_transport.h"

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/transport/ucx/ucx_transport.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hetpar::transport::nccl {
namespace {

using ::testing::HasSubstr;

constexpr absl::Duration kWait = absl::Seconds(20);

std::unique_ptr<ucx::UcxTransport> Ucx(const std::string& name) {
  ucx::UcxTransport::Options options;
  options.name = name;
  auto transport = ucx::UcxTransport::Create(options);
  EXPECT_TRUE(transport.ok()) << transport.status();
  return transport.ok() ? std::move(transport).value() : nullptr;
}

std::vector<uint8_t> Bytes(uint8_t seed, size_t size) {
  std::vector<uint8_t> bytes(size);
  for (size_t i = 0; i < size; ++i) bytes[i] = static_cast<uint8_t>(seed + i * 13 + (i >> 10));
  return bytes;
}

NcclTransport::Options TestMode() {
  NcclTransport::Options options;
  options.host_through_protocol_for_testing = true;
  return options;
}

// Two wrapped transports connected both ways.
struct Pair {
  std::unique_ptr<Transport> a, b;
  PeerId b_at_a = 0, a_at_b = 0;
};

Pair Connected(std::unique_ptr<Transport> a, std::unique_ptr<Transport> b) {
  Pair pair{std::move(a), std::move(b)};
  auto b_at_a = pair.a->Connect(pair.b->LocalAddress(), absl::Now() + kWait);
  auto a_at_b = pair.b->Connect(pair.a->LocalAddress(), absl::Now() + kWait);
  EXPECT_TRUE(b_at_a.ok() && a_at_b.ok()) << b_at_a.status() << a_at_b.status();
  pair.b_at_a = b_at_a.value_or(0);
  pair.a_at_b = a_at_b.value_or(0);
  return pair;
}

// Sends `size` bytes from -> to with `tag` and checks every byte.
void RoundTrip(Transport* from, PeerId to_at_from, Transport* to, PeerId from_at_to, Tag tag,
               size_t size) {
  std::vector<uint8_t> out = Bytes(static_cast<uint8_t>(tag), size), in(size, 0);
  auto recv = to->Recv(from_at_to, tag, MutableBuffer::Host(in.data(), in.size()));
  auto send = from->Send(to_at_from, tag, ConstBuffer::Host(out.data(), out.size()));
  ASSERT_TRUE(recv.ok() && send.ok()) << recv.status() << send.status();
  ASSERT_TRUE((*recv)->Wait(absl::Now() + kWait).ok());
  ASSERT_TRUE((*send)->Wait(absl::Now() + kWait).ok());
  EXPECT_EQ((*recv)->bytes(), size);
  EXPECT_EQ(in, out);
}

absl::StatusOr<std::unique_ptr<Transport>> Wrapped(const std::string& name,
                                                   const NcclTransport::Options& options) {
  auto wrapped = NcclTransport::Wrap(Ucx(name), options);
  if (!wrapped.ok()) return wrapped.status();
  return std::unique_ptr<Transport>(std::move(wrapped).value());
}

TEST(NcclTransportTest, WrapKeepsTheUcxIdentity) {
  std::unique_ptr<ucx::UcxTransport> ucx = Ucx("enc r1");
  ASSERT_NE(ucx, nullptr);
  const std::string address = ucx->LocalAddress();
  auto wrapped = NcclTransport::Wrap(std::move(ucx), TestMode());
  ASSERT_TRUE(wrapped.ok()) << wrapped.status();
  EXPECT_EQ((*wrapped)->backend(), "nccl");
  EXPECT_EQ((*wrapped)->name(), "enc r1");
  EXPECT_EQ((*wrapped)->LocalAddress(), address);
  auto null = NcclTransport::Wrap(nullptr, TestMode());
  EXPECT_EQ(null.status().code(), absl::StatusCode::kInvalidArgument);
}

// Options whose GPU no machine has: NCCL cannot set up there, on a GPU machine as here.
NcclTransport::Options NoUsableGpu() {
  NcclTransport::Options options;
  options.cuda_device = 1 << 20;
  return options;
}

TEST(NcclTransportTest, WithoutNcclOrAGpuCudaMemoryIsRefusedWithTheReason) {
  auto wrapped = Wrapped("a", NoUsableGpu());
  if (!NcclTransport::BuiltWithNccl()) {
    ASSERT_EQ(wrapped.status().code(), absl::StatusCode::kUnimplemented) << wrapped.status();
    EXPECT_THAT(std::string(wrapped.status().message()), HasSubstr("has no NCCL"));
    EXPECT_THAT(std::string(wrapped.status().message()), HasSubstr("use transport ucx"));
    return;
  }
  ASSERT_TRUE(wrapped.ok()) << wrapped.status();
  EXPECT_FALSE((*wrapped)->CanMove(MemoryKind::kCuda));
  auto peer = (*wrapped)->Connect((*wrapped)->LocalAddress(), absl::Now() + kWait);
  ASSERT_TRUE(peer.ok()) << peer.status();
  int dummy = 0;
  auto send = (*wrapped)->Send(*peer, 1, ConstBuffer{&dummy, sizeof(dummy), MemoryKind::kCuda, 0});
  EXPECT_EQ(send.status().code(), absl::StatusCode::kUnimplemented) << send.status();
  EXPECT_THAT(std::string(send.status().message()), HasSubstr("cannot be moved"));
  EXPECT_THAT(std::string(send.status().message()), HasSubstr("CUDA"));
}

// Host memory goes straight to the UCX transport with the same tags: a plain UCX peer talks to a
// wrapped one.
TEST(NcclTransportTest, HostMemoryPassesStraightThroughToUcx) {
  NcclTransport::Options options;
  if (!NcclTransport::BuiltWithNccl()) GTEST_SKIP() << "this build has no NCCL: Wrap fails";
  auto wrapped = Wrapped("wrapped", options);
  ASSERT_TRUE(wrapped.ok()) << wrapped.status();
  Pair pair = Connected(std::move(wrapped).value(), Ucx("plain"));
  ASSERT_NE(pair.b, nullptr);
  RoundTrip(pair.a.get(), pair.b_at_a, pair.b.get(), pair.a_at_b, kMaxTag, 100000);
  RoundTrip(pair.b.get(), pair.a_at_b, pair.a.get(), pair.b_at_a, 3, 17);
  std::vector<uint8_t> out = Bytes(5, 64), first(20, 0), second(44, 0);
  auto scatter = pair.a->RecvScatter(pair.b_at_a, 4,
                                     {MutableBuffer::Host(first.data(), first.size()),
                                      MutableBuffer::Host(second.data(), second.size())});
  auto send = pair.b->Send(pair.a_at_b, 4, ConstBuffer::Host(out.data(), out.size()));
  ASSERT_TRUE(scatter.ok() && send.ok());
  ASSERT_TRUE((*scatter)->Wait(absl::Now() + kWait).ok());
  ASSERT_TRUE((*send)->Wait(absl::Now() + kWait).ok());
  first.insert(first.end(), second.begin(), second.end());
  EXPECT_EQ(first, out);
}

// A cancelled send that no receive has taken is withdrawn: the receiver's next receive of that
// tag gets the next message, never the withdrawn one.
TEST(NcclTransportTest, CancelledSendIsWithdrawnBeforeAnyReceiveTakesIt) {
  auto a = Wrapped("a", TestMode());
  auto b = Wrapped("b", TestMode());
  ASSERT_TRUE(a.ok() && b.ok());
  Pair pair = Connected(std::move(a).value(), std::move(b).value());
  // The channels are set up once a message has crossed both ways.
  RoundTrip(pair.a.get(), pair.b_at_a, pair.b.get(), pair.a_at_b, 1, 8);
  RoundTrip(pair.b.get(), pair.a_at_b, pair.a.get(), pair.b_at_a, 1, 8);
  std::vector<uint8_t> withdrawn = Bytes(1, 4096);
  auto cancelled = pair.a->Send(pair.b_at_a, 7, ConstBuffer::Host(withdrawn.data(), 4096));
  ASSERT_TRUE(cancelled.ok());
  (*cancelled)->Cancel();
  absl::Status status = (*cancelled)->Wait(absl::Now() + kWait);
  EXPECT_EQ(status.code(), absl::StatusCode::kCancelled) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("send to peer 'b' tag 7"));
  RoundTrip(pair.a.get(), pair.b_at_a, pair.b.get(), pair.a_at_b, 7, 4096);
}

// A send whose receive is already waiting cannot be withdrawn once the receiver has answered:
// cancelling it after it completed keeps the result, and every byte arrives.
TEST(NcclTransportTest, CancelAfterTheReceiveMatchedCompletesNormally) {
  auto a = Wrapped("a", TestMode());
  auto b = Wrapped("b", TestMode());
  ASSERT_TRUE(a.ok() && b.ok());
  Pair pair = Connected(std::move(a).value(), std::move(b).value());
  std::vector<uint8_t> out = Bytes(3, 1 << 20), in(out.size(), 0);
  auto recv = pair.b->Recv(pair.a_at_b, 9, MutableBuffer::Host(in.data(), in.size()));
  auto send = pair.a->Send(pair.b_at_a, 9, ConstBuffer::Host(out.data(), out.size()));
  ASSERT_TRUE(recv.ok() && send.ok());
  ASSERT_TRUE((*recv)->Wait(absl::Now() + kWait).ok());
  (*send)->Cancel();
  absl::Status status = (*send)->Wait(absl::Now() + kWait);
  EXPECT_TRUE(status.ok()) << status;
  EXPECT_EQ(in, out);
}

// A peer that cannot move device memory tells its peers, whose device operations then fail
// naming it instead of waiting for channels that never come.
TEST(NcclTransportTest, APeerWithoutChannelsFailsDeviceOperationsWithTheReason) {
  if (!NcclTransport::BuiltWithNccl()) GTEST_SKIP() << "this build has no NCCL: Wrap fails";
  auto a = Wrapped("a", NoUsableGpu());
  auto b = Wrapped("b", TestMode());
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_FALSE((*a)->CanMove(MemoryKind::kCuda));
  Pair pair = Connected(std::move(a).value(), std::move(b).value());
  // b routes host memory through the protocol; a has no mover, so b's channels with a fail.
  std::vector<uint8_t> out(16, 1);
  auto send = pair.b->Send(pair.a_at_b, 1, ConstBuffer::Host(out.data(), out.size()));
  absl::Status status = send.ok() ? (*send)->Wait(absl::Now() + kWait) : send.status();
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("peer 'a'"));
  EXPECT_THAT(std::string(status.message()), HasSubstr("cannot move device memory"));
}

}  // namespace
}  // namespace hetpar::transport::nccl
