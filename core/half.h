#ifndef GRADSUM_CORE_HALF_H_
#define GRADSUM_CORE_HALF_H_

// bf16 and IEEE f16 storage types with exact conversions.
//
// float -> bf16/f16 rounds to nearest, ties to even; NaN stays NaN (quiet, sign kept),
// +-Inf stays Inf, overflow goes to Inf, f16 subnormals are produced and read exactly.
// bf16/f16 -> float is exact. Arithmetic is done by converting to float.
//
//   BF16 b = BF16::FromFloat(x);
//   float y = b.ToFloat();

#include <cstdint>
#include <cstring>

namespace gradsum {

inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

inline float BitsToFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

struct BF16 {
  uint16_t bits = 0;

  static BF16 FromBits(uint16_t b) {
    BF16 r;
    r.bits = b;
    return r;
  }

  static BF16 FromFloat(float f) {
    const uint32_t u = FloatBits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      // NaN: keep the sign and the top payload bits, force quiet so it never becomes Inf.
      return FromBits(static_cast<uint16_t>((u >> 16) | 0x0040u));
    }
    // Round to nearest even on the 16 dropped bits. Overflow carries into Inf correctly.
    const uint32_t lsb = (u >> 16) & 1u;
    const uint32_t rounded = u + 0x7fffu + lsb;
    return FromBits(static_cast<uint16_t>(rounded >> 16));
  }

  float ToFloat() const { return BitsToFloat(static_cast<uint32_t>(bits) << 16); }
};

struct F16 {
  uint16_t bits = 0;

  static F16 FromBits(uint16_t b) {
    F16 r;
    r.bits = b;
    return r;
  }

  static F16 FromFloat(float f) {
    const uint32_t u = FloatBits(f);
    const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
    const uint32_t abs = u & 0x7fffffffu;
    if (abs > 0x7f800000u) {  // NaN: quiet, keep top payload bits.
      return FromBits(static_cast<uint16_t>(sign | 0x7e00u | ((abs >> 13) & 0x3ffu)));
    }
    if (abs >= 0x477ff000u) {
      // >= 65520 rounds to Inf (65504 is the largest finite; 65520 is the tie above it).
      return FromBits(static_cast<uint16_t>(sign | 0x7c00u));
    }
    if (abs < 0x38800000u) {
      // Result is subnormal or zero in f16: value = m * 2^-24 with m in [0, 1024].
      // Shift the full 24-bit significand and round to nearest even.
      const int exp = static_cast<int>(abs >> 23);  // biased float exponent
      if (exp < 102) return FromBits(sign);         // < 2^-25: rounds to zero (ties too)
      const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
      const int shift = 126 - exp;  // 14..24 for exp in [102, 112]
      const uint32_t half = 1u << (shift - 1);
      const uint32_t rem = mant & ((1u << shift) - 1);
      uint32_t q = mant >> shift;
      if (rem > half || (rem == half && (q & 1u))) ++q;
      return FromBits(static_cast<uint16_t>(sign | q));
    }
    // Normal: rebias exponent (127 -> 15) and round 13 dropped bits to nearest even.
    const uint32_t lsb = (abs >> 13) & 1u;
    const uint32_t rounded = abs + 0xfffu + lsb;
    const uint32_t h = (rounded >> 13) - ((127u - 15u) << 10);
    return FromBits(static_cast<uint16_t>(sign | h));
  }

  float ToFloat() const {
    const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
    const uint32_t exp = (bits >> 10) & 0x1fu;
    const uint32_t mant = bits & 0x3ffu;
    if (exp == 0x1f) return BitsToFloat(sign | 0x7f800000u | (mant << 13));  // Inf / NaN
    if (exp == 0) {
      // Zero or subnormal: mant * 2^-24, exact in float.
      const float v = static_cast<float>(mant) * 5.9604644775390625e-8f;
      return sign ? -v : v;
    }
    return BitsToFloat(sign | ((exp + 127u - 15u) << 23) | (mant << 13));
  }
};

static_assert(sizeof(BF16) == 2, "BF16 must be 2 bytes");
static_assert(sizeof(F16) == 2, "F16 must be 2 bytes");

}  // namespace gradsum

#endif  // GRADSUM_CORE_HALF_H_
