# Finds UCX for hetpar's data plane and defines hetpar::ucx, the one target that links it.
#
# Which UCX, first match wins:
#  1. -Ducx_DIR=<dir with ucx-config.cmake> or -DHETPAR_UCX_PREFIX=<UCX install prefix>: a UCX of
#     your own (for example one built with verbs for RDMA across nodes);
#  2. the PyPI wheel libucx-cu13 that deploy/install-deps.sh installs into <repo>/.venv (pinned in
#     deploy/requirements.txt): UCX 1.22 built with CUDA (cuda_copy, CUDA IPC) and without verbs;
#     its CMake config is relocatable, its pkg-config files are not (they name the wheel's build
#     machine);
#  3. only when there is no venv (HETPAR_NO_VENV=1 builds): pkg-config `ucx`, Debian's libucx-dev
#     (UCX 1.13, no CUDA).
#
# Loading. Debian's libucx0 (libucp.so.0, libuct.so.0, libucs.so.0, libucm.so.0 in the system
# library directory) may be installed beside the wheel, and the sonames are the same. The wheel's
# libraries carry an RPATH that starts with a directory of its build machine, and its modules
# (lib/ucx/libuct_*.so) only that as RUNPATH. So hetpar::ucx links all four libraries with
# --no-as-needed: each is a direct NEEDED entry of every executable, found through the
# executable's RUNPATH (the UCX lib/ directory), and the modules UCX loads later reuse them. UCX
# loads its modules from lib/ucx beside the libucs.so.0 it runs with.
#
# Sets HETPAR_UCX_VERSION, HETPAR_UCX_HAS_CUDA (whether this UCX has its CUDA transport module;
# UCX loads it only where the GPU driver's libcuda.so.1 and libnvidia-ml.so.1 are),
# HETPAR_UCX_LIBDIR and HETPAR_UCX_PERFTEST (this UCX's ucx_perftest, else the one on PATH).

if(TARGET hetpar::ucx)
  return()
endif()

set(HETPAR_UCX_PREFIX "" CACHE PATH
    "A UCX installation to build against (with lib/cmake/ucx); empty: the wheel in .venv")

set(_hetpar_venv_ucx "${PROJECT_SOURCE_DIR}/.venv/lib/python3*/site-packages/libucx/lib/cmake/ucx")
# Whether ucx_DIR (cached by an earlier configure) is the venv's wheel.
macro(_hetpar_ucx_dir_in_venv out)
  string(FIND "${ucx_DIR}" "${PROJECT_SOURCE_DIR}/.venv/" _hetpar_pos)
  if(_hetpar_pos EQUAL 0)
    set(${out} TRUE)
  else()
    set(${out} FALSE)
  endif()
endmacro()
if(HETPAR_UCX_PREFIX)
  if(NOT EXISTS "${HETPAR_UCX_PREFIX}/lib/cmake/ucx/ucx-config.cmake")
    message(FATAL_ERROR
      "hetpar: HETPAR_UCX_PREFIX=${HETPAR_UCX_PREFIX} has no lib/cmake/ucx/ucx-config.cmake; "
      "expected the prefix of a UCX 1.13 or newer installation (UCX's make install writes it)")
  endif()
  set(ucx_DIR "${HETPAR_UCX_PREFIX}/lib/cmake/ucx" CACHE PATH "UCX's CMake config" FORCE)
elseif(ucx_DIR AND NOT EXISTS "${ucx_DIR}/ucx-config.cmake")
  _hetpar_ucx_dir_in_venv(_in_venv)
  if(NOT _in_venv)
    message(FATAL_ERROR "hetpar: ucx_DIR=${ucx_DIR} has no ucx-config.cmake")
  endif()
  unset(ucx_DIR CACHE)  # the venv's wheel moved or went: look again
endif()
if(NOT ucx_DIR AND NOT "$ENV{HETPAR_NO_VENV}" STREQUAL "1")
  file(GLOB _hetpar_ucx_dirs "${_hetpar_venv_ucx}")
  if(_hetpar_ucx_dirs)
    list(GET _hetpar_ucx_dirs 0 _hetpar_ucx_dir)
    set(ucx_DIR "${_hetpar_ucx_dir}" CACHE PATH "UCX's CMake config" FORCE)
  elseif(EXISTS "${PROJECT_SOURCE_DIR}/.venv/bin/python")
    message(FATAL_ERROR
      "hetpar: ${PROJECT_SOURCE_DIR}/.venv has no libucx wheel. Run deploy/install-deps.sh (it "
      "installs the pinned libucx-cu13 into the venv), or point -DHETPAR_UCX_PREFIX at a UCX "
      "installation.")
  endif()
endif()

