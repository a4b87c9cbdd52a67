// Fused log-softmax + top-K over the vocabulary (the drafter's per-depth candidates for the DDTree build).
#include "vocab_rows.cuh"

#include <algorithm>

namespace ddtree {

namespace {

// ---- top-K ------------------------------------------------------------------------------------------------
// One CTA streams a chunk of a row once: an online max / sum-exp, and a candidate buffer of unique 64-bit keys
// (value, reversed id) above the running threshold = the K-th best key at the last compaction. When the buffer
// passes a few K keys, an exact radix select (8 passes of 8 bits over shared memory) finds the K-th key and
// compacts the buffer to K: compacting early keeps the threshold high, so later rounds rarely append.
//
// The stream is latency-bound unless many bytes are in flight: rows with 16-byte aligned groups copy each
// thread's 8 elements STAGES - 1 rounds ahead with cp.async into a shared-memory ring (dynamic shared memory). A
// thread reads back only the bytes it copied itself, so its own wait_group orders them: no barrier. The buffer
// holds the compaction trigger plus one round: K <= kTkSmallK needs 2560 keys, which leaves room (4 CTAs an SM)
// for a ring of 128 bytes a thread; larger K take 4096 keys and 64 bytes a thread.
constexpr int kTkThreads = 256, kTkEpt = kRowEpt, kTkRound = kTkThreads * kTkEpt, kTkCap = 4096;
constexpr int kTkSmallK = 128, kTkSmallCap = 4 * kTkSmallK + kTkRound;

template <int CAP>
struct TopkSmem {
  uint64_t buf[CAP];
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
template <int CAP>
__device__ uint64_t block_kth_largest(TopkSmem<CAP>& sm, int n, int k) {
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
template <int CAP>
__device__ void block_compact(TopkSmem<CAP>& sm, int k) {
  const int tid = threadIdx.x;
  const int n = sm.count;
  if (n <= k) return;
  const uint64_t kth = block_kth_largest(sm, n, k);
  uint64_t keep[CAP / kTkThreads];
#pragma unroll
  for (int j = 0; j < CAP / kTkThreads; ++j) {
    const int i = tid + j * kTkThreads;
    keep[j] = (i < n && sm.buf[i] >= kth) ? sm.buf[i] : 0;
  }
  __syncthreads();
  if (tid == 0) { sm.count = 0; sm.thr = kth; sm.thr_x = from_ordered_bits(static_cast<uint32_t>(kth >> 32)); }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < CAP / kTkThreads; ++j)
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

// Buffer -> exactly the top k; then either this chunk's partial keys (unsorted: the merge re-selects) or the
// final rows, sorted once by (log-prob, reversed id) so values that round to the same log-prob order by id.
template <int CAP>
__device__ void topk_finalize(TopkSmem<CAP>& sm, int k, float m, float s, int64_t out_row, float* out_lp,
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

// One round: 8 elements per thread. Online max / sum-exp, then candidates above the threshold go to the buffer:
// a warp scan of the per-thread counts and one atomic per warp. FULL: every element of the round is inside the
// chunk (no bounds checks). Once a threshold exists the value test alone is exact: ids grow along the stream, so
// a later element tying the threshold's value has the smaller key (reversed id). One barrier a round; it also
// tells every thread whether the buffer passed `trigger` (the warp adding last sees the round's final count).
template <bool FULL, int CAP>
__device__ __forceinline__ void topk_consume(TopkSmem<CAP>& sm, const float (&v)[kTkEpt], int i0, int end, int k,
                                             int trigger, float& m, float& s) {
  const int lane = threadIdx.x & 31;
  const bool full = FULL || i0 + kTkEpt <= end;
  float lmax = -CUDART_INF_F;
#pragma unroll
  for (int e = 0; e < kTkEpt; ++e)
    if (full || i0 + e < end) lmax = fmaxf(lmax, v[e]);
  if (lmax > m) {
    s *= ex2((m - lmax) * kLog2e);
    m = lmax;
  }
  const bool none = sm.thr == 0;  // no threshold yet: everything enters (-inf too: it fills a short row)
  const float tx = sm.thr_x;
  unsigned bits = 0;
  if (m > -CUDART_INF_F) {
    const float ml = m * kLog2e;
#pragma unroll
    for (int e = 0; e < kTkEpt; ++e)
      if (full || i0 + e < end) s += ex2(fmaf(v[e], kLog2e, -ml));
    if (none || lmax > tx) {  // most rounds of most threads: nothing above the threshold
#pragma unroll
      for (int e = 0; e < kTkEpt; ++e)
        if ((full || i0 + e < end) && (none || v[e] > tx)) bits |= 1u << e;
    }
  } else if (none) {
#pragma unroll
    for (int e = 0; e < kTkEpt; ++e)
      if (full || i0 + e < end) bits |= 1u << e;
  }
  bool over = false;
  if (__any_sync(0xffffffffu, bits != 0)) {
    const int n = __popc(bits);
    int incl = n;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, incl, off);
      if (lane >= off) incl += y;
    }
    int base = 0;
    if (lane == 31) {
      base = atomicAdd(&sm.count, incl);
      over = base + incl > trigger;
    }
    int pos = __shfl_sync(0xffffffffu, base, 31) + incl - n;
#pragma unroll
    for (int e = 0; e < kTkEpt; ++e)
      if ((bits >> e) & 1u) sm.buf[pos++] = topk_key(v[e] + 0.0f, static_cast<uint32_t>(i0 + e));  // -0.0 -> +0.0
  }
  if (__syncthreads_or(over)) block_compact(sm, k);
}

template <int CAP>
__device__ void block_reduce_ms(TopkSmem<CAP>& sm, float& m, float& s) {
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

// Full rounds of a 16-byte aligned row through the cp.async ring; returns where the partial tail starts.
template <typename T, int CAP, int STAGES>
__device__ int topk_stream_full_rounds(TopkSmem<CAP>& sm, uint4* ring, const T* x, int begin, int end, int k,
                                       int trigger, float& m, float& s) {
  constexpr int V = sizeof(T) * kTkEpt / 16;  // 16-byte copies per thread per round
  const int tid = threadIdx.x;
  const int rounds = (end - begin) / kTkRound;
  const uint4* src = reinterpret_cast<const uint4*>(x + begin) + tid * V;
  uint4* mine = ring + tid * V;  // [stage][thread][V]
#pragma unroll
  for (int r = 0; r < STAGES - 1; ++r) {
#pragma unroll
    for (int j = 0; j < V; ++j)
      cp_async_16(mine + r * kTkThreads * V + j, src + static_cast<int64_t>(r) * kTkThreads * V + j, r < rounds);
    cp_async_commit();
  }
  for (int r = 0; r < rounds; ++r) {
    const int ahead = r + STAGES - 1;  // its stage was read by this thread in round r - 1
#pragma unroll
    for (int j = 0; j < V; ++j)
      cp_async_16(mine + (ahead % STAGES) * kTkThreads * V + j, src + static_cast<int64_t>(ahead) * kTkThreads * V + j,
                  ahead < rounds);
    cp_async_commit();
    cp_async_wait<STAGES - 1>();
    uint4 raw[V];
#pragma unroll
    for (int j = 0; j < V; ++j) raw[j] = mine[(r % STAGES) * kTkThreads * V + j];
    const T* h = reinterpret_cast<const T*>(raw);
    float v[kTkEpt];
#pragma unroll
    for (int e = 0; e < kTkEpt; ++e) v[e] = Num<T>::to_f(h[e]);  // -0.0 stays: only keys need it canonical
    topk_consume<true>(sm, v, begin + r * kTkRound + tid * kTkEpt, end, k, trigger, m, s);
  }
  cp_async_wait<0>();
  return begin + rounds * kTkRound;
}

template <typename T, int CAP, int STAGES>
__global__ void __launch_bounds__(kTkThreads) topk_kernel(const T* __restrict__ logits, int vocab, int k, int trigger,
                                                          int chunks, int chunk_len, float* out_lp, int64_t* out_ids,
                                                          float* part_ms, uint64_t* part_keys) {
  __shared__ TopkSmem<CAP> sm;
  extern __shared__ __align__(16) unsigned char ring_raw[];
  const int tid = threadIdx.x;
  const int row = blockIdx.x / chunks, c = blockIdx.x % chunks;
  const int begin = c * chunk_len, end = min(vocab, begin + chunk_len);
  const T* x = logits + static_cast<int64_t>(row) * vocab;
  if (tid == 0) { sm.count = 0; sm.thr = 0; sm.thr_x = -CUDART_INF_F; }
  __syncthreads();
  const bool vec = (static_cast<int64_t>(vocab) * sizeof(T)) % 16 == 0 && (reinterpret_cast<uintptr_t>(logits) & 15) == 0;
  float m = -CUDART_INF_F, s = 0.f;
  int tail = begin;
  if (vec) tail = topk_stream_full_rounds<T, CAP, STAGES>(sm, reinterpret_cast<uint4*>(ring_raw), x, begin, end, k, trigger, m, s);
  float cur[kTkEpt], nxt[kTkEpt];
  if (tail < end) load8<T>(x, tail + tid * kTkEpt, end, vec, cur);
  for (int base = tail; base < end; base += kTkRound) {
    const int i0 = base + tid * kTkEpt;
    if (base + kTkRound < end) load8<T>(x, i0 + kTkRound, end, vec, nxt);
    topk_consume<false>(sm, cur, i0, end, k, trigger, m, s);
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
  __shared__ TopkSmem<kTkCap> sm;
  const int tid = threadIdx.x, row = blockIdx.x;
  const int n = chunks * k;
  for (int i = tid; i < n; i += kTkThreads) sm.buf[i] = part_keys[static_cast<int64_t>(row) * n + i];
  if (tid == 0) sm.count = n;
  float m = -CUDART_INF_F, s = 0.f;
  for (int c = 0; c < chunks; ++c)
    ms_merge(m, s, part_ms[2 * (static_cast<int64_t>(row) * chunks + c)], part_ms[2 * (static_cast<int64_t>(row) * chunks + c) + 1]);
  topk_finalize(sm, k, m, s, row, out_lp, out_ids, nullptr, nullptr);
}

template <typename T, int CAP, int STAGES>
cudaError_t launch_topk_cfg(const T* logits, int rows, int vocab, int k, int chunks, int chunk_len, float* out_lp,
                            int64_t* out_ids, float* part_ms, uint64_t* part_keys, cudaStream_t stream) {
  constexpr int ring_bytes = STAGES * kTkThreads * kTkEpt * static_cast<int>(sizeof(T));
  auto kernel = topk_kernel<T, CAP, STAGES>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, ring_bytes);
  if (err != cudaSuccess) return err;
  // compacting at a few K keeps the threshold near the K-th best seen so far, so few elements pass it later
  // (H200, R = 64, K = 64: 0.233 ms compacting past 256 keys, 0.258 past 2048; K = 16: 0.188 vs 0.216)
  const int trigger = std::min(CAP - kTkRound, std::max(4 * k, 256));
  kernel<<<rows * chunks, kTkThreads, ring_bytes, stream>>>(logits, vocab, k, trigger, chunks, chunk_len, out_lp, out_ids,
                                                            part_ms, part_keys);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_topk(const T* logits, int rows, int vocab, int k, int chunks, int chunk_len, float* out_lp,
                        int64_t* out_ids, float* part_ms, uint64_t* part_keys, cudaStream_t stream) {
  constexpr int small_stages = 128 / (kTkEpt * static_cast<int>(sizeof(T)));  // 128 bytes a thread in the ring
  if (k <= kTkSmallK)
    return launch_topk_cfg<T, kTkSmallCap, small_stages>(logits, rows, vocab, k, chunks, chunk_len, out_lp, out_ids,
                                                         part_ms, part_keys, stream);
  return launch_topk_cfg<T, kTkCap, 4>(logits, rows, vocab, k, chunks, chunk_len, out_lp, out_ids, part_ms, part_keys,
                                       stream);
}

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
  cudaError_t err;
  if (dtype == kFloat32) err = launch_topk<float>(static_cast<const float*>(logits), rows, vocab, k, chunks, chunk_len, out_lp, out_ids, part_ms, part_keys, stream);
  else if (dtype == kFloat16) err = launch_topk<__half>(static_cast<const __half*>(logits), rows, vocab, k, chunks, chunk_len, out_lp, out_ids, part_ms, part_keys, stream);
  else err = launch_topk<__nv_bfloat16>(static_cast<const __nv_bfloat16*>(logits), rows, vocab, k, chunks, chunk_len, out_lp, out_ids, part_ms, part_keys, stream);
  if (err != cudaSuccess || chunks <= 1) return err;
  topk_merge_kernel<<<rows, kTkThreads, 0, stream>>>(k, chunks, part_ms, part_keys, out_lp, out_ids);
  return cudaGetLastError();
}

}  // namespace ddtree
