# transport_bw: hetpar's UCX data plane against raw ucx_perftest, c10d Gloo send/recv and memcpy,
# one pair of processes over loopback; with --memory cuda, CUDA buffers on one GPU against
# ucx_perftest -m cuda and a device-to-device copy. JSON lines on stdout. libtorch is linked for
# the Gloo baseline, the CUDA buffers and the GPU of UCX's progress thread (as a worker's).
add_executable(transport_bw "${CMAKE_CURRENT_LIST_DIR}/transport_bw.cc")
hetpar_target_defaults(transport_bw)
target_link_libraries(transport_bw PRIVATE hetpar_transport_ucx hetpar_nn_ucx
                                           hetpar_common ${TORCH_LIBRARIES}
                                           nlohmann_json::nlohmann_json)
# The raw baseline is the ucx_perftest of the UCX hetpar links, with that UCX's libraries.
target_compile_definitions(transport_bw PRIVATE HETPAR_UCX_PERFTEST="${HETPAR_UCX_PERFTEST}"
                                               HETPAR_UCX_LIBDIR="${HETPAR_UCX_LIBDIR}")

# Its smoke test (label unit; no timing asserted): --memory cuda prints a "skipped" line and exits
# 0 without a GPU (and measures with one), the host mode moves and checks its bytes.
if(HETPAR_BUILD_TESTS)
  hetpar_add_test(NAME transport_bw_test SOURCES "${CMAKE_CURRENT_LIST_DIR}/transport_bw_test.cc"
                  LIBS hetpar_test_util nlohmann_json::nlohmann_json LABELS unit TIMEOUT 300)
  target_compile_definitions(transport_bw_test PRIVATE
                             TRANSPORT_BW_BIN="$<TARGET_FILE:transport_bw>")
  add_dependencies(transport_bw_test transport_bw)
endif()
