# Shared helpers for hetpar's targets.

# Warnings for hetpar's own code (dependencies are SYSTEM includes and stay quiet).
function(hetpar_target_defaults target)
  target_compile_options(${target} PRIVATE -Wall -Wextra)
  if(HETPAR_WERROR)
    target_compile_options(${target} PRIVATE -Werror)
  endif()
endfunction()

# hetpar_add_test(NAME name SOURCES a.cc b.cc LIBS lib... LABELS unit|integration|parity|fault|slow
#                 [TIMEOUT seconds] [ARGS ...])
# One executable and one ctest per test file; gtest_main unless the sources define main.
function(hetpar_add_test)
  cmake_parse_arguments(T "NO_GTEST_MAIN" "NAME;TIMEOUT" "SOURCES;LIBS;LABELS;ARGS" ${ARGN})
  add_executable(${T_NAME} ${T_SOURCES})
  hetpar_target_defaults(${T_NAME})
  target_link_libraries(${T_NAME} PRIVATE ${T_LIBS} GTest::gtest GTest::gmock)
  if(NOT T_NO_GTEST_MAIN)
    target_link_libraries(${T_NAME} PRIVATE GTest::gtest_main)
  endif()
  add_test(NAME ${T_NAME} COMMAND ${T_NAME} ${T_ARGS})
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 300)
  endif()
  set_tests_properties(${T_NAME} PROPERTIES LABELS "${T_LABELS}" TIMEOUT ${T_TIMEOUT})
endfunction()
