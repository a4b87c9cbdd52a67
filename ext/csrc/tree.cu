// DDTree tree kernels: fused log-softmax + top-K over the vocabulary, the batched best-first tree build, the
// tree walk (accept), and the per-row target token (argmax or Gumbel-max sample).
#include "common.cuh"

namespace ddtree {

namespace {

constexpr float kLog2e = 1.4426950408889634f;

// ---- top-K ------------------------------------------------------------------------------------------------
// One CTA streams a chunk of a row once: an online max / sum-exp, and a candidate buffer of unique 64-bit keys
// (value, reversed id) above the running threshold = the K-th best key so far. When the buffer fills, an exact
// radix select (8 passes of 8 bits over shared memory) finds the K-th key and compacts the buffer to K.
constexpr int kTkThreads = 256, kTkEpt = 8, kTkRound = kTkThreads * kTkEpt, kTkCap = 4096;

struct TopkSmem {
  uint64_t buf[kTkCap];
  unsigned hist[256];
  unsigned wsum[kTkThreads / 32];
  float red_m[kTkThreads / 32], red_s[kTkThreads / 32];
  uint64_t thr;   // key of the current K-th best candidate (0 = none yet)
  float thr_x;    // its value: elements below it cannot enter (cheap first test)
  int count, digit, krem;
};

__device__ __forceinline__ void ms_merge(float& m, float& s, float m2, float s2) {
  const float mn = fmaxf(m, m2);
  if (mn == -CUDART_INF_F) return;
  s = s * exp2f((m - mn) * kLog2e) + s2 * exp2f((m2 - mn) * kLog2e);
  m = mn;
}

// The k-th largest (1-based) of sm.buf[0..n), n >= k. All threads call; keys are unique.
__device__ uint64_t block_kth_largest(TopkSmem& sm, int n, int k) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  uint64_t prefix = 0, mask = 0;
  int krem = k;
  for (int shift = 56; shift >= 0; shift -= 8) {
    sm.hist[tid] = 0;
    __syncthreads();
    for (int i = tid; i < n; i += kTkThreads) {
      const uint64_t key = sm.buf[i];
      if ((key & mask) == prefix) atomicAdd(&sm.hist[(key >> shift) & 255], 1u);
    }
    __syncthreads();
    const unsigned v = sm.hist[255 - tid];  // thread tid scans bins from the top
    unsigned x = v;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const unsigned y = __shfl_up_sync(0xffffffffu, x, off);
      if (lane >= off) x += y;
    }
    if (lane == 31) sm.wsum[warp] = x;
    __syncthreads();
    unsigned base = 0;
    for (int w = 0; w < warp; ++w) base += sm.wsum[w];
    const unsigned incl = base + x, excl = incl - v;
    if (excl < static_cast<unsigned>(krem) && incl >= static_cast<unsigned>(krem)) {
      sm.digit = 255 - tid;
      sm.krem = krem - static_cast<int>(excl);
    }
    __syncthreads();
    prefix |= static_cast<uint64_t>(sm.digit) << shift;
    mask |= static_cast<uint64_t>(255) << shift;
    krem = sm.krem;
  }
  __syncthreads();
  return prefix;
}

// Keeps exactly the k largest keys of the buffer (if it holds more) and raises the threshold to the k-th.
__device__ void block_compact(TopkSmem& sm, int k) {
  const int tid = threadIdx.x;
  const int n = sm.count;
  if (n <= k) return;
  const uint64_t kth = block_kth_largest(sm, n, k);
  uint64_t keep[kTkCap / kTkThreads];
#pragma unroll
  for (int j = 0; j < kTkCap / kTkThreads; ++j) {
    const int i = tid + j * kTkThreads;
    keep[j] = (i < n && sm.buf[i] >= kth) ? sm.buf[i] : 0;
  }
  __syncthreads();
  if (tid == 0) { sm.count = 0; sm.thr = kth; sm.thr_x = from_ordered_bits(static_cast<uint32_t>(kth >> 32)); }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < kTkCap / kTkThreads; ++j)
    if (keep[j]) sm.buf[atomicAdd(&sm.count, 1)] = keep[j];
  __syncthreads();
}

