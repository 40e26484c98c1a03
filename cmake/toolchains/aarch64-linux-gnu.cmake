# Cross build for aarch64 with Debian's cross compiler; the arm64 libraries
# (BLIS, Google Benchmark, xsimd, GoogleTest) come from dpkg's multiarch
# (/usr/lib/aarch64-linux-gnu, /usr/include/aarch64-linux-gnu), header-only
# packages from /usr/share.  ctest runs every test binary under qemu-aarch64.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
set(CMAKE_LIBRARY_ARCHITECTURE aarch64-linux-gnu)

set(CMAKE_FIND_ROOT_PATH /usr/aarch64-linux-gnu /)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)

# The cross toolchain's own libgomp goes first: Debian's multiarch
# libgomp1:arm64 (pulled in by BLIS) hangs in its first parallel region under
# qemu-user 7.2, the cross one does not.
set(CMAKE_CROSSCOMPILING_EMULATOR
    qemu-aarch64;-L;/usr/aarch64-linux-gnu;-E;LD_LIBRARY_PATH=/usr/aarch64-linux-gnu/lib)
