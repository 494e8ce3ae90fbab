#ifndef GRADSUM_CORE_RANDOM_H_
#define GRADSUM_CORE_RANDOM_H_

// The one seeded generator of the repo: SplitMix64, small, portable and identical on every
// platform, so the corpus and the initial weights are the same everywhere.
//
//   SplitMix64 rng(MixSeed(seed, /*stream=*/7));
//   double x = rng.Normal();

#include <cstdint>

namespace gradsum {

class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}
  uint64_t Next();
  // Uniform in [0, 1) with 53 random bits.
  double Uniform();
  // Uniform integer in [0, n), n > 0.
  uint64_t Below(uint64_t n);
  // Standard normal (Box-Muller).
  double Normal();

 private:
  uint64_t state_;
};

// Mixes several words into one seed (for keyed random streams).
uint64_t MixSeed(uint64_t a, uint64_t b, uint64_t c = 0);

}  // namespace gradsum

#endif  // GRADSUM_CORE_RANDOM_H_
