# plan_calibrate: this machine's constants for the layout planner, written as a cluster file
# (`hetpar plan --estimate --cluster FILE`; see the source and docs/planner.md).
add_executable(plan_calibrate ${CMAKE_CURRENT_LIST_DIR}/plan_calibrate.cc)
hetpar_target_defaults(plan_calibrate)
target_link_libraries(plan_calibrate PRIVATE hetpar_encoder hetpar_llm CLI11::CLI11
                      nlohmann_json::nlohmann_json)
target_compile_definitions(plan_calibrate PRIVATE HETPAR_BIN="$<TARGET_FILE:hetpar>"
                                                  HETPAR_SOURCE_DIR="${PROJECT_SOURCE_DIR}")
add_dependencies(plan_calibrate hetpar hetpar-encoder hetpar-llm)
