// Decoder-layer kernels: RMSNorm with a fused residual add, neox rotary embedding of q and k in place, and
// SiLU-and-mul. Each reproduces the rounding steps of the eager PyTorch math (ext/reference/layers.py): every
// intermediate the eager code materialises in the model dtype is rounded to it here too, products and sums are
// IEEE-rounded (no FMA contraction), so rope and SiLU-and-mul match the eager CUDA math bit for bit and RMSNorm
// differs only by the order of its sum of squares. RMSNorm and rope may be launched as programmatic dependents
// (p.pdl, common.cuh): they wait for the previous kernel before reading anything.
#include "common.cuh"

namespace ddtree {

namespace {

template <typename T, int N> struct alignas(sizeof(T) * N) Pack { T v[N]; };

// The output dtype of `weight * normalised`: the dtype itself when they agree, else fp32 (type promotion of
// {fp16, bf16} with fp32, or of fp16 with bf16).
template <typename T, typename W> struct Promote { using type = float; };
template <typename T> struct Promote<T, T> { using type = T; };

template <typename T, int N> __device__ __forceinline__ void load_f(const T* p, float (&out)[N]) {
  const Pack<T, N> v = *reinterpret_cast<const Pack<T, N>*>(p);
#pragma unroll
  for (int j = 0; j < N; ++j) out[j] = Num<T>::to_f(v.v[j]);
}
template <typename T, int N> __device__ __forceinline__ void store_f(T* p, const float (&in)[N]) {
  Pack<T, N> v;
#pragma unroll
  for (int j = 0; j < N; ++j) v.v[j] = Num<T>::from_f(in[j]);
  *reinterpret_cast<Pack<T, N>*>(p) = v;
}

// ---- RMSNorm -------------------------------------------------------------------------------------------------
constexpr int kNormCached = 4;       // vectors per thread kept in registers between the two passes
constexpr int kNormWarpRows = 4;     // rows per 128-thread block in the warp-per-row variant

// Row `row` = (outer t, inner r): x at x + t*x_stride0 + r*x_stride1. Pass 1 forms the new residual (rounded to
// T), writes it and sums its squares in fp32; pass 2 scales by rsqrt(mean + eps), rounds to T, multiplies by the
// weight and rounds to the output dtype. WARP_ROW: one warp per row (short rows); else one block per row.
constexpr int kNormMaxThreads = 512;  // block-per-row variant (128 registers a thread: no spills)

template <typename T, typename W, int VEC, bool WARP_ROW>
__global__ void __launch_bounds__(WARP_ROW ? 32 * kNormWarpRows : kNormMaxThreads) rms_norm_kernel(RmsNormParams p) {
  using O = typename Promote<T, W>::type;
  __shared__ float partial[32];
  pdl_wait();  // x and the residual are the previous kernel's outputs
  pdl_trigger();
  int64_t row;
  int tid, nthreads;
  if (WARP_ROW) {
    row = static_cast<int64_t>(blockIdx.x) * kNormWarpRows + threadIdx.x / 32;
    tid = threadIdx.x % 32;
    nthreads = 32;
    if (row >= p.rows) return;  // the whole warp leaves together
  } else {
    row = blockIdx.x;
    tid = threadIdx.x;
    nthreads = blockDim.x;
  }
  const int64_t t = row / p.inner, r = row % p.inner;
  const T* x = static_cast<const T*>(p.x) + t * p.x_stride0 + r * p.x_stride1;
  const T* res = p.residual ? static_cast<const T*>(p.residual) + t * p.r_stride0 + r * p.r_stride1 : nullptr;
  T* nres = p.new_residual ? static_cast<T*>(p.new_residual) + row * p.hidden : nullptr;
  const W* weight = static_cast<const W*>(p.weight);
  O* out = static_cast<O*>(p.out) + row * p.hidden;
  const int nvec = p.hidden / VEC;

  float cached[kNormCached][VEC];
  float ss = 0.f;
  auto first = [&](int i, float (&v)[VEC]) {
    load_f<T, VEC>(x + i * VEC, v);
    if (res != nullptr) {
      float b[VEC];
      load_f<T, VEC>(res + i * VEC, b);
#pragma unroll
      for (int j = 0; j < VEC; ++j) v[j] = round_to<T>(__fadd_rn(v[j], b[j]));
      store_f<T, VEC>(nres + i * VEC, v);
    }
#pragma unroll
    for (int j = 0; j < VEC; ++j) ss = __fadd_rn(ss, __fmul_rn(v[j], v[j]));
  };
#pragma unroll
  for (int k = 0; k < kNormCached; ++k) {
    const int i = tid + k * nthreads;
    if (i < nvec) first(i, cached[k]);
  }
  for (int i = tid + kNormCached * nthreads; i < nvec; i += nthreads) {
    float v[VEC];
    first(i, v);
  }

  ss = warp_sum(ss);
  if (!WARP_ROW) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nwarps = (blockDim.x + 31) / 32;
    if (lane == 0) partial[warp] = ss;
    __syncthreads();
    if (warp == 0) {
      float s = lane < nwarps ? partial[lane] : 0.f;
      s = warp_sum(s);
      if (lane == 0) partial[0] = s;
    }
    __syncthreads();
    ss = partial[0];
  }
  const float inv = rsqrtf(__fadd_rn(__fdiv_rn(ss, static_cast<float>(p.hidden)), p.eps));

