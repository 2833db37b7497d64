#include "comm/gloo/reduce_kernels.h"

#include <cstring>

namespace shardtrain::comm::kernels {
namespace {

inline float FromBF16(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Round to nearest even, NaN to the canonical quiet NaN (as c10::BFloat16).
inline uint16_t ToBF16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

inline float Apply(float v, const Finish& f) {
  if (f.plus_zero) v += 0.0f;
  return f.scale != 1.0f ? v * f.scale : v;
}

}  // namespace

// Each loop is compiled for AVX2 and for the baseline; the loader picks one
// for the CPU it runs on (GCC function multiversioning).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define ST_VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define ST_VECTOR_CLONES
#endif

// The branches on `f` are hoisted out of the loops by the compiler (unswitching at -O3).
ST_VECTOR_CLONES void AddF32(float* out, const float* a, const float* b, int64_t n, Finish f) {
  for (int64_t i = 0; i < n; ++i) out[i] = Apply(a[i] + b[i], f);
}

ST_VECTOR_CLONES void AddBF16(uint16_t* out, const uint16_t* a, const uint16_t* b, int64_t n, Finish f) {
  for (int64_t i = 0; i < n; ++i) out[i] = ToBF16(Apply(FromBF16(a[i]) + FromBF16(b[i]), f));
}

ST_VECTOR_CLONES void LoadBF16(float* __restrict acc, const uint16_t* __restrict src, int64_t n, bool plus_zero) {
  if (plus_zero) {
    for (int64_t i = 0; i < n; ++i) acc[i] = FromBF16(src[i]) + 0.0f;
  } else {
    for (int64_t i = 0; i < n; ++i) acc[i] = FromBF16(src[i]);
  }
}

ST_VECTOR_CLONES void AccumulateBF16(float* __restrict acc, const uint16_t* __restrict src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] += FromBF16(src[i]);
}

ST_VECTOR_CLONES void StoreBF16(uint16_t* __restrict out, const float* __restrict acc, int64_t n, float scale) {
  if (scale != 1.0f) {
    for (int64_t i = 0; i < n; ++i) out[i] = ToBF16(acc[i] * scale);
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = ToBF16(acc[i]);
  }
}

ST_VECTOR_CLONES void LoadF32(float* __restrict acc, const float* __restrict src, int64_t n, bool plus_zero) {
  if (plus_zero) {
    for (int64_t i = 0; i < n; ++i) acc[i] = src[i] + 0.0f;
  } else {
    std::memcpy(acc, src, n * sizeof(float));
  }
}

ST_VECTOR_CLONES void AccumulateF32(float* __restrict acc, const float* __restrict src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] += src[i];
}

ST_VECTOR_CLONES void ScaleF32(float* acc, int64_t n, float scale) {
  for (int64_t i = 0; i < n; ++i) acc[i] *= scale;
}

}  // namespace shardtrain::comm::kernels
