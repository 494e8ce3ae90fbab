#ifndef GRADSUM_TESTING_EXACT_SUM_REFERENCE_H_
#define GRADSUM_TESTING_EXACT_SUM_REFERENCE_H_

// An independent reference for core/exact_sum.h, for tests: it never calls the code under
// test. A value is decoded with frexp into an integer mantissa and exponent, rounded to the
// LSB 2^lsb with integer arithmetic (ties to even, by comparing the remainder with half the
// divisor), summed in __int128, and converted back with the compiler's own (correctly
// rounded) __int128 -> float/double conversion and an exact ldexp. Sums must stay within
// __int128 (|sum| < 2^126 units).

#include <cmath>
#include <cstdint>

namespace gradsum::exact_reference {

using i128 = __int128;

// round(x / 2^lsb), ties to even. x finite.
inline i128 Units(double x, int lsb) {
  if (x == 0) return 0;
  int e;
  const double f = std::frexp(std::fabs(x), &e);              // |x| = f * 2^e, f in [0.5, 1)
  const int64_t m = static_cast<int64_t>(std::ldexp(f, 53));  // exact integer
  const int shift = e - 53 - lsb;                             // |x| / 2^lsb = m * 2^shift
  i128 q;
  if (shift >= 0) {
    q = static_cast<i128>(m) << shift;
  } else if (shift <= -64) {
    q = 0;  // below a quarter LSB
  } else {
    const i128 div = static_cast<i128>(1) << -shift;
    q = m / div;
    const i128 rem = m % div;
    const i128 half = div / 2;
    if (rem > half || (rem == half && (q & 1))) ++q;
  }
  return x < 0 ? -q : q;
}

inline float ToFloat(i128 v, int lsb) { return std::ldexp(static_cast<float>(v), lsb); }
inline double ToDouble(i128 v, int lsb) { return std::ldexp(static_cast<double>(v), lsb); }

}  // namespace gradsum::exact_reference

#endif  // GRADSUM_TESTING_EXACT_SUM_REFERENCE_H_
