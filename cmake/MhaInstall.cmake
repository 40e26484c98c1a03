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

# The .pc file finds the prefix relative to itself, whatever --prefix is used.
file(RELATIVE_PATH MHA_PC_TO_PREFIX "/prefix/${CMAKE_INSTALL_LIBDIR}/pkgconfig" "/prefix")
configure_file(${PROJECT_SOURCE_DIR}/cmake/mha.pc.in ${CMAKE_BINARY_DIR}/mha.pc @ONLY)
install(FILES ${CMAKE_BINARY_DIR}/mha.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
if(TARGET mha_mpi)
  configure_file(${PROJECT_SOURCE_DIR}/cmake/mha-mpi.pc.in ${CMAKE_BINARY_DIR}/mha-mpi.pc @ONLY)
  install(FILES ${CMAKE_BINARY_DIR}/mha-mpi.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
endif()

install(FILES ${PROJECT_SOURCE_DIR}/LICENSE ${PROJECT_SOURCE_DIR}/README.md
              ${PROJECT_SOURCE_DIR}/CHANGELOG.md DESTINATION ${CMAKE_INSTALL_DOCDIR})
