// Paths fixed when the benches are built (the build folder's binaries, the UCX the build linked),
// each replaceable by an environment variable of the same name, so that the binaries still find
// each other once moved out of the build folder (tools/gpu-bundle packs them for another machine).
#ifndef HETPAR_BENCH_BUILT_PATH_H_
#define HETPAR_BENCH_BUILT_PATH_H_

#include <cstdlib>
#include <string>

namespace hetpar::bench {

// The environment variable `name` when set and not empty, else `built`.
inline std::string BuiltPath(const char* name, const char* built) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? std::string(value) : std::string(built);
}

}  // namespace hetpar::bench

#endif  // HETPAR_BENCH_BUILT_PATH_H_