  auto second = [&](int i, const float (&v)[VEC]) {
    float w[VEC], o[VEC];
    load_f<W, VEC>(weight + i * VEC, w);
#pragma unroll
    for (int j = 0; j < VEC; ++j) o[j] = __fmul_rn(w[j], round_to<T>(__fmul_rn(v[j], inv)));
    store_f<O, VEC>(out + i * VEC, o);
  };
#pragma unroll
  for (int k = 0; k < kNormCached; ++k) {
    const int i = tid + k * nthreads;
    if (i < nvec) second(i, cached[k]);
  }
  for (int i = tid + kNormCached * nthreads; i < nvec; i += nthreads) {
    float v[VEC];
    load_f<T, VEC>((res != nullptr ? nres : x) + i * VEC, v);  // this thread's own writes of pass 1
    second(i, v);
  }
}

// A warp per row serves many rows; a decode step's few rows get a block each, one vector a thread, so all of a
// row's loads are in flight at once (a lone warp looping over a SmolLM2 row of 576 took 4 us on the H200,
// bench/step.py --top-kernels). Rows one warp covers in a single pass stay warp per row.
constexpr int64_t kNormWarpRowMinRows = 132;

template <typename T, typename W, int VEC>
cudaError_t rms_norm_launch(const RmsNormParams& p, cudaStream_t stream) {
  const int nvec = p.hidden / VEC;
  if (nvec <= 32 * kNormCached && (nvec <= 32 || p.rows >= kNormWarpRowMinRows)) {
    const int64_t blocks = (p.rows + kNormWarpRows - 1) / kNormWarpRows;
    return launch(rms_norm_kernel<T, W, VEC, true>, static_cast<unsigned>(blocks), 32 * kNormWarpRows, stream,
                  p.pdl, p);
  }
  const int threads = nvec >= kNormMaxThreads ? kNormMaxThreads : (nvec + 31) / 32 * 32;
  return launch(rms_norm_kernel<T, W, VEC, false>, static_cast<unsigned>(p.rows), threads, stream, p.pdl, p);
}

bool aligned(const void* ptr, int bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }

template <typename T, typename W>
cudaError_t rms_norm_typed(const RmsNormParams& p, cudaStream_t stream) {
  constexpr int V = 16 / sizeof(T);
  using O = typename Promote<T, W>::type;
  bool vec = p.hidden % V == 0 && p.x_stride0 % V == 0 && p.x_stride1 % V == 0 && aligned(p.x, 16) &&
             aligned(p.weight, V * sizeof(W)) && aligned(p.out, V * sizeof(O));
  if (p.residual != nullptr)
    vec = vec && p.r_stride0 % V == 0 && p.r_stride1 % V == 0 && aligned(p.residual, 16) && aligned(p.new_residual, 16);
  return vec ? rms_norm_launch<T, W, V>(p, stream) : rms_norm_launch<T, W, 1>(p, stream);
}

template <typename T>
cudaError_t rms_norm_weight(const RmsNormParams& p, DType wd, cudaStream_t stream) {
  if (wd == kFloat32) return rms_norm_typed<T, float>(p, stream);
  if (wd == kFloat16) return rms_norm_typed<T, __half>(p, stream);
  return rms_norm_typed<T, __nv_bfloat16>(p, stream);
}

// ---- rotary embedding ------------------------------------------------------------------------------------------
// Items are (head of q or k, VEC pairs (i, i + half)), one a thread over a grid of (token, block of items): a decode
// step's ~450 items are one round of loads, where a 256-thread block a token walked them in two (Qwen3-8B on the
// H200: 4.7 -> 2.9 us a launch, bench/step.py --top-kernels). out_i = x_i*cos_i - x_{i+h}*sin_i,
// out_{i+h} = x_{i+h}*cos_{i+h} + x_i*sin_{i+h}, each product and the sum rounded to T as the eager code does.
// With a cache (p.k_cache): roped k rows are also stored at the token's slot, and further items copy v's VEC-wide
// chunks there, so rope and the K+V cache write are one launch.
// NORM (Qwen3): each head is RMS-normalised first. A head's `chunks` items are consecutive lanes of one warp (chunks
// divides 32 and blocks are whole warps), so they reduce its sum of squares with shuffles, in rms_norm_kernel's
// warp-per-row order: there lane i holds the row's vector i, here item c holds vectors c and c + chunks, and the
// warp's butterfly adds exactly those two first (the offsets above `chunks` add zeros), then halves down.
// (Loading the norm weights before the PDL wait measured slower: 4.56 against 4.51 ms a Qwen3-8B step.)
template <typename T, int VEC>
__device__ __forceinline__ void rms_norm_head(const T* weight, int c, int half, int chunks, float eps,
                                              float (&x1)[VEC], float (&x2)[VEC]) {
  // loaded first: their latency overlaps the reduction below
  const Pack<T, VEC> w1 = *reinterpret_cast<const Pack<T, VEC>*>(weight + c);
  const Pack<T, VEC> w2 = *reinterpret_cast<const Pack<T, VEC>*>(weight + half + c);
  float a = 0.f, b = 0.f;
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    a = __fadd_rn(a, __fmul_rn(x1[j], x1[j]));
    b = __fadd_rn(b, __fmul_rn(x2[j], x2[j]));
  }
  float ss = __fadd_rn(a, b);
  const unsigned lane = threadIdx.x & 31u;
  const unsigned group = chunks == 32 ? 0xffffffffu : ((1u << chunks) - 1u) << (lane & ~static_cast<unsigned>(chunks - 1));
  for (int off = chunks / 2; off > 0; off >>= 1) ss += __shfl_xor_sync(group, ss, off);
  const float inv = rsqrtf(__fadd_rn(__fdiv_rn(ss, static_cast<float>(2 * half)), eps));
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    x1[j] = round_to<T>(__fmul_rn(Num<T>::to_f(w1.v[j]), round_to<T>(__fmul_rn(x1[j], inv))));
    x2[j] = round_to<T>(__fmul_rn(Num<T>::to_f(w2.v[j]), round_to<T>(__fmul_rn(x2[j], inv))));
  }
}

