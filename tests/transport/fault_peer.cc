// The peer process of the transport fault tests: a UCX transport that streams large messages to,
// or receives and verifies them from, the test process until it is killed.
//
//   transport_fault_peer --role send|recv --size BYTES --dir DIR
//
// It writes its address to DIR/peer.addr (atomically, by rename), waits for DIR/test.addr,
// connects, and then sends message 0, 1, 2, ... (role send) or receives and checks them (role
// recv), printing "verified message N" after each checked message. Every byte of message N is
// MessageByte(N, i). It exits 0 after --count messages (0: never), 3 when the transport fails.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "common/atomic_file.h"
#include "common/transport/ucx/ucx_transport.h"
#include "tests/transport/fault_message.h"
#include "tests/util/subprocess.h"

namespace hetpar::transport {
namespace {

int Fail(const std::string& what) {
  std::cout << "error: " << what << std::endl;
  return 3;
}

int Run(int argc, char** argv) {
  std::string role, dir;
  size_t size = 0;
  long count = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--role") {
      role = argv[i + 1];
    } else if (flag == "--size") {
      size = std::strtoull(argv[i + 1], nullptr, 10);
    } else if (flag == "--dir") {
      dir = argv[i + 1];
    } else if (flag == "--count") {
      count = std::strtol(argv[i + 1], nullptr, 10);
    } else {
      return Fail("unknown flag " + flag);
    }
  }
  if ((role != "send" && role != "recv") || size == 0 || dir.empty()) {
    return Fail("usage: --role send|recv --size BYTES --dir DIR [--count N]");
  }
  ucx::UcxTransport::Options options;
  options.name = "fault-peer";
  auto transport = ucx::UcxTransport::Create(options);
  if (!transport.ok()) return Fail(std::string(transport.status().message()));
  if (!WriteFileAtomically(dir + "/peer.addr", (*transport)->LocalAddress()).ok()) {
    return Fail("cannot write " + dir + "/peer.addr");
  }
  std::string test_address;
  if (!testing::WaitForFile(dir + "/test.addr", absl::Seconds(30), &test_address)) {
    return Fail("no " + dir + "/test.addr within 30 s");
  }
  auto peer = (*transport)->Connect(test_address, absl::Now() + absl::Seconds(30));
  if (!peer.ok()) return Fail(std::string(peer.status().message()));
  std::cout << "connected" << std::endl;

  std::vector<uint8_t> buffer(size);
  for (long seq = 0; count == 0 || seq < count; ++seq) {
    std::unique_ptr<Operation> op;
    if (role == "send") {
      FillMessage(seq, buffer.data(), size);
      auto send = (*transport)->Send(*peer, kFaultTag, ConstBuffer::Host(buffer.data(), size));
      if (!send.ok()) return Fail(std::string(send.status().message()));
      op = std::move(send).value();
    } else {
      auto recv = (*transport)->Recv(*peer, kFaultTag, MutableBuffer::Host(buffer.data(), size));
      if (!recv.ok()) return Fail(std::string(recv.status().message()));
      op = std::move(recv).value();
    }
    absl::Status status = op->Wait(absl::Now() + absl::Seconds(60));
    if (!status.ok()) return Fail(std::string(status.message()));
    if (role == "recv") {
      const long bad = FirstBadByte(seq, buffer.data(), size);
      if (bad >= 0) return Fail("message " + std::to_string(seq) + " byte " + std::to_string(bad));
      std::cout << "verified message " << seq << std::endl;
    }
  }
  return 0;
}

}  // namespace
}  // namespace hetpar::transport

int main(int argc, char** argv) { return hetpar::transport::Run(argc, argv); }
