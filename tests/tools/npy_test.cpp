// The .npy reader/writer: round trips, NumPy's exact header, Fortran order,
// and a table of malformed files, each refused with a one-line message.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "half.h"
#include "npy.h"
#include "test_util.h"

namespace {

using mha_tools::encode_npy;
using mha_tools::NpyArray;
using mha_tools::NpyDtype;
using mha_tools::NpyError;
using mha_tools::parse_npy;
using mha_tools::read_npy;
using mha_tools::write_npy;
using Bytes = std::vector<unsigned char>;

const NpyDtype kAllDtypes[] = {NpyDtype::F32, NpyDtype::F64, NpyDtype::Bool, NpyDtype::U8,
                               NpyDtype::I32, NpyDtype::I64, NpyDtype::F16};

std::string temp_path(const std::string& name) {
  return ::testing::TempDir() + "mha_npy_test_" + std::to_string(::getpid()) + "_" + name;
}

Bytes to_bytes(const std::string& s) {
  return Bytes(s.begin(), s.end());
}

// A file with the given version and header text (padded to 64 bytes with
// spaces and a final '\n' when `pad`), followed by `data`.
Bytes make_file(int major, const std::string& dict, const Bytes& data, bool pad = true) {
  const std::size_t len_bytes = major == 1 ? 2 : 4;
  std::string header = dict;
  if (pad) {
    const std::size_t hlen = header.size() + 1;
    header += std::string(64 - (8 + len_bytes + hlen) % 64, ' ') + "\n";
  }
  // Built as a string: GCC 12 at -O3 sees a false array-bounds error in
  // inserting into a vector made from an initializer list.
  std::string out("\x93NUMPY", 6);
  out += static_cast<char>(major);
  out += '\0';
  for (std::size_t i = 0; i < len_bytes; ++i) {
    out += static_cast<char>((header.size() >> (8 * i)) & 0xff);
  }
  out += header;
  out.append(data.begin(), data.end());
  return Bytes(out.begin(), out.end());
}

std::string dict_of(const std::string& descr, const std::string& order, const std::string& shape) {
  return "{'descr': '" + descr + "', 'fortran_order': " + order + ", 'shape': " + shape + ", }";
}

void write_bytes(const std::string& path, const Bytes& bytes) {
  FILE* f = std::fopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr) << path;
  if (!bytes.empty()) {
    ASSERT_EQ(std::fwrite(bytes.data(), 1, bytes.size(), f), bytes.size());
  }
  ASSERT_EQ(std::fclose(f), 0);
}

// Fills an array with values that differ per element and fit every dtype.
void fill_pattern(NpyArray& a) {
  for (int64_t i = 0; i < a.size(); ++i) {
    double value = static_cast<double>(i % 7) - 3.0 + static_cast<double>(i % 3) * 0.25;
    if (a.dtype() == NpyDtype::Bool) value = (i % 3 == 0) ? 1.0 : 0.0;
    if (a.dtype() == NpyDtype::U8) value = static_cast<double>(i % 200);
    if (a.dtype() == NpyDtype::I32 || a.dtype() == NpyDtype::I64)
      value = static_cast<double>(i) - 5;
    a.set_from_double(i, value);
  }
}

void expect_same(const NpyArray& a, const NpyArray& b) {
  EXPECT_EQ(a.dtype(), b.dtype());
  EXPECT_EQ(a.shape(), b.shape());
  EXPECT_EQ(a.strides(), b.strides());
  EXPECT_EQ(a.fortran_order(), b.fortran_order());
  ASSERT_EQ(a.nbytes(), b.nbytes());
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.nbytes()), 0);
}

// --------------------------------------------------------------- round trips

