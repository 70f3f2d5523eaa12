# Finds libtorch 2.x for hetpar.
#
# Default: the PyPI torch wheel that deploy/install-deps.sh installs into <repo>/.venv (pinned in
# deploy/requirements.txt; built for CUDA 13.0, its headers, libraries and CMake config inside the
# wheel). Another libtorch: configure with -DTorch_DIR=<prefix>/share/cmake/Torch.
#
# Two things differ from a plain find_package(Torch):
#  - the libraries are searched in that libtorch's own lib/ only, never the system paths (Debian's
#    libtorch 1.13 in /usr/lib must not be picked up by the wheel's config);
#  - the wheel's include/ carries protobuf 3.13 headers (include/google), which would shadow
#    Debian's protobuf 3.21 that the control plane is generated for. hetpar compiles against a
#    view of that include/ without google/ (symlinks under the build tree).
# A wheel built with CUDA needs the CUDA toolkit at configure time (CUDAToolkit_ROOT, default
# /usr/local/cuda); no GPU is needed to build or to run the CPU paths.

if(NOT Torch_DIR)
  file(GLOB _hetpar_torch_dirs
       "${PROJECT_SOURCE_DIR}/.venv/lib/python3*/site-packages/torch/share/cmake/Torch")
  if(NOT _hetpar_torch_dirs)
    message(FATAL_ERROR
      "hetpar: no libtorch found. Run deploy/install-deps.sh (it installs the pinned torch wheel "
      "into ${PROJECT_SOURCE_DIR}/.venv), or point -DTorch_DIR at <libtorch>/share/cmake/Torch.")
  endif()
  list(GET _hetpar_torch_dirs 0 _hetpar_torch_dir)
  set(Torch_DIR "${_hetpar_torch_dir}" CACHE PATH "libtorch's CMake config (TorchConfig.cmake)")
endif()
get_filename_component(HETPAR_TORCH_PREFIX "${Torch_DIR}/../../.." ABSOLUTE)

if(NOT CUDAToolkit_ROOT AND NOT DEFINED ENV{CUDAToolkit_ROOT} AND EXISTS /usr/local/cuda/bin/nvcc)
  set(CUDAToolkit_ROOT /usr/local/cuda)
endif()

# hetpar compiles no CUDA sources of its own: no architecture list for CMake, and a fixed one for
# libtorch's config (it would otherwise probe for a GPU at configure time and warn).
if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
  set(CMAKE_CUDA_ARCHITECTURES OFF)
endif()
if(NOT DEFINED TORCH_CUDA_ARCH_LIST AND NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
  set(TORCH_CUDA_ARCH_LIST "8.0;9.0;10.0")
endif()

# Its Caffe2 config (not Debian's in /usr/lib/cmake) and its libraries, from libtorch's own
# prefix only.
set(Caffe2_DIR "${HETPAR_TORCH_PREFIX}/share/cmake/Caffe2" CACHE PATH "libtorch's Caffe2 config" FORCE)
foreach(_lib torch torch_cpu torch_cuda c10 c10_cuda)
  if(EXISTS "${HETPAR_TORCH_PREFIX}/lib/lib${_lib}.so")
    set(${_lib}_LIBRARY "${HETPAR_TORCH_PREFIX}/lib/lib${_lib}.so" CACHE FILEPATH "")
  endif()
endforeach()
set(TORCH_LIBRARY "${HETPAR_TORCH_PREFIX}/lib/libtorch.so" CACHE FILEPATH "libtorch")
# The wheel links kineto (the profiler) into libtorch_cpu; TorchConfig would warn that it has no
# library of its own.
if(NOT EXISTS "${HETPAR_TORCH_PREFIX}/lib/libkineto.so"
   AND EXISTS "${HETPAR_TORCH_PREFIX}/lib/libtorch_cpu.so")
  set(kineto_LIBRARY "${HETPAR_TORCH_PREFIX}/lib/libtorch_cpu.so" CACHE FILEPATH "")
endif()
if(EXISTS "${HETPAR_TORCH_PREFIX}/lib/libc10_cuda.so")
  set(C10_CUDA_LIBRARY "${HETPAR_TORCH_PREFIX}/lib/libc10_cuda.so" CACHE FILEPATH "")
endif()

find_package(Torch REQUIRED)
if(Torch_VERSION VERSION_LESS 2.0)
  message(FATAL_ERROR "hetpar: libtorch ${Torch_VERSION} at ${HETPAR_TORCH_PREFIX} is too old; "
                      "hetpar needs libtorch 2.x (the c10d Backend API)")
endif()

# The wheel's libraries export parts of a newer libstdc++ that they carry linked in (std::filesystem,
# std::chrono's time zones, stream str() overloads; libtorch.so alone exports 182 std:: symbols).
# Loaded before the system's libstdc++.so.6 they would interpose its definitions for the whole
# process: std::filesystem::remove_all called from hetpar jumped to a null address. Linking
# libstdc++ ahead of libtorch puts libstdc++.so.6 first in the search order, so every std::
# symbol the system library has comes from it.
set(TORCH_LIBRARIES stdc++ ${TORCH_LIBRARIES})

# The include view without google/ (see above).
set(_view "${PROJECT_BINARY_DIR}/torch-include")
file(MAKE_DIRECTORY "${_view}")
file(GLOB _entries RELATIVE "${HETPAR_TORCH_PREFIX}/include" "${HETPAR_TORCH_PREFIX}/include/*")
foreach(_entry ${_entries})
  if(NOT _entry STREQUAL "google" AND NOT EXISTS "${_view}/${_entry}")
    file(CREATE_LINK "${HETPAR_TORCH_PREFIX}/include/${_entry}" "${_view}/${_entry}" SYMBOLIC)
  endif()
endforeach()
set(HETPAR_TORCH_INCLUDE_DIRS "${_view}" "${HETPAR_TORCH_PREFIX}/include/torch/csrc/api/include")
foreach(_target torch torch_cpu torch_cuda c10 c10_cuda torch_cpu_library torch_cuda_library
                torch_library)
  if(TARGET ${_target})
    set_target_properties(${_target} PROPERTIES INTERFACE_INCLUDE_DIRECTORIES
                                                "${HETPAR_TORCH_INCLUDE_DIRS}")
  endif()
endforeach()
set(HETPAR_TORCH_HAS_CUDA OFF)
if(TARGET torch_cuda)
  set(HETPAR_TORCH_HAS_CUDA ON)
endif()
message(STATUS "hetpar: libtorch ${Torch_VERSION} at ${HETPAR_TORCH_PREFIX} (CUDA: ${HETPAR_TORCH_HAS_CUDA})")
