// DDTree tree walk: follow each request's tree along the target's tokens from the root, one warp per request,
// writing the accepted rows and the emitted tokens (the target's token after each accepted row: the accepted drafts,
// then the bonus) so the round needs no gathers after it.
#include "common.cuh"

namespace ddtree {

namespace {

// ---- tree walk ------------------------------------------------------------------------------------------------
__global__ void __launch_bounds__(32) tree_accept_kernel(const int64_t* __restrict__ target,
                                                         const int64_t* __restrict__ tokens,
                                                         const int64_t* __restrict__ parents,
                                                         const int64_t* __restrict__ num_nodes, int R, int L,
                                                         int64_t* accepted, int64_t* accept_len, int64_t* emitted) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  int64_t* s_tok = reinterpret_cast<int64_t*>(smem_raw);
  int* s_par = reinterpret_cast<int*>(s_tok + R);
  const int n = blockIdx.x, lane = threadIdx.x;
  const int64_t base = static_cast<int64_t>(n) * R;
  int64_t nn = num_nodes[n];
  const int count = static_cast<int>(nn < 0 ? 0 : (nn > R ? R : nn));
  for (int j = lane; j < count; j += 32) {
    s_tok[j] = tokens[base + j];
    s_par[j] = static_cast<int>(parents[base + j]);
  }
  __syncwarp();
  int cur = 0, len = 1;
  int64_t* acc = accepted + static_cast<int64_t>(n) * (L + 1);
  int64_t* out = emitted + static_cast<int64_t>(n) * (L + 1);
  int64_t want = target[base];
  for (int step = 1; step <= L; ++step) {
    int found = -1;
    for (int j0 = 0; j0 < count && found < 0; j0 += 32) {
      const int j = j0 + lane;
      const bool hit = j > 0 && j < count && s_par[j] == cur && s_tok[j] == want;
      const unsigned bal = __ballot_sync(0xffffffffu, hit);
      if (bal) found = j0 + __ffs(bal) - 1;
    }
    if (found < 0) break;
    cur = found;
    if (lane == 0) {
      acc[step] = found;
      out[step - 1] = want;  // = the accepted draft's token
    }
    ++len;
    want = target[base + cur];
  }
  for (int j = lane; j <= L; j += 32) {
    if (j == 0 || j >= len) acc[j] = j == 0 ? 0 : -1;
    if (j >= len) out[j] = -1;
  }
  if (lane == 0) {
    accept_len[n] = len;
    out[len - 1] = want;  // the bonus: the target's token after the last accepted row
  }
}

}  // namespace

cudaError_t tree_accept(const int64_t* target_token_ids, const int64_t* node_token_ids, const int64_t* parents,
                        const int64_t* num_nodes, int num_reqs, int num_rows, int max_depth, int64_t* accepted_nodes,
                        int64_t* accept_len, int64_t* emitted, cudaStream_t stream) {
  if (num_reqs == 0) return cudaSuccess;
  const size_t smem = static_cast<size_t>(num_rows) * (sizeof(int64_t) + sizeof(int));
  cudaError_t err = cudaFuncSetAttribute(tree_accept_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  tree_accept_kernel<<<num_reqs, 32, smem, stream>>>(target_token_ids, node_token_ids, parents, num_nodes, num_rows,
                                                     max_depth, accepted_nodes, accept_len, emitted);
  return cudaGetLastError();
}

}  // namespace ddtree