TEST(Npy, DtypeTable) {
  EXPECT_STREQ(mha_tools::npy_descr(NpyDtype::F32), "<f4");
  EXPECT_STREQ(mha_tools::npy_descr(NpyDtype::F64), "<f8");
  EXPECT_STREQ(mha_tools::npy_descr(NpyDtype::Bool), "|b1");
  EXPECT_STREQ(mha_tools::npy_descr(NpyDtype::U8), "|u1");
  EXPECT_STREQ(mha_tools::npy_descr(NpyDtype::I32), "<i4");
  EXPECT_STREQ(mha_tools::npy_descr(NpyDtype::I64), "<i8");
  EXPECT_STREQ(mha_tools::npy_descr(NpyDtype::F16), "<f2");
  EXPECT_STREQ(mha_tools::npy_dtype_name(NpyDtype::F16), "float16");
  EXPECT_EQ(mha_tools::npy_itemsize(NpyDtype::F64), 8u);
  EXPECT_EQ(mha_tools::npy_itemsize(NpyDtype::Bool), 1u);
  EXPECT_EQ(mha_tools::npy_itemsize(NpyDtype::F16), 2u);
}

// ------------------------------------------------------------- float16

// The bits of a float16 array's element.
uint16_t f16_bits(const NpyArray& a, int64_t i) {
  return a.data_as<uint16_t>()[static_cast<std::size_t>(i)];
}

TEST(NpyHalf, EveryFloat16ValueRoundTrips) {
  NpyArray a(NpyDtype::F16, {65536});
  for (uint32_t bits = 0; bits < 65536; ++bits) {
    a.data_as<uint16_t>()[bits] = static_cast<uint16_t>(bits);
  }
  NpyArray b(NpyDtype::F16, {65536});
  for (int64_t i = 0; i < a.size(); ++i) {
    const double value = a.value_as_double(i);
    // The value, from the format's definition (tests/test_util.h).
    const double want = mha_test::half_bits_value(f16_bits(a, i), MHA_DTYPE_F16);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(value)) << i;
    } else {
      EXPECT_EQ(value, want) << i;
    }
    b.set_from_double(i, value);
    if (std::isnan(value)) {
      EXPECT_EQ(f16_bits(b, i) & 0x7E00u, 0x7E00u) << "NaN stays a quiet NaN: " << i;
      EXPECT_EQ(f16_bits(b, i) & 0x8000u, f16_bits(a, i) & 0x8000u) << "its sign too: " << i;
    } else {
      EXPECT_EQ(f16_bits(b, i), f16_bits(a, i)) << i;
    }
  }
}

TEST(NpyHalf, RoundsToNearestEven) {
  NpyArray a(NpyDtype::F16, {1});
  const auto stored = [&a](double x) {
    a.set_from_double(0, x);
    return a.value_as_double(0);
  };
  EXPECT_EQ(stored(1.0 + 0x1p-11), 1.0);                      // a tie: to the even 1.0
  EXPECT_EQ(stored(1.0 + 3 * 0x1p-11), 1.0 + 0x1p-9);         // a tie: to the even neighbour
  EXPECT_EQ(stored(1.0 + 0x1p-11 + 0x1p-40), 1.0 + 0x1p-10);  // above the tie: up
  // Rounded once from double: through float32 first, 1 + 2^-11 + 2^-40 would
  // become the tie 1 + 2^-11 and then 1.0.
  EXPECT_EQ(stored(-2.5), -2.5);
  EXPECT_EQ(stored(65504.0), 65504.0);
  EXPECT_EQ(stored(65519.99), 65504.0);
  EXPECT_EQ(stored(65520.0), HUGE_VAL);  // the tie with 2^16 rounds to infinity
  EXPECT_EQ(stored(-1e9), -HUGE_VAL);
  EXPECT_EQ(stored(0x1p-24), 0x1p-24);  // the smallest subnormal
  EXPECT_EQ(stored(0x1p-25), 0.0);      // a tie: to the even 0
  EXPECT_EQ(stored(3 * 0x1p-25), 0x1p-23);
  EXPECT_EQ(stored(0x1p-14 - 0x1p-26), 0x1p-14);  // up to the smallest normal
  a.set_from_double(0, -0.0);
  EXPECT_EQ(f16_bits(a, 0), 0x8000u);
  a.set_from_double(0, -HUGE_VAL);
  EXPECT_EQ(f16_bits(a, 0), 0xFC00u);
  EXPECT_EQ(a.value_as_int64(0), std::numeric_limits<int64_t>::min());
  a.set_from_double(0, -7.75);
  EXPECT_EQ(a.value_as_int64(0), -7);
}

