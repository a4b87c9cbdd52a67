// Batched best-first DDTree build (paper Alg. 1), one warp per request: a shared-memory frontier for any budget,
// and a register variant for budgets up to 255 nodes and depths up to 255.
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

// Global -> shared with 32 loads in flight per lane (a dependent load per element costs ~0.5 us per 32 floats).
__device__ __forceinline__ void load_logprobs(float* dst, const float* __restrict__ src, int total, int lane) {
  for (int base = 0; base < total; base += 32 * 32) {
    float v[32];
#pragma unroll
    for (int u = 0; u < 32; ++u) { const int i = base + u * 32 + lane; v[u] = i < total ? __ldg(src + i) : 0.f; }
#pragma unroll
    for (int u = 0; u < 32; ++u) { const int i = base + u * 32 + lane; if (i < total) dst[i] = v[u]; }
  }
}

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
  load_logprobs(t.lp, logprobs + static_cast<int64_t>(n) * L * K, L * K, lane);
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

// Register variant for B + 1 <= 32 * SPL <= 256 and L <= 255: lane l holds slots l, l + 32, ... as order-preserving
// 64-bit keys of their fp64 scores (0 = empty) beside a packed (slot, parent, rank, depth) word, so a pop is two
// warp max-reductions (redux.sync) on the key halves, two ballots and one shuffle of the winner's word: nothing on
// the pop's dependency chain touches shared memory but the three log-probs of the new candidates. Only exact fp64
// ties (several slots holding the max key) compare rank paths, walking the popped nodes' parents. Ancestor sets
// (the visibility output) are built after the pops and written 16 bytes a lane.
__device__ __forceinline__ uint64_t score_key(double x) {
  const uint64_t b = static_cast<uint64_t>(__double_as_longlong(x + 0.0));  // -0.0 ties with +0.0
  return (b >> 63) ? ~b : (b | 0x8000000000000000ull);
}
__device__ __forceinline__ double key_score(uint64_t k) {
  const uint64_t b = (k >> 63) ? (k & 0x7fffffffffffffffull) : ~k;
  return __longlong_as_double(static_cast<long long>(b));
}

// a candidate: slot | parent node << 8 | rank << 16 | depth << 24 (each < 256 in this variant)
__device__ __forceinline__ unsigned pack_cand(int slot, int parent, int rank, int depth) {
  return static_cast<unsigned>(slot) | (static_cast<unsigned>(parent) << 8) | (static_cast<unsigned>(rank) << 16) |
         (static_cast<unsigned>(depth) << 24);
}

// Rank path of candidate a < rank path of candidate b (tuple order: the shallowest differing rank decides, a
// prefix first). Walks the popped nodes' parents (n_parent / n_rank); every lane calls it with the same operands.
__device__ bool cand_path_less(const int* n_parent, const int* n_rank, unsigned a, unsigned b) {
  int pa = (a >> 8) & 255, ra = (a >> 16) & 255, pb = (b >> 8) & 255, rb = (b >> 16) & 255;
  const int da = a >> 24, db = b >> 24, dm = min(da, db);
  for (int d = da; d > dm; --d) { ra = n_rank[pa]; pa = n_parent[pa]; }
  for (int d = db; d > dm; --d) { rb = n_rank[pb]; pb = n_parent[pb]; }
  int order = 0;  // at the shallowest differing depth: -1 a first, 1 b first
  for (int d = dm; d >= 1; --d) {
    if (ra != rb) order = ra < rb ? -1 : 1;
    if (d > 1) { ra = n_rank[pa]; pa = n_parent[pa]; rb = n_rank[pb]; pb = n_parent[pb]; }
  }
  return order != 0 ? order < 0 : da < db;
}

template <int SPL>
__device__ __forceinline__ void lane_best_regs(const uint64_t (&keys)[SPL], const unsigned (&cands)[SPL],
                                               uint64_t& bkey, unsigned& bcand, bool& dup) {
  bkey = 0; bcand = 0; dup = false;
#pragma unroll
  for (int i = 0; i < SPL; ++i) {
    if (keys[i] > bkey) { bkey = keys[i]; bcand = cands[i]; dup = false; }
    else if (keys[i] == bkey && bkey != 0) dup = true;
  }
}

// Visibility byte (i, j) of a tree: anc_bits row i holds node i's ancestor-or-self set (just i for rows past
// the tree).
__device__ __forceinline__ unsigned vis_bit(const uint64_t* anc_bits, int W, int i, int j) {
  return static_cast<unsigned>((anc_bits[i * W + (j >> 6)] >> (j & 63)) & 1ull);
}

