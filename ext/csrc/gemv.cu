// Dense GEMV for a few rows (decoding at small batch): out[m, n] = sum_k x[m, k] w[n, k] (+ bias[n]) for
// m < rows <= kGemvMaxRows, bf16/fp16 in and out, fp32 accumulation. At these shapes a GEMM is bound by launch and
// memory latency, not by its math (cuBLAS spends ~3.7 us on any small one on the H200): one warp per output row
// streams the weight row with 16-byte loads, kGemvUnroll of them in flight per lane, and reduces with shuffles.
//
// The SiLU-and-mul variant reads w as [gate; up] ([2 I, K]): the warp of output n computes gate row n and up row
// I + n, rounds both to T (the projection's output dtype) and applies silu_and_mul's rounding steps, so it equals
// silu_and_mul(gemv(x, w)) bit for bit.
//
// Launched as a programmatic dependent (p.pdl, sm_90): blocks become resident while the kernel producing x still
// runs; with weights up to kGemvPrefetchMaxBytes they also prefetch the start of their weight rows into L2 first.
#include "common.cuh"
#include "kernels.h"

namespace ddtree {

namespace {

constexpr int kGemvWarps = 4;   // warps (output rows) per block: small blocks spread short outputs over many SMs
constexpr int kGemvUnroll = 4;  // 16-byte weight loads in flight per lane
// Weights up to this size prefetch into L2 before waiting (a decode step of a small model is a chain of
// few-microsecond kernels, where starting early pays). Larger ones only launch early: on the H200 a Qwen3-8B step
// (bench/step.py, L = 512) took 4.68 ms with no prefetch, 4.68 with 512 bytes a row and 4.82 with 2 KB a row
// (their first wave's prefetch competes with the running kernel's stream and L2). Loading the first 2 KB of each
// row into registers before waiting did not pay either: 4.74 ms against 4.66, and 5.15 when the RMSNorm and rope
// launches also released their dependents before waiting (docs/BENCHMARKS.md, 2026-12-03 08:54). Nor did the
// output projection pulling its whole weight into L2 (one bulk prefetch a row) while attention runs: 4.63 / 4.65
// ms against 4.58 / 4.56, attention and rope slower by ~2 us a layer and the GEMV no faster (2026-12-03 13:20).
// A grid capped at 16 blocks an SM whose warps stride over the rows, with 8 loads in flight a lane for one row of x,
// was measured and dropped: 4.44-4.54 against 4.64-4.69 ms on one machine, 4.56-4.62 against 4.46-4.52 on another
// (2026-12-04, docs/BENCHMARKS.md).
constexpr int64_t kGemvPrefetchMaxBytes = int64_t{8} << 20;

template <typename T>
__device__ __forceinline__ float dot8(const uint4& a, const uint4& b, float acc) {
  const T* av = reinterpret_cast<const T*>(&a);
  const T* bv = reinterpret_cast<const T*>(&b);
#pragma unroll
  for (int j = 0; j < 8; ++j) acc = fmaf(Num<T>::to_f(av[j]), Num<T>::to_f(bv[j]), acc);
  return acc;
}

template <typename T, int M, bool SILU>
__global__ void __launch_bounds__(kGemvWarps * 32) gemv_kernel(const GemvParams p) {
  constexpr int R = SILU ? 2 : 1;  // weight rows per warp
  const int lane = threadIdx.x & 31;
  const int64_t n = static_cast<int64_t>(blockIdx.x) * kGemvWarps + threadIdx.x / 32;
  if (n >= p.n_out) return;  // the whole warp leaves together
  const int vecs = static_cast<int>(p.k / 8);
  const T* w = static_cast<const T*>(p.w);
  const uint4* wrow[R];
  wrow[0] = reinterpret_cast<const uint4*>(w + n * p.k);
  if constexpr (SILU) wrow[1] = reinterpret_cast<const uint4*>(w + (n + p.n_out) * p.k);
  // the weight is no earlier kernel's output: its first loads head for L2 before x (the previous kernel's
  // output) may be read
  if (p.prefetch) {
#pragma unroll
    for (int u = 0; u < kGemvUnroll; ++u)
#pragma unroll
      for (int r = 0; r < R; ++r)
        if (lane + 32 * u < vecs) prefetch_l2(wrow[r] + lane + 32 * u);
  }
  pdl_wait();
  pdl_trigger();
  const T* x = static_cast<const T*>(p.x);
  float acc[M][R];
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int r = 0; r < R; ++r) acc[m][r] = 0.f;

