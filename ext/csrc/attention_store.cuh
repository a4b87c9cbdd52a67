// The tensor-core attention's finished rows (attention_mma.cuh): a warp's two rows of each 8-row half, from its
// fp32 accumulators, normalized into the output (one KV split) or as fp32 partials plus log2-sum-exp for the split
// combine.
#pragma once
#include "common.cuh"

namespace ddtree {

// row = the warp's first packed row (row0 + 16-row block + lane / 4); col0 = its first output column.
template <typename T, int DV, int O_NT>
__device__ __forceinline__ void store_tile_rows(const AttnParams& p, const float (&o)[O_NT][4], const float (&m_r)[2],
                                                const float (&l_r)[2], int row, int rows_total, int q0, int kvh,
                                                int split, int col0, int tq) {
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int pr = row + hr * 8;
    if (pr >= rows_total) continue;
    const int t = q0 + pr / p.group, h = kvh * p.group + pr % p.group;
    const float inv = l_r[hr] > 0.f ? 1.f / l_r[hr] : 0.f;
    if (p.num_splits == 1) {
      T* orow = static_cast<T*>(p.out) + static_cast<int64_t>(t) * p.o_stride_t + static_cast<int64_t>(h) * p.o_stride_h;
#pragma unroll
      for (int nt = 0; nt < O_NT; ++nt) {
        const int col = col0 + nt * 8 + tq * 2;
        *reinterpret_cast<uint32_t*>(orow + col) = Num<T>::pack2(o[nt][hr * 2] * inv, o[nt][hr * 2 + 1] * inv);
      }
    } else {
      const int64_t r = (static_cast<int64_t>(split) * p.num_tokens + t) * p.num_q_heads + h;
      float* orow = p.o_part + r * DV;
#pragma unroll
      for (int nt = 0; nt < O_NT; ++nt) {
        const int col = col0 + nt * 8 + tq * 2;
        *reinterpret_cast<float2*>(orow + col) = make_float2(o[nt][hr * 2] * inv, o[nt][hr * 2 + 1] * inv);
      }
      if (col0 == 0 && tq == 0) p.lse_part[r] = l_r[hr] > 0.f ? m_r[hr] + log2f(l_r[hr]) : -CUDART_INF_F;
    }
  }
}

}  // namespace ddtree