// A request's [F, F] bool visibility block, written 16 bytes a lane (the block starts at any byte: a head and a
// tail of single bytes around the aligned body). Row-by-row byte stores made the build's no-pop part 14 us at
// F = 65 on the H200 (4.7 us this way).
__device__ __forceinline__ void write_visibility(bool* __restrict__ vis, const uint64_t* anc_bits, int W, int F,
                                                 int lane) {
  unsigned char* out = reinterpret_cast<unsigned char*>(vis);
  const int total = F * F;
  const int head = min(static_cast<int>((16 - (reinterpret_cast<uintptr_t>(out) & 15)) & 15), total);
  const int body = (total - head) & ~15, tail = total - head - body;
  if (lane < head) out[lane] = vis_bit(anc_bits, W, lane / F, lane % F);
  if (lane < tail) { const int e = head + body + lane; out[e] = vis_bit(anc_bits, W, e / F, e % F); }
  uint4* mid = reinterpret_cast<uint4*>(out + head);
  for (int q = lane; q < body / 16; q += 32) {
    const int e = head + 16 * q;
    int i = e / F, j = e - i * F;
    unsigned w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
    for (int b = 0; b < 16; ++b) {
      w[b >> 2] |= vis_bit(anc_bits, W, i, j) << (8 * (b & 3));
      if (++j == F) { j = 0; ++i; }
    }
    mid[q] = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

template <int SPL>
__global__ void __launch_bounds__(32) build_tree_regs_kernel(const float* __restrict__ logprobs,
                                                             const int64_t* __restrict__ token_ids,
                                                             const int64_t* __restrict__ budgets, int L, int K, int B,
                                                             int64_t* __restrict__ node_token_ids,
                                                             int64_t* __restrict__ parents,
                                                             int64_t* __restrict__ depths,
                                                             int64_t* __restrict__ num_nodes,
                                                             bool* __restrict__ visibility,
                                                             double* __restrict__ scores,
                                                             int64_t* __restrict__ ranks) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int F = B + 1, W = (F + 63) / 64, n = blockIdx.x, lane = threadIdx.x;
  uint64_t* anc_bits = reinterpret_cast<uint64_t*>(smem_raw);  // [F][W], after the pops
  double* n_score = reinterpret_cast<double*>(anc_bits + F * W);
  float* lp = reinterpret_cast<float*>(n_score + F);
  int* n_parent = reinterpret_cast<int*>(lp + L * K);
  int* n_depth = n_parent + F;
  int* n_rank = n_depth + F;

  int64_t budget = budgets[n];
  budget = budget < 0 ? 0 : (budget > B ? B : budget);
  load_logprobs(lp, logprobs + static_cast<int64_t>(n) * L * K, L * K, lane);
  uint64_t keys[SPL];
  unsigned cands[SPL];
#pragma unroll
  for (int i = 0; i < SPL; ++i) { keys[i] = 0; cands[i] = 0; }
  const bool can_pop = budget > 0 && L > 0 && K > 0;
  if (lane == 0) {
    n_parent[0] = -1; n_depth[0] = 0; n_rank[0] = -1; n_score[0] = 0.0;
    if (can_pop) { keys[0] = score_key(static_cast<double>(lp[0])); cands[0] = pack_cand(0, 0, 0, 1); }
  }
  __syncwarp();
  uint64_t bkey;
  unsigned bcand;
  bool dup;
  lane_best_regs<SPL>(keys, cands, bkey, bcand, dup);
  int count = 0;
  for (int step = 0; step < budget; ++step) {
    const unsigned hi = __reduce_max_sync(0xffffffffu, static_cast<unsigned>(bkey >> 32));
    const unsigned lo = __reduce_max_sync(0xffffffffu, static_cast<unsigned>(bkey >> 32) == hi ? static_cast<unsigned>(bkey) : 0u);
    const uint64_t wkey = (static_cast<uint64_t>(hi) << 32) | lo;
    if (wkey == 0) break;  // frontier exhausted
    const unsigned tied = __ballot_sync(0xffffffffu, bkey == wkey);
    const unsigned tied_in_lane = __ballot_sync(0xffffffffu, bkey == wkey && dup);
    unsigned win;
    if (__popc(tied) == 1 && tied_in_lane == 0) {
      win = __shfl_sync(0xffffffffu, bcand, __ffs(tied) - 1);
    } else {  // exact fp64 tie: the smaller rank path pops first (warp-uniform)
      __syncwarp();  // lane 0's node rows visible to every lane
      unsigned mine = 0xffffffffu;
#pragma unroll
      for (int i = 0; i < SPL; ++i)
        if (keys[i] == wkey && (mine == 0xffffffffu || cand_path_less(n_parent, n_rank, cands[i], mine))) mine = cands[i];
      win = 0xffffffffu;
      for (unsigned rest = tied; rest; rest &= rest - 1) {
        const unsigned c = __shfl_sync(0xffffffffu, mine, __ffs(rest) - 1);
        if (win == 0xffffffffu || cand_path_less(n_parent, n_rank, c, win)) win = c;
      }
    }
    const int slot = win & 255, par = (win >> 8) & 255, rk = (win >> 16) & 255, dep = win >> 24;
    const int node = step + 1;
    const double sc = key_score(wkey);
    const bool sib_ok = rk + 1 < K, child_ok = dep < L;
    const double sib = (sc - static_cast<double>(lp[(dep - 1) * K + rk])) + static_cast<double>(lp[(dep - 1) * K + (sib_ok ? rk + 1 : rk)]);
    const double child = sc + static_cast<double>(lp[(child_ok ? dep : 0) * K]);
    if (lane == 0) { n_parent[node] = par; n_depth[node] = dep; n_rank[node] = rk; n_score[node] = sc; }
    const uint64_t sib_key = sib_ok ? score_key(sib) : 0, child_key = child_ok ? score_key(child) : 0;
    const int sidx = lane == (slot & 31) ? (slot >> 5) : -1, nidx = lane == (node & 31) ? (node >> 5) : -1;
#pragma unroll
    for (int i = 0; i < SPL; ++i) {
      if (i == nidx) { keys[i] = child_key; cands[i] = pack_cand(node, node, 0, dep + 1); }
      else if (i == sidx) { keys[i] = sib_key; cands[i] = pack_cand(slot, par, rk + 1, dep); }
    }
    count = node;
    lane_best_regs<SPL>(keys, cands, bkey, bcand, dup);
  }
  __syncwarp();

  // ancestor-or-self sets, one row per lane: the node, its parents up the chain, the root; rows past the tree
  // (padding) see only themselves
  for (int i = lane; i < F; i += 32) {
    uint64_t* row = anc_bits + i * W;
    for (int w = 0; w < W; ++w) row[w] = 0;
    if (i <= count) {
      row[0] = 1ull;
      for (int p = i; p > 0; p = n_parent[p]) row[p >> 6] |= 1ull << (p & 63);
    } else {
      row[i >> 6] = 1ull << (i & 63);
    }
  }
  const int64_t rbase = static_cast<int64_t>(n) * F;
  for (int i = lane; i < F; i += 32) {
    const bool real = i >= 1 && i <= count;
    const int dep = real ? n_depth[i] : 0, rk = real ? n_rank[i] : -1;
    node_token_ids[rbase + i] = real ? token_ids[(static_cast<int64_t>(n) * L + dep - 1) * K + rk] : -1;
    parents[rbase + i] = real ? n_parent[i] : -1;
    depths[rbase + i] = dep;
    ranks[rbase + i] = rk;
    scores[rbase + i] = i == 0 ? 0.0 : (real ? n_score[i] : -CUDART_INF);
  }
  if (lane == 0) num_nodes[n] = count + 1;
  __syncwarp();
  write_visibility(visibility + rbase * F, anc_bits, W, F, lane);
}

bool use_regs(int L, int B) { return (B + 1 + 31) / 32 <= 8 && L <= 255; }

size_t build_tree_regs_smem_bytes(int L, int K, int B) {
  const size_t F = static_cast<size_t>(B) + 1, W = (F + 63) / 64;
  return F * W * sizeof(uint64_t) + F * sizeof(double) + static_cast<size_t>(L) * K * sizeof(float) +
         F * 3 * sizeof(int);
}

}  // namespace

size_t build_tree_smem_bytes(int max_depth, int k, int max_budget) {
  const size_t F = static_cast<size_t>(max_budget) + 1;
  if (use_regs(max_depth, max_budget)) return build_tree_regs_smem_bytes(max_depth, k, max_budget);
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
  if (use_regs(max_depth, max_budget)) {
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
