// Tensor-core MLA (absorbed) instantiations: bf16/fp16 over a latent cache of 512 + 64 rope dims, the values
// being the first 512 dims of the same rows (loaded once per tile). Config 0: 16 rows (<= 16 heads x tokens),
// 4 column warps; config 1: 64 rows, 4 x 2 warps, 32-token KV tiles (shared memory holds Q 64x576).
#include "attention_mma_launch.cuh"

namespace ddtree {

template <typename T>
static cudaError_t mla(const AttnParams& p, int config, cudaStream_t stream) {
  if (config == 0) return launch_attn_mma<T, 576, 512, 1, 4, 64, true, 2>(p, stream);
  return launch_attn_mma<T, 576, 512, 4, 2, 32, true, 2>(p, stream);
}

template <typename T>
static int mla_occupancy(int config) {
  static const int occ[2] = {attn_mma_occupancy<T, 576, 512, 1, 4, 64, true, 2>(),
                             attn_mma_occupancy<T, 576, 512, 4, 2, 32, true, 2>()};
  return occ[config != 0];
}

int attn_mma_mla_ctas_per_sm(DType dtype, int config) {
  return dtype == kBFloat16 ? mla_occupancy<__nv_bfloat16>(config) : mla_occupancy<__half>(config);
}

cudaError_t attn_mma_mla(const AttnParams& p, DType dtype, int config, cudaStream_t stream) {
  if (p.dk != 576 || p.dv != 512 || p.qa_dim != 512) return cudaErrorNotSupported;
  if (dtype == kBFloat16) return mla<__nv_bfloat16>(p, config, stream);
  if (dtype == kFloat16) return mla<__half>(p, config, stream);
  return cudaErrorNotSupported;
}

}  // namespace ddtree
