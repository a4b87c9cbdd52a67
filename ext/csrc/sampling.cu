// Target token per row: argmax for greedy rows, else inverse-CDF sampling of softmax(logits / T) over the min-p
// kept tokens at a caller-supplied uniform. ext/reference/sampling.py is the PyTorch twin: same fp32 weights
// e = exp((x - max) * (1 / T)), fp64 masses, the same crossing rule.
//
// One CTA per row, three steps:
//   1. arg-max over the row (NaN counts as the largest value, equal values -> lower id), as torch.argmax;
//   2. each warp sums the kept weights of whole chunks (256 * G consecutive tokens) into shared memory;
//   3. warp 0 scans the chunk sums for the first chunk whose inclusive mass exceeds uniform * total, then scans
//      that chunk alone (lane-sequential, warp prefix scan) for the first token whose cumulative mass exceeds it.
// The chosen token always has a positive kept weight: a crossing only happens where the cumulative mass grows;
// if rounding leaves no crossing (uniform within 2^-52 of 1), the last kept token is taken, as in the twin.
#include "vocab_rows.cuh"

namespace ddtree {

namespace {

constexpr int kSmThreads = 512, kSmWarps = kSmThreads / 32;  // two CTAs per SM (<= 64 registers)
constexpr int kSmSub = 32 * kRowEpt;  // tokens one warp-wide load covers (256)

// Strict total order of torch.argmax: NaN above every number, equal values -> lower index.
__device__ __forceinline__ bool arg_better(float v, int i, float bv, int bi) {
  const bool vn = v != v, bn = bv != bv;
  if (vn || bn) return vn && (!bn || i < bi);
  return v > bv || (v == bv && i < bi);
}

// Kept weight of one token: e = exp((x - m) * inv_t) (so the row max has e = 1 and p_i / max p = e), kept when
// e > 0 and e >= min_p; NaN (a NaN or +inf logit somewhere) is never kept.
__device__ __forceinline__ float kept_weight(float x, float m, float inv_t, float min_p) {
  const float e = expf((x - m) * inv_t);
  return (e > 0.f && e >= min_p) ? e : 0.f;
}

__device__ __forceinline__ double warp_sum_d(double x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

__device__ __forceinline__ double warp_incl_scan_d(double x) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const double y = __shfl_up_sync(0xffffffffu, x, off);
    if (lane >= off) x += y;
  }
  return x;
}

// This lane's share (8 tokens per 256-token sub-chunk) of the kept mass of chunk c.
template <typename T>
__device__ __forceinline__ double lane_chunk_mass(const T* x, int vocab, bool vec, int c, int chunk_len, float m,
                                                  float inv_t, float min_p) {
  const int lane = threadIdx.x & 31;
  double s = 0.0;
  for (int g = 0; g < chunk_len; g += kSmSub) {
    const int i0 = c * chunk_len + g + lane * kRowEpt;
    float v[kRowEpt];
    load8<T>(x, i0, vocab, vec, v);  // past the end: -inf, weight 0, nothing read
#pragma unroll
    for (int e = 0; e < kRowEpt; ++e) s += static_cast<double>(kept_weight(v[e], m, inv_t, min_p));
  }
  return s;
}

template <typename T>
__global__ void __launch_bounds__(kSmThreads, 2) sample_tokens_kernel(const T* __restrict__ logits, int vocab,
                                                                   int chunk_len, int num_chunks,
                                                                   const float* __restrict__ temperature,
                                                                   const float* __restrict__ min_p_in,
                                                                   const double* __restrict__ uniform,
                                                                   int64_t* __restrict__ out) {
  extern __shared__ double s_chunk[];  // [num_chunks] kept mass per chunk
  __shared__ float s_bv[kSmWarps];
  __shared__ int s_bi[kSmWarps];
  const int row = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const T* x = logits + static_cast<int64_t>(row) * vocab;
  const bool vec = (static_cast<int64_t>(vocab) * sizeof(T)) % 16 == 0 &&
                   (reinterpret_cast<uintptr_t>(logits) & 15) == 0;

  // 1. arg-max (two independent loads in flight per thread)
  constexpr int kStride = kSmThreads * kRowEpt;
  float bv = -CUDART_INF_F;
  int bi = 0x7fffffff;
  for (int i0 = tid * kRowEpt; i0 < vocab; i0 += 2 * kStride) {
    float a[kRowEpt], b[kRowEpt];
    load8<T>(x, i0, vocab, vec, a);
    load8<T>(x, i0 + kStride, vocab, vec, b);
#pragma unroll
    for (int e = 0; e < kRowEpt; ++e) {
      if (i0 + e < vocab && arg_better(a[e], i0 + e, bv, bi)) { bv = a[e]; bi = i0 + e; }
      if (i0 + kStride + e < vocab && arg_better(b[e], i0 + kStride + e, bv, bi)) { bv = b[e]; bi = i0 + kStride + e; }
    }
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, off);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, off);
    if (arg_better(ov, oi, bv, bi)) { bv = ov; bi = oi; }
  }
  if (lane == 0) { s_bv[warp] = bv; s_bi[warp] = bi; }
  __syncthreads();
  bv = s_bv[0];
  bi = s_bi[0];
  for (int w = 1; w < kSmWarps; ++w)
    if (arg_better(s_bv[w], s_bi[w], bv, bi)) { bv = s_bv[w]; bi = s_bi[w]; }
  if (bi == 0x7fffffff) bi = 0;

  const float temp = temperature[row];
  // Greedy rows, and rows whose max is not finite (all -inf, a NaN, a +inf: no finite kept mass) take the argmax.
  if (!(temp >= 1e-5f) || !(fabsf(bv) <= 3.402823466e38f)) {
    if (tid == 0) out[row] = bi;
    return;
  }
  const float m = bv, inv_t = 1.0f / temp, min_p = min_p_in[row];

  // 2. kept mass per chunk, two chunks per warp in flight
  for (int c = warp; c < num_chunks; c += 2 * kSmWarps) {
    const int c2 = c + kSmWarps;
    double s = lane_chunk_mass<T>(x, vocab, vec, c, chunk_len, m, inv_t, min_p);
    double s2 = c2 < num_chunks ? lane_chunk_mass<T>(x, vocab, vec, c2, chunk_len, m, inv_t, min_p) : 0.0;
    s = warp_sum_d(s);
    s2 = warp_sum_d(s2);
    if (lane == 0) {
      s_chunk[c] = s;
      if (c2 < num_chunks) s_chunk[c2] = s2;
    }
  }
  __syncthreads();
  if (warp != 0) return;

  // 3a. total kept mass and the chunk holding the crossing
  double total = 0.0;
  for (int c = lane; c < num_chunks; c += 32) total += s_chunk[c];
  total = warp_sum_d(total);
  int pick = bi;
  if (total > 0.0) {
    double target = uniform[row] * total;
    double carry = 0.0, base = 0.0;
    int chunk = -1, last_chunk = -1;
    for (int c0 = 0; c0 < num_chunks; c0 += 32) {
      const int c = c0 + lane;
      const double s = c < num_chunks ? s_chunk[c] : 0.0;
      const double scan = warp_incl_scan_d(s);
      const double before = __shfl_up_sync(0xffffffffu, scan, 1);
      const double incl = carry + scan, excl = carry + (lane == 0 ? 0.0 : before);
      const unsigned has_mass = __ballot_sync(0xffffffffu, s > 0.0);
      const unsigned hit = __ballot_sync(0xffffffffu, s > 0.0 && incl > target);
      if (has_mass) last_chunk = c0 + 31 - __clz(has_mass);
      if (hit) {
        const int l = __ffs(hit) - 1;
        chunk = c0 + l;
        base = __shfl_sync(0xffffffffu, excl, l);
        break;
      }
      carry = __shfl_sync(0xffffffffu, incl, 31);
    }
    if (chunk < 0) {  // rounding (uniform ~ 1): the last kept token
      chunk = last_chunk;
      target = CUDART_INF;
    }

    // 3b. the first token of that chunk whose cumulative kept mass exceeds the target
    int found = -1, last_kept = -1;
    double run = base;
    for (int g = 0; chunk >= 0 && g < chunk_len; g += kSmSub) {
      const int i0 = chunk * chunk_len + g + lane * kRowEpt;
      float v[kRowEpt], wt[kRowEpt];
      load8<T>(x, i0, vocab, vec, v);
      double local = 0.0;
#pragma unroll
      for (int e = 0; e < kRowEpt; ++e) {
        wt[e] = kept_weight(v[e], m, inv_t, min_p);
        local += static_cast<double>(wt[e]);
      }
      const double scan = warp_incl_scan_d(local);
      const double before = __shfl_up_sync(0xffffffffu, scan, 1);
      double acc = run + (lane == 0 ? 0.0 : before);
      int cand = -1, lane_last = -1;
#pragma unroll
      for (int e = 0; e < kRowEpt; ++e) {
        if (wt[e] > 0.f) {
          acc += static_cast<double>(wt[e]);
          if (cand < 0 && acc > target) cand = i0 + e;
          lane_last = i0 + e;
        }
      }
      const unsigned hit = __ballot_sync(0xffffffffu, cand >= 0);
      if (hit) {
        found = __shfl_sync(0xffffffffu, cand, __ffs(hit) - 1);
        break;
      }
      const unsigned any = __ballot_sync(0xffffffffu, lane_last >= 0);
      if (any) last_kept = __shfl_sync(0xffffffffu, lane_last, 31 - __clz(any));
      run += __shfl_sync(0xffffffffu, scan, 31);
    }
    if (found < 0) found = last_kept;
    if (found >= 0) pick = found;
  }
  if (lane == 0) out[row] = pick;
}

