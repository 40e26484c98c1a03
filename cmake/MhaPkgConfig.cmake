# Run by `cmake --install` (install(SCRIPT) in MhaInstall.cmake): writes the
# pkg-config files for the prefix being installed to -- `--prefix` included --
# as an absolute, normalised path, as Debian's own .pc files name /usr.  A
# prefix relative to the file (${pcfiledir}/../..) kept pkg-config from
# recognising its system directories: it printed -I/usr/lib/<triplet>/
# pkgconfig/../../../include for a /usr install, which moves /usr/include
# ahead of the compiler's own system directories.
#
# Set by install(CODE) before this runs: MHA_PC_SOURCE_DIR, MHA_PC_BINARY_DIR,
# MHA_PC_FILES (names without .pc), MHA_PC_LIBDIR, MHA_PC_INCLUDEDIR (relative
# to the prefix, or absolute), MHA_PC_DESCRIPTION, MHA_PC_VERSION.
cmake_path(SET MHA_PC_PREFIX NORMALIZE "${CMAKE_INSTALL_PREFIX}")
string(REGEX REPLACE "(.)/$" "\\1" MHA_PC_PREFIX "${MHA_PC_PREFIX}")
foreach(kind LIBDIR INCLUDEDIR)
  if(IS_ABSOLUTE "${MHA_PC_${kind}}")
    cmake_path(SET MHA_PC_${kind}_PATH NORMALIZE "${MHA_PC_${kind}}")
  else()
    set(MHA_PC_${kind}_PATH "\${prefix}/${MHA_PC_${kind}}")
  endif()
endforeach()
foreach(name IN LISTS MHA_PC_FILES)
  configure_file("${MHA_PC_SOURCE_DIR}/${name}.pc.in" "${MHA_PC_BINARY_DIR}/${name}.pc" @ONLY)
endforeach()
