// Helpers shared by the tests: a seeded RNG, tensor layouts, guarded buffers
// and the list of backends the runtime knows.
#pragma once

#include <mha/mha.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace mha_test {

// ------------------------------------------------------------------ random values

class Rng {
 public:
  explicit Rng(uint64_t seed) : engine_(seed) {}
  float uniform(float lo = -1.0f, float hi = 1.0f) {
    return std::uniform_real_distribution<float>(lo, hi)(engine_);
  }
  int64_t integer(int64_t lo, int64_t hi) {  // [lo, hi]
    return std::uniform_int_distribution<int64_t>(lo, hi)(engine_);
  }
  bool chance(double p) { return std::bernoulli_distribution(p)(engine_); }

 private:
  std::mt19937_64 engine_;
};

// ------------------------------------------------------------------ layouts

// The logical shape of q, k, v and out is [B, heads, L, D]; the memory order is
// either that (BHLD) or the projection's natural [B, L, heads, D] (BLHD).
enum class Layout { BHLD, BLHD };

inline const char* layout_name(Layout layout) {
  return layout == Layout::BHLD ? "BHLD" : "BLHD";
}

struct Shape4 {
  int64_t shape[4];
  int64_t strides[4];
  int64_t extent;  // elements from the first to one past the last reachable element
};

// Strides (in elements) of a [b, h, l, d] tensor stored in `layout`, each row of
// d features followed by `pad` unused elements.
inline Shape4 make_shape(Layout layout, int64_t b, int64_t h, int64_t l, int64_t d,
                         int64_t pad = 0) {
  const int64_t row = d + pad;
  Shape4 s{{b, h, l, d}, {0, 0, 0, 1}, 0};
  if (layout == Layout::BHLD) {
    s.strides[2] = row;
    s.strides[1] = l * row;
    s.strides[0] = h * l * row;
  } else {
    s.strides[1] = row;
    s.strides[2] = h * row;
    s.strides[0] = l * h * row;
  }
  s.extent = b * h * l * row;
  return s;
}

// C-order strides of a shape.
inline std::vector<int64_t> c_strides(const std::vector<int64_t>& shape) {
  std::vector<int64_t> strides(shape.size());
  int64_t running = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = running;
    running *= shape[i];
  }
  return strides;
}

