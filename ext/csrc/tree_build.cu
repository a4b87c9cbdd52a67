// Batched best-first DDTree build (paper Alg. 1), one warp per request: a shared-memory frontier for any budget,
// and a register variant for budgets up to 255 nodes.
#include "common.cuh"

namespace ddtree {

namespace {

// ---- tree build ----------------------------------------------------------------------------------------------
// One warp per request. Frontier slots live in shared memory (slot s owned by lane s % 32, which caches the best
// of its slots); a pop is a 5-step butterfly arg-max over the lanes under the strict order (score desc, rank
// path asc), the path compare reading each candidate's ancestors (anc[node][depth]) only on exact fp64 ties.
// Scores use the reference's fp64 arithmetic: child = score + lp[d][0]; sibling = (score - lp[d-1][r]) + lp[d-1][r+1].
struct TreeSmem {
  double* c_score; double* n_score; float* lp;
  int* c_parent; int* c_depth; int* c_rank; int* n_parent; int* n_depth; int* n_rank;
  unsigned short* anc;
  int l1;  // max_depth + 1: anc row stride
};

__device__ __forceinline__ bool path_less(const TreeSmem& t, int a, int b) {
  const int da = t.c_depth[a], db = t.c_depth[b], pa = t.c_parent[a], pb = t.c_parent[b];
  const int dm = min(da, db);
  for (int d = 1; d <= dm; ++d) {
    const int ra = d < da ? t.n_rank[t.anc[pa * t.l1 + d]] : t.c_rank[a];
    const int rb = d < db ? t.n_rank[t.anc[pb * t.l1 + d]] : t.c_rank[b];
    if (ra != rb) return ra < rb;
  }
  return da < db;
}

__device__ __forceinline__ bool better(const TreeSmem& t, double sa, int a, double sb, int b) {
  if (a < 0) return false;
  if (b < 0) return true;
  if (sa != sb) return sa > sb;
  if (a == b) return false;
  return path_less(t, a, b);
}

__device__ __forceinline__ void lane_best(const TreeSmem& t, int num_slots, double& bs, int& bslot) {
  bs = -CUDART_INF;
  bslot = -1;
  for (int s = threadIdx.x; s < num_slots; s += 32)
    if (t.c_depth[s] > 0 && better(t, t.c_score[s], s, bs, bslot)) { bs = t.c_score[s]; bslot = s; }
}

__global__ void __launch_bounds__(32) build_tree_kernel(const float* __restrict__ logprobs,
                                                        const int64_t* __restrict__ token_ids,
                                                        const int64_t* __restrict__ budgets, int L, int K, int B,
                                                        int64_t* node_token_ids, int64_t* parents, int64_t* depths,
                                                        int64_t* num_nodes, bool* visibility, double* scores,
                                                        int64_t* ranks) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int F = B + 1, n = blockIdx.x, lane = threadIdx.x;
  TreeSmem t;
  t.c_score = reinterpret_cast<double*>(smem_raw);
  t.n_score = t.c_score + F;
  t.lp = reinterpret_cast<float*>(t.n_score + F);
  t.c_parent = reinterpret_cast<int*>(t.lp + L * K);
  t.c_depth = t.c_parent + F;
  t.c_rank = t.c_depth + F;
  t.n_parent = t.c_rank + F;
  t.n_depth = t.n_parent + F;
  t.n_rank = t.n_depth + F;
  t.anc = reinterpret_cast<unsigned short*>(t.n_rank + F);
  t.l1 = L + 1;

