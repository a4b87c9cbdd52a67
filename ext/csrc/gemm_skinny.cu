// Tensor-core GEMM for a few rows (tree verify, small decode batches): out[m, n] = sum_k x[m, k] w[n, k] (+ bias[n])
// for m < rows <= kSkinnyMaxRows, bf16/fp16 in and out, fp32 accumulation. At 3-32 rows the product is still bound by
// reading w (or by latency), but the CUDA-core GEMV (gemv.cu) runs out of FMA throughput (17 rows: ~17 flops a
// weight byte against the H200's ~14 fp32 flops per byte of HBM bandwidth; at 8 rows it already takes 2-5x
// cuBLAS's time), and cuBLAS spends 3.6-6 us on any small product (docs/BENCHMARKS.md, 2026-12-04). Here the weight
// is the mma's A operand (16 output features a warp) and x the B operand (8 rows a tile, up to 4 tiles), both loaded
// straight from global memory into fragments:
//
//  - k is permuted inside each 32-wide chunk so that a lane's fragment slots hold 8 consecutive elements of a row:
//    lane (g = lane / 4, t = lane % 4) loads w[n0 + g, 32c + 8t .. +8) and w[n0 + g + 8, ...] as 16-byte vectors,
//    and x[8j + g, 32c + 8t .. +8) for tile j. Logical k 2t+e of the first k16 mma is physical 8t+e, logical
//    2t+8+e is 8t+2+e; the second mma takes 8t+4.. and 8t+6... A and B agree on the map, so the dot products are
//    the same sums in another order.
//  - the block's kSkWarps warps split k (chunk c goes to warp c % kSkWarps, so together they stream 512 contiguous
//    bytes of every row, and the split does not depend on the unroll: the SiLU variant sums in the same order) and
//    add their partial sums through shared memory in warp order: a row's result does not depend on the other rows
//    or on how many there are.
//  - a warp loads U chunks of weight (128 bytes a lane) into registers before their mma; the last group is
//    predicated, so a short k (576: 2-3 chunks a warp) still has all its loads in flight at once. (A cp.async ring
//    of 4 stages a warp instead was slower everywhere: 1.15-1.6x cuBLAS on Qwen3-8B's projections at 17 rows;
//    groups of U consecutive chunks a warp were slower on long k; docs/BENCHMARKS.md. Also measured in a copy of
//    this kernel, 2026-12-04: the next group's weights loaded while this group's mma run, 3 or 4 blocks an SM in
//    the launch bounds, and 32 features a block, so two weight tiles share each x fragment: none was faster on
//    the shapes routed here; 32 features a block gained only on weights of 50 MB and more at 17-32 rows, which
//    cuBLAS still serves faster.)
//
// The SiLU-and-mul variant reads w as [gate; up] ([2 I, K]): the warp holds gate rows n0.. and up rows I + n0..,
// rounds both sums to T and applies silu_and_mul's rounding steps, so it equals silu_and_mul of the plain product.
#include "common.cuh"
#include "kernels.h"

namespace ddtree {

namespace {

constexpr int kSkWarps = 8;     // warps of a block, splitting k
constexpr int kSkFeatures = 16; // output features of a block (the mma's M)

// acc [16 features x 8 rows] += w chunk (rows g and g + 8: lo, hi) x x chunk (row g of the tile: b), 32 k.
template <typename T>
__device__ __forceinline__ void mma_chunk(float (&acc)[4], const uint4& lo, const uint4& hi, const uint4& b) {
  const uint32_t first[4] = {lo.x, hi.x, lo.y, hi.y};
  mma16816<T>(acc, first, b.x, b.y);
  const uint32_t second[4] = {lo.z, hi.z, lo.w, hi.w};
  mma16816<T>(acc, second, b.z, b.w);
}

template <typename T, int NT, bool SILU>
__global__ void __launch_bounds__(kSkWarps * 32, 2) gemm_skinny_kernel(const GemvParams p) {
  constexpr int R = SILU ? 2 : 1;  // weight row groups a warp holds (gate, up)
  constexpr int U = SILU ? 2 : 4;  // chunks a warp loads at once: 128 bytes of weight a lane
  __shared__ float partial[kSkWarps][kSkFeatures * R][8 * NT + 1];  // +1: the sum below reads a column conflict-free
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kSkFeatures;
  const T* w = static_cast<const T*>(p.w);
  const uint4* wrow[R][2];  // [group][g, g + 8], advanced to this lane's 16 bytes of a chunk
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t n = min(n0 + g + 8 * h, p.n_out - 1);  // features past n_out compute a discarded copy
      wrow[r][h] = reinterpret_cast<const uint4*>(w + (n + r * p.n_out) * p.k) + t;
    }
  pdl_wait();
  pdl_trigger();
  const T* x = static_cast<const T*>(p.x);
  const uint4* xrow[NT];
  bool live[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const int m = 8 * j + g;
    live[j] = m < p.rows;
    xrow[j] = reinterpret_cast<const uint4*>(x + static_cast<int64_t>(live[j] ? m : 0) * p.x_stride) + t;
  }
  float acc[R][NT][4];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[r][j][e] = 0.f;

