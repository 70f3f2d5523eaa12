// What the UCX device tests share. CudaUcxRequired: whether a UCX that moves no CUDA memory fails
// a UCX device test instead of skipping it. tools/gpu-check sets HETPAR_GPU_REQUIRE_CUDA_UCX=1
// where it sees a GPU: there such a UCX is the build's or the bundle's fault (a CUDA module
// missing), not the machine's. (The tests make their GPU current on UCX's progress thread as a
// worker does: nn::SelectProgressThreadDevice.)
#ifndef HETPAR_TESTS_GPU_REQUIRE_CUDA_UCX_H_
#define HETPAR_TESTS_GPU_REQUIRE_CUDA_UCX_H_

#include <cstdlib>
#include <string>

namespace hetpar::testing {

inline bool CudaUcxRequired() {
  const char* value = std::getenv("HETPAR_GPU_REQUIRE_CUDA_UCX");
  return value != nullptr && std::string(value) == "1";
}

}  // namespace hetpar::testing

#endif  // HETPAR_TESTS_GPU_REQUIRE_CUDA_UCX_H_
