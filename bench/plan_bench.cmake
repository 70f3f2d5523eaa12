# plan_bench: the full step plan for a 2048-rank LLM fed by a 1024-rank encoder pool.
add_executable(plan_bench "${CMAKE_CURRENT_LIST_DIR}/plan_bench.cc")
hetpar_target_defaults(plan_bench)
target_link_libraries(plan_bench PRIVATE hetpar_common benchmark::benchmark)