inline int64_t element_count(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

// A descriptor built by hand (no mha call), so a test controls every field.
inline mha_tensor describe(void* data, mha_dtype dtype, const std::vector<int64_t>& shape,
                           const std::vector<int64_t>& strides) {
  mha_tensor t{};
  t.data = data;
  t.dtype = dtype;
  t.ndim = static_cast<int32_t>(shape.size());
  // (i < strides.size() too: g++ 12's -Warray-bounds cannot see that the two
  // sizes agree once this is inlined.)
  for (size_t i = 0; i < shape.size() && i < strides.size() && i < MHA_MAX_DIMS; ++i) {
    t.shape[i] = shape[i];
    t.strides[i] = strides[i];
  }
  return t;
}

inline mha_tensor describe(void* data, mha_dtype dtype, const std::vector<int64_t>& shape) {
  return describe(data, dtype, shape, c_strides(shape));
}

// Calls fn(offset) for every element offset a descriptor reaches.
template <typename Fn>
void for_each_offset(const mha_tensor& t, Fn&& fn) {
  int64_t shape[4] = {1, 1, 1, 1}, strides[4] = {0, 0, 0, 0};
  for (int32_t d = 0; d < t.ndim; ++d) {
    shape[4 - t.ndim + d] = t.shape[d];
    strides[4 - t.ndim + d] = t.strides[d];
  }
  for (int64_t a = 0; a < shape[0]; ++a)
    for (int64_t b = 0; b < shape[1]; ++b)
      for (int64_t c = 0; c < shape[2]; ++c)
        for (int64_t e = 0; e < shape[3]; ++e)
          fn(a * strides[0] + b * strides[1] + c * strides[2] + e * strides[3]);
}

// ------------------------------------------------------------------ guarded memory

// Bytes per element of a dtype (0 for an unknown one).
inline int64_t element_bytes(int32_t dtype) {
  switch (dtype) {
    case MHA_DTYPE_BOOL:
    case MHA_DTYPE_I8:
      return 1;
    case MHA_DTYPE_F16:
    case MHA_DTYPE_BF16:
      return 2;
    case MHA_DTYPE_F32:
    case MHA_DTYPE_I32:
      return 4;
    case MHA_DTYPE_I64:
      return 8;
    default:
      return 0;
  }
}

// Of the `size` bytes at `now` (a buffer a descriptor `t` points into), the
// number outside t's elements that differ from `before` (a copy taken
// earlier): what a call wrote where it must not.
inline int64_t changed_bytes_outside(const void* now, const void* before, size_t size,
                                     const mha_tensor& t) {
  const auto* bytes = static_cast<const unsigned char*>(now);
  const auto* old = static_cast<const unsigned char*>(before);
  std::vector<char> reached(size, 0);
  const int64_t start = static_cast<const unsigned char*>(t.data) - bytes;
  const int64_t width = element_bytes(t.dtype);
  for_each_offset(t, [&](int64_t offset) {
    for (int64_t k = 0; k < width; ++k)
      reached[static_cast<size_t>(start + offset * width + k)] = 1;
  });
  int64_t changed = 0;
  for (size_t i = 0; i < size; ++i) {
    if (reached[i] == 0 && bytes[i] != old[i]) ++changed;
  }
  return changed;
}

// A float allocation with kGuard sentinel elements on either side of its payload.
// Everything starts as the sentinel (a NaN with a recognisable payload: reading
// it by mistake poisons a result, writing it by mistake is visible).
class Arena {
 public:
  static constexpr int64_t kGuard = 67;
  static constexpr uint32_t kSentinelBits = 0x7fc0dead;

  explicit Arena(int64_t payload)
      : data_(static_cast<size_t>(payload + 2 * kGuard), sentinel()), payload_(payload) {}

  static float sentinel() {
    float f;
    std::memcpy(&f, &kSentinelBits, sizeof f);
    return f;
  }
  static bool is_sentinel(float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof bits);
    return bits == kSentinelBits;
  }

  float* base() { return data_.data() + kGuard; }
  const float* base() const { return data_.data() + kGuard; }
  int64_t payload() const { return payload_; }
  const std::vector<float>& all() const { return data_; }

  // A descriptor of [b, h, l, d] at `offset` elements into the payload.
  mha_tensor view(const Shape4& s, int64_t offset = 0) {
    return describe(base() + offset, MHA_DTYPE_F32,
                    {s.shape[0], s.shape[1], s.shape[2], s.shape[3]},
                    {s.strides[0], s.strides[1], s.strides[2], s.strides[3]});
  }

  // Number of bytes outside `t`'s elements (of any dtype: a half-precision
  // tensor may live in an arena too) that differ from `before`.
  int64_t changed_outside(const mha_tensor& t, const std::vector<float>& before) const {
    return changed_bytes_outside(data_.data(), before.data(), data_.size() * sizeof(float), t);
  }

  bool bits_equal(const std::vector<float>& before) const {
    return before.size() == data_.size() &&
           std::memcmp(before.data(), data_.data(), data_.size() * sizeof(float)) == 0;
  }

 private:
  std::vector<float> data_;
  int64_t payload_;
};

// Fills the elements a float descriptor reaches with uniform values in [lo, hi].
inline void fill_uniform(const mha_tensor& t, Rng& rng, float lo = -1.0f, float hi = 1.0f) {
  float* data = static_cast<float*>(t.data);
  for_each_offset(t, [&](int64_t offset) { data[offset] = rng.uniform(lo, hi); });
}

// ------------------------------------------------------------------ half precision

// x rounded to nearest (ties to even) as IEEE binary16 / bfloat16 bits,
// computed in double from the formats' definitions -- independent of the
// library's own conversions.
inline uint16_t round_to_f16_bits(float x) {
  if (std::isnan(x)) return 0x7E00;
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  const double a = std::fabs(static_cast<double>(x));
  if (a >= 65520.0) return static_cast<uint16_t>(sign | 0x7C00);  // rounds to infinity
  if (a < std::ldexp(1.0, -14)) {  // subnormal: units of 2^-24 (1024 units: the smallest normal)
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(std::nearbyint(std::ldexp(a, 24))));
  }
  int e = 0;
  std::frexp(a, &e);                                     // a = f · 2^e, f in [0.5, 1)
  double units = std::nearbyint(std::ldexp(a, 11 - e));  // 11 significant bits
  int exponent = e - 1;
  if (units == 2048.0) {
    units = 1024.0;
    ++exponent;
  }
  if (exponent > 15) return static_cast<uint16_t>(sign | 0x7C00);
  return static_cast<uint16_t>(sign | ((exponent + 15) << 10) |
                               static_cast<uint16_t>(units - 1024.0));
}

