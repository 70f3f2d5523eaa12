# transport_bw: hetpar's UCX data plane against raw ucx_perftest, c10d Gloo send/recv and memcpy,
# one pair of processes over loopback. JSON lines on stdout. libtorch is linked here only, for
# the Gloo baseline; the transport targets never link it.
add_executable(transport_bw "${CMAKE_CURRENT_LIST_DIR}/transport_bw.cc")
hetpar_target_defaults(transport_bw)
target_link_libraries(transport_bw PRIVATE hetpar_transport_ucx ${TORCH_LIBRARIES})
# The raw baseline is the ucx_perftest of the UCX hetpar links, with that UCX's libraries.
target_compile_definitions(transport_bw PRIVATE HETPAR_UCX_PERFTEST="${HETPAR_UCX_PERFTEST}"
                                               HETPAR_UCX_LIBDIR="${HETPAR_UCX_LIBDIR}")