  const int chunks = static_cast<int>(p.k / 32);
  // U chunks of weight in registers, then their mma: chunk c0 + kSkWarps * u for u < U, those below `chunks`
  auto group = [&](int c0, bool full) {  // inlined twice: `full` is a constant at each call
    uint4 a[U][R][2];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const bool in = full || c0 + kSkWarps * u < chunks;
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int h = 0; h < 2; ++h) a[u][r][h] = in ? __ldg(wrow[r][h] + 4 * (c0 + kSkWarps * u)) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + kSkWarps * u;
      if (!full && c >= chunks) break;
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const uint4 b = live[j] ? xrow[j][4 * c] : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int r = 0; r < R; ++r) mma_chunk<T>(acc[r][j], a[u][r][0], a[u][r][1], b);
      }
    }
  };
  int c0 = warp;
  for (; c0 + kSkWarps * (U - 1) < chunks; c0 += kSkWarps * U) group(c0, true);
  if (c0 < chunks) group(c0, false);  // the last, partial group: its loads still go out together

  // accumulator e of tile j: feature g + 8 (e / 2), row 8j + 2t + e % 2
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) partial[warp][r * kSkFeatures + g + 8 * (e >> 1)][8 * j + 2 * t + (e & 1)] = acc[r][j][e];
  __syncthreads();

  T* out = static_cast<T*>(p.out);
  for (int i = threadIdx.x; i < kSkFeatures * p.rows; i += kSkWarps * 32) {
    const int f = i % kSkFeatures, m = i / kSkFeatures;  // consecutive threads: consecutive features of a row
    const int64_t n = n0 + f;
    if (n >= p.n_out) continue;
    float total[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      total[r] = 0.f;
#pragma unroll
      for (int v = 0; v < kSkWarps; ++v) total[r] += partial[v][r * kSkFeatures + f][m];
    }
    out[m * p.out_stride + n] = Num<T>::from_f(few_rows_value<T, SILU>(total, p, n));
  }
}

template <typename T, bool SILU>
cudaError_t gemm_skinny_typed(const GemvParams& p, cudaStream_t stream) {
  const unsigned blocks = static_cast<unsigned>((p.n_out + kSkFeatures - 1) / kSkFeatures);
  const dim3 block(kSkWarps * 32);
  if (p.rows <= 8) return launch(gemm_skinny_kernel<T, 1, SILU>, blocks, block, stream, p.pdl, p);
  if (p.rows <= 16) return launch(gemm_skinny_kernel<T, 2, SILU>, blocks, block, stream, p.pdl, p);
  if (p.rows <= 24) return launch(gemm_skinny_kernel<T, 3, SILU>, blocks, block, stream, p.pdl, p);
  return launch(gemm_skinny_kernel<T, 4, SILU>, blocks, block, stream, p.pdl, p);
}

}  // namespace

cudaError_t gemm_skinny(const GemvParams& p, DType dtype, bool silu_mul, cudaStream_t stream) {
  if (p.rows < 1 || p.rows > kSkinnyMaxRows || p.k % 32 != 0 || p.x_stride % 8 != 0 || (silu_mul && p.bias != nullptr))
    return cudaErrorInvalidValue;
  if (p.n_out == 0) return cudaSuccess;
  if (dtype == kBFloat16)
    return silu_mul ? gemm_skinny_typed<__nv_bfloat16, true>(p, stream) : gemm_skinny_typed<__nv_bfloat16, false>(p, stream);
  if (dtype == kFloat16) return silu_mul ? gemm_skinny_typed<__half, true>(p, stream) : gemm_skinny_typed<__half, false>(p, stream);
  return cudaErrorNotSupported;
}

}  // namespace ddtree
