# Finds oneDNN (Debian's libdnnl-dev) for its CPU engine only, and exposes DNNL::dnnl.
#
# Debian's own dnnl-config.cmake is not used: it was built with the OpenCL GPU runtime and
# calls find_package(OpenCL REQUIRED), which fails on a fresh machine because libdnnl-dev
# only *recommends* ocl-icd-opencl-dev (and scripts/setup installs without recommends).
# strata uses the CPU engine alone, so neither OpenCL's headers nor its CMake files are
# needed; the OpenCL loader (ocl-icd-libopencl1) that libdnnl.so links against comes with
# libdnnl2 as a hard dependency.
# Usage: find_package(DNNL 2.6 REQUIRED)

find_path(DNNL_INCLUDE_DIR NAMES oneapi/dnnl/dnnl.h)
find_library(DNNL_LIBRARY NAMES dnnl)
if(DNNL_INCLUDE_DIR AND EXISTS "${DNNL_INCLUDE_DIR}/oneapi/dnnl/dnnl_version.h")
  foreach(_part MAJOR MINOR PATCH)
    file(STRINGS "${DNNL_INCLUDE_DIR}/oneapi/dnnl/dnnl_version.h" _line
         REGEX "^#define DNNL_VERSION_${_part} [0-9]+")
    string(REGEX REPLACE ".*DNNL_VERSION_${_part} ([0-9]+).*" "\\1" _v_${_part} "${_line}")
  endforeach()
  set(DNNL_VERSION "${_v_MAJOR}.${_v_MINOR}.${_v_PATCH}")
endif()

include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(DNNL
  REQUIRED_VARS DNNL_LIBRARY DNNL_INCLUDE_DIR
  VERSION_VAR DNNL_VERSION)

if(DNNL_FOUND AND NOT TARGET DNNL::dnnl)
  add_library(DNNL::dnnl UNKNOWN IMPORTED)
  set_target_properties(DNNL::dnnl PROPERTIES
    IMPORTED_LOCATION "${DNNL_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${DNNL_INCLUDE_DIR}")
endif()
mark_as_advanced(DNNL_INCLUDE_DIR DNNL_LIBRARY)
