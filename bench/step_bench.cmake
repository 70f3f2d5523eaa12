# step_bench: whole training steps of `hetpar run` (real coordinator and worker processes over UCX
# on loopback) decomposed into encoder compute, LLM compute, bridge waits and collectives, and the
# pipelining efficiency step time / max(encoder busy, LLM busy), and the bridge's throughput inside
# the steps against transport_bw at the same message size, and the LLM pipeline's bubble at 2 and 4
# stages against the 1F1B bound. JSON lines on stdout.
add_executable(step_bench "${CMAKE_CURRENT_LIST_DIR}/step_bench.cc")
hetpar_target_defaults(step_bench)
target_include_directories(step_bench PRIVATE "${PROJECT_SOURCE_DIR}")
target_link_libraries(step_bench PRIVATE hetpar_common nlohmann_json::nlohmann_json CLI11::CLI11)
target_compile_definitions(step_bench PRIVATE HETPAR_BIN="$<TARGET_FILE:hetpar>"
                                              HETPAR_SOURCE_DIR="${PROJECT_SOURCE_DIR}"
                                              TRANSPORT_BW_BIN="$<TARGET_FILE:transport_bw>")
add_dependencies(step_bench hetpar hetpar-encoder hetpar-llm hetpar-reference transport_bw)