if(ucx_DIR)
  find_package(ucx CONFIG REQUIRED NO_DEFAULT_PATH PATHS "${ucx_DIR}")
  foreach(_lib ucp uct ucs)
    if(NOT TARGET ucx::${_lib})
      message(FATAL_ERROR "hetpar: UCX's CMake config ${ucx_DIR} defines no target ucx::${_lib}")
    endif()
  endforeach()
  get_target_property(_hetpar_ucs_location ucx::ucs IMPORTED_LOCATION)
  get_filename_component(_hetpar_ucx_libdir "${_hetpar_ucs_location}" DIRECTORY)
  set(HETPAR_UCX_VERSION "${ucx_VERSION}")
  _hetpar_ucx_dir_in_venv(_in_venv)
  if(_in_venv)
    set(_hetpar_ucx_found "the libucx-cu13 wheel in .venv, ${_hetpar_ucx_libdir}")
  else()
    set(_hetpar_ucx_found "${_hetpar_ucx_libdir}")
  endif()
  # The config has no target for libucm (UCX's memory hooks, which libucs and libuct need).
  if(NOT EXISTS "${_hetpar_ucx_libdir}/libucm.so")
    message(FATAL_ERROR "hetpar: ${_hetpar_ucx_libdir} has no libucm.so (UCX's memory hooks)")
  endif()
  add_library(hetpar_ucx_ucm SHARED IMPORTED)
  set_target_properties(hetpar_ucx_ucm PROPERTIES IMPORTED_LOCATION
                                                  "${_hetpar_ucx_libdir}/libucm.so")

  # A link feature that keeps the listed libraries as NEEDED entries although the linker runs
  # with --as-needed (Debian's GCC passes it). Cached so that it applies in every directory:
  # CMake reads it where the executable is linked.
  set(CMAKE_LINK_LIBRARY_USING_HETPAR_NO_AS_NEEDED
      "LINKER:--push-state,--no-as-needed;<LINK_ITEM>;LINKER:--pop-state" CACHE INTERNAL "")
  set(CMAKE_LINK_LIBRARY_USING_HETPAR_NO_AS_NEEDED_SUPPORTED TRUE CACHE INTERNAL "")
  add_library(hetpar_ucx INTERFACE)
  target_link_libraries(hetpar_ucx INTERFACE
    "$<LINK_LIBRARY:HETPAR_NO_AS_NEEDED,ucx::ucp,ucx::uct,ucx::ucs,hetpar_ucx_ucm>")
else()
  find_package(PkgConfig REQUIRED)
  pkg_check_modules(UCX REQUIRED IMPORTED_TARGET ucx)
  pkg_get_variable(_hetpar_ucx_libdir ucx libdir)
  set(HETPAR_UCX_VERSION "${UCX_VERSION}")
  set(_hetpar_ucx_found "pkg-config ucx (no venv), ${_hetpar_ucx_libdir}")
  add_library(hetpar_ucx INTERFACE)
  target_link_libraries(hetpar_ucx INTERFACE PkgConfig::UCX)
endif()
add_library(hetpar::ucx ALIAS hetpar_ucx)

if(HETPAR_UCX_VERSION VERSION_LESS 1.13)
  message(FATAL_ERROR "hetpar: UCX ${HETPAR_UCX_VERSION} (${_hetpar_ucx_found}) is too old; "
                      "hetpar needs UCX 1.13 or newer")
endif()

# The ucx_perftest of this UCX (bench/transport_bw's raw baseline), run with its libraries first on
# the library path; the one on PATH otherwise.
# Cached (internal) so that other directories, such as bench/, see them.
set(HETPAR_UCX_LIBDIR "${_hetpar_ucx_libdir}" CACHE INTERNAL "")
get_filename_component(_hetpar_ucx_bindir "${_hetpar_ucx_libdir}/../bin" ABSOLUTE)
if(EXISTS "${_hetpar_ucx_bindir}/ucx_perftest")
  set(HETPAR_UCX_PERFTEST "${_hetpar_ucx_bindir}/ucx_perftest" CACHE INTERNAL "")
else()
  set(HETPAR_UCX_PERFTEST "ucx_perftest" CACHE INTERNAL "")
endif()

file(GLOB _hetpar_ucx_cuda_module "${_hetpar_ucx_libdir}/ucx/libuct_cuda.so*")
if(_hetpar_ucx_cuda_module)
  set(HETPAR_UCX_HAS_CUDA ON)
else()
  set(HETPAR_UCX_HAS_CUDA OFF)
endif()
message(STATUS "hetpar: UCX ${HETPAR_UCX_VERSION} from ${_hetpar_ucx_found} (CUDA: "
               "${HETPAR_UCX_HAS_CUDA})")