inline uint16_t round_to_bf16_bits(float x) {
  if (std::isnan(x)) return 0x7FC0;
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  const double a = std::fabs(static_cast<double>(x));
  if (std::isinf(a)) return static_cast<uint16_t>(sign | 0x7F80);
  if (a < std::ldexp(1.0, -126)) {  // subnormal: units of 2^-133
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(std::nearbyint(std::ldexp(a, 133))));
  }
  int e = 0;
  std::frexp(a, &e);
  double units = std::nearbyint(std::ldexp(a, 8 - e));  // 8 significant bits
  int exponent = e - 1;
  if (units == 256.0) {
    units = 128.0;
    ++exponent;
  }
  if (exponent > 127) return static_cast<uint16_t>(sign | 0x7F80);
  return static_cast<uint16_t>(sign | ((exponent + 127) << 7) |
                               static_cast<uint16_t>(units - 128.0));
}

// The value of binary16 / bfloat16 bits, from the formats' definitions.
inline double half_bits_value(uint16_t bits, int32_t dtype) {
  if (dtype == MHA_DTYPE_BF16) {
    const uint32_t wide = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &wide, sizeof f);
    return static_cast<double>(f);
  }
  const double sign = (bits & 0x8000u) != 0 ? -1.0 : 1.0;
  const int exponent = (bits >> 10) & 0x1F, mantissa = bits & 0x3FF;
  if (exponent == 0x1F) return mantissa != 0 ? std::nan("") : sign * HUGE_VAL;
  if (exponent == 0) return sign * std::ldexp(mantissa, -24);
  return sign * std::ldexp(1024 + mantissa, exponent - 25);
}

// A float tensor's values stored as another dtype (F32, BF16 or F16): the
// buffer, and a descriptor over it with the original's shape and strides.
class TypedCopy {
 public:
  TypedCopy(const mha_tensor& source, int32_t dtype) : t_(source) {
    int64_t extent = 1;
    for (int32_t d = 0; d < source.ndim; ++d) extent += (source.shape[d] - 1) * source.strides[d];
    bytes_.assign(static_cast<size_t>(extent) * (dtype == MHA_DTYPE_F32 ? 4 : 2), 0);
    t_.data = bytes_.data();
    t_.dtype = dtype;
    const float* from = static_cast<const float*>(source.data);
    for_each_offset(source, [&](int64_t at) {
      if (dtype == MHA_DTYPE_F32) {
        std::memcpy(bytes_.data() + at * 4, from + at, 4);
      } else {
        const uint16_t bits =
            dtype == MHA_DTYPE_BF16 ? round_to_bf16_bits(from[at]) : round_to_f16_bits(from[at]);
        std::memcpy(bytes_.data() + at * 2, &bits, 2);
      }
    });
  }
  mha_tensor& get() { return t_; }

 private:
  std::vector<unsigned char> bytes_;
  mha_tensor t_;
};

// ------------------------------------------------------------------ backends

struct BackendEntry {
  std::string name;
  bool usable = false;
  int32_t priority = 0;
  std::string reason;
  bool bf16_dot = false;  // mha_backend_get_bf16_dot: bf16 products by bf16 dot products
};

// Every backend the runtime knows, usable or not, in the runtime's order.
inline std::vector<BackendEntry> list_backends() {
  std::vector<BackendEntry> list;
  const int32_t count = mha_backend_count();
  for (int32_t i = 0; i < count; ++i) {
    mha_backend_info info{};
    if (mha_backend_get_info(i, &info) != MHA_OK || info.name == nullptr) continue;
    int32_t bf16_dot = 0;
    if (mha_backend_get_bf16_dot(i, &bf16_dot) != MHA_OK) bf16_dot = 0;
    list.push_back({info.name, info.usable != 0, info.priority,
                    info.reason != nullptr ? info.reason : "", bf16_dot != 0});
  }
  return list;
}

inline const BackendEntry* find_backend(const std::vector<BackendEntry>& list,
                                        const std::string& name) {
  for (const auto& entry : list) {
    if (entry.name == name) return &entry;
  }
  return nullptr;
}

// The usable backend of highest priority (the first in the runtime's order on a
// tie), or nullptr.
inline const BackendEntry* best_usable(const std::vector<BackendEntry>& list) {
  const BackendEntry* best = nullptr;
  for (const auto& entry : list) {
    if (entry.usable && (best == nullptr || entry.priority > best->priority)) best = &entry;
  }
  return best;
}

inline std::string join_shape(const int64_t* shape, int32_t ndim) {
  std::ostringstream os;
  os << '[';
  for (int32_t i = 0; i < ndim; ++i) os << (i ? "," : "") << shape[i];
  os << ']';
  return os.str();
}

}  // namespace mha_test