// Items of one token: the rope items of its q and k heads, then (with a cache) the VEC-wide chunks of its v rows.
__host__ __device__ __forceinline__ int rope_items(const RopeParams& p, int vec, bool cached) {
  return (p.num_q_heads + p.num_k_heads) * (p.head_dim / 2 / vec) + (cached ? p.num_k_heads * p.head_dim / vec : 0);
}

template <typename T, int VEC, bool NORM>
__global__ void __launch_bounds__(256) rope_kernel(RopeParams p) {
  pdl_wait();  // q, k and v are the previous kernel's outputs
  pdl_trigger();
  const int64_t t = blockIdx.x;
  const int half = p.head_dim / 2, chunks = half / VEC, num_rope = (p.num_q_heads + p.num_k_heads) * chunks;
  const int it = blockIdx.y * blockDim.x + threadIdx.x;
  const int64_t slot = p.k_cache != nullptr ? p.slots[t] : -1;
  const int64_t cache_row = slot * p.num_k_heads * p.head_dim;
  if (it >= num_rope) {  // a chunk of v into the cache
    if (slot < 0 || it >= rope_items(p, VEC, true)) return;
    const int j = it - num_rope, h = j / (2 * chunks), c = (j % (2 * chunks)) * VEC;
    const T* src = static_cast<const T*>(p.v) + t * p.v_stride_t + h * p.v_stride_h + c;
    T* dst = static_cast<T*>(p.v_cache) + cache_row + h * p.head_dim + c;
    *reinterpret_cast<Pack<T, VEC>*>(dst) = *reinterpret_cast<const Pack<T, VEC>*>(src);
    return;
  }
  const int h = it / chunks, c = (it % chunks) * VEC;
  T* x = h < p.num_q_heads ? static_cast<T*>(p.q) + t * p.q_stride_t + h * p.q_stride_h
                           : static_cast<T*>(p.k) + t * p.k_stride_t + (h - p.num_q_heads) * p.k_stride_h;
  const T* cos = static_cast<const T*>(p.cos) + t * p.cos_stride_t;
  const T* sin = static_cast<const T*>(p.sin) + t * p.sin_stride_t;
  float x1[VEC], x2[VEC], c1[VEC], c2[VEC], s1[VEC], s2[VEC], o1[VEC], o2[VEC];
  load_f<T, VEC>(x + c, x1);
  load_f<T, VEC>(x + half + c, x2);
  load_f<T, VEC>(cos + c, c1);  // beside x, not after the norm's reduction: one round of loads
  load_f<T, VEC>(cos + half + c, c2);
  load_f<T, VEC>(sin + c, s1);
  load_f<T, VEC>(sin + half + c, s2);
  if constexpr (NORM)
    rms_norm_head<T, VEC>(static_cast<const T*>(h < p.num_q_heads ? p.q_norm : p.k_norm), c, half, chunks,
                          p.norm_eps, x1, x2);
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    o1[j] = __fsub_rn(round_to<T>(__fmul_rn(x1[j], c1[j])), round_to<T>(__fmul_rn(x2[j], s1[j])));
    o2[j] = __fadd_rn(round_to<T>(__fmul_rn(x2[j], c2[j])), round_to<T>(__fmul_rn(x1[j], s2[j])));
  }
  store_f<T, VEC>(x + c, o1);
  store_f<T, VEC>(x + half + c, o2);
  if (h >= p.num_q_heads && slot >= 0) {
    T* dst = static_cast<T*>(p.k_cache) + cache_row + (h - p.num_q_heads) * p.head_dim;
    store_f<T, VEC>(dst + c, o1);
    store_f<T, VEC>(dst + half + c, o2);
  }
}

