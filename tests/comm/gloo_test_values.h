// Test values the Gloo communicator tests share: exact small integers, random
// values with signed zeros, and a bit-for-bit comparison.
#ifndef SHARDTRAIN_TESTS_COMM_GLOO_TEST_VALUES_H_
#define SHARDTRAIN_TESTS_COMM_GLOO_TEST_VALUES_H_

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <cstdint>

namespace shardtrain::comm {

// Small integers: exact in float32, float16 and bfloat16 (all sums <= 256).
inline at::Tensor Pattern(int64_t n, int rank, at::ScalarType dtype) {
  return (at::arange(n, at::kDouble).remainder(7) + 1 + 10 * rank).to(dtype);
}

// Random values with signed zeros and mixed magnitudes (the same for a given seed).
inline at::Tensor RandomValues(int64_t n, at::ScalarType dtype, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  at::Tensor t = at::randn({n}, gen, at::TensorOptions().dtype(at::kDouble));
  t.mul_(at::pow(10.0, at::randint(-3, 4, {n}, gen, at::TensorOptions().dtype(at::kDouble))));
  t[0] = -0.0;
  t[1] = 0.0;
  return t.to(dtype);
}

inline bool BitEqual(const at::Tensor& a, const at::Tensor& b) {
  const at::ScalarType bits = a.element_size() == 2 ? at::kShort : a.element_size() == 4 ? at::kInt : at::kLong;
  return a.scalar_type() == b.scalar_type() && at::equal(a.view(bits), b.view(bits));
}

}  // namespace shardtrain::comm

#endif  // SHARDTRAIN_TESTS_COMM_GLOO_TEST_VALUES_H_
