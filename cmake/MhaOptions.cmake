# Compiler settings shared by every target of mha's own code.

# mha_warnings: warnings (as errors) for mha's own sources, never for third-party headers.
add_library(mha_warnings INTERFACE)
target_compile_options(mha_warnings INTERFACE
  -Wall -Wextra -Wshadow -Wnon-virtual-dtor -Wcast-align -Wunused -Woverloaded-virtual
  -Wconversion -Wno-sign-conversion -Wdouble-promotion -Wformat=2 -Wimplicit-fallthrough)
if(MHA_WERROR)
  target_compile_options(mha_warnings INTERFACE -Werror)
endif()

# Sanitizers apply to everything built here, tests included.  Sanitized
# builds compile at -O1 with line tables only (-g1; the reports still name
# files and lines), as the sanitizers' own docs advise: g++ 12 at -O3 -g
# took 9 minutes for the avx512bf16 kernel object alone under ASan+UBSan,
# when that kernel was a fraction of today's; for today's see mha_simd_code
# below.  (Later options win over the build type's -O3.)
if(MHA_SANITIZE)
  add_compile_options(-fsanitize=${MHA_SANITIZE} -fno-omit-frame-pointer -O1 -g1)
  add_link_options(-fsanitize=${MHA_SANITIZE})
  if(MHA_SANITIZE MATCHES "undefined")
    add_compile_options(-fno-sanitize-recover=undefined)
  endif()
endif()

# mha_simd_code: what every file compiled with an instruction set's flags gets
# (the plugins' kernels, the micro-kernel and exp2 tests).  Under GCC's ASan,
# no use-after-scope poisoning there: at -O1 the xsimd batches live on the
# stack, each one poisoned and unpoisoned around its scope; the AVX-512 kernel
# object took 311 s to compile (9.4 MB of code for AVX2) against 110 s without
# (Zen 3, GCC 12).  Out-of-bounds accesses, to the heap and to the stack, are
# still caught; use-after-scope stays on in the runtime, the tests and the tools.
add_library(mha_simd_code INTERFACE)
if(MHA_SANITIZE MATCHES "address" AND CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
  target_compile_options(mha_simd_code INTERFACE -fno-sanitize-address-use-after-scope)
endif()

# mha_test_code and mha_tool_code: the code that drives the library rather
# than computes in it -- the tests (not the float64 reference, their hot
# loop) and the tools.  Under the sanitizers it is compiled at -O0: every
# access is still checked (more of them than at -O1), and these objects, most
# of a sanitized tree's compile time, build about 2x faster (test_varlen under
# ASan+UBSan, GCC 12: 18.3 s at -O1, 6.6 s at -O0; the ASan tree's 41 such
# objects 594 s of compiler CPU against 292, its tests 148 s against 164).
# The tests are compiled at -O1 in optimized builds too (test_varlen 7.4 s at
# -O3, 3.9 s at -O1; test_module for aarch64 18.3 s and 9.3 s); the tools
# keep the build type's level there, being part of the product.
# (docs/decisions.md, "CI's time".)
add_library(mha_test_code INTERFACE)
add_library(mha_tool_code INTERFACE)
if(MHA_SANITIZE)
  target_compile_options(mha_test_code INTERFACE -O0)
  target_compile_options(mha_tool_code INTERFACE -O0)
else()
  target_compile_options(mha_test_code INTERFACE
                         $<$<CONFIG:Release,RelWithDebInfo,MinSizeRel>:-O1>)
endif()

# mha_plugin_flags: what every backend plugin is built with.  Never -ffast-math or
# -Ofast: loading such an object sets FTZ/DAZ in the caller's MXCSR.
# Loops start on a 64-byte boundary: without it, an unused function added to
# the avx512 plugin moved S8 (paged decode) by 5 % (in-process A/B, Zen 5);
# with it, by 0.1 %, and S1, S2, S3, S4, S5, S9 within 1-2 % of before.
add_library(mha_plugin_flags INTERFACE)
target_compile_options(mha_plugin_flags INTERFACE -fvisibility=hidden -fvisibility-inlines-hidden
  -fno-math-errno -falign-loops=64)
if(NOT MHA_SANITIZE)
  target_link_options(mha_plugin_flags INTERFACE -Wl,-z,defs)
endif()