// float32 values rounded by half.h (from double) and by the tests' own
// conversions (tests/test_util.h, from the formats' definitions) agree, for
// bfloat16 too; so do float64 values that float32 holds.
TEST(NpyHalf, AgreesWithTheTestsConversions) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<uint32_t> any_bits;
  for (int i = 0; i < 200000; ++i) {  // also under qemu: a few seconds
    uint32_t u = any_bits(rng);
    if (i % 4 == 1) {  // exponents from 2^-27 to 2^16: float16's subnormals to its overflow
      u = (u & 0x807FFFFFu) | ((100u + u % 44u) << 23);
    }
    if (i % 4 == 2) u = (u & ~0x1FFFu) | 0x1000u;  // a float16 tie
    if (i % 4 == 3) u = (u & ~0xFFFFu) | 0x8000u;  // a bfloat16 tie
    float x = 0;
    std::memcpy(&x, &u, sizeof x);
    const double d = static_cast<double>(x);
    if (std::isnan(x)) continue;
    ASSERT_EQ(mha_tools::f16_bits_from_double(d), mha_test::round_to_f16_bits(x)) << u;
    ASSERT_EQ(mha_tools::bf16_bits_from_double(d), mha_test::round_to_bf16_bits(x)) << u;
    const uint16_t b = mha_test::round_to_bf16_bits(x);
    EXPECT_EQ(mha_tools::bf16_bits_to_double(b), mha_test::half_bits_value(b, MHA_DTYPE_BF16));
  }
  EXPECT_EQ(mha_tools::bf16_bits_from_double(1.0 + 0x1p-8), 0x3F80u);  // a tie: even
  EXPECT_EQ(mha_tools::bf16_bits_from_double(1.0 + 0x1p-8 + 0x1p-40), 0x3F81u);
  EXPECT_EQ(mha_tools::bf16_bits_from_double(mha_tools::kBf16Max), 0x7F7Fu);
  EXPECT_EQ(mha_tools::bf16_bits_from_double(3.4e38), 0x7F80u);  // beyond: infinity
  EXPECT_EQ(mha_tools::bf16_bits_from_double(-std::nan("")) & 0xFFC0u, 0xFFC0u);
}

TEST(Npy, RoundTripEveryDtypeAndRank) {
  const std::vector<std::vector<int64_t>> shapes = {
      {}, {5}, {2, 3}, {2, 3, 4}, {2, 1, 3, 5}, {0}, {3, 0, 2}, {1, 1, 1, 1, 2, 3}};
  int file_index = 0;
  for (const NpyDtype dtype : kAllDtypes) {
    for (const auto& shape : shapes) {
      for (const bool fortran : {false, true}) {
        SCOPED_TRACE(std::string(mha_tools::npy_descr(dtype)) + " rank " +
                     std::to_string(shape.size()) + (fortran ? " F" : " C"));
        NpyArray a(dtype, shape, fortran);
        fill_pattern(a);
        const Bytes bytes = encode_npy(a);
        EXPECT_EQ((bytes.size() - a.nbytes()) % 64, 0u) << "header not padded to 64 bytes";
        expect_same(a, parse_npy(bytes.data(), bytes.size()));

        const std::string path = temp_path("rt" + std::to_string(file_index++) + ".npy");
        write_npy(path, a);
        expect_same(a, read_npy(path));
        std::remove(path.c_str());
      }
    }
  }
}