// splitmix64's finalizer of x + the golden gamma (the twin's _splitmix64, whose int64 arithmetic wraps alike).
__device__ __forceinline__ uint64_t splitmix64(uint64_t x) {
  uint64_t z = x + 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

__global__ void seeded_uniforms_kernel(const int64_t* __restrict__ seeds, const int64_t* __restrict__ indices,
                                       int rows, double* __restrict__ out) {
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  const uint64_t h = splitmix64(splitmix64(static_cast<uint64_t>(seeds[r])) + static_cast<uint64_t>(indices[r]));
  out[r] = static_cast<double>(h >> 11) * (1.0 / 9007199254740992.0);  // (h >> 11) < 2^53: exact in fp64
}

}  // namespace

cudaError_t seeded_uniforms(const int64_t* seeds, const int64_t* indices, int rows, double* out,
                            cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  seeded_uniforms_kernel<<<(rows + kThreads - 1) / kThreads, kThreads, 0, stream>>>(seeds, indices, rows, out);
  return cudaGetLastError();
}

cudaError_t sample_tokens(const void* logits, DType dtype, int rows, int vocab, const float* temperature,
                          const float* min_p, const double* uniform, int64_t* out, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if (vocab <= 0 || vocab > kSampleMaxVocab) return cudaErrorInvalidValue;
  const int subs = (vocab + kSmSub - 1) / kSmSub;
  const int per_chunk = (subs + kSampleMaxChunks - 1) / kSampleMaxChunks;  // sub-chunks per chunk (1 below 1M)
  const int chunk_len = per_chunk * kSmSub;
  const int num_chunks = (vocab + chunk_len - 1) / chunk_len;
  const size_t smem = static_cast<size_t>(num_chunks) * sizeof(double);  // <= 32 KiB
  const dim3 grid(rows), block(kSmThreads);
  if (dtype == kFloat32)
    sample_tokens_kernel<float><<<grid, block, smem, stream>>>(static_cast<const float*>(logits), vocab, chunk_len,
                                                               num_chunks, temperature, min_p, uniform, out);
  else if (dtype == kFloat16)
    sample_tokens_kernel<__half><<<grid, block, smem, stream>>>(static_cast<const __half*>(logits), vocab, chunk_len,
                                                                num_chunks, temperature, min_p, uniform, out);
  else
    sample_tokens_kernel<__nv_bfloat16><<<grid, block, smem, stream>>>(
        static_cast<const __nv_bfloat16*>(logits), vocab, chunk_len, num_chunks, temperature, min_p, uniform, out);
  return cudaGetLastError();
}

}  // namespace ddtree