__device__ void block_sort_desc(uint64_t* a, int n_pow2) {
  for (int size = 2; size <= n_pow2; size <<= 1)
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int i = threadIdx.x; i < n_pow2 / 2; i += kTkThreads) {
        const int lo = 2 * stride * (i / stride) + (i % stride), hi = lo + stride;
        const bool desc = (lo & size) == 0;
        const uint64_t x = a[lo], y = a[hi];
        if ((x < y) == desc) { a[lo] = y; a[hi] = x; }
      }
      __syncthreads();
    }
}

__device__ __forceinline__ int next_pow2(int x) {
  int p = 1;
  while (p < x) p <<= 1;
  return p;
}

// Buffer -> exactly the top k; then either this chunk's partial keys (unsorted: the merge re-selects) or the
// final rows, sorted once by (log-prob, reversed id) so values that round to the same log-prob order by id.
__device__ void topk_finalize(TopkSmem& sm, int k, float m, float s, int64_t out_row, float* out_lp,
                              int64_t* out_ids, uint64_t* part_keys, float* part_ms) {
  const int tid = threadIdx.x;
  __syncthreads();
  block_compact(sm, k);
  const int n = sm.count;
  if (part_keys != nullptr) {
    for (int i = tid; i < k; i += kTkThreads) part_keys[out_row * k + i] = i < n ? sm.buf[i] : 0;
    if (tid == 0) { part_ms[2 * out_row] = m; part_ms[2 * out_row + 1] = s; }
    return;
  }
  const int kp = next_pow2(k);
  const float logs = logf(s);
  for (int i = tid; i < kp; i += kTkThreads) {
    uint64_t key = 0;
    if (i < n) {
      const uint64_t x_key = sm.buf[i];
      const float x = from_ordered_bits(static_cast<uint32_t>(x_key >> 32));
      key = topk_key(((x - m) - logs) + 0.0f, 0xffffffffu - static_cast<uint32_t>(x_key));
    }
    sm.buf[i] = key;
  }
  __syncthreads();
  block_sort_desc(sm.buf, kp);
  for (int i = tid; i < k; i += kTkThreads) {
    const uint64_t key = sm.buf[i];
    out_lp[out_row * k + i] = from_ordered_bits(static_cast<uint32_t>(key >> 32));
    out_ids[out_row * k + i] = static_cast<int64_t>(0xffffffffu - static_cast<uint32_t>(key));
  }
}

template <typename T>
__device__ __forceinline__ void load8(const T* x, int i0, int end, bool vec, float (&v)[kTkEpt]) {
  if (vec && i0 + kTkEpt <= end) {
    if constexpr (sizeof(T) == 2) {
      const uint4 raw = *reinterpret_cast<const uint4*>(x + i0);
      const T* h = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int e = 0; e < kTkEpt; ++e) v[e] = Num<T>::to_f(h[e]);
    } else {
      const float4 a = *reinterpret_cast<const float4*>(x + i0);
      const float4 b = *reinterpret_cast<const float4*>(x + i0 + 4);
      v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    }
  } else {
#pragma unroll
    for (int e = 0; e < kTkEpt; ++e) v[e] = i0 + e < end ? Num<T>::to_f(x[i0 + e]) : -CUDART_INF_F;
  }
#pragma unroll
  for (int e = 0; e < kTkEpt; ++e) v[e] += 0.0f;  // -0.0 -> +0.0, so it ties with +0.0 (reference)
}

