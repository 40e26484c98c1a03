# The backends, one row each: the only place a backend's name, target
# architecture, instruction-set flags, required CPU features, priority and
# vector width are written.  From these rows the build makes each plugin
# (backends/CMakeLists.txt), the runtime's list of known backends
# (runtime/known_backends.h.in), and the per-ISA tests and benchmarks.
# A variant is one more row: avx512bf16 is the avx512 template with the bf16
# dot-product path enabled (a row that requires AVX512_BF16 gets it).
#
#   mha_isa(<name>
#     ARCH x86_64|aarch64|any     the target architecture (any: every one)
#     PRIORITY <n>                auto picks the usable backend with the highest
#     LANES <n>                   floats per vector register (1 for scalar)
#     DESCRIPTION <text>          what mha-info says of it
#     [XSIMD <type>]              the xsimd architecture of the shared SIMD
#                                 kernel (none: the scalar backend)
#     [FEATURES <bits>...]        mha_cpu_feature bits a CPU must have
#     [FLAGS <options>...])       compiler options of its kernel sources

function(mha_isa name)
  cmake_parse_arguments(ARG "" "ARCH;PRIORITY;LANES;DESCRIPTION;XSIMD" "FEATURES;FLAGS" ${ARGN})
  set_property(GLOBAL APPEND PROPERTY MHA_ISAS ${name})
  foreach(field ARCH PRIORITY LANES DESCRIPTION XSIMD FEATURES FLAGS)
    set_property(GLOBAL PROPERTY MHA_ISA_${name}_${field} "${ARG_${field}}")
  endforeach()
endfunction()

# mha_isa_get(<out variable> <name> <field>)
function(mha_isa_get out name field)
  get_property(value GLOBAL PROPERTY MHA_ISA_${name}_${field})
  set(${out} "${value}" PARENT_SCOPE)
endfunction()

# mha_isas_for(<out variable> [ALL]): the backends built for this target
# architecture (ALL: every row, for the runtime's list of known backends).
function(mha_isas_for out)
  get_property(all GLOBAL PROPERTY MHA_ISAS)
  set(result "")
  foreach(name IN LISTS all)
    mha_isa_get(arch ${name} ARCH)
    if("ALL" IN_LIST ARGN OR arch STREQUAL "any" OR arch STREQUAL MHA_ARCH)
      list(APPEND result ${name})
    endif()
  endforeach()
  set(${out} ${result} PARENT_SCOPE)
endfunction()

# mha_isa_bf16_dot(<out variable> <name>): true when the row requires
# AVX512_BF16; its kernel then takes the bf16 dot-product path for bf16
# inputs (backends/simd/bf16_dot.hpp), and the benchmarks get its peak loop.
function(mha_isa_bf16_dot out name)
  mha_isa_get(features ${name} FEATURES)
  if("MHA_CPU_AVX512BF16" IN_LIST features)
    set(${out} true PARENT_SCOPE)
  else()
    set(${out} false PARENT_SCOPE)
  endif()
endfunction()

mha_isa(scalar ARCH any PRIORITY 0 LANES 1
  DESCRIPTION "portable C++, no SIMD intrinsics")
mha_isa(avx2 ARCH x86_64 PRIORITY 20 LANES 8
  DESCRIPTION "AVX2 + FMA, xsimd fma3<avx2>"
  XSIMD "xsimd::fma3<xsimd::avx2>"
  FEATURES MHA_CPU_AVX MHA_CPU_AVX2 MHA_CPU_FMA MHA_CPU_F16C
  FLAGS -mavx2 -mfma -mf16c)
# -Wno-(maybe-)uninitialized: GCC 12.2 warns inside its own avx512fintrin.h
# (bug 105593, fixed in 12.3).
mha_isa(avx512 ARCH x86_64 PRIORITY 30 LANES 16
  DESCRIPTION "AVX-512 F/CD/DQ/BW/VL, xsimd avx512bw"
  XSIMD "xsimd::avx512bw"
  FEATURES MHA_CPU_AVX512F MHA_CPU_AVX512CD MHA_CPU_AVX512DQ MHA_CPU_AVX512BW MHA_CPU_AVX512VL
           MHA_CPU_AVX2 MHA_CPU_FMA MHA_CPU_F16C
  FLAGS -mavx512f -mavx512cd -mavx512dq -mavx512bw -mavx512vl -mavx2 -mfma -mf16c
        $<$<CXX_COMPILER_ID:GNU>:-Wno-uninitialized -Wno-maybe-uninitialized>)
# The avx512 template with vdpbf16ps for bf16 Q with bf16 K and V (prefill);
# every other call runs avx512's code (Zen 4 and later, Cooper Lake, Sapphire
# Rapids and later).
mha_isa(avx512bf16 ARCH x86_64 PRIORITY 40 LANES 16
  DESCRIPTION "AVX-512 + AVX512_BF16, xsimd avx512bw: bf16 Q with bf16 K/V prefill on vdpbf16ps (P rounded to bf16 once); decode and every other call as avx512"
  XSIMD "xsimd::avx512bw"
  FEATURES MHA_CPU_AVX512F MHA_CPU_AVX512CD MHA_CPU_AVX512DQ MHA_CPU_AVX512BW MHA_CPU_AVX512VL
           MHA_CPU_AVX2 MHA_CPU_FMA MHA_CPU_F16C MHA_CPU_AVX512BF16
  FLAGS -mavx512f -mavx512cd -mavx512dq -mavx512bw -mavx512vl -mavx512bf16 -mavx2 -mfma -mf16c
        $<$<CXX_COMPILER_ID:GNU>:-Wno-uninitialized -Wno-maybe-uninitialized>)
# Advanced SIMD is part of the aarch64 baseline: no extra flags.
mha_isa(neon ARCH aarch64 PRIORITY 20 LANES 4
  DESCRIPTION "aarch64 Advanced SIMD, xsimd neon64"
  XSIMD "xsimd::neon64"
  FEATURES MHA_CPU_NEON)