  int64_t budget = budgets[n];
  budget = budget < 0 ? 0 : (budget > B ? B : budget);
  const float* lp_g = logprobs + static_cast<int64_t>(n) * L * K;
  for (int i = lane; i < L * K; i += 32) t.lp[i] = lp_g[i];
  for (int s = lane; s < F; s += 32) t.c_depth[s] = 0;
  __syncwarp();
  if (lane == 0) {
    t.n_parent[0] = -1; t.n_depth[0] = 0; t.n_rank[0] = -1; t.n_score[0] = 0.0;
    t.anc[0] = 0;
    if (budget > 0 && L > 0 && K > 0) {
      t.c_score[0] = static_cast<double>(t.lp[0]);
      t.c_parent[0] = 0; t.c_depth[0] = 1; t.c_rank[0] = 0;
    }
  }
  __syncwarp();
  double bs;
  int bslot;
  lane_best(t, F, bs, bslot);
  int count = 0;
  for (int step = 0; step < budget; ++step) {
    double ws = bs;
    int wslot = bslot;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      const double os = __shfl_xor_sync(0xffffffffu, ws, off);
      const int oslot = __shfl_xor_sync(0xffffffffu, wslot, off);
      if (better(t, os, oslot, ws, wslot)) { ws = os; wslot = oslot; }
    }
    if (wslot < 0) break;
    const int slot = wslot, node = step + 1;
    const double sc = t.c_score[slot];
    const int par = t.c_parent[slot], dep = t.c_depth[slot], rk = t.c_rank[slot];
    __syncwarp();
    for (int d = lane; d <= dep; d += 32) t.anc[node * t.l1 + d] = d < dep ? t.anc[par * t.l1 + d] : static_cast<unsigned short>(node);
    if (lane == 0) {
      t.n_parent[node] = par; t.n_depth[node] = dep; t.n_rank[node] = rk; t.n_score[node] = sc;
      if (rk + 1 < K) {
        t.c_score[slot] = (sc - static_cast<double>(t.lp[(dep - 1) * K + rk])) + static_cast<double>(t.lp[(dep - 1) * K + rk + 1]);
        t.c_rank[slot] = rk + 1;
      } else {
        t.c_depth[slot] = 0;
      }
      if (dep < L) {
        t.c_score[node] = sc + static_cast<double>(t.lp[dep * K]);
        t.c_parent[node] = node; t.c_depth[node] = dep + 1; t.c_rank[node] = 0;
      } else {
        t.c_depth[node] = 0;
      }
    }
    __syncwarp();
    count = node;
    if (lane == (slot & 31) || lane == (node & 31)) lane_best(t, F, bs, bslot);
    __syncwarp();
  }

  const int64_t rbase = static_cast<int64_t>(n) * F;
  for (int i = lane; i < F; i += 32) {
    const bool real = i >= 1 && i <= count;
    const int dep = real ? t.n_depth[i] : 0, rk = real ? t.n_rank[i] : -1;
    node_token_ids[rbase + i] = real ? token_ids[(static_cast<int64_t>(n) * L + dep - 1) * K + rk] : -1;
    parents[rbase + i] = real ? t.n_parent[i] : -1;
    depths[rbase + i] = dep;
    ranks[rbase + i] = rk;
    scores[rbase + i] = i == 0 ? 0.0 : (real ? t.n_score[i] : -CUDART_INF);
  }
  if (lane == 0) num_nodes[n] = count + 1;
  bool* vis = visibility + rbase * F;
  for (int i = 0; i < F; ++i) {
    const bool row_real = i <= count;
    const int di = row_real ? t.n_depth[i] : 0;
    for (int j = lane; j < F; j += 32) {
      bool v = i == j;
      if (!v && row_real && j <= count) {
        const int dj = t.n_depth[j];
        v = dj <= di && t.anc[i * t.l1 + dj] == j;
      }
      vis[static_cast<int64_t>(i) * F + j] = v;
    }
  }
}

// Register variant for B + 1 <= 32 * SPL <= 256: lane l holds slots l, l + 32, ... as order-preserving 64-bit keys
// of their fp64 scores (0 = empty), so a pop is two warp max-reductions (redux.sync) on the key halves plus a
// ballot; only exact fp64 ties (several lanes holding the max key, or a lane holding equal keys) read rank paths.
// Ancestor sets are kept as bitmasks too, for the visibility output.
__device__ __forceinline__ uint64_t score_key(double x) {
  const uint64_t b = static_cast<uint64_t>(__double_as_longlong(x + 0.0));  // -0.0 ties with +0.0
  return (b >> 63) ? ~b : (b | 0x8000000000000000ull);
}
__device__ __forceinline__ double key_score(uint64_t k) {
  const uint64_t b = (k >> 63) ? (k & 0x7fffffffffffffffull) : ~k;
  return __longlong_as_double(static_cast<long long>(b));
}

template <int SPL>
__device__ __forceinline__ void lane_best_regs(const TreeSmem& t, const uint64_t (&keys)[SPL], uint64_t& bkey, int& bslot) {
  bkey = 0;
  bslot = -1;
#pragma unroll
  for (int i = 0; i < SPL; ++i) {
    const uint64_t k = keys[i];
    const int s = threadIdx.x + 32 * i;
    if (k > bkey || (k == bkey && k != 0 && path_less(t, s, bslot))) { bkey = k; bslot = s; }
  }
}