TEST(Npy, HeaderIsNumpys) {
  NpyArray a(NpyDtype::F32, {2, 3});
  const Bytes bytes = encode_npy(a);
  const std::string dict = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }";
  std::string expected("\x93NUMPY\x01\x00\x76\x00", 10);
  expected += dict + std::string(128 - 10 - dict.size() - 1, ' ') + "\n";
  ASSERT_EQ(bytes.size(), 128u + 24u);
  EXPECT_EQ(std::string(bytes.begin(), bytes.begin() + 128), expected);

  const Bytes rank1 = encode_npy(NpyArray(NpyDtype::I64, {3}));
  EXPECT_NE(std::string(rank1.begin(), rank1.end()).find("'shape': (3,), }"), std::string::npos);
  const Bytes rank0 = encode_npy(NpyArray(NpyDtype::Bool, {}));
  EXPECT_NE(std::string(rank0.begin(), rank0.end()).find("'shape': (), }"), std::string::npos);
  EXPECT_EQ(rank0.size(), 128u + 1u);  // 10 + 55 + 1 bytes round up to 128
}

TEST(Npy, ReadsVersions2And3) {
  const Bytes data = {1, 0, 0, 0, 2, 0, 0, 0};
  for (const int major : {1, 2, 3}) {
    const Bytes file = make_file(major, dict_of("<i4", "False", "(2,)"), data);
    const NpyArray a = parse_npy(file.data(), file.size());
    ASSERT_EQ(a.shape(), std::vector<int64_t>{2});
    EXPECT_EQ(a.value_as_int64(0), 1);
    EXPECT_EQ(a.value_as_int64(1), 2);
  }
}

TEST(Npy, AcceptsHeaderVariants) {
  const Bytes data(4 * 6, 0);
  const std::string variants[] = {
      "{\"descr\": \"<f4\", \"fortran_order\": False, \"shape\": (2, 3)}",
      "{'shape': (2, 3), 'fortran_order': False, 'descr': '<f4'}",
      "{'descr':'<f4','fortran_order':False,'shape':(2,3,),}",
      "{ 'descr' : '<f4' ,\t'fortran_order' : False , 'shape' : ( 2 , 3 ) , }",
  };
  for (const auto& dict : variants) {
    SCOPED_TRACE(dict);
    const Bytes file = make_file(1, dict, data);
    EXPECT_EQ(parse_npy(file.data(), file.size()).shape(), (std::vector<int64_t>{2, 3}));
    // Without the 64-byte padding: just a newline.
    const Bytes unpadded = make_file(1, dict + "\n", data, false);
    EXPECT_EQ(parse_npy(unpadded.data(), unpadded.size()).size(), 6);
  }
  const Bytes u1 = make_file(1, dict_of("|u1", "False", "(3,)"), {0, 1, 7});
  const NpyArray a = parse_npy(u1.data(), u1.size());
  EXPECT_EQ(a.dtype(), NpyDtype::U8);
  EXPECT_EQ(a.data_as<uint8_t>()[2], 7);
}