__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// One round: 8 elements per thread. Online max / sum-exp, then candidates above the threshold go to the
// buffer (warp-aggregated). A round where nobody appended costs one barrier.
__device__ __forceinline__ void topk_consume(TopkSmem& sm, const float (&v)[kTkEpt], int i0, int end, int k,
                                             float& m, float& s) {
  const int lane = threadIdx.x & 31;
  const bool full = i0 + kTkEpt <= end;
  float lmax = -CUDART_INF_F;
#pragma unroll
  for (int e = 0; e < kTkEpt; ++e)
    if (full || i0 + e < end) lmax = fmaxf(lmax, v[e]);
  if (lmax > m) {
    s *= ex2((m - lmax) * kLog2e);
    m = lmax;
  }
  bool maybe = false;
  if (m > -CUDART_INF_F) {
    const float ml = m * kLog2e, tx = sm.thr_x;
#pragma unroll
    for (int e = 0; e < kTkEpt; ++e) {
      if (full || i0 + e < end) {
        s += ex2(fmaf(v[e], kLog2e, -ml));
        maybe |= v[e] >= tx;
      }
    }
  } else {
    maybe = i0 < end && sm.thr == 0;  // only -inf so far: they still fill an empty buffer
  }
  bool appended = false;
  if (__any_sync(0xffffffffu, maybe)) {
    const uint64_t thr = sm.thr;
#pragma unroll
    for (int e = 0; e < kTkEpt; ++e) {
      const uint64_t key = topk_key(v[e], static_cast<uint32_t>(i0 + e));
      const bool pass = maybe && i0 + e < end && key > thr;
      const unsigned bal = __ballot_sync(0xffffffffu, pass);
      if (bal) {
        const int leader = __ffs(bal) - 1;
        int base = 0;
        if (lane == leader) base = atomicAdd(&sm.count, __popc(bal));
        base = __shfl_sync(0xffffffffu, base, leader);
        if (pass) sm.buf[base + __popc(bal & ((1u << lane) - 1u))] = key;
      }
      appended |= pass;
    }
  }
  if (__syncthreads_or(appended)) {
    const int cnt = sm.count;
    __syncthreads();
    if (cnt > kTkCap - kTkRound) block_compact(sm, k);
  }
}

__device__ void block_reduce_ms(TopkSmem& sm, float& m, float& s) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, off), s2 = __shfl_xor_sync(0xffffffffu, s, off);
    ms_merge(m, s, m2, s2);
  }
  if (lane == 0) { sm.red_m[warp] = m; sm.red_s[warp] = s; }
  __syncthreads();
  m = sm.red_m[0];
  s = sm.red_s[0];
  for (int w = 1; w < kTkThreads / 32; ++w) ms_merge(m, s, sm.red_m[w], sm.red_s[w]);
}

template <typename T>
__global__ void __launch_bounds__(kTkThreads) topk_kernel(const T* __restrict__ logits, int vocab, int k, int chunks,
                                                          int chunk_len, float* out_lp, int64_t* out_ids,
                                                          float* part_ms, uint64_t* part_keys) {
  __shared__ TopkSmem sm;
  const int tid = threadIdx.x;
  const int row = blockIdx.x / chunks, c = blockIdx.x % chunks;
  const int begin = c * chunk_len, end = min(vocab, begin + chunk_len);
  const T* x = logits + static_cast<int64_t>(row) * vocab;
  if (tid == 0) { sm.count = 0; sm.thr = 0; sm.thr_x = -CUDART_INF_F; }
  __syncthreads();
  const bool vec = (static_cast<int64_t>(vocab) * sizeof(T)) % 16 == 0 && (reinterpret_cast<uintptr_t>(logits) & 15) == 0;
  float m = -CUDART_INF_F, s = 0.f;
  float cur[kTkEpt], nxt[kTkEpt];
  if (begin < end) load8<T>(x, begin + tid * kTkEpt, end, vec, cur);
  for (int base = begin; base < end; base += kTkRound) {
    const int i0 = base + tid * kTkEpt;
    if (base + kTkRound < end) load8<T>(x, i0 + kTkRound, end, vec, nxt);
    topk_consume(sm, cur, i0, end, k, m, s);
#pragma unroll
    for (int e = 0; e < kTkEpt; ++e) cur[e] = nxt[e];
  }
  block_reduce_ms(sm, m, s);
  if (chunks == 1) topk_finalize(sm, k, m, s, row, out_lp, out_ids, nullptr, nullptr);
  else topk_finalize(sm, k, m, s, blockIdx.x, nullptr, nullptr, part_keys, part_ms);
}

__global__ void __launch_bounds__(kTkThreads) topk_merge_kernel(int k, int chunks, const float* part_ms,
                                                                const uint64_t* part_keys, float* out_lp,
                                                                int64_t* out_ids) {
  __shared__ TopkSmem sm;
  const int tid = threadIdx.x, row = blockIdx.x;
  const int n = chunks * k;
  for (int i = tid; i < n; i += kTkThreads) sm.buf[i] = part_keys[static_cast<int64_t>(row) * n + i];
  if (tid == 0) sm.count = n;
  float m = -CUDART_INF_F, s = 0.f;
  for (int c = 0; c < chunks; ++c)
    ms_merge(m, s, part_ms[2 * (static_cast<int64_t>(row) * chunks + c)], part_ms[2 * (static_cast<int64_t>(row) * chunks + c) + 1]);
  topk_finalize(sm, k, m, s, row, out_lp, out_ids, nullptr, nullptr);
}

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