template <int SPL>
__global__ void __launch_bounds__(32) build_tree_regs_kernel(const float* __restrict__ logprobs,
                                                             const int64_t* __restrict__ token_ids,
                                                             const int64_t* __restrict__ budgets, int L, int K, int B,
                                                             int64_t* node_token_ids, int64_t* parents, int64_t* depths,
                                                             int64_t* num_nodes, bool* visibility, double* scores,
                                                             int64_t* ranks) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int F = B + 1, W = (F + 63) / 64, n = blockIdx.x, lane = threadIdx.x;
  TreeSmem t;
  uint64_t* anc_bits = reinterpret_cast<uint64_t*>(smem_raw);  // [F][W]
  t.c_score = nullptr;
  t.n_score = reinterpret_cast<double*>(anc_bits + F * W);
  t.lp = reinterpret_cast<float*>(t.n_score + F);
  t.c_parent = reinterpret_cast<int*>(t.lp + L * K);
  t.c_depth = t.c_parent + F;
  t.c_rank = t.c_depth + F;
  t.n_parent = t.c_rank + F;
  t.n_depth = t.n_parent + F;
  t.n_rank = t.n_depth + F;
  t.anc = reinterpret_cast<unsigned short*>(t.n_rank + F);
  t.l1 = L + 1;

  int64_t budget = budgets[n];
  budget = budget < 0 ? 0 : (budget > B ? B : budget);
  const float* lp_g = logprobs + static_cast<int64_t>(n) * L * K;
  for (int i = lane; i < L * K; i += 32) t.lp[i] = lp_g[i];
  for (int s = lane; s < F; s += 32) t.c_depth[s] = 0;
  for (int w = lane; w < W; w += 32) anc_bits[w] = w == 0 ? 1ull : 0ull;
  uint64_t keys[SPL];
#pragma unroll
  for (int i = 0; i < SPL; ++i) keys[i] = 0;
  const bool can_pop = budget > 0 && L > 0 && K > 0;
  __syncwarp();
  if (lane == 0) {
    t.n_parent[0] = -1; t.n_depth[0] = 0; t.n_rank[0] = -1; t.n_score[0] = 0.0;
    t.anc[0] = 0;
    if (can_pop) { t.c_parent[0] = 0; t.c_depth[0] = 1; t.c_rank[0] = 0; }
  }
  if (can_pop && lane == 0) keys[0] = score_key(static_cast<double>(lp_g[0]));
  __syncwarp();
  uint64_t bkey;
  int bslot;
  lane_best_regs<SPL>(t, keys, bkey, bslot);
  int count = 0;
  for (int step = 0; step < budget; ++step) {
    const unsigned hi = __reduce_max_sync(0xffffffffu, static_cast<unsigned>(bkey >> 32));
    const unsigned lo = __reduce_max_sync(0xffffffffu, static_cast<unsigned>(bkey >> 32) == hi ? static_cast<unsigned>(bkey) : 0u);
    const uint64_t wkey = (static_cast<uint64_t>(hi) << 32) | lo;
    if (wkey == 0) break;  // frontier exhausted
    const unsigned tied = __ballot_sync(0xffffffffu, bkey == wkey);
    int slot;
    if (__popc(tied) == 1) {
      slot = __shfl_sync(0xffffffffu, bslot, __ffs(tied) - 1);
    } else {  // exact fp64 tie across lanes: the smaller rank path pops first (uniform loop)
      slot = -1;
      for (unsigned rest = tied; rest; rest &= rest - 1) {
        const int s = __shfl_sync(0xffffffffu, bslot, __ffs(rest) - 1);
        if (slot < 0 || path_less(t, s, slot)) slot = s;
      }
    }
    const int node = step + 1;
    const double sc = key_score(wkey);
    const int par = t.c_parent[slot], dep = t.c_depth[slot], rk = t.c_rank[slot];
    const bool sib_ok = rk + 1 < K, child_ok = dep < L;
    const double sib = (sc - static_cast<double>(t.lp[(dep - 1) * K + rk])) + static_cast<double>(t.lp[(dep - 1) * K + (sib_ok ? rk + 1 : rk)]);
    const double child = sc + static_cast<double>(t.lp[(child_ok ? dep : 0) * K]);
    __syncwarp();
    for (int d = lane; d <= dep; d += 32) t.anc[node * t.l1 + d] = d < dep ? t.anc[par * t.l1 + d] : static_cast<unsigned short>(node);
    for (int w = lane; w < W; w += 32)
      anc_bits[node * W + w] = anc_bits[par * W + w] | (w == (node >> 6) ? (1ull << (node & 63)) : 0ull);
    if (lane == 0) {
      t.n_parent[node] = par; t.n_depth[node] = dep; t.n_rank[node] = rk; t.n_score[node] = sc;
      if (sib_ok) t.c_rank[slot] = rk + 1; else t.c_depth[slot] = 0;
      t.c_parent[node] = node; t.c_depth[node] = child_ok ? dep + 1 : 0; t.c_rank[node] = 0;
    }
    const bool own_slot = lane == (slot & 31), own_node = lane == (node & 31);
    const uint64_t sib_key = sib_ok ? score_key(sib) : 0, child_key = child_ok ? score_key(child) : 0;
    const int sidx = own_slot ? (slot >> 5) : -1, nidx = own_node ? (node >> 5) : -1;
#pragma unroll
    for (int i = 0; i < SPL; ++i) keys[i] = i == nidx ? child_key : (i == sidx ? sib_key : keys[i]);
    __syncwarp();
    count = node;
    if (own_slot || own_node) lane_best_regs<SPL>(t, keys, bkey, bslot);
  }

  const int64_t rbase = static_cast<int64_t>(n) * F;
  for (int i = lane; i < F; i += 32) {
    const bool real = i >= 1 && i <= count;
    const int dep = real ? t.n_depth[i] : 0, rk = real ? t.n_rank[i] : -1;
    node_token_ids[rbase + i] = real ? token_ids[(static_cast<int64_t>(n) * L + dep - 1) * K + rk] : -1;
    parents[rbase + i] = real ? t.n_parent[i] : -1;
    depths[rbase + i] = dep;
    ranks[rbase + i] = rk;
    scores[rbase + i] = i == 0 ? 0.0 : (real ? t.n_score[i] : -CUDART_INF);
  }
  if (lane == 0) num_nodes[n] = count + 1;
  bool* vis = visibility + rbase * F;
  for (int i = 0; i < F; ++i) {
    const uint64_t* row = anc_bits + i * W;
    const bool row_real = i <= count;
    for (int j = lane; j < F; j += 32)
      vis[static_cast<int64_t>(i) * F + j] = row_real ? ((row[j >> 6] >> (j & 63)) & 1ull) != 0 : i == j;
  }
}

