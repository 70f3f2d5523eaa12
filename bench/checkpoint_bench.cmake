# checkpoint_bench: what a sharded checkpoint costs a run. In `hetpar run` (real coordinator and
# workers), the time a step waits for a save (the snapshot copy) against the step time, with the
# goal <= 0.10, and the step time against a run without checkpoints; in-process, the copy, write
# and resume (load) throughput of a shard of --mib MiB of parameters plus AdamW moments against a
# plain fsynced sequential write and read of the same bytes. JSON lines on stdout.
add_executable(checkpoint_bench "${CMAKE_CURRENT_LIST_DIR}/checkpoint_bench.cc")
hetpar_target_defaults(checkpoint_bench)
target_include_directories(checkpoint_bench PRIVATE "${PROJECT_SOURCE_DIR}")
target_link_libraries(checkpoint_bench PRIVATE hetpar_train nlohmann_json::nlohmann_json
                      CLI11::CLI11)
target_compile_definitions(checkpoint_bench PRIVATE HETPAR_BIN="$<TARGET_FILE:hetpar>"
                                                    HETPAR_SOURCE_DIR="${PROJECT_SOURCE_DIR}")
add_dependencies(checkpoint_bench hetpar hetpar-encoder hetpar-llm)
