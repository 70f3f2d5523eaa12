# coordinator_scale: a coordinator process serving 1024 simulated workers (registration time,
# heartbeat round trips, the coordinator's CPU per step at 1 step/s against its heartbeat-only
# baseline and the 5%-of-a-core goal). JSON lines on stdout.
add_executable(coordinator_scale "${CMAKE_CURRENT_LIST_DIR}/coordinator_scale.cc")
hetpar_target_defaults(coordinator_scale)
target_link_libraries(coordinator_scale PRIVATE hetpar_coordinator_service CLI11::CLI11)
