# Writes common/version.h (HETPAR_VERSION, HETPAR_GIT_REVISION) at build time, so that a binary
# names the commit it was built from, not the one its build folder was configured at. Run by the
# hetpar_version target on every build; the header is rewritten, and what includes it rebuilt,
# only when the revision changed.
#   cmake -DSOURCE_DIR=... -DOUTPUT=... -DPROJECT_VERSION=... -P HetparVersion.cmake
execute_process(COMMAND git rev-parse --short HEAD WORKING_DIRECTORY "${SOURCE_DIR}"
                OUTPUT_VARIABLE HETPAR_GIT_REVISION OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
if(NOT HETPAR_GIT_REVISION)
  set(HETPAR_GIT_REVISION "unknown")
endif()
configure_file("${SOURCE_DIR}/common/version.h.in" "${OUTPUT}" @ONLY)