template <typename T, int VEC, bool NORM>
cudaError_t rope_launch(const RopeParams& p, cudaStream_t stream) {
  const int items = rope_items(p, VEC, p.k_cache != nullptr);
  const int threads = items >= 256 ? 256 : (items + 31) / 32 * 32;
  const dim3 grid(static_cast<unsigned>(p.num_tokens), static_cast<unsigned>((items + threads - 1) / threads));
  return launch(rope_kernel<T, VEC, NORM>, grid, threads, stream, p.pdl, p);
}

template <typename T>
cudaError_t rope_typed(const RopeParams& p, cudaStream_t stream) {
  constexpr int V = 16 / sizeof(T);
  const int half = p.head_dim / 2;
  bool vec = half % V == 0 && p.q_stride_t % V == 0 && p.q_stride_h % V == 0 && p.k_stride_t % V == 0 &&
             p.k_stride_h % V == 0 && p.cos_stride_t % V == 0 && p.sin_stride_t % V == 0 && aligned(p.q, 16) &&
             aligned(p.k, 16) && aligned(p.cos, 16) && aligned(p.sin, 16);
  if (p.k_cache != nullptr)
    vec = vec && p.v_stride_t % V == 0 && p.v_stride_h % V == 0 && aligned(p.v, 16) && aligned(p.k_cache, 16) &&
          aligned(p.v_cache, 16);
  if (p.q_norm != nullptr) {
    const int chunks = half / V;
    if (!vec || chunks > 16 || (chunks & (chunks - 1)) != 0 || !aligned(p.q_norm, 16) || !aligned(p.k_norm, 16))
      return cudaErrorInvalidValue;
    return rope_launch<T, V, true>(p, stream);
  }
  return vec ? rope_launch<T, V, false>(p, stream) : rope_launch<T, 1, false>(p, stream);
}