TEST(Npy, FortranOrderIsReadAsStrides) {
  // A 2 x 3 int32 array in Fortran order: memory holds column after column.
  Bytes data;
  const int32_t column_major[6] = {0, 10, 1, 11, 2, 12};  // element (i, j) = 10 * i + j
  data.resize(sizeof column_major);
  std::memcpy(data.data(), column_major, sizeof column_major);
  const Bytes file = make_file(1, dict_of("<i4", "True", "(2, 3)"), data);
  const NpyArray a = parse_npy(file.data(), file.size());
  EXPECT_TRUE(a.fortran_order());
  EXPECT_EQ(a.strides(), (std::vector<int64_t>{1, 2}));
  for (int64_t i = 0; i < 2; ++i) {
    for (int64_t j = 0; j < 3; ++j) EXPECT_EQ(a.value_as_int64(a.offset({i, j})), 10 * i + j);
  }

  // Rank 4: strides are the running products of the sizes, first dimension fastest.
  NpyArray f(NpyDtype::F32, {2, 3, 4, 5}, true);
  EXPECT_EQ(f.strides(), (std::vector<int64_t>{1, 2, 6, 24}));
  NpyArray c(NpyDtype::F32, {2, 3, 4, 5});
  EXPECT_EQ(c.strides(), (std::vector<int64_t>{60, 20, 5, 1}));
  for (int64_t i = 0; i < 2; ++i)
    for (int64_t j = 0; j < 3; ++j)
      for (int64_t k = 0; k < 4; ++k)
        for (int64_t l = 0; l < 5; ++l) {
          const double value = static_cast<double>(1000 * i + 100 * j + 10 * k + l);
          f.set_from_double(f.offset({i, j, k, l}), value);
          c.set_from_double(c.offset({i, j, k, l}), value);
        }
  const Bytes fbytes = encode_npy(f);
  const NpyArray back = parse_npy(fbytes.data(), fbytes.size());
  EXPECT_TRUE(back.fortran_order());
  for (int64_t i = 0; i < 2; ++i)
    for (int64_t j = 0; j < 3; ++j)
      for (int64_t k = 0; k < 4; ++k)
        for (int64_t l = 0; l < 5; ++l) {
          EXPECT_EQ(back.value_as_double(back.offset({i, j, k, l})),
                    c.value_as_double(c.offset({i, j, k, l})));
        }
  EXPECT_EQ(back.value_as_double(1), 1000.0);  // (1,0,0,0) is next in memory
}

// An empty array may have large dimensions besides its zero one, as long as
// their product fits in 63 bits (NumPy's rule): it is read, with the strides
// of its layout, and written back unchanged.
TEST(Npy, EmptyArraysWithLargeDimensions) {
  const Bytes file = make_file(1, dict_of("<f4", "False", "(3, 0, 4294967296, 4)"), Bytes());
  const NpyArray a = parse_npy(file.data(), file.size());
  EXPECT_EQ(a.size(), 0);
  EXPECT_EQ(a.nbytes(), 0u);
  EXPECT_EQ(a.shape(), (std::vector<int64_t>{3, 0, 4294967296, 4}));
  EXPECT_EQ(a.strides(), (std::vector<int64_t>{0, 17179869184, 4, 1}));
  const Bytes again = encode_npy(a);
  const NpyArray b = parse_npy(again.data(), again.size());
  EXPECT_EQ(b.shape(), a.shape());
  EXPECT_EQ(b.size(), 0);
}

TEST(Npy, CheckedAccess) {
  NpyArray a(NpyDtype::F32, {2, 3});
  EXPECT_THROW(a.offset({2, 0}), NpyError);
  EXPECT_THROW(a.offset({0, -1}), NpyError);
  EXPECT_THROW(a.offset({0}), NpyError);
  EXPECT_THROW(a.data_as<double>(), NpyError);
  EXPECT_NO_THROW(a.data_as<float>());
  NpyArray b(NpyDtype::Bool, {4});
  EXPECT_NO_THROW(b.data_as<uint8_t>());
  EXPECT_THROW(NpyArray(NpyDtype::F32, {-1}), NpyError);
  EXPECT_THROW(NpyArray(NpyDtype::F64, {int64_t{1} << 62, 4}), NpyError);
  EXPECT_THROW(NpyArray(NpyDtype::F32, std::vector<int64_t>(33, 1)), NpyError);
}

// --------------------------------------------------------------- malformed files

struct Malformed {
  const char* name;
  Bytes bytes;
  const char* message;  // a part of the expected message
};

