// Tiles from the machine's caches: mha_cpu_caches reports what the runtime
// detected (or what MHA_CACHE_SIZES says), and every usable backend's tiles
// (mha_backend_get_tiles) follow its rule from them
// (backends/simd/tile_choice.hpp, docs/kernel-design.md).  Each ctest entry
// sets MHA_CACHE_SIZES and declares what it expects; that the kernels compute
// the same with other tiles is checked by test_attention and test_blocks
// entries run under the same overrides (tests/CMakeLists.txt).
//
// The decode's key streams (mha_backend_get_decode_streams) are the runtime's
// choice from the CPU, which MHA_DECODE_STREAMS overrides: only the avx2
// backend has streams (four), every other usable backend reads in address
// order.  So are the bf16 dot products (mha_backend_get_bf16_dot), which
// MHA_BF16_DOT overrides: only avx512bf16 has them, off on Intel's CPUs.
//
// Environment read by these tests (set by tests/CMakeLists.txt):
//   MHA_TEST_EXPECT_L1D, MHA_TEST_EXPECT_L2   the bytes the entry's override gives
//   MHA_TEST_EXPECT_AVX2_STREAMS              the avx2 backend's streams under the
//                                             entry's MHA_DECODE_STREAMS
//   MHA_TEST_EXPECT_BF16_DOT                  avx512bf16's bf16_dot under the
//                                             entry's MHA_BF16_DOT
#include <gtest/gtest.h>
#include <mha/mha.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <string>

#include "small_call.h"

#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace mha_test {
namespace {

// Floats per vector register of a SIMD backend (0: scalar or unknown).
int64_t lanes_of(const std::string& backend) {
  if (backend.rfind("avx512", 0) == 0) return 16;
  if (backend == "avx2") return 8;
  if (backend == "neon") return 4;
  return 0;
}

// The SIMD plugins' rule: the score tile (64 queries x key_tile fp32) takes
// three quarters of the L1d, in whole steps of 6 keys (the score micro-kernel) and whole
// vectors, from two steps to 576 keys.
int32_t expected_key_tile(int64_t lanes, int64_t l1d) {
  const int64_t step = std::lcm<int64_t>(6, lanes);
  return static_cast<int32_t>(
      std::clamp<int64_t>(l1d * 3 / 4 / (64 * 4) / step * step, 2 * step, 576 / step * step));
}

// Whether the CPU has AMX tiles with bf16 products (CPUID 7.0 EDX bits 24
// and 22) and the OS saves their state (XCR0 bits 17 and 18).  The runtime
// must then also have asked Linux for the permission to use them.
bool amx_bf16_expected() {
#if defined(__x86_64__)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid_max(0, nullptr) < 7) return false;
  __cpuid_count(7, 0, eax, ebx, ecx, edx);
  if (!((edx >> 24) & 1u) || !((edx >> 22) & 1u) || !((ebx >> 16) & 1u)) return false;
  uint32_t lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (lo & 0x600e6u) == 0x600e6u;  // AVX-512's state and the tiles'
#else
  return false;
#endif
}

// The runtime's rule for the bf16 dot products (runtime/bf16_dot.cpp): on
// AMX tiles where they are usable (2); otherwise everywhere but on Intel's
// CPUs, where vdpbf16ps runs below the FMA's rate.  MHA_BF16_DOT 0 and 1
// override it, and 2 where AMX tiles are usable.
int32_t expected_bf16_dot(const std::string& given) {
  if (given == "0" || given == "1") return given == "1" ? 1 : 0;
  if (amx_bf16_expected()) return 2;
#if defined(__x86_64__)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(0, &eax, &ebx, &ecx, &edx) != 0) {
    char vendor[13] = {};
    std::memcpy(vendor, &ebx, 4);
    std::memcpy(vendor + 4, &edx, 4);
    std::memcpy(vendor + 8, &ecx, 4);
    return std::string(vendor) == "GenuineIntel" ? 0 : 1;
  }
#endif
  return 1;
}

TEST(Tiles, CachesAreWhatTheEntryGives) {
  mha_cache_info caches{};
  ASSERT_EQ(mha_cpu_caches(&caches), MHA_OK) << mha_last_error();
  EXPECT_GE(caches.l1d_bytes, 0);
  EXPECT_GE(caches.l2_bytes, 0);
  EXPECT_GE(caches.l3_bytes, 0);
  const std::string l1d = env("MHA_TEST_EXPECT_L1D"), l2 = env("MHA_TEST_EXPECT_L2");
  if (!l1d.empty()) {
    EXPECT_EQ(caches.l1d_bytes, std::stoll(l1d));
  }
  if (!l2.empty()) {
    EXPECT_EQ(caches.l2_bytes, std::stoll(l2));
  }
}

// The runtime asks Linux for the AMX tiles' permission where they may run
// (it enlarges every signal frame of the process), and not where
// MHA_BF16_DOT=0 or 1 rules them out.
TEST(Tiles, AmxPermissionOnlyWhereTheTilesMayRun) {
  if (!amx_bf16_expected()) GTEST_SKIP() << "no AMX tiles with bf16 products here";
#if defined(__x86_64__) && defined(__linux__)
  ASSERT_GT(mha_backend_count(), 0);  // the runtime has detected the CPU
  uint64_t permitted = 0;
  constexpr long kArchGetXcompPerm = 0x1022;
  ASSERT_EQ(syscall(SYS_arch_prctl, kArchGetXcompPerm, &permitted), 0);
  const bool granted = ((permitted >> 18) & 1u) != 0;  // XTILEDATA
  const std::string given = env("MHA_BF16_DOT");
  EXPECT_EQ(granted, given != "0" && given != "1") << "MHA_BF16_DOT=" << given;
#endif
}

