// Fuzz entry point for the RunSpec YAML loader: any bytes must give a RunSpec or an error,
// never a crash, hang or sanitizer report. Built as a libFuzzer target with clang
// (-DHETPAR_FUZZ=ON) and replayed over the seed corpus by config_fuzz_test in `make test`.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "common/config/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view text(reinterpret_cast<const char*>(data), size);
  hetpar::config::LoadOptions options;
  options.check_files = false;
  options.overrides = {};
  auto loaded = hetpar::config::LoadRunSpecFromString(text, "fuzz.yaml", options);
  if (loaded.ok()) {
    // A spec that loads must print and load again.
    std::string yaml = hetpar::config::RunSpecToYaml(loaded->spec);
    auto again = hetpar::config::LoadRunSpecFromString(yaml, "fuzz-roundtrip.yaml", options);
    if (!again.ok()) __builtin_trap();
  }
  return 0;
}
