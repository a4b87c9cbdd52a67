// The floor of top-k / top-p per row: the smallest value a row keeps, so that `x >= floor` is the kept set. No
// sort: each row narrows a key interval in a few passes over its values, 256-bin histograms a pass.
// ext/reference/sampling.py `top_k_top_p_floor` is the PyTorch twin and the definition (integer masses, so the
// sums are exact in any order and the kernel and its twin agree bit for bit given the same exp).
//
// One CTA per row:
//   1. the row's max, smallest finite value, number of -inf values, and whether it holds a NaN or +inf;
//   2. top-k (0 < k < V): the k-th largest value, selected by counts;
//   3. top-p (p < 1): the largest value t whose keep-set {x >= t} (within top-k's) holds p of the mass, selected
//      by masses q = floor(exp(x - max) * 2^24).
// A selection keeps a key interval [lo, hi] of the row's order-preserving keys known to hold the answer; a pass
// spreads the interval's elements over 256 bins (linear in value; one key a bin once the interval spans fewer
// than 256 keys) with each bin's weight and smallest and largest key, and the bin where the running weight from
// the top reaches the need becomes the next interval. Each element in the interval takes three shared atomics
// (weight, smallest and largest key of its bin); warp-aggregating lanes of one bin first (__match_any_sync) made
// the kernel 3.5-7x slower on the H100.
#include "vocab_rows.cuh"

namespace ddtree {

namespace {

constexpr int kFlThreads = 512, kFlWarps = kFlThreads / 32;
constexpr int kFlSub = 32 * kRowEpt;  // tokens one warp-wide load covers (256)
constexpr int kFlBins = 256;
constexpr float kMassScale = 16777216.0f;  // 2^24: q <= 2^24

// Larger value -> larger key (never called on NaN; -0.0 arrives as +0.0).
__device__ __forceinline__ uint32_t order_key(float v) {
  const uint32_t u = __float_as_uint(v);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float key_value(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

struct FilterShared {
  unsigned long long weight[kFlBins];
  uint32_t key_min[kFlBins], key_max[kFlBins];
  unsigned long long scan_above;
  uint32_t lo, hi;
  float red_f[2][kFlWarps];
  int red_i[2][kFlWarps];
};

__device__ __forceinline__ unsigned long long warp_incl_scan_u64(unsigned long long x) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const unsigned long long y = __shfl_up_sync(0xffffffffu, x, off);
    if (lane >= off) x += y;
  }
  return x;
}

// Narrows [lo, hi] to the one key t with above(t) < need <= above(t) + weight(t), where above(t) is the weight of
// the keys in the interval above t (counts when !kMass, masses q when kMass; zero-mass elements take no part).
// need < 0 (masses only): -need * the interval's total weight, i.e. a fraction p of it, taken on the first pass.
template <typename T, bool kMass>
__device__ uint32_t select_key(const T* x, int vocab, bool vec, uint32_t lo, uint32_t hi, float m, double need,
                               FilterShared& s) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  unsigned long long above = 0;
  while (lo != hi) {
    for (int b = tid; b < kFlBins; b += kFlThreads) {
      s.weight[b] = 0;
      s.key_min[b] = 0xffffffffu;
      s.key_max[b] = 0;
    }
    __syncthreads();
    const bool exact = hi - lo < kFlBins;
    const double hv = key_value(hi);
    const double inv = exact ? 0.0 : kFlBins / (hv - static_cast<double>(key_value(lo)));
    for (int base = warp * kFlSub; base < vocab; base += kFlWarps * kFlSub) {
      const int i0 = base + lane * kRowEpt;
      float v[kRowEpt];
      load8<T>(x, i0, vocab, vec, v);
#pragma unroll
      for (int e = 0; e < kRowEpt; ++e) {
        const uint32_t key = order_key(v[e]);
        bool in = i0 + e < vocab && key >= lo && key <= hi;
        uint32_t w = 1u;
        if (kMass && in) {
          w = static_cast<uint32_t>(expf(v[e] - m) * kMassScale);
          in = w != 0;
        }
        if (!in) continue;
        const uint32_t bin = exact ? hi - key
                                   : static_cast<uint32_t>(min(kFlBins - 1, static_cast<int>((hv - v[e]) * inv)));
        atomicAdd(&s.weight[bin], static_cast<unsigned long long>(w));
        atomicMin(&s.key_min[bin], key);
        atomicMax(&s.key_max[bin], key);
      }
    }
    __syncthreads();
    if (warp == 0) {  // lane l holds bins 8l .. 8l+7, bin 0 the highest keys
      unsigned long long local[8], lane_sum = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) lane_sum += (local[j] = s.weight[lane * 8 + j]);
      const unsigned long long incl = warp_incl_scan_u64(lane_sum);
      if (need < 0.0) need = -need * static_cast<double>(__shfl_sync(0xffffffffu, incl, 31));
      // the first lane with weight whose running weight reaches the need; the callers' needs never exceed the
      // interval's weight, so "none" is rounding, and the last lane with weight holds the crossing
      const unsigned has = __ballot_sync(0xffffffffu, lane_sum != 0);
      const unsigned hit = __ballot_sync(0xffffffffu, lane_sum != 0 && static_cast<double>(above + incl) >= need);
      const int l = hit ? __ffs(hit) - 1 : 31 - __clz(has);
      if (lane == l) {
        unsigned long long acc = above + incl - lane_sum, acc_chosen = acc;
        int chosen = 0;
        for (int j = 0; j < 8; ++j) {
          if (local[j] == 0) continue;
          chosen = lane * 8 + j;
          acc_chosen = acc;
          if (static_cast<double>(acc + local[j]) >= need) break;
          acc += local[j];
        }
        s.scan_above = acc_chosen;
        s.lo = s.key_min[chosen];
        s.hi = s.key_max[chosen];
      }
    }
    __syncthreads();
    above = s.scan_above;
    lo = s.lo;
    hi = s.hi;
    __syncthreads();
  }
  return lo;
}

