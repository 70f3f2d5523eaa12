// Two in-process transports connected both ways, for tests of what runs over the data plane.
//
//   absl::StatusOr<testing::InprocPair> pair = testing::ConnectInprocPair("sender", "receiver");
//   pair->a->Send(pair->a_to_b, ...);  // arrives at pair->b
#ifndef HETPAR_TESTS_UTIL_INPROC_PAIR_H_
#define HETPAR_TESTS_UTIL_INPROC_PAIR_H_

#include <memory>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "common/status.h"
#include "common/transport/inproc/inproc_transport.h"

namespace hetpar::testing {

struct InprocPair {
  std::unique_ptr<transport::Transport> a;
  std::unique_ptr<transport::Transport> b;
  transport::PeerId a_to_b = 0;  // b, as a's peer
  transport::PeerId b_to_a = 0;  // a, as b's peer
};

inline absl::StatusOr<InprocPair> ConnectInprocPair(const std::string& a_name,
                                                    const std::string& b_name) {
  InprocPair pair;
  HETPAR_ASSIGN_OR_RETURN(pair.a, transport::inproc::InprocTransport::Create({a_name}));
  HETPAR_ASSIGN_OR_RETURN(pair.b, transport::inproc::InprocTransport::Create({b_name}));
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  HETPAR_ASSIGN_OR_RETURN(pair.a_to_b, pair.a->Connect(pair.b->LocalAddress(), deadline));
  HETPAR_ASSIGN_OR_RETURN(pair.b_to_a, pair.b->Connect(pair.a->LocalAddress(), deadline));
  return pair;
}

}  // namespace hetpar::testing

#endif  // HETPAR_TESTS_UTIL_INPROC_PAIR_H_
