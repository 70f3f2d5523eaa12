# data_bench: samples/s of load + decode + tokenise on one core against the samples/s the tiny
# config's encoder consumes (forward + backward, one core), measured in the same run, plus a
# read-only baseline. JSON lines on stdout. The encoder part is compiled in when the
# hetpar_encoder target exists (it links libtorch; hetpar_data does not).
add_executable(data_bench "${CMAKE_CURRENT_LIST_DIR}/data_bench.cc")
hetpar_target_defaults(data_bench)
target_link_libraries(data_bench PRIVATE hetpar_data)
target_compile_definitions(data_bench PRIVATE HETPAR_SOURCE_DIR="${PROJECT_SOURCE_DIR}")
if(TARGET hetpar_encoder)
  target_link_libraries(data_bench PRIVATE hetpar_encoder)
  target_compile_definitions(data_bench PRIVATE HETPAR_DATA_BENCH_ENCODER=1)
endif()
