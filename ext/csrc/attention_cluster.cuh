// The split-KV combine inside one attention launch (sm_90): the splits of a tile run as one thread-block cluster
// and merge their partial outputs through distributed shared memory (AttnParams::cluster_combine).
#pragma once
#include <cooperative_groups.h>

#include "common.cuh"
#include "kernels.h"

namespace ddtree {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// The splits of one tile as a thread-block cluster (AttnParams::cluster_combine): each CTA has left its normalized
// partial output po [BM, DV] and log2-sum-exp plse [BM] (-inf = empty split) in its own shared memory; the cluster
// combines them through distributed shared memory, each CTA writing a share of the tile's outputs, exactly as
// attn_combine_kernel does from global memory.
template <typename T, int BM, int DV, int NTHREADS>
__device__ __forceinline__ void cluster_combine(const AttnParams& p, float* po, float* plse, int q0, int row0,
                                                int rows_total, int kvh) {
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();  // every split's partials are in its shared memory
  const int splits = static_cast<int>(cluster.num_blocks()), rank = static_cast<int>(cluster.block_rank());
  for (int idx = rank * NTHREADS + static_cast<int>(threadIdx.x); idx < BM * DV; idx += splits * NTHREADS) {
    const int r = idx / DV, col = idx % DV, pr = row0 + r;
    if (pr >= rows_total) continue;
    float lse[kMaxClusterSplits];
    float mx = -CUDART_INF_F;
#pragma unroll
    for (int s = 0; s < kMaxClusterSplits; ++s) {
      lse[s] = s < splits ? cluster.map_shared_rank(plse, s)[r] : -CUDART_INF_F;
      mx = fmaxf(mx, lse[s]);
    }
    float acc = 0.f, wsum = 0.f;
#pragma unroll
    for (int s = 0; s < kMaxClusterSplits; ++s) {
      if (lse[s] == -CUDART_INF_F) continue;  // empty split: its partial was never written
      const float w = exp2f(lse[s] - mx);
      acc += w * cluster.map_shared_rank(po, s)[r * DV + col];
      wsum += w;
    }
    const int t = q0 + pr / p.group, h = kvh * p.group + pr % p.group;
    static_cast<T*>(p.out)[static_cast<int64_t>(t) * p.o_stride_t + static_cast<int64_t>(h) * p.o_stride_h + col] =
        Num<T>::from_f(wsum > 0.f ? acc / wsum : 0.f);
  }
  cluster.sync();  // no CTA leaves while another still reads its shared memory
}
#endif

}  // namespace ddtree