// ---- tree walk ------------------------------------------------------------------------------------------------
__global__ void __launch_bounds__(32) tree_accept_kernel(const int64_t* __restrict__ target,
                                                         const int64_t* __restrict__ tokens,
                                                         const int64_t* __restrict__ parents,
                                                         const int64_t* __restrict__ num_nodes, int R, int L,
                                                         int64_t* accepted, int64_t* accept_len, int64_t* bonus) {
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
  for (int step = 1; step <= L; ++step) {
    const int64_t want = target[base + cur];
    int found = -1;
    for (int j0 = 0; j0 < count && found < 0; j0 += 32) {
      const int j = j0 + lane;
      const bool hit = j > 0 && j < count && s_par[j] == cur && s_tok[j] == want;
      const unsigned bal = __ballot_sync(0xffffffffu, hit);
      if (bal) found = j0 + __ffs(bal) - 1;
    }
    if (found < 0) break;
    cur = found;
    if (lane == 0) acc[step] = found;
    ++len;
  }
  for (int j = lane; j <= L; j += 32)
    if (j == 0 || j >= len) acc[j] = j == 0 ? 0 : -1;
  if (lane == 0) {
    accept_len[n] = len;
    bonus[n] = target[base + cur];
  }
}

// ---- target tokens ------------------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t mix32(uint32_t x) {
  x ^= x >> 16; x *= 0x7feb352du; x ^= x >> 15; x *= 0x846ca68bu; x ^= x >> 16;
  return x;
}

template <typename T>
__global__ void __launch_bounds__(256) sample_tokens_kernel(const T* __restrict__ logits, int vocab,
                                                            const float* __restrict__ temperature, uint64_t seed,
                                                            int64_t* out) {
  __shared__ float s_val[8];
  __shared__ int s_idx[8];
  const int row = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const T* x = logits + static_cast<int64_t>(row) * vocab;
  const float temp = temperature ? temperature[row] : 0.f;
  const bool greedy = !(temp >= 1e-5f);
  const float inv_t = greedy ? 1.f : 1.f / temp;
  const uint32_t rowkey = mix32(static_cast<uint32_t>(seed) ^ mix32(static_cast<uint32_t>(seed >> 32) + 0x9e3779b9u * static_cast<uint32_t>(row + 1)));
  const bool vec = (static_cast<int64_t>(vocab) * sizeof(T)) % 16 == 0 && (reinterpret_cast<uintptr_t>(logits) & 15) == 0;
  float best = -CUDART_INF_F;
  int bidx = 0x7fffffff;
  for (int i0 = tid * kTkEpt; i0 < vocab; i0 += 256 * kTkEpt) {
    float v[kTkEpt];
    load8<T>(x, i0, vocab, vec, v);
#pragma unroll
    for (int e = 0; e < kTkEpt; ++e) {
      const int idx = i0 + e;
      if (idx >= vocab) continue;
      float val = v[e] * inv_t;
      if (!greedy) {  // Gumbel(0, 1) noise from a counter hash: -ln(-ln u), u in (0, 1)
        const uint32_t h = mix32(rowkey ^ (static_cast<uint32_t>(idx) * 0x9e3779b1u));
        const float u = fmaf(static_cast<float>(h >> 8), 1.0f / 16777216.0f, 0.5f / 16777216.0f);
        val -= __logf(__log2f(u) * -0.69314718f);
      }
      if (val > best || bidx == 0x7fffffff) { best = val; bidx = idx; }
    }
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, best, off);
    const int oi = __shfl_xor_sync(0xffffffffu, bidx, off);
    if (ov > best || (ov == best && oi < bidx)) { best = ov; bidx = oi; }
  }
  if (lane == 0) { s_val[warp] = best; s_idx[warp] = bidx; }
  __syncthreads();
  if (tid == 0) {
    for (int w = 1; w < 8; ++w)
      if (s_val[w] > best || (s_val[w] == best && s_idx[w] < bidx)) { best = s_val[w]; bidx = s_idx[w]; }
    out[row] = bidx == 0x7fffffff ? 0 : bidx;
  }
}

