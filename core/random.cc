#include "core/random.h"

#include <cmath>

namespace gradsum {
namespace {

uint64_t Finalize(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

}  // namespace

uint64_t SplitMix64::Next() {
  state_ += 0x9e3779b97f4a7c15ull;
  return Finalize(state_);
}

double SplitMix64::Uniform() { return static_cast<double>(Next() >> 11) * 0x1.0p-53; }

uint64_t SplitMix64::Below(uint64_t n) {
  // Rejection keeps the draw exactly uniform.
  const uint64_t limit = ~uint64_t{0} - (~uint64_t{0} % n);
  uint64_t x;
  do {
    x = Next();
  } while (x >= limit);
  return x % n;
}

double SplitMix64::Normal() {
  double u1;
  do {
    u1 = Uniform();
  } while (u1 <= 0.0);
  const double u2 = Uniform();
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
}

uint64_t MixSeed(uint64_t a, uint64_t b, uint64_t c) {
  uint64_t x = Finalize(a + 0x9e3779b97f4a7c15ull);
  x = Finalize(x ^ (b + 0x632be59bd9b4e019ull));
  return Finalize(x ^ (c + 0x85157af5ull));
}

}  // namespace gradsum
