# cmake -DBUILD_DIR=<build tree> -DWORK_DIR=<scratch> -DSOURCE_DIR=<repo>
#       [-DWITH_MPI=ON] -DCXX=<compiler> -P check_install.cmake
#
# What a user of the installed library does: `cmake --install` into a fresh
# prefix, then builds tests/install/consumer against it with find_package(mha)
# (C99 and C++ with warnings as errors, the C++ standard left to mha::mha's
# requirement), runs both, and checks the prefix: no plugin_abi.h (the
# runtime's contract with its own plugins), the license and documents,
# pkg-config files that name the libraries.
function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE status OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT status EQUAL 0)
    message(FATAL_ERROR "failed (${status}): ${ARGN}\n${out}")
  endif()
  message(STATUS "${out}")
endfunction()

file(REMOVE_RECURSE ${WORK_DIR})
set(prefix ${WORK_DIR}/prefix)
run(${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix})
foreach(expected include/mha/mha.h include/mha/mha.hpp lib/pkgconfig/mha.pc
                 share/doc/mha/LICENSE share/doc/mha/README.md share/doc/mha/CHANGELOG.md)
  if(NOT EXISTS ${prefix}/${expected})
    message(FATAL_ERROR "not installed: ${expected}")
  endif()
endforeach()
if(EXISTS ${prefix}/include/mha/plugin_abi.h)
  message(FATAL_ERROR "plugin_abi.h is installed: it is no public header")
endif()
file(READ ${prefix}/lib/pkgconfig/mha.pc pc)
if(NOT pc MATCHES "Libs: -L\\\${libdir} -lmha")
  message(FATAL_ERROR "mha.pc does not link -lmha:\n${pc}")
endif()
# The prefix as installed to, absolute (pkg-config can then tell system directories).
string(FIND "${pc}" "prefix=${prefix}\n" at)
if(at LESS 0)
  message(FATAL_ERROR "mha.pc does not name the prefix ${prefix}:\n${pc}")
endif()
find_program(PKG_CONFIG pkg-config)
if(PKG_CONFIG)
  execute_process(COMMAND ${CMAKE_COMMAND} -E env PKG_CONFIG_PATH=${prefix}/lib/pkgconfig
                          ${PKG_CONFIG} --cflags --libs mha
                  OUTPUT_VARIABLE flags RESULT_VARIABLE status)
  if(NOT status EQUAL 0 OR NOT flags MATCHES "^-I${prefix}/include -L${prefix}/lib -lmha")
    message(FATAL_ERROR "pkg-config --cflags --libs mha gave (${status}): ${flags}")
  endif()
endif()
if(WITH_MPI)
  file(READ ${prefix}/lib/pkgconfig/mha-mpi.pc pc)
  if(NOT pc MATCHES "Requires: mha" OR NOT pc MATCHES "-lmha-mpi")
    message(FATAL_ERROR "mha-mpi.pc does not require mha and link -lmha-mpi:\n${pc}")
  endif()
endif()
run(${CMAKE_COMMAND} -S ${SOURCE_DIR}/tests/install/consumer -B ${WORK_DIR}/build
    -DCMAKE_PREFIX_PATH=${prefix} -DCMAKE_CXX_COMPILER=${CXX} -DWITH_MPI=${WITH_MPI})
run(${CMAKE_COMMAND} --build ${WORK_DIR}/build)
run(${WORK_DIR}/build/consumer_c)
run(${WORK_DIR}/build/consumer_cpp)
