// CPU shim for running mx.fast.metal_kernel bodies with g++ (test-only).
//
// The harness (harness.py) pastes the EXACT body text of a metal/*.metal file into a C++ function
// whose signature mirrors the one MLX generates (mlx/backend/metal/custom_kernel.cpp,
// write_signature), and runs it over the whole grid. This header supplies the little of the
// Metal Shading Language that the bodies may use:
//
// - address-space qualifiers `device` and `constant` are defined away. `threadgroup` storage is
//   deliberately NOT provided (a body that declares threadgroup memory fails to compile here:
//   the harness would otherwise give each thread a private copy, which is not Metal's semantics);
// - `uint`, `uint3` and the thread-position attributes (passed as arguments by the generated
//   launcher);
// - `half`/`float16_t` and `bfloat16_t`/`bfloat` as 16-bit storage types with EXPLICIT float
//   conversions (round to nearest even, as Metal and MLX convert), so a body that does arithmetic
//   in half or bfloat instead of float does not compile here rather than being silently run in
//   float;
// - `metal::exp`, `metal::max`, `metal::min`, `metal::abs`, `metal::fast::exp`,
//   `metal::precise::exp`, `metal::isnan`, `metal::isinf`;
// - `threadgroup_barrier(mem_flags::...)`: when a body uses it, the launcher runs the threads of
//   each threadgroup as cooperative fibers that all stop at each barrier (a barrier not reached by
//   every thread of the group is reported as an error). SIMD-group functions are not provided.
#pragma once

// Every standard header the harness needs comes before the address-space macros below.
#include <ucontext.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#define device
#define constant
#define thread
#define METAL_FUNC inline

typedef unsigned int uint;

struct uint3 {
  uint x, y, z;
};

namespace dflash2_shim {

inline uint16_t float_to_half_bits(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t absx = x & 0x7fffffffu;
  if (absx > 0x7f800000u) {
    return static_cast<uint16_t>(sign | 0x7e00u | ((absx >> 13) & 0x3ffu));  // NaN stays NaN
  }
  if (absx >= 0x477ff000u) {
    return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520 rounds to infinity (and inf)
  }
  if (absx < 0x38800000u) {
    // Below the smallest normal half (2^-14): a multiple of 2^-24, rounded to nearest even.
    float a;
    std::memcpy(&a, &absx, 4);
    const uint32_t m = static_cast<uint32_t>(std::nearbyint(a * 16777216.0f));
    return static_cast<uint16_t>(sign | m);
  }
  const uint32_t mant = absx & 0x7fffffu;
  const uint32_t exp = (absx >> 23) - 127u + 15u;
  uint32_t h = (exp << 10) | (mant >> 13);
  const uint32_t rem = mant & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) {
    h += 1u;
  }
  return static_cast<uint16_t>(sign | h);
}

inline float half_bits_to_float(uint16_t h) {
  const uint32_t sign = (static_cast<uint32_t>(h) & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    const float v = static_cast<float>(mant) * 5.9604644775390625e-08f;  // mant * 2^-24, exact
    return sign ? -v : v;
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 112u) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t float_to_bfloat_bits(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if (std::isnan(f)) {
    return 0x7fc0u;  // as MLX's _MLX_BFloat16
  }
  x += 0x7fffu + ((x >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(x >> 16);
}

inline float bfloat_bits_to_float(uint16_t b) {
  const uint32_t x = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}

}  // namespace dflash2_shim

struct half {
  uint16_t bits;
  half() = default;
  explicit half(float f) : bits(dflash2_shim::float_to_half_bits(f)) {}
  explicit operator float() const { return dflash2_shim::half_bits_to_float(bits); }
};

struct bfloat16_t {
  uint16_t bits;
  bfloat16_t() = default;
  explicit bfloat16_t(float f) : bits(dflash2_shim::float_to_bfloat_bits(f)) {}
  explicit operator float() const { return dflash2_shim::bfloat_bits_to_float(bits); }
};

typedef half float16_t;
typedef bfloat16_t bfloat;
static_assert(sizeof(half) == 2 && sizeof(bfloat16_t) == 2, "16-bit storage types");

namespace metal {

inline float exp(float x) { return std::exp(x); }
inline float max(float a, float b) { return std::fmax(a, b); }
inline float min(float a, float b) { return std::fmin(a, b); }
inline int max(int a, int b) { return a > b ? a : b; }
inline int min(int a, int b) { return a < b ? a : b; }
inline uint max(uint a, uint b) { return a > b ? a : b; }
inline uint min(uint a, uint b) { return a < b ? a : b; }
inline float abs(float x) { return std::fabs(x); }
inline int abs(int x) { return x < 0 ? -x : x; }
inline bool isnan(float x) { return std::isnan(x); }
inline bool isinf(float x) { return std::isinf(x); }
namespace fast {
inline float exp(float x) { return std::exp(x); }
}  // namespace fast
namespace precise {
inline float exp(float x) { return std::exp(x); }
}  // namespace precise

enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
inline mem_flags operator|(mem_flags a, mem_flags b) {
  return static_cast<mem_flags>(static_cast<int>(a) | static_cast<int>(b));
}

}  // namespace metal

using metal::mem_flags;

// Implemented by the launcher (runtime.h): suspends the calling fiber until every thread of its
// threadgroup has reached the barrier.
void threadgroup_barrier(mem_flags flags);
