# colocated_bench: on the same ranks and data, the homogeneous layout (the encoder forced to the
# LLM's TP) against the heterogeneous one (encoder at tp 1, its ranks as data-parallel replicas),
# both colocated, through `hetpar run`. JSON lines: tokens/s, the ratio, and each module's time split.
add_executable(colocated_bench "${CMAKE_CURRENT_LIST_DIR}/colocated_bench.cc")
hetpar_target_defaults(colocated_bench)
target_include_directories(colocated_bench PRIVATE "${PROJECT_SOURCE_DIR}")
target_link_libraries(colocated_bench PRIVATE nlohmann_json::nlohmann_json CLI11::CLI11)
target_compile_definitions(colocated_bench PRIVATE HETPAR_BIN="$<TARGET_FILE:hetpar>"
                                                   HETPAR_SOURCE_DIR="${PROJECT_SOURCE_DIR}")
add_dependencies(colocated_bench hetpar hetpar-encoder hetpar-llm hetpar-reference)
