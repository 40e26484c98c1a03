# Installation: the library, its plugins (beside it), the headers, a CMake
# package (find_package(mha) -> mha::mha) and a pkg-config file.
include(CMakePackageConfigHelpers)

install(TARGETS mha EXPORT mhaTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
# (mha_mpi.h goes with libmha-mpi: mpi/CMakeLists.txt installs it when built;
# plugin_abi.h is the runtime's contract with its own plugins, not an API.)
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/mha DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
  PATTERN "mha_mpi.h" EXCLUDE PATTERN "plugin_abi.h" EXCLUDE)
install(EXPORT mhaTargets NAMESPACE mha:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/mha)

configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/mhaConfig.cmake.in
  ${CMAKE_BINARY_DIR}/mhaConfig.cmake INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/mha)
write_basic_package_version_file(${CMAKE_BINARY_DIR}/mhaConfigVersion.cmake
  COMPATIBILITY SameMajorVersion)
install(FILES ${CMAKE_BINARY_DIR}/mhaConfig.cmake ${CMAKE_BINARY_DIR}/mhaConfigVersion.cmake
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/mha)

# The .pc files name the prefix installed to, absolute and normalised, written
# when installing (MhaPkgConfig.cmake says why), then installed.
set(_mha_pc_files mha)
if(TARGET mha_mpi)
  list(APPEND _mha_pc_files mha-mpi)
endif()
install(CODE "
  set(MHA_PC_SOURCE_DIR \"${PROJECT_SOURCE_DIR}/cmake\")
  set(MHA_PC_BINARY_DIR \"${CMAKE_BINARY_DIR}/pkgconfig\")
  set(MHA_PC_FILES \"${_mha_pc_files}\")
  set(MHA_PC_LIBDIR \"${CMAKE_INSTALL_LIBDIR}\")
  set(MHA_PC_INCLUDEDIR \"${CMAKE_INSTALL_INCLUDEDIR}\")
  set(MHA_PC_DESCRIPTION \"${PROJECT_DESCRIPTION}\")
  set(MHA_PC_VERSION \"${PROJECT_VERSION}\")")
install(SCRIPT ${PROJECT_SOURCE_DIR}/cmake/MhaPkgConfig.cmake)
foreach(_name IN LISTS _mha_pc_files)
  install(FILES ${CMAKE_BINARY_DIR}/pkgconfig/${_name}.pc
          DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
endforeach()

install(FILES ${PROJECT_SOURCE_DIR}/LICENSE ${PROJECT_SOURCE_DIR}/README.md
              ${PROJECT_SOURCE_DIR}/CHANGELOG.md DESTINATION ${CMAKE_INSTALL_DOCDIR})
