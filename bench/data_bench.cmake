# data_bench: samples/s of load + decode + tokenise on one core against the samples/s the tiny
# config's encoder consumes (forward + backward, one core), measured in the same run, plus a
# read-only baseline. JSON lines on stdout.
add_executable(data_bench "${CMAKE_CURRENT_LIST_DIR}/data_bench.cc")
hetpar_target_defaults(data_bench)
target_link_libraries(data_bench PRIVATE hetpar_data hetpar_encoder)
target_compile_definitions(data_bench PRIVATE HETPAR_SOURCE_DIR="${PROJECT_SOURCE_DIR}")
