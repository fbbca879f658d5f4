# Finds NCCL (header nccl.h, library libnccl) and reads its version from the header.
# Hints: NCCL_HOME / NCCL_ROOT (environment or cache), the CUDA toolkit, the system paths.
# Defines NCCL::nccl and NCCL_VERSION.
set(_nccl_hints $ENV{NCCL_HOME} $ENV{NCCL_ROOT} ${NCCL_HOME} ${NCCL_ROOT})
if(CUDAToolkit_LIBRARY_ROOT)
  list(APPEND _nccl_hints ${CUDAToolkit_LIBRARY_ROOT})
endif()
find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${_nccl_hints} ${CUDAToolkit_INCLUDE_DIRS} PATH_SUFFIXES include)
find_library(NCCL_LIBRARY NAMES nccl HINTS ${_nccl_hints} ${CUDAToolkit_LIBRARY_DIR} PATH_SUFFIXES lib lib64)

if(NCCL_INCLUDE_DIR AND EXISTS "${NCCL_INCLUDE_DIR}/nccl.h")
  file(STRINGS "${NCCL_INCLUDE_DIR}/nccl.h" _nccl_major REGEX "^#define NCCL_MAJOR +[0-9]+")
  file(STRINGS "${NCCL_INCLUDE_DIR}/nccl.h" _nccl_minor REGEX "^#define NCCL_MINOR +[0-9]+")
  file(STRINGS "${NCCL_INCLUDE_DIR}/nccl.h" _nccl_patch REGEX "^#define NCCL_PATCH +[0-9]+")
  string(REGEX REPLACE ".* ([0-9]+)$" "\\1" _nccl_major "${_nccl_major}")
  string(REGEX REPLACE ".* ([0-9]+)$" "\\1" _nccl_minor "${_nccl_minor}")
  string(REGEX REPLACE ".* ([0-9]+)$" "\\1" _nccl_patch "${_nccl_patch}")
  set(NCCL_VERSION "${_nccl_major}.${_nccl_minor}.${_nccl_patch}")
endif()

include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(NCCL REQUIRED_VARS NCCL_LIBRARY NCCL_INCLUDE_DIR VERSION_VAR NCCL_VERSION)

if(NCCL_FOUND AND NOT TARGET NCCL::nccl)
  if(NOT EXISTS "${NCCL_INCLUDE_DIR}/nccl_device.h")
    message(FATAL_ERROR "NCCL ${NCCL_VERSION} at ${NCCL_INCLUDE_DIR} has no nccl_device.h: tdist needs NCCL >= 2.28 with its device API")
  endif()
  add_library(NCCL::nccl UNKNOWN IMPORTED)
  set_target_properties(NCCL::nccl PROPERTIES
    IMPORTED_LOCATION "${NCCL_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${NCCL_INCLUDE_DIR}")
endif()
mark_as_advanced(NCCL_INCLUDE_DIR NCCL_LIBRARY)
