// One rank of a TP group for the equivalence tests: joins the group over a file store, runs every
// case of model_cases.h and writes what it holds to a record file.
//
//   model_equivalence_rank --store <file> --tp <size> --rank <r> --out <records file>
//
// Exit code 0 on success; 1 with the reason on stderr otherwise.
#include <ATen/Parallel.h>

#include <cstdlib>
#include <iostream>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/nn/communicator.h"
#include "tests/models/model_cases.h"

namespace hetpar::models_test {
namespace {

absl::Status Run(int argc, char** argv) {
  std::string store_path, out_path;
  int tp = 0, rank = -1;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const std::string value = argv[i + 1];
    if (flag == "--store") {
      store_path = value;
    } else if (flag == "--out") {
      out_path = value;
    } else if (flag == "--tp") {
      if (!absl::SimpleAtoi(value, &tp)) return absl::InvalidArgumentError("--tp: not a number");
    } else if (flag == "--rank") {
      if (!absl::SimpleAtoi(value, &rank)) {
        return absl::InvalidArgumentError("--rank: not a number");
      }
    } else {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag ", flag));
    }
  }
  if (store_path.empty() || out_path.empty() || tp < 1 || rank < 0 || rank >= tp) {
    return absl::InvalidArgumentError(
        "usage: model_equivalence_rank --store <file> --tp <size> --rank <r> --out <file>");
  }
  SetLogTag(absl::StrCat("tp", tp, " r", rank));
  at::set_num_threads(1);
  auto store = nn::OpenFileStore(store_path, tp);
  if (!store.ok()) return store.status();
  nn::CommunicatorOptions options;
  options.prefix = "equivalence/tp";
  options.rank = rank;
  options.size = tp;
  options.timeout = absl::Seconds(90);
  auto comm = nn::Communicator::Create(*store, options);
  if (!comm.ok()) return comm.status();
  AllRecords all;
  for (const ModelCase& c : AllCases()) {
    auto records = RunCase(c, **comm);
    if (!records.ok()) return records.status();
    all[c.name] = *std::move(records);
  }
  return WriteRecords(out_path, all);
}

}  // namespace
}  // namespace hetpar::models_test

int main(int argc, char** argv) {
  absl::Status status = hetpar::models_test::Run(argc, argv);
  if (!status.ok()) {
    HETPAR_LOG(ERROR) << status;
    return 1;
  }
  return 0;
}
