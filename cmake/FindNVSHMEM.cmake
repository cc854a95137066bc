# Finds NVSHMEM as shipped in the nvidia-nvshmem-cu13 wheel (no CMake config, no unversioned
# host library), or under NVSHMEM_ROOT (CMake variable or environment). Defines:
#   nvshmem::host    libnvshmem_host.so.3, linked by its full path
#   nvshmem::device  libnvshmem_device.a, for the device link (relocatable device code)
#   NVSHMEM_ROOT, NVSHMEM_VERSION, NVSHMEM_INCLUDE_DIR, NVSHMEM_HOST_LIBRARY, NVSHMEM_DEVICE_LIBRARY
if(NOT NVSHMEM_ROOT AND DEFINED ENV{NVSHMEM_ROOT})
  set(NVSHMEM_ROOT "$ENV{NVSHMEM_ROOT}")
endif()
if(NOT NVSHMEM_ROOT)
  if(NOT Python_EXECUTABLE)
    find_package(Python REQUIRED COMPONENTS Interpreter)
  endif()
  # nvidia.nvshmem is a namespace package: its location is __path__, not __file__.
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c "import nvidia.nvshmem as m; print(list(m.__path__)[0])"
    OUTPUT_VARIABLE NVSHMEM_ROOT OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
endif()

# The paths found below are cached. Search again when the root changed: with pip's build
# isolation every build installs the wheel into a fresh temporary environment, and a reused
# build directory would otherwise point at the previous, deleted one.
if(NOT "${NVSHMEM_ROOT}" STREQUAL "${_JAX_EP_NVSHMEM_SEARCHED_ROOT}")
  unset(NVSHMEM_INCLUDE_DIR CACHE)
  unset(NVSHMEM_HOST_LIBRARY CACHE)
  unset(NVSHMEM_DEVICE_LIBRARY CACHE)
endif()
set(_JAX_EP_NVSHMEM_SEARCHED_ROOT "${NVSHMEM_ROOT}" CACHE INTERNAL "NVSHMEM root last searched")

find_path(NVSHMEM_INCLUDE_DIR nvshmem.h HINTS "${NVSHMEM_ROOT}/include" NO_DEFAULT_PATH)
find_file(NVSHMEM_HOST_LIBRARY NAMES libnvshmem_host.so.3 libnvshmem_host.so
          HINTS "${NVSHMEM_ROOT}/lib" NO_DEFAULT_PATH)
find_file(NVSHMEM_DEVICE_LIBRARY NAMES libnvshmem_device.a
          HINTS "${NVSHMEM_ROOT}/lib" NO_DEFAULT_PATH)

if(NVSHMEM_INCLUDE_DIR AND EXISTS "${NVSHMEM_INCLUDE_DIR}/non_abi/nvshmem_version.h")
  file(STRINGS "${NVSHMEM_INCLUDE_DIR}/non_abi/nvshmem_version.h" _nvshmem_version_lines
       REGEX "#define NVSHMEM_VENDOR_(MAJOR|MINOR|PATCH)_VERSION")
  foreach(part MAJOR MINOR PATCH)
    string(REGEX REPLACE ".*NVSHMEM_VENDOR_${part}_VERSION[ \t]+([0-9]+).*" "\\1" _v_${part}
           "${_nvshmem_version_lines}")
  endforeach()
  set(NVSHMEM_VERSION "${_v_MAJOR}.${_v_MINOR}.${_v_PATCH}")
endif()

include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(NVSHMEM
  REQUIRED_VARS NVSHMEM_INCLUDE_DIR NVSHMEM_HOST_LIBRARY NVSHMEM_DEVICE_LIBRARY
  VERSION_VAR NVSHMEM_VERSION
  FAIL_MESSAGE "NVSHMEM not found: pip install nvidia-nvshmem-cu13==3.4.5, or set NVSHMEM_ROOT")

if(NVSHMEM_FOUND AND NOT TARGET nvshmem::host)
  add_library(nvshmem::host SHARED IMPORTED)
  set_target_properties(nvshmem::host PROPERTIES
    IMPORTED_LOCATION "${NVSHMEM_HOST_LIBRARY}"
    IMPORTED_SONAME "libnvshmem_host.so.3"
    INTERFACE_INCLUDE_DIRECTORIES "${NVSHMEM_INCLUDE_DIR}")
  add_library(nvshmem::device STATIC IMPORTED)
  set_target_properties(nvshmem::device PROPERTIES
    IMPORTED_LOCATION "${NVSHMEM_DEVICE_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${NVSHMEM_INCLUDE_DIR}")
endif()