void expect_refused(const Bytes& bytes, const char* message, const std::string& name) {
  try {
    (void)parse_npy(bytes.data(), bytes.size());
    ADD_FAILURE() << name << ": accepted";
  } catch (const NpyError& e) {
    const std::string what = e.what();
    EXPECT_FALSE(what.empty()) << name;
    EXPECT_EQ(what.find('\n'), std::string::npos) << name << ": " << what;
    EXPECT_NE(what.find(message), std::string::npos) << name << ": " << what;
  }
  const std::string path = temp_path(std::string("bad_") + name + ".npy");
  write_bytes(path, bytes);
  try {
    (void)read_npy(path);
    ADD_FAILURE() << name << ": accepted from a file";
  } catch (const NpyError& e) {
    const std::string what = e.what();
    EXPECT_EQ(what.rfind(path + ": ", 0), 0u) << name << ": " << what;
    EXPECT_EQ(what.find('\n'), std::string::npos) << name << ": " << what;
    EXPECT_NE(what.find(message), std::string::npos) << name << ": " << what;
  }
  std::remove(path.c_str());
}

std::vector<Malformed> malformed_files() {
  std::string rank33 = "(";  // 33 dimensions of size 1
  for (int i = 0; i < 33; ++i) rank33 += "1, ";
  rank33 += ")";
  const auto f = [](const std::string& dict, const Bytes& data = Bytes(24, 0)) {
    return make_file(1, dict, data);
  };
  const auto v1 = [](uint16_t len, const std::string& rest) {  // a version 1.0 preamble
    std::string b("\x93NUMPY\x01", 7);
    b += '\0';
    b += static_cast<char>(len & 0xff);
    b += static_cast<char>(len >> 8);
    return to_bytes(b + rest);
  };
  std::vector<Malformed> t = {
      {"empty", {}, "empty file"},
      {"short_magic", {0x93, 'N', 'U'}, "truncated"},
      {"bad_magic", {0x93, 'N', 'U', 'M', 'P', 'X', 1, 0, 3, 0, '{', '}', '\n'}, "bad magic"},
      {"text", to_bytes("hello, world, this is not an array"), "bad magic"},
      {"version_4", {0x93, 'N', 'U', 'M', 'P', 'Y', 4, 0, 0, 0, 0, 0}, "version 4.0"},
      {"version_1_1", {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 1, 0, 0}, "version 1.1"},
      {"version_0", {0x93, 'N', 'U', 'M', 'P', 'Y', 0, 0, 0, 0}, "version 0.0"},
      {"no_length", {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0}, "preamble"},
      {"half_length", {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0, 5}, "preamble"},
      {"v2_half_length", {0x93, 'N', 'U', 'M', 'P', 'Y', 2, 0, 5, 0, 0}, "preamble"},
      {"header_beyond_file", v1(100, "{'descr': '<f4'"), "truncated"},
      {"header_huge",
       {0x93, 'N', 'U', 'M', 'P', 'Y', 2, 0, 0xff, 0xff, 0xff, 0xff, '{', '}', '\n'},
       "exceeds the limit"},
      {"header_empty", v1(0, ""), "empty"},
      {"no_newline", v1(59, dict_of("<f4", "False", "(2, 3)")), "newline"},
      {"not_a_dict", f("['descr', '<f4']"), "'{'"},
      {"leading_space", f(" " + dict_of("<f4", "False", "(2, 3)")), "'{'"},
      {"missing_descr", f("{'fortran_order': False, 'shape': (2, 3), }"), "'descr' is missing"},
      {"missing_order", f("{'descr': '<f4', 'shape': (2, 3), }"), "'fortran_order' is missing"},
      {"missing_shape", f("{'descr': '<f4', 'fortran_order': False, }"), "'shape' is missing"},
      {"duplicate_key",
       f("{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (2, 3)}"), "twice"},
      {"unknown_key", f("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), 'x': 1}"),
       "unexpected key 'x'"},
      {"unquoted_key", f("{descr: '<f4', 'fortran_order': False, 'shape': (2, 3)}"), "quoted"},
      {"descr_not_string", f("{'descr': 5, 'fortran_order': False, 'shape': (2, 3)}"), "quoted"},
      {"structured", f("{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (2, 3)}"),
       "structured"},
      {"float128", f(dict_of("<f16", "False", "(2, 3)")), "unsupported dtype '<f16'"},
      {"complex", f(dict_of("<c8", "False", "(2, 3)")), "unsupported dtype"},
      {"dtype_name", f(dict_of("float32", "False", "(2, 3)")), "unsupported dtype"},
      {"object", f(dict_of("|O", "False", "(2, 3)")), "unsupported dtype"},
      {"unicode", f(dict_of("<U3", "False", "(2, 3)")), "unsupported dtype"},
      {"big_endian_f4", f(dict_of(">f4", "False", "(2, 3)")), "big-endian"},
      {"big_endian_i8", f(dict_of(">i8", "False", "(3,)")), "big-endian"},
      {"order_string", f(dict_of("<f4", "'no'", "(2, 3)")), "True or False"},
      {"order_int", f(dict_of("<f4", "0", "(2, 3)")), "True or False"},
      {"order_lowercase", f(dict_of("<f4", "false", "(2, 3)")), "True or False"},
      {"order_prefix", f(dict_of("<f4", "Falsey", "(2, 3)")), "True or False"},
      {"shape_list", f(dict_of("<f4", "False", "[2, 3]")), "not a list"},
      {"shape_int", f(dict_of("<f4", "False", "6")), "tuple"},
      {"shape_not_tuple", f(dict_of("<f4", "False", "(6)")), "not a tuple"},
      {"shape_negative", f(dict_of("<f4", "False", "(-1,)")), "negative"},
      {"shape_float", f(dict_of("<f4", "False", "(2.0, 3)")), "',' or ')'"},
      {"shape_text", f(dict_of("<f4", "False", "('a',)")), "integers"},
      {"shape_leading_zero", f(dict_of("<f4", "False", "(02, 3)")), "leading zero"},
      {"shape_long_suffix", f(dict_of("<f4", "False", "(2L, 3L)")), "plain integers"},
      {"shape_unclosed", f("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3"), "')'"},
      {"shape_huge_int", f(dict_of("<f4", "False", "(99999999999999999999,)")), "63 bits"},
      {"shape_product_overflow", f(dict_of("<f4", "False", "(4294967296, 4294967296, 4)")),
       "63 bits"},
      {"bytes_overflow", f(dict_of("<f8", "False", "(2305843009213693952,)")), "63 bits"},
      {"rank_33", f(dict_of("<f4", "False", rank33), Bytes(4, 0)), "more than 32 dimensions"},
      {"unterminated_string", f("{'descr: '<f4', 'fortran_order': False, 'shape': (2, 3)}"),
       "':' missing"},
      {"escape", f("{'descr': '<f\\x34', 'fortran_order': False, 'shape': (2, 3)}"), "escape"},
      {"non_ascii", f("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), '\xe9': 1}"),
       "character 233"},
      {"nul_in_header",
       f(std::string("{'descr': '<f4',") + '\0' + " 'fortran_order': False, 'shape': (2, 3)}"),
       "character 0"},
      {"newline_inside", f("{'descr': '<f4',\n'fortran_order': False, 'shape': (2, 3)}"),
       "character 10"},
      {"text_after_dict", f(dict_of("<f4", "False", "(2, 3)") + " x"), "after the closing"},
      {"two_dicts", f(dict_of("<f4", "False", "(2, 3)") + "{}"), "after the closing"},
      {"missing_colon", f("{'descr' '<f4', 'fortran_order': False, 'shape': (2, 3)}"), "':'"},
      {"missing_comma", f("{'descr': '<f4' 'fortran_order': False, 'shape': (2, 3)}"), "','"},
      {"unclosed_dict", f("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3)"), "','"},
      {"data_short", f(dict_of("<f4", "False", "(2, 3)"), Bytes(23, 0)), "truncated data"},
      {"data_long", f(dict_of("<f4", "False", "(2, 3)"), Bytes(25, 0)), "size mismatch"},
      {"data_missing", f(dict_of("<f8", "False", "(1000000000, 1000000000)"), Bytes()),
       "truncated data"},
      {"zero_size_with_data", f(dict_of("<f4", "False", "(0, 3)"), Bytes(4, 0)), "size mismatch"},
      // No elements, but the other dimensions' product (the strides) overflows
      // (npy_fuzzer's finding: signed overflow in the strides).
      {"empty_product_overflow",
       f(dict_of("<f8", "False", "(0, 1111, 1111111111111111111, 111, 111, 1, 1)")), "63 bits"},
      {"empty_product_overflow_fortran", f(dict_of("<f4", "True", "(4294967296, 0, 4294967296)")),
       "63 bits"},
  };
  return t;
}