size_t build_tree_regs_smem_bytes(int L, int K, int B) {
  const size_t F = static_cast<size_t>(B) + 1, W = (F + 63) / 64;
  return F * W * sizeof(uint64_t) + F * sizeof(double) + static_cast<size_t>(L) * K * sizeof(float) +
         F * 6 * sizeof(int) + F * (L + 1) * sizeof(unsigned short);
}

}  // namespace

size_t build_tree_smem_bytes(int max_depth, int k, int max_budget) {
  const size_t F = static_cast<size_t>(max_budget) + 1;
  if ((max_budget + 32) / 32 <= 8) return build_tree_regs_smem_bytes(max_depth, k, max_budget);
  return F * 2 * sizeof(double) + static_cast<size_t>(max_depth) * k * sizeof(float) + F * 6 * sizeof(int) +
         F * (max_depth + 1) * sizeof(unsigned short);
}

cudaError_t build_tree(const float* logprobs, const int64_t* token_ids, const int64_t* budgets, int num_reqs,
                       int max_depth, int k, int max_budget, int64_t* node_token_ids, int64_t* parents,
                       int64_t* depths, int64_t* num_nodes, bool* visibility, double* scores, int64_t* ranks,
                       cudaStream_t stream) {
  if (num_reqs == 0) return cudaSuccess;
  if (max_budget >= 65535) return cudaErrorInvalidValue;
  const int spl = (max_budget + 1 + 31) / 32;
  if (spl <= 8) {
    const size_t smem = build_tree_regs_smem_bytes(max_depth, k, max_budget);
    auto kernel = spl == 1 ? build_tree_regs_kernel<1> : spl == 2 ? build_tree_regs_kernel<2>
                : spl == 3 ? build_tree_regs_kernel<3> : spl == 4 ? build_tree_regs_kernel<4>
                : spl <= 6 ? build_tree_regs_kernel<6> : build_tree_regs_kernel<8>;
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (err != cudaSuccess) return err;
    kernel<<<num_reqs, 32, smem, stream>>>(logprobs, token_ids, budgets, max_depth, k, max_budget, node_token_ids,
                                           parents, depths, num_nodes, visibility, scores, ranks);
    return cudaGetLastError();
  }
  const size_t smem = build_tree_smem_bytes(max_depth, k, max_budget);
  cudaError_t err = cudaFuncSetAttribute(build_tree_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  build_tree_kernel<<<num_reqs, 32, smem, stream>>>(logprobs, token_ids, budgets, max_depth, k, max_budget,
                                                    node_token_ids, parents, depths, num_nodes, visibility, scores, ranks);
  return cudaGetLastError();
}

}  // namespace ddtree
