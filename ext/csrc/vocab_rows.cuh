// Device helpers shared by the kernels that stream vocabulary rows (top-K, sampling): 8-element row loads
// (16-byte vectors where the row allows), fast exp2, and small integer helpers.
#pragma once
#include "common.cuh"

namespace ddtree {

constexpr float kLog2e = 1.4426950408889634f;
constexpr int kRowEpt = 8;  // elements per thread per load

// v[e] = x[i0 + e] as fp32 for e < 8 (-inf past `end`). `vec`: 16-byte loads allowed (row base aligned, i0 a
// multiple of 8); a group of 8 that runs past `end` is read element by element. -0.0 is canonicalized to +0.0.
template <typename T>
__device__ __forceinline__ void load8(const T* x, int i0, int end, bool vec, float (&v)[kRowEpt]) {
  if (vec && i0 + kRowEpt <= end) {
    if constexpr (sizeof(T) == 2) {
      const uint4 raw = *reinterpret_cast<const uint4*>(x + i0);
      const T* h = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int e = 0; e < kRowEpt; ++e) v[e] = Num<T>::to_f(h[e]);
    } else {
      const float4 a = *reinterpret_cast<const float4*>(x + i0);
      const float4 b = *reinterpret_cast<const float4*>(x + i0 + 4);
      v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    }
  } else {
#pragma unroll
    for (int e = 0; e < kRowEpt; ++e) v[e] = i0 + e < end ? Num<T>::to_f(x[i0 + e]) : -CUDART_INF_F;
  }
#pragma unroll
  for (int e = 0; e < kRowEpt; ++e) v[e] += 0.0f;  // -0.0 -> +0.0, so it ties with +0.0 (reference)
}

__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__host__ __device__ __forceinline__ int next_pow2(int x) {
  int p = 1;
  while (p < x) p <<= 1;
  return p;
}

__host__ __device__ __forceinline__ int round_up(int x, int m) { return (x + m - 1) / m * m; }

}  // namespace ddtree
