# CUDA set-up for a build against a CUDA build of torch; included before find_package(Torch).
#
# Left to itself, torch's CMake (Caffe2/public/cuda.cmake) looks for the toolkit next to the first
# nvcc on PATH (wrong when that nvcc is a wrapper script that execs the real one), detects the GPU
# architectures with a try_run (needs a GPU, and fails when our C++20 leaks into the CUDA
# try-compile) and requires libnvrtc from the toolkit (pip users get it from the nvidia-* wheels
# torch depends on instead). Here every one of those comes from us, found once:
#
# - nvcc: CMAKE_CUDA_COMPILER or CUDACXX if set, else $CUDA_HOME/bin or $CUDA_PATH/bin (which
#   must then hold nvcc), else PATH, else /usr/local/cuda/bin. CMake's compiler identification
#   resolves a wrapper script to the real toolkit.
# - the toolkit: CMake's CUDAToolkit package, from that compiler; handed to torch's FindCUDA as
#   CUDA_TOOLKIT_ROOT_DIR and CUDA_NVCC_EXECUTABLE.
# - architectures: CMAKE_CUDA_ARCHITECTURES (setup.py fills it from VLLM_KV_CUDA_ARCHS or
#   TORCH_CUDA_ARCH_LIST), default 80;90a;100a;120a, handed to torch as TORCH_CUDA_ARCH_LIST so
#   that nothing is detected.
# - libnvrtc: CUDA_nvrtc_LIBRARY if set, else the toolkit, else the nvidia wheels installed next to
#   torch (found from CMAKE_PREFIX_PATH, i.e. torch.utils.cmake_prefix_path).
#
# Optional input VLLM_KV_TORCH_CUDA_VERSION (torch.version.cuda): the toolkit's major version must
# match it. Output: VLLM_KV_CUDA_ARCHITECTURES.

if(NOT CMAKE_CUDA_ARCHITECTURES)
  set(CMAKE_CUDA_ARCHITECTURES "80;90a;100a;120a")
endif()
# find_package(Torch) resets CMAKE_CUDA_ARCHITECTURES (warning that it ignores it: expected) and
# appends its own -gencode flags: keep ours; CMakeLists.txt puts them back on the target.
set(VLLM_KV_CUDA_ARCHITECTURES "${CMAKE_CUDA_ARCHITECTURES}")

# --- architectures, in torch's spelling: 90a -> 9.0a, 120a -> 12.0a, 80-virtual -> 8.0+PTX ------
set(TORCH_CUDA_ARCH_LIST "")
foreach(_arch IN LISTS VLLM_KV_CUDA_ARCHITECTURES)
  if(NOT _arch MATCHES "^([0-9]+)([0-9])([af]?)(-real|-virtual)?$")
    message(FATAL_ERROR
      "vllm-kvcache: CUDA architecture '${_arch}': expected entries like 80, 90a or 120a-real "
      "(set VLLM_KV_CUDA_ARCHS or CMAKE_CUDA_ARCHITECTURES)")
  endif()
  set(_torch_arch "${CMAKE_MATCH_1}.${CMAKE_MATCH_2}${CMAKE_MATCH_3}")
  if(CMAKE_MATCH_4 STREQUAL "-virtual")
    string(APPEND _torch_arch "+PTX")
  endif()
  list(APPEND TORCH_CUDA_ARCH_LIST "${_torch_arch}")
endforeach()

# --- nvcc -------------------------------------------------------------------------------------
if(NOT CMAKE_CUDA_COMPILER AND "$ENV{CUDACXX}" STREQUAL "")
  set(_vllm_kv_nvcc_hints "")
  foreach(_var CUDA_HOME CUDA_PATH)
    if(NOT "$ENV{${_var}}" STREQUAL "")
      # A toolkit named explicitly must be used, not silently replaced by another nvcc.
      if(NOT EXISTS "$ENV{${_var}}/bin/nvcc")
        message(FATAL_ERROR
          "vllm-kvcache: ${_var}=$ENV{${_var}}, but $ENV{${_var}}/bin/nvcc does not exist. Set "
          "${_var} to the CUDA toolkit's directory (the one holding bin/nvcc), or unset it.")
      endif()
      list(APPEND _vllm_kv_nvcc_hints "$ENV{${_var}}/bin")
    endif()
  endforeach()
  find_program(VLLM_KV_NVCC nvcc HINTS ${_vllm_kv_nvcc_hints} PATHS /usr/local/cuda/bin)
  if(NOT VLLM_KV_NVCC)
    message(FATAL_ERROR
      "vllm-kvcache: torch is a CUDA build, but no nvcc was found (looked in $CUDA_HOME/bin, "
      "$CUDA_PATH/bin, PATH and /usr/local/cuda/bin). Install the CUDA toolkit and set CUDA_HOME "
      "to its directory (the one holding bin/nvcc), or set CUDACXX to the nvcc to use.")
  endif()
  set(CMAKE_CUDA_COMPILER "${VLLM_KV_NVCC}")
