// Launching the tensor-core attention kernel (attention_mma.cuh) and its occupancy, per instantiation.
#pragma once
#include "attention_mma.cuh"

namespace ddtree {

template <typename T, int DK, int DV, int WM, int WN, int BN, bool SHARED_KV, int STAGES, bool WG = false>
cudaError_t launch_attn_mma(const AttnParams& p, cudaStream_t stream) {
  using C = MmaCfg<DK, DV, WM, WN, BN, SHARED_KV, sizeof(T), STAGES, WG>;
  auto kernel = attn_mma_kernel<T, DK, DV, WM, WN, BN, SHARED_KV, STAGES, WG>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(C::SMEM));
  if (err != cudaSuccess) return err;
  const dim3 grid(p.num_seqs * p.tiles_per_seq, p.num_kv_heads, p.num_splits);
  // cluster_combine: the splits of a tile form one cluster (grid z = cluster z)
  const unsigned cluster_z = p.cluster_combine ? static_cast<unsigned>(p.num_splits) : 1u;
  return launch_ex(kernel, grid, dim3(C::NTHREADS), C::SMEM, cluster_z, stream, p.pdl != 0, p);
}

template <typename T, int DK, int DV, int WM, int WN, int BN, bool SHARED_KV, int STAGES, bool WG = false>
int attn_mma_occupancy() {
  using C = MmaCfg<DK, DV, WM, WN, BN, SHARED_KV, sizeof(T), STAGES, WG>;
  auto kernel = attn_mma_kernel<T, DK, DV, WM, WN, BN, SHARED_KV, STAGES, WG>;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(C::SMEM)) != cudaSuccess) return 1;
  int blocks = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, C::NTHREADS, C::SMEM) != cudaSuccess) return 1;
  return blocks > 0 ? blocks : 1;
}

}  // namespace ddtree
