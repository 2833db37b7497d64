// Element-wise loops for the shared memory reductions (comm/gloo_communicator.cc):
// float32 and bfloat16 sums with the arithmetic ATen would use (float32 math,
// bfloat16 rounded to nearest even), in one pass where ATen needs several or
// falls back to a slow mixed-dtype loop. Compiled with -O3 (vectorized). Plain
// C++: bfloat16 is its raw 16 bits.
#ifndef SHARDTRAIN_COMM_GLOO_REDUCE_KERNELS_H_
#define SHARDTRAIN_COMM_GLOO_REDUCE_KERNELS_H_

#include <cstdint>

namespace shardtrain::comm::kernels {

// How a finished sum v is stored: v + 0 when `plus_zero` (turns -0 into +0,
// as a sum that starts from +0), then v * scale when scale != 1.
struct Finish {
  bool plus_zero = false;
  float scale = 1.0f;
};

// out[i] = finish(a[i] + b[i]); out may be a or b.
void AddF32(float* out, const float* a, const float* b, int64_t n, Finish f);
// out[i] = bf16(finish(float(a[i]) + float(b[i]))); out may be a or b.
void AddBF16(uint16_t* out, const uint16_t* a, const uint16_t* b, int64_t n, Finish f);

// Running float32 sums for bfloat16 inputs:
// acc[i] = float(src[i]) (+ 0 when plus_zero)
void LoadBF16(float* acc, const uint16_t* src, int64_t n, bool plus_zero);
// acc[i] += float(src[i])
void AccumulateBF16(float* acc, const uint16_t* src, int64_t n);
// out[i] = bf16(acc[i] * scale)
void StoreBF16(uint16_t* out, const float* acc, int64_t n, float scale);

// Running float32 sums: acc[i] = src[i] (+ 0 when plus_zero); acc[i] += src[i];
// acc[i] *= scale.
void LoadF32(float* acc, const float* src, int64_t n, bool plus_zero);
void AccumulateF32(float* acc, const float* src, int64_t n);
void ScaleF32(float* acc, int64_t n, float scale);

}  // namespace shardtrain::comm::kernels

#endif  // SHARDTRAIN_COMM_GLOO_REDUCE_KERNELS_H_
