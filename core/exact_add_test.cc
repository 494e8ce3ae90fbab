// Every build of the exact-add kernel (core/exact_add.h) against the independent __int128
// reference (testing/exact_sum_reference.h), element by element, and the limb bounds.

#include "core/exact_add.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "core/exact_sum.h"
#include "gtest/gtest.h"
#include "testing/exact_sum_reference.h"

namespace gradsum::exact::internal {
namespace {

namespace ref = gradsum::exact_reference;

template <class T>
std::vector<T> Values() {
  std::vector<T> v = {T(0),
                      -T(0),
                      T(1),
                      T(-1),
                      std::numeric_limits<T>::denorm_min(),
                      -std::numeric_limits<T>::min(),
                      T(std::ldexp(1.0, kLsbExponent - 1)),          // a tie: rounds to 0
                      T(std::ldexp(3.0, kLsbExponent - 1)),          // a tie: rounds to 2
                      T(-std::ldexp(5.0, kLsbExponent - 1)),         // a tie: rounds to -2
                      T(std::ldexp(1.0, kLimbBits + kLsbExponent)),  // exactly one limb-1 unit
                      std::nextafter(T(std::ldexp(1.0, kMaxExponent)), T(0)),
                      -std::nextafter(T(std::ldexp(1.0, kMaxExponent)), T(0))};
  std::mt19937_64 gen(17);
  std::uniform_real_distribution<double> exponent(-80, 28.9);
  std::uniform_real_distribution<double> sign(-1, 1);
  for (int i = 0; i < 5000; ++i) {
    v.push_back(T(std::copysign(std::exp2(exponent(gen)), sign(gen))));
  }
  return v;
}

template <class T>
void CheckBuild(const AddKernels& k,
                int64_t (*add)(const AddKernels&, const T*, size_t, int64_t*)) {
  std::vector<T> v = Values<T>();
  const size_t good = v.size();
  // Rejected: NaN, +-Inf, |x| >= 2^kMaxExponent.
  v.push_back(std::numeric_limits<T>::quiet_NaN());
  v.push_back(std::numeric_limits<T>::infinity());
  v.push_back(-std::numeric_limits<T>::infinity());
  v.push_back(T(std::ldexp(1.0, kMaxExponent)));
  std::vector<int64_t> limbs(2 * v.size(), 0);
  // Two passes over an odd-sized tail too (the vector body and the scalar remainder).
  EXPECT_EQ(add(k, v.data(), v.size(), limbs.data()), 4) << k.isa;
  EXPECT_EQ(add(k, v.data() + 3, v.size() - 3, limbs.data() + 6), 4) << k.isa;
  for (size_t i = 0; i < v.size(); ++i) {
    const int passes = i >= 3 ? 2 : 1;
    const ref::i128 want =
        i < good ? passes * ref::Units(static_cast<double>(v[i]), kLsbExponent) : 0;
    const ref::i128 got =
        limbs[2 * i] + static_cast<ref::i128>(limbs[2 * i + 1]) * (ref::i128{1} << kLimbBits);
    ASSERT_TRUE(got == want) << k.isa << " element " << i << " = " << v[i];
    for (int l = 0; l < 2; ++l) {
      EXPECT_LE(std::abs(limbs[2 * i + l]), passes * (int64_t{1} << 45)) << k.isa << " " << i;
    }
  }
}

TEST(ExactAddTest, EveryBuildMatchesTheInt128Reference) {
  int builds = 0;
  for (const char* isa : {"generic", "avx2", "avx512"}) {
    const AddKernels* k = AddKernelsFor(isa);
    if (k == nullptr) continue;  // this CPU does not run it
    ++builds;
    CheckBuild<float>(*k, [](const AddKernels& k, const float* v, size_t n, int64_t* o) {
      return k.add_floats(v, n, o);
    });
    CheckBuild<double>(*k, [](const AddKernels& k, const double* v, size_t n, int64_t* o) {
      return k.add_doubles(v, n, o);
    });
  }
  EXPECT_GE(builds, 1);
  EXPECT_NE(AddKernelsFor("generic"), nullptr);
  EXPECT_EQ(AddKernelsFor("sse9"), nullptr);
}

}  // namespace
}  // namespace gradsum::exact::internal