endif()

# The .cu kernels are torch-free C++17. Set before torch's CMake reads it: otherwise it copies
# CMAKE_CXX_STANDARD (20, with GNU extensions) into every CUDA try-compile.
set(CMAKE_CUDA_STANDARD 17)
set(CMAKE_CUDA_STANDARD_REQUIRED ON)
set(CMAKE_CUDA_EXTENSIONS OFF)
enable_language(CUDA)

# --- the toolkit --------------------------------------------------------------------------------
find_package(CUDAToolkit REQUIRED)
get_filename_component(_vllm_kv_cuda_root "${CUDAToolkit_BIN_DIR}" DIRECTORY)
message(STATUS "vllm-kvcache: CUDA ${CUDAToolkit_VERSION} toolkit in ${_vllm_kv_cuda_root} "
               "(nvcc ${CUDAToolkit_NVCC_EXECUTABLE})")
if(NOT EXISTS "${_vllm_kv_cuda_root}/include/cuda_runtime.h")
  message(FATAL_ERROR
    "vllm-kvcache: ${_vllm_kv_cuda_root}/include/cuda_runtime.h not found (the toolkit of "
    "${CUDAToolkit_NVCC_EXECUTABLE}). Set CUDA_HOME to a complete CUDA toolkit.")
endif()
if(VLLM_KV_TORCH_CUDA_VERSION)
  string(REGEX MATCH "^[0-9]+" _vllm_kv_torch_cuda_major "${VLLM_KV_TORCH_CUDA_VERSION}")
  if(NOT _vllm_kv_torch_cuda_major STREQUAL CUDAToolkit_VERSION_MAJOR)
    message(FATAL_ERROR
      "vllm-kvcache: torch was built with CUDA ${VLLM_KV_TORCH_CUDA_VERSION}, but the toolkit in "
      "${_vllm_kv_cuda_root} is CUDA ${CUDAToolkit_VERSION}. Set CUDA_HOME to a CUDA "
      "${_vllm_kv_torch_cuda_major}.x toolkit (or CUDACXX to its nvcc).")
  endif()
endif()
set(CUDA_TOOLKIT_ROOT_DIR "${_vllm_kv_cuda_root}" CACHE PATH "toolkit for torch's FindCUDA" FORCE)
set(CUDA_NVCC_EXECUTABLE "${CUDAToolkit_NVCC_EXECUTABLE}" CACHE FILEPATH "real nvcc" FORCE)

# --- libnvrtc -----------------------------------------------------------------------------------
set(_vllm_kv_wheel_lib_dirs "")
foreach(_prefix IN LISTS CMAKE_PREFIX_PATH)
  # torch.utils.cmake_prefix_path is <site-packages>/torch/share/cmake.
  get_filename_component(_site "${_prefix}/../../.." ABSOLUTE)
  file(GLOB _dirs LIST_DIRECTORIES true "${_site}/nvidia/*/lib")
  list(APPEND _vllm_kv_wheel_lib_dirs ${_dirs})
endforeach()
find_library(CUDA_nvrtc_LIBRARY
  NAMES nvrtc "libnvrtc.so.${CUDAToolkit_VERSION_MAJOR}"
  HINTS ${CUDAToolkit_LIBRARY_DIR} ${_vllm_kv_wheel_lib_dirs}
  NO_DEFAULT_PATH)
if(NOT CUDA_nvrtc_LIBRARY)
  message(FATAL_ERROR
    "vllm-kvcache: libnvrtc.so (or libnvrtc.so.${CUDAToolkit_VERSION_MAJOR}) not found in "
    "${CUDAToolkit_LIBRARY_DIR} nor in the nvidia wheels next to torch "
    "(${_vllm_kv_wheel_lib_dirs}). Install the nvrtc wheel torch depends on "
    "(pip show torch lists it) or set CUDA_nvrtc_LIBRARY to the library's path.")
endif()
message(STATUS "vllm-kvcache: CUDA architectures ${VLLM_KV_CUDA_ARCHITECTURES} "
               "(TORCH_CUDA_ARCH_LIST ${TORCH_CUDA_ARCH_LIST}), nvrtc ${CUDA_nvrtc_LIBRARY}")
