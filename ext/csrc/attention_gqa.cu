// Tensor-core GQA instantiations: bf16/fp16, head_dim 64/128; config 0 = 16-row tiles split over 4 column
// warps (decode-shaped: at most 16 packed rows per sequence; 3 cp.async stages, since it is memory-bound),
// config 1 = 64-row tiles, one warp per 16 rows, 2 stages; config 2 = 128-row tiles as warpgroup MMAs, two
// warpgroups sharing each KV tile, 3 stages (sm_90a builds on compute capability 9.0 only: attn_wgmma_built()).
// 64-row warpgroup tiles were 3-5% slower than config 1 on 17-64 rows (trees of 8-16 nodes on an H100, cause not
// established; docs/BENCHMARKS.md 2026-12-06), so warpgroups serve only past 64 rows.
// (An 80-row config for the 68 packed rows of a B = 16 tree, one tile instead of 64 + 4 rows, was measured slower:
// the two tiles run at once and the small one's reads hit L2; docs/BENCHMARKS.md, 2026-12-04.)
#include "attention_mma_launch.cuh"

namespace ddtree {

template <typename T, int D>
static cudaError_t gqa(const AttnParams& p, int config, cudaStream_t stream) {
  if (config == 0) return launch_attn_mma<T, D, D, 1, 4, 64, false, 3>(p, stream);
  if (config == 2) return launch_attn_mma<T, D, D, 8, 1, 64, false, 3, true>(p, stream);
  return launch_attn_mma<T, D, D, 4, 1, 64, false, 2>(p, stream);
}

template <typename T, int D>
static int gqa_occupancy(int config) {
  static const int occ[3] = {attn_mma_occupancy<T, D, D, 1, 4, 64, false, 3>(),
                             attn_mma_occupancy<T, D, D, 4, 1, 64, false, 2>(),
                             attn_mma_occupancy<T, D, D, 8, 1, 64, false, 3, true>()};
  return occ[config < 0 || config > 2 ? 1 : config];
}

bool attn_wgmma_built() {
#ifdef DDTREE_SM90A
  return true;
#else
  return false;
#endif
}

int attn_mma_gqa_ctas_per_sm(DType dtype, int d, int config) {
  if (dtype == kBFloat16) return d == 64 ? gqa_occupancy<__nv_bfloat16, 64>(config) : gqa_occupancy<__nv_bfloat16, 128>(config);
  return d == 64 ? gqa_occupancy<__half, 64>(config) : gqa_occupancy<__half, 128>(config);
}

cudaError_t attn_mma_gqa(const AttnParams& p, DType dtype, int config, cudaStream_t stream) {
  if (p.dk != p.dv) return cudaErrorNotSupported;
  if (dtype == kBFloat16) {
    if (p.dk == 64) return gqa<__nv_bfloat16, 64>(p, config, stream);
    if (p.dk == 128) return gqa<__nv_bfloat16, 128>(p, config, stream);
  } else if (dtype == kFloat16) {
    if (p.dk == 64) return gqa<__half, 64>(p, config, stream);
    if (p.dk == 128) return gqa<__half, 128>(p, config, stream);
  }
  return cudaErrorNotSupported;
}

}  // namespace ddtree
