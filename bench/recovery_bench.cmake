# recovery_bench: what losing a DP replica's worker costs a run. `hetpar run` on a non-colocated
# RunSpec, one encoder (then one LLM) worker killed (SIGKILL) mid-run: the time from the kill to
# its detection and to the next committed step, against the same run's median step time. JSON
# lines.
add_executable(recovery_bench "${CMAKE_CURRENT_LIST_DIR}/recovery_bench.cc")
hetpar_target_defaults(recovery_bench)
target_include_directories(recovery_bench PRIVATE "${PROJECT_SOURCE_DIR}")
target_link_libraries(recovery_bench PRIVATE nlohmann_json::nlohmann_json CLI11::CLI11)
target_compile_definitions(recovery_bench PRIVATE HETPAR_BIN="$<TARGET_FILE:hetpar>"
                                                  HETPAR_SOURCE_DIR="${PROJECT_SOURCE_DIR}")
add_dependencies(recovery_bench hetpar hetpar-encoder hetpar-llm hetpar-reference)