TEST(Tiles, FollowTheRule) {
  mha_cache_info caches{};
  ASSERT_EQ(mha_cpu_caches(&caches), MHA_OK) << mha_last_error();
  const int32_t count = mha_backend_count();
  int usable = 0;
  for (int32_t i = 0; i < count; ++i) {
    mha_backend_info info{};
    mha_backend_tiles tiles{};
    int32_t streams = -1;
    int32_t bf16_dot = -1;
    ASSERT_EQ(mha_backend_get_info(i, &info), MHA_OK) << mha_last_error();
    ASSERT_EQ(mha_backend_get_tiles(i, &tiles), MHA_OK) << mha_last_error();
    ASSERT_EQ(mha_backend_get_decode_streams(i, &streams), MHA_OK) << mha_last_error();
    ASSERT_EQ(mha_backend_get_bf16_dot(i, &bf16_dot), MHA_OK) << mha_last_error();
    const std::string name = info.name;
    SCOPED_TRACE(name);
    if (info.usable == 0) {
      EXPECT_EQ(tiles.query_tile, 0);
      EXPECT_EQ(tiles.key_tile, 0);
      EXPECT_EQ(tiles.decode_key_tile, 0);
      EXPECT_EQ(streams, 0);
      EXPECT_EQ(bf16_dot, 0);
      continue;
    }
    ++usable;
    if (name != "avx512bf16") {
      EXPECT_EQ(bf16_dot, 0) << "only avx512bf16 has bf16 dot products";
    } else if (const std::string want = env("MHA_TEST_EXPECT_BF16_DOT"); !want.empty()) {
      EXPECT_EQ(bf16_dot, std::stoi(want));
    } else {
      EXPECT_EQ(bf16_dot, expected_bf16_dot(env("MHA_BF16_DOT")));
    }
    const std::string avx2_streams = env("MHA_TEST_EXPECT_AVX2_STREAMS");
    if (name != "avx2") {
      EXPECT_EQ(streams, 1);
    } else if (!avx2_streams.empty()) {
      EXPECT_EQ(streams, std::stoi(avx2_streams));
    } else {
      EXPECT_TRUE(streams == 1 || streams == 4) << streams;
    }
    EXPECT_GT(tiles.query_tile, 0);
    EXPECT_GT(tiles.key_tile, 0);
    const int64_t lanes = lanes_of(name);
    if (lanes == 0) {  // scalar: single keys, no decode orientation
      EXPECT_EQ(tiles.decode_key_tile, 0);
      continue;
    }
    EXPECT_EQ(tiles.query_tile, 64);
    EXPECT_EQ(tiles.decode_key_tile, 1024);
    EXPECT_EQ(tiles.key_tile % std::lcm<int64_t>(6, lanes), 0);
    if (caches.l1d_bytes > 0) {
      EXPECT_EQ(tiles.key_tile, expected_key_tile(lanes, caches.l1d_bytes))
          << "l1d " << caches.l1d_bytes;
    }
  }
  EXPECT_GE(usable, 1);
}

TEST(Tiles, BadArgumentsAreNamed) {
  EXPECT_EQ(mha_cpu_caches(nullptr), MHA_ERR_NULL_POINTER);
  EXPECT_NE(std::string(mha_last_error()).find("caches"), std::string::npos) << mha_last_error();
  EXPECT_EQ(mha_backend_get_tiles(0, nullptr), MHA_ERR_NULL_POINTER);
  EXPECT_NE(std::string(mha_last_error()).find("tiles"), std::string::npos) << mha_last_error();
  mha_backend_tiles tiles{7, 7, 7};
  for (int32_t index : {-1, mha_backend_count()}) {
    EXPECT_EQ(mha_backend_get_tiles(index, &tiles), MHA_ERR_INVALID_VALUE);
    EXPECT_NE(std::string(mha_last_error()).find("backend index"), std::string::npos)
        << mha_last_error();
  }
  EXPECT_EQ(tiles.key_tile, 7) << "a refused call wrote its output";
  EXPECT_EQ(mha_backend_get_decode_streams(0, nullptr), MHA_ERR_NULL_POINTER);
  EXPECT_NE(std::string(mha_last_error()).find("streams"), std::string::npos) << mha_last_error();
  int32_t streams = 7;
  for (int32_t index : {-1, mha_backend_count()}) {
    EXPECT_EQ(mha_backend_get_decode_streams(index, &streams), MHA_ERR_INVALID_VALUE);
    EXPECT_NE(std::string(mha_last_error()).find("backend index"), std::string::npos)
        << mha_last_error();
  }
  EXPECT_EQ(streams, 7) << "a refused call wrote its output";
  EXPECT_EQ(mha_backend_get_bf16_dot(0, nullptr), MHA_ERR_NULL_POINTER);
  EXPECT_NE(std::string(mha_last_error()).find("bf16_dot"), std::string::npos) << mha_last_error();
  int32_t bf16_dot = 7;
  for (int32_t index : {-1, mha_backend_count()}) {
    EXPECT_EQ(mha_backend_get_bf16_dot(index, &bf16_dot), MHA_ERR_INVALID_VALUE);
    EXPECT_NE(std::string(mha_last_error()).find("backend index"), std::string::npos)
        << mha_last_error();
  }
  EXPECT_EQ(bf16_dot, 7) << "a refused call wrote its output";
}

}  // namespace
}  // namespace mha_test