TEST(Npy, MalformedFilesAreRefused) {
  for (const auto& m : malformed_files()) {
    SCOPED_TRACE(m.name);
    expect_refused(m.bytes, m.message, m.name);
  }
}

TEST(Npy, EveryTruncationIsRefused) {
  NpyArray a(NpyDtype::I64, {2, 3});
  fill_pattern(a);
  const Bytes full = encode_npy(a);
  for (std::size_t n = 0; n < full.size(); ++n) {
    const Bytes cut(full.begin(), full.begin() + static_cast<std::ptrdiff_t>(n));
    EXPECT_THROW(parse_npy(cut.data(), cut.size()), NpyError) << n << " bytes";
  }
}

// Every byte of the preamble and header replaced by characters that matter to
// the parser: each result is either read correctly or refused, never a crash
// (run this under AddressSanitizer).
TEST(Npy, MutatedHeadersNeverCrash) {
  NpyArray a(NpyDtype::F32, {2, 3});
  fill_pattern(a);
  const Bytes full = encode_npy(a);
  const std::size_t header_end = full.size() - a.nbytes();
  const unsigned char replacements[] = {0,   ' ', '\n', '(',  ')',  ',',  '9', '0', '\'', '"',
                                        '{', '}', ':',  '\\', 0x7f, 0xff, 1,   2,   'T',  '>'};
  int accepted = 0, refused = 0;
  for (std::size_t pos = 0; pos < header_end; ++pos) {
    for (const unsigned char r : replacements) {
      Bytes b = full;
      if (b[pos] == r) continue;
      b[pos] = r;
      try {
        const NpyArray got = parse_npy(b.data(), b.size());
        ++accepted;
        EXPECT_LE(got.nbytes(), b.size());
      } catch (const NpyError& e) {
        ++refused;
        EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos);
      }
    }
  }
  EXPECT_GT(refused, 0);
  EXPECT_GT(accepted, 0);  // e.g. a padding space turned into a tab-free space variant
}

TEST(Npy, FileErrors) {
  try {
    (void)read_npy(temp_path("does_not_exist.npy"));
    ADD_FAILURE() << "accepted a missing file";
  } catch (const NpyError& e) {
    EXPECT_NE(std::string(e.what()).find("cannot open"), std::string::npos) << e.what();
  }
  try {
    (void)read_npy(::testing::TempDir());
    ADD_FAILURE() << "accepted a directory";
  } catch (const NpyError& e) {
    EXPECT_NE(std::string(e.what()).find("not a regular file"), std::string::npos) << e.what();
  }
  try {
    write_npy(temp_path("no_such_dir/x.npy"), NpyArray(NpyDtype::F32, {1}));
    ADD_FAILURE() << "wrote into a missing directory";
  } catch (const NpyError& e) {
    EXPECT_NE(std::string(e.what()).find("cannot create"), std::string::npos) << e.what();
  }
  // A path with a newline still gives a one-line message.
  try {
    (void)read_npy(temp_path("bad\nname.npy"));
    ADD_FAILURE();
  } catch (const NpyError& e) {
    EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos);
  }
}

}  // namespace