// ---- SiLU and mul ----------------------------------------------------------------------------------------------
// out[t, i] = round(round(g / (1 + exp(-g))) * u) with g = x[t, i], u = x[t, inter + i] (torch's silu formula).
template <typename T, int VEC>
__global__ void __launch_bounds__(256) silu_and_mul_kernel(const T* __restrict__ x, int64_t x_stride,
                                                           T* __restrict__ out, int64_t rows, int inter) {
  const int chunks = inter / VEC;
  const int64_t total = rows * chunks;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = idx / chunks;
    const int c = static_cast<int>(idx % chunks) * VEC;
    float g[VEC], u[VEC], o[VEC];
    load_f<T, VEC>(x + t * x_stride + c, g);
    load_f<T, VEC>(x + t * x_stride + inter + c, u);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      o[j] = silu_times<T>(g[j], u[j]);
    }
    store_f<T, VEC>(out + t * inter + c, o);
  }
}

template <typename T>
cudaError_t silu_typed(const void* x, int64_t x_stride, void* out, int64_t rows, int inter, cudaStream_t stream) {
  constexpr int V = 16 / sizeof(T);
  const bool vec = inter % V == 0 && x_stride % V == 0 && aligned(x, 16) && aligned(out, 16);
  const int64_t total = rows * (vec ? inter / V : inter);
  const int64_t blocks = (total + 255) / 256;
  const unsigned grid = static_cast<unsigned>(blocks < 65536 ? blocks : 65536);
  const T* xi = static_cast<const T*>(x);
  T* o = static_cast<T*>(out);
  if (vec) silu_and_mul_kernel<T, V><<<grid, 256, 0, stream>>>(xi, x_stride, o, rows, inter);
  else silu_and_mul_kernel<T, 1><<<grid, 256, 0, stream>>>(xi, x_stride, o, rows, inter);
  return cudaGetLastError();
}

}  // namespace

cudaError_t rms_norm(const RmsNormParams& p, DType x_dtype, DType weight_dtype, cudaStream_t stream) {
  if (p.rows == 0 || p.hidden == 0) return cudaSuccess;
  if (x_dtype == kFloat32) return rms_norm_weight<float>(p, weight_dtype, stream);
  if (x_dtype == kFloat16) return rms_norm_weight<__half>(p, weight_dtype, stream);
  return rms_norm_weight<__nv_bfloat16>(p, weight_dtype, stream);
}

cudaError_t rope_inplace(const RopeParams& p, DType dtype, cudaStream_t stream) {
  if (p.num_tokens == 0 || p.head_dim < 2 || p.num_q_heads + p.num_k_heads == 0) return cudaSuccess;
  if (dtype == kFloat32) return rope_typed<float>(p, stream);
  if (dtype == kFloat16) return rope_typed<__half>(p, stream);
  return rope_typed<__nv_bfloat16>(p, stream);
}

cudaError_t silu_and_mul(const void* x, DType dtype, int64_t x_stride, void* out, int64_t rows, int inter,
                         cudaStream_t stream) {
  if (rows == 0 || inter == 0) return cudaSuccess;
  if (dtype == kFloat32) return silu_typed<float>(x, x_stride, out, rows, inter, stream);
  if (dtype == kFloat16) return silu_typed<__half>(x, x_stride, out, rows, inter, stream);
  return silu_typed<__nv_bfloat16>(x, x_stride, out, rows, inter, stream);
}

}  // namespace ddtree