template <typename T>
__global__ void __launch_bounds__(kFlThreads, 2) top_k_top_p_floor_kernel(const T* __restrict__ logits, int vocab,
                                                                        const int64_t* __restrict__ top_k,
                                                                        const float* __restrict__ top_p,
                                                                        float* __restrict__ out) {
  __shared__ FilterShared s;
  const int row = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const T* x = logits + static_cast<int64_t>(row) * vocab;
  const bool vec = (static_cast<int64_t>(vocab) * sizeof(T)) % 16 == 0 &&
                   (reinterpret_cast<uintptr_t>(logits) & 15) == 0;
  const int64_t k = top_k[row];
  const float p = top_p[row];
  const bool use_k = k > 0 && k < vocab, use_p = p < 1.0f;
  if (!use_k && !use_p) {
    if (tid == 0) out[row] = -CUDART_INF_F;
    return;
  }

  // 1. max, smallest finite value, -inf count, NaN / +inf
  float mx = -CUDART_INF_F, mn = CUDART_INF_F;
  int num_neg_inf = 0, bad = 0;
  for (int i0 = tid * kRowEpt; i0 < vocab; i0 += kFlThreads * kRowEpt) {
    float v[kRowEpt];
    load8<T>(x, i0, vocab, vec, v);
#pragma unroll
    for (int e = 0; e < kRowEpt; ++e) {
      if (i0 + e >= vocab) continue;
      const float a = v[e];
      bad |= (a != a) || a == CUDART_INF_F;
      num_neg_inf += a == -CUDART_INF_F;
      if (a != -CUDART_INF_F) mn = fminf(mn, a);
      mx = fmaxf(mx, a);
    }
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    mn = fminf(mn, __shfl_xor_sync(0xffffffffu, mn, off));
    num_neg_inf += __shfl_xor_sync(0xffffffffu, num_neg_inf, off);
    bad |= __shfl_xor_sync(0xffffffffu, bad, off);
  }
  if (lane == 0) {
    s.red_f[0][warp] = mx;
    s.red_f[1][warp] = mn;
    s.red_i[0][warp] = num_neg_inf;
    s.red_i[1][warp] = bad;
  }
  __syncthreads();
  mx = s.red_f[0][0];
  mn = s.red_f[1][0];
  num_neg_inf = s.red_i[0][0];
  bad = s.red_i[1][0];
  for (int w = 1; w < kFlWarps; ++w) {
    mx = fmaxf(mx, s.red_f[0][w]);
    mn = fminf(mn, s.red_f[1][w]);
    num_neg_inf += s.red_i[0][w];
    bad |= s.red_i[1][w];
  }
  __syncthreads();  // s.red is not read again, but select_key's first clear must not race these reads
  if (bad || mx == -CUDART_INF_F) {  // no finite max: sample_tokens takes the argmax
    if (tid == 0) out[row] = -CUDART_INF_F;
    return;
  }

  // 2. top-k: the k-th largest value (-inf when fewer than k values are finite)
  uint32_t floor_key = order_key(-CUDART_INF_F);
  if (use_k && k <= vocab - num_neg_inf)
    floor_key = select_key<T, false>(x, vocab, vec, order_key(mn), order_key(mx), mx, static_cast<double>(k), s);

  // 3. top-p within top-k's keep-set
  if (use_p)
    floor_key = select_key<T, true>(x, vocab, vec, max(floor_key, order_key(mn)), order_key(mx), mx,
                                    -static_cast<double>(p), s);
  if (tid == 0) out[row] = key_value(floor_key);
}

}  // namespace

cudaError_t top_k_top_p_floor(const void* logits, DType dtype, int rows, int vocab, const int64_t* top_k,
                              const float* top_p, float* out, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if (vocab <= 0 || vocab > kSampleMaxVocab) return cudaErrorInvalidValue;
  const dim3 grid(rows), block(kFlThreads);
  if (dtype == kFloat32)
    top_k_top_p_floor_kernel<float><<<grid, block, 0, stream>>>(static_cast<const float*>(logits), vocab, top_k,
                                                                top_p, out);
  else if (dtype == kFloat16)
    top_k_top_p_floor_kernel<__half><<<grid, block, 0, stream>>>(static_cast<const __half*>(logits), vocab, top_k,
                                                                 top_p, out);
  else
    top_k_top_p_floor_kernel<__nv_bfloat16><<<grid, block, 0, stream>>>(
        static_cast<const __nv_bfloat16*>(logits), vocab, top_k, top_p, out);
  return cudaGetLastError();
}

}  // namespace ddtree
