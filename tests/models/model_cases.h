// The cases of the tensor-parallel equivalence tests, shared by the test (which runs the
// single-process reference) and model_equivalence_rank (which runs one rank of a TP group).
//
// A case builds the encoder or the LLM at a dtype, with sequence parallelism on or off, on tiny
// sizes whose row counts do not divide by the TP size (so SP padding is exercised), runs one
// forward and backward on fixed inputs, and records what the rank holds: the forward output,
// the image-rows gradient (LLM), and every parameter's initial values and gradient with its TP
// slicing.
#ifndef HETPAR_TESTS_MODELS_MODEL_CASES_H_
#define HETPAR_TESTS_MODELS_MODEL_CASES_H_

#include <ATen/core/Tensor.h>

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/nn/communicator.h"

namespace hetpar::models_test {

struct ModelCase {
  std::string name;    // e.g. "llm_sp_float64"
  std::string module;  // "encoder" or "llm"
  bool sequence_parallel = false;
  at::ScalarType dtype = at::kDouble;
};

// Every case, in the order ranks run them.
std::vector<ModelCase> AllCases();

// One tensor a rank holds, stored as float64 (exact for float32 and bfloat16).
struct Record {
  at::Tensor value;
  int split_dim = -1;  // for parameters: the TP slicing; -1 replicated or not a parameter
  int64_t offset = 0;
  std::vector<int64_t> full_shape;
};

// Keys: "output" (encoder), "loss" and "image_rows.grad" (LLM), "init/<parameter>",
// "grad/<parameter>".
using CaseRecords = std::map<std::string, Record>;
using AllRecords = std::map<std::string, CaseRecords>;  // by case name

absl::StatusOr<CaseRecords> RunCase(const ModelCase& c, nn::Communicator& tp);

absl::Status WriteRecords(const std::string& path, const AllRecords& records);
absl::StatusOr<AllRecords> ReadRecords(const std::string& path);

}  // namespace hetpar::models_test

#endif  // HETPAR_TESTS_MODELS_MODEL_CASES_H_
