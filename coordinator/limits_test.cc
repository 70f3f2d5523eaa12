// The network-facing bounds: each refusal names the field, the size and the limit; text that
// enters a log is escaped and cut.
#include "coordinator/limits.h"

#include <string>
#include <vector>

#include "coordinator/kv_store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hetpar::coordinator {
namespace {

using ::testing::HasSubstr;

v1::RegisterRequest Request(const std::string& host) {
  v1::RegisterRequest request;
  request.set_host(host);
  request.set_data_address(std::string(512, 'a'));
  request.add_capabilities("ucx");
  return request;
}

void ExpectRefused(const absl::Status& status, const std::string& detail) {
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr(detail));
}

TEST(LimitsTest, RealHostsAndAddressesPass) {
  for (const std::string& host :
       std::vector<std::string>{"127.0.0.1", "node-17.cluster.local", "[fe80::1%eth0]",
                                "encoder-pool-3.hetpar.svc", std::string(253, 'h')}) {
    EXPECT_TRUE(CheckRegistration(Request(host)).ok()) << host;
  }
  v1::RegisterRequest request = Request("10.0.0.7");
  request.set_data_address(std::string(64 * 1024, '\x01'));
  EXPECT_TRUE(CheckRegistration(request).ok());
}

TEST(LimitsTest, OversizedOrStrangeRegistrationsAreRefusedNamingTheLimit) {
  ExpectRefused(CheckRegistration(Request(std::string(254, 'h'))),
                "host is 254 bytes; the limit is 253 bytes");
  ExpectRefused(CheckRegistration(Request(std::string(1 << 20, 'h'))),
                "host is 1048576 bytes; the limit is 253 bytes");
  ExpectRefused(CheckRegistration(Request("evil\nhost")), "host 'evil\\nhost' is not a hostname");
  v1::RegisterRequest request = Request("10.0.0.7");
  request.set_data_address(std::string(64 * 1024 + 1, 'a'));
  ExpectRefused(CheckRegistration(request), "data_address is 65537 bytes; the limit is 65536");
  request = Request("10.0.0.7");
  for (int i = 0; i < 33; ++i) request.add_capabilities("x");
  ExpectRefused(CheckRegistration(request), "capabilities has 34 entries; the limit is 32");
}

TEST(LimitsTest, PrintableEscapesAndCuts) {
  EXPECT_EQ(Printable("ok"), "ok");
  EXPECT_EQ(Printable("a\nb\x01"), "a\\nb\\x01");
  EXPECT_EQ(Printable("it's \"x\" \\ \xc3\xa9"), "it's \"x\" \\ \\xc3\\xa9");
  EXPECT_EQ(Printable("abcdef", 3), "abc...(6 bytes)");
  const std::string cut = Printable(std::string(1 << 20, 'x'));
  EXPECT_EQ(cut, std::string(256, 'x') + "...(1048576 bytes)");
}

TEST(LimitsTest, TheKeyValueStoreRefusesOversizedKeysAndValues) {
  KeyValueStore kv;
  ExpectRefused(kv.Set(1, std::string(1025, 'k'), "v"),
                "rendezvous key is 1025 bytes; the limit is 1024");
  ExpectRefused(kv.Set(1, "k", std::string((1 << 20) + 1, 'v')),
                "rendezvous value is 1048577 bytes; the limit is 1048576");
  ExpectRefused(kv.CompareSet(1, "k", "", std::string((1 << 20) + 1, 'v')).status(),
                "rendezvous value is 1048577 bytes");
  ExpectRefused(kv.Add(1, std::string(2048, 'k'), 1).status(), "rendezvous key is 2048 bytes");
  ExpectRefused(kv.Check(1, std::vector<std::string>(1025, "k")).status(),
                "names 1025 keys; the limit is 1024");
  absl::Status waited;
  kv.Wait(kv.NewWaitId(), 1, {std::string(4096, 'k')}, absl::InfiniteFuture(),
          [&](absl::Status s) { waited = s; });
  ExpectRefused(waited, "rendezvous key is 4096 bytes");
  EXPECT_EQ(kv.pending_waits(), 0);
  // Nothing was stored; values at the limit are.
  EXPECT_EQ(*kv.NumKeys(1), 0);
  EXPECT_TRUE(kv.Set(1, std::string(1024, 'k'), std::string(1 << 20, 'v')).ok());
  EXPECT_EQ(*kv.NumKeys(1), 1);
}

}  // namespace
}  // namespace hetpar::coordinator
