# BLIS, OpenMP flavour (Debian: libblis-openmp-dev), found in Debian's
# multiarch folders for native and cross builds alike (the paths name the
# architecture, so they cannot hand a cross build the host's files).  Defines
# the imported target mha_blis when found; libmha's module needs it, the
# benchmarks' baseline uses it.
set(_mha_blis_multiarch ${MHA_ARCH}-linux-gnu)
find_path(MHA_BLIS_INCLUDE_DIR blis.h
  PATH_SUFFIXES ${_mha_blis_multiarch}/blis-openmp blis-openmp)
find_path(MHA_BLIS_INCLUDE_DIR blis.h
  PATHS /usr/include/${_mha_blis_multiarch}/blis-openmp NO_DEFAULT_PATH NO_CMAKE_FIND_ROOT_PATH)
find_library(MHA_BLIS_LIBRARY NAMES blis
  PATH_SUFFIXES ${_mha_blis_multiarch}/blis-openmp blis-openmp)
find_library(MHA_BLIS_LIBRARY NAMES blis
  PATHS /usr/lib/${_mha_blis_multiarch}/blis-openmp NO_DEFAULT_PATH NO_CMAKE_FIND_ROOT_PATH)
if(MHA_BLIS_INCLUDE_DIR AND MHA_BLIS_LIBRARY)
  message(STATUS "mha: BLIS ${MHA_BLIS_LIBRARY}")
  add_library(mha_blis INTERFACE IMPORTED GLOBAL)
  set_target_properties(mha_blis PROPERTIES
    INTERFACE_INCLUDE_DIRECTORIES ${MHA_BLIS_INCLUDE_DIR}  # imported: a system include
    INTERFACE_LINK_LIBRARIES ${MHA_BLIS_LIBRARY})
endif()