  int v = lane;
  for (; v + 32 * (kGemvUnroll - 1) < vecs; v += 32 * kGemvUnroll) {
    uint4 wv[kGemvUnroll][R];
#pragma unroll
    for (int u = 0; u < kGemvUnroll; ++u)
#pragma unroll
      for (int r = 0; r < R; ++r) wv[u][r] = __ldg(wrow[r] + v + 32 * u);
#pragma unroll
    for (int m = 0; m < M; ++m) {
      if (m >= p.rows) break;
      const uint4* xrow = reinterpret_cast<const uint4*>(x + m * p.x_stride);
#pragma unroll
      for (int u = 0; u < kGemvUnroll; ++u) {
        const uint4 xv = xrow[v + 32 * u];
#pragma unroll
        for (int r = 0; r < R; ++r) acc[m][r] = dot8<T>(wv[u][r], xv, acc[m][r]);
      }
    }
  }
  for (; v < vecs; v += 32) {
    uint4 wv[R];
#pragma unroll
    for (int r = 0; r < R; ++r) wv[r] = __ldg(wrow[r] + v);
#pragma unroll
    for (int m = 0; m < M; ++m) {
      if (m >= p.rows) break;
      const uint4 xv = reinterpret_cast<const uint4*>(x + m * p.x_stride)[v];
#pragma unroll
      for (int r = 0; r < R; ++r) acc[m][r] = dot8<T>(wv[r], xv, acc[m][r]);
    }
  }

  T* out = static_cast<T*>(p.out);
#pragma unroll
  for (int m = 0; m < M; ++m) {
    if (m >= p.rows) break;
    float total[R];
#pragma unroll
    for (int r = 0; r < R; ++r) total[r] = warp_sum(acc[m][r]);
    if (lane != m % 32) continue;
    out[m * p.out_stride + n] = Num<T>::from_f(few_rows_value<T, SILU>(total, p, n));
  }
}

template <typename T, bool SILU>
cudaError_t gemv_typed(GemvParams p, cudaStream_t stream) {
  const unsigned blocks = static_cast<unsigned>((p.n_out + kGemvWarps - 1) / kGemvWarps);
  const dim3 block(kGemvWarps * 32);
  p.prefetch = p.pdl && p.n_out * (SILU ? 2 : 1) * p.k * static_cast<int64_t>(sizeof(T)) <= kGemvPrefetchMaxBytes;
  if (p.rows <= 1) return launch(gemv_kernel<T, 1, SILU>, blocks, block, stream, p.pdl, p);
  if (p.rows <= 2) return launch(gemv_kernel<T, 2, SILU>, blocks, block, stream, p.pdl, p);
  if (p.rows <= 4) return launch(gemv_kernel<T, 4, SILU>, blocks, block, stream, p.pdl, p);
  return launch(gemv_kernel<T, kGemvMaxRows, SILU>, blocks, block, stream, p.pdl, p);
}

}  // namespace

cudaError_t gemv(const GemvParams& p, DType dtype, bool silu_mul, cudaStream_t stream) {
  if (p.rows < 1 || p.rows > kGemvMaxRows || p.k % 8 != 0 || p.x_stride % 8 != 0 || (silu_mul && p.bias != nullptr))
    return cudaErrorInvalidValue;
  if (p.n_out == 0) return cudaSuccess;
  if (dtype == kBFloat16) return silu_mul ? gemv_typed<__nv_bfloat16, true>(p, stream) : gemv_typed<__nv_bfloat16, false>(p, stream);
  if (dtype == kFloat16) return silu_mul ? gemv_typed<__half, true>(p, stream) : gemv_typed<__half, false>(p, stream);
  return cudaErrorNotSupported;
}

}  // namespace ddtree