int round_up(int x, int m) { return (x + m - 1) / m * m; }

}  // namespace

int topk_num_chunks(int rows, int vocab, int k, int num_sms) {
  if (rows <= 0 || rows >= 2 * num_sms) return 1;
  int want = (2 * num_sms + rows - 1) / rows;
  const int by_vocab = vocab / (2 * kTkRound);
  int kp = 1;
  while (kp < k) kp <<= 1;
  const int by_cap = kTkCap / kp;
  want = want < by_vocab ? want : by_vocab;
  want = want < by_cap ? want : by_cap;
  if (want <= 1) return 1;
  const int chunk_len = round_up((vocab + want - 1) / want, 2 * kTkRound);
  return (vocab + chunk_len - 1) / chunk_len;
}

size_t topk_workspace_bytes(int rows, int k, int chunks) {
  if (chunks <= 1) return 0;
  return static_cast<size_t>(rows) * chunks * (2 * sizeof(float) + k * sizeof(uint64_t)) + 16;
}

cudaError_t topk_logprobs(const void* logits, DType dtype, int rows, int vocab, int k, int chunks, void* workspace,
                          float* out_lp, int64_t* out_ids, cudaStream_t stream) {
  if (rows == 0 || k == 0) return cudaSuccess;
  if (k > kTopkMaxK || k > vocab) return cudaErrorInvalidValue;
  const int chunk_len = chunks <= 1 ? vocab : round_up((vocab + chunks - 1) / chunks, 2 * kTkRound);
  uint64_t* part_keys = nullptr;
  float* part_ms = nullptr;
  if (chunks > 1) {
    part_keys = static_cast<uint64_t*>(workspace);
    part_ms = reinterpret_cast<float*>(part_keys + static_cast<size_t>(rows) * chunks * k);
  }
  const dim3 grid(rows * chunks);
  if (dtype == kFloat32) topk_kernel<float><<<grid, kTkThreads, 0, stream>>>(static_cast<const float*>(logits), vocab, k, chunks, chunk_len, out_lp, out_ids, part_ms, part_keys);
  else if (dtype == kFloat16) topk_kernel<__half><<<grid, kTkThreads, 0, stream>>>(static_cast<const __half*>(logits), vocab, k, chunks, chunk_len, out_lp, out_ids, part_ms, part_keys);
  else topk_kernel<__nv_bfloat16><<<grid, kTkThreads, 0, stream>>>(static_cast<const __nv_bfloat16*>(logits), vocab, k, chunks, chunk_len, out_lp, out_ids, part_ms, part_keys);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || chunks <= 1) return err;
  topk_merge_kernel<<<rows, kTkThreads, 0, stream>>>(k, chunks, part_ms, part_keys, out_lp, out_ids);
  return cudaGetLastError();
}

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

cudaError_t tree_accept(const int64_t* target_token_ids, const int64_t* node_token_ids, const int64_t* parents,
                        const int64_t* num_nodes, int num_reqs, int num_rows, int max_depth, int64_t* accepted_nodes,
                        int64_t* accept_len, int64_t* bonus, cudaStream_t stream) {
  if (num_reqs == 0) return cudaSuccess;
  const size_t smem = static_cast<size_t>(num_rows) * (sizeof(int64_t) + sizeof(int));
  cudaError_t err = cudaFuncSetAttribute(tree_accept_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  tree_accept_kernel<<<num_reqs, 32, smem, stream>>>(target_token_ids, node_token_ids, parents, num_nodes, num_rows,
                                                     max_depth, accepted_nodes, accept_len, bonus);
  return cudaGetLastError();
}

cudaError_t sample_tokens(const void* logits, DType dtype, int rows, int vocab, const float* temperature,
                          uint64_t seed, int64_t* out, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if (dtype == kFloat32) sample_tokens_kernel<float><<<rows, 256, 0, stream>>>(static_cast<const float*>(logits), vocab, temperature, seed, out);
  else if (dtype == kFloat16) sample_tokens_kernel<__half><<<rows, 256, 0, stream>>>(static_cast<const __half*>(logits), vocab, temperature, seed, out);
  else sample_tokens_kernel<__nv_bfloat16><<<rows, 256, 0, stream>>>(static_cast<const __nv_bfloat16*>(logits), vocab, temperature, seed, out);
  return cudaGetLastError();
}

}  // namespace ddtree
