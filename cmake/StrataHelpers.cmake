# Small helpers so every folder declares its target the same way.

# strata_library(NAME <target> SOURCES ... [DEPS ...] [PRIVATE_DEPS ...])
function(strata_library)
  cmake_parse_arguments(L "" "NAME" "SOURCES;DEPS;PRIVATE_DEPS" ${ARGN})
  add_library(${L_NAME} STATIC ${L_SOURCES})
  target_include_directories(${L_NAME} PUBLIC ${PROJECT_SOURCE_DIR})
  target_compile_options(${L_NAME} PRIVATE -Wall -Wextra)
  target_link_libraries(${L_NAME} PUBLIC ${L_DEPS} PRIVATE ${L_PRIVATE_DEPS})
endfunction()

# strata_test(NAME <target> SOURCES ... DEPS ... LABELS ... [SERIAL | PROCESSES])
# SERIAL: run its tests one at a time, alone (multi-process tests whose
# heartbeat deadlines must not compete with the rest of the suite for 2 cores).
# PROCESSES: one at a time among themselves (each starts a cluster of
# processes), but beside single-process tests, and before them.
function(strata_test)
  cmake_parse_arguments(T "SERIAL;PROCESSES" "NAME" "SOURCES;DEPS;LABELS" ${ARGN})
  set(props LABELS "${T_LABELS}")
  if(T_SERIAL)
    list(APPEND props RUN_SERIAL TRUE)
  endif()
  if(T_PROCESSES)
    # Started first (CTest runs costlier tests first; a fresh build has no
    # timings yet), so that single-process tests fill the other core meanwhile.
    list(APPEND props RESOURCE_LOCK processes COST 1000)
  endif()
  add_executable(${T_NAME} ${T_SOURCES})
  # Test code is assertions and calls into the (fully optimized) libraries: -O1
  # compiles it in about 60 % of -O3's time (what a fresh machine waits for).
  target_compile_options(${T_NAME} PRIVATE -Wall -Wextra -O1)
  target_compile_definitions(${T_NAME} PRIVATE
    STRATA_SHARED_DIR="${STRATA_SHARED_DIR}"
    STRATA_BINARY_DIR="${PROJECT_BINARY_DIR}"
    STRATA_SOURCE_DIR="${PROJECT_SOURCE_DIR}")
  target_link_libraries(${T_NAME} PRIVATE ${T_DEPS} GTest::gtest GTest::gtest_main)
  gtest_discover_tests(${T_NAME}
    WORKING_DIRECTORY ${PROJECT_SOURCE_DIR}
    PROPERTIES ${props}
    DISCOVERY_TIMEOUT 60)
endfunction()
