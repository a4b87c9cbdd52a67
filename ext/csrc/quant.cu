// Weight-quantized linear layers: the W4A16 GEMM for decode-sized batches (below), and FP8 activation quantization
// for the blockwise-scaled GEMM (engine/model/fp8_linear.py): each row's 128-column
// group is scaled so its largest magnitude maps to 448 (e4m3's maximum) and rounded to e4m3, in one launch. The
// output is what torch._scaled_mm's 1x128 scaling takes: q [padded_rows, K] row-major (rows past `rows` are
// zeros) and scales stored transposed, [K/128, padded_rows] contiguous (its .t() is outer-dim-major). The math is
// the reference's (ext/reference/quant.py) step by step with IEEE-rounded divisions, so both agree bit for bit.
#include <cuda_fp8.h>

#include "common.cuh"

namespace ddtree {

namespace {

constexpr int kGroup = 128;               // columns per scale
constexpr int kPerLane = kGroup / 32;     // one warp per (row, group)
constexpr float kFp8Max = 448.0f;

template <typename T>
__global__ void __launch_bounds__(256) quantize_fp8_kernel(const T* __restrict__ x, int64_t x_stride, int64_t rows,
                                                           int64_t padded_rows, int64_t groups, float amax_floor,
                                                           __nv_fp8_storage_t* __restrict__ q,
                                                           float* __restrict__ scale_t) {
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (warp >= padded_rows * groups) return;
  const int64_t row = warp / groups, group = warp % groups;
  const int64_t col = group * kGroup + lane * kPerLane;
  float v[kPerLane];
  float amax = 0.0f;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    v[j] = row < rows ? Num<T>::to_f(x[row * x_stride + col + j]) : 0.0f;
    amax = fmaxf(amax, fabsf(v[j]));
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  const float scale = __fdiv_rn(fmaxf(amax, amax_floor), kFp8Max);
  const int64_t width = groups * kGroup;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const float s = fminf(fmaxf(__fdiv_rn(v[j], scale), -kFp8Max), kFp8Max);
    q[row * width + col + j] = __nv_cvt_float_to_fp8(s, __NV_SATFINITE, __NV_E4M3);
  }
  if (lane == 0) scale_t[group * padded_rows + row] = scale;
}

template <typename T>
cudaError_t quantize_typed(const void* x, int64_t x_stride, int64_t rows, int64_t padded_rows, int64_t cols,
                           float amax_floor, void* q, float* scale_t, cudaStream_t stream) {
  const int64_t groups = cols / kGroup;
  const int64_t warps = padded_rows * groups;
  if (warps == 0) return cudaSuccess;
  const int64_t blocks = (warps * 32 + 255) / 256;
  quantize_fp8_kernel<T><<<static_cast<unsigned>(blocks), 256, 0, stream>>>(
      static_cast<const T*>(x), x_stride, rows, padded_rows, groups, amax_floor,
      static_cast<__nv_fp8_storage_t*>(q), scale_t);
  return cudaGetLastError();
}

}  // namespace

cudaError_t quantize_fp8_blockwise(const void* x, DType dtype, int64_t x_stride, int64_t rows, int64_t padded_rows,
                                   int64_t cols, float amax_floor, void* q, float* scale_t, cudaStream_t stream) {
  switch (dtype) {
    case kFloat32: return quantize_typed<float>(x, x_stride, rows, padded_rows, cols, amax_floor, q, scale_t, stream);
    case kFloat16: return quantize_typed<__half>(x, x_stride, rows, padded_rows, cols, amax_floor, q, scale_t, stream);
    case kBFloat16:
      return quantize_typed<__nv_bfloat16>(x, x_stride, rows, padded_rows, cols, amax_floor, q, scale_t, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace ddtree

// ---- W4A16: int4 weights (compressed-tensors pack-quantized), 16-bit activations ----------------------------------
namespace ddtree {

namespace {

constexpr int kW4Rows = 2;      // output rows per warp (each reuses its x loads across them)
constexpr int kW4Warps = 8;     // warps per block

// out[m, n] = sum_k x[m, k] * (q[n, k] * scale[n, k / group]) for m < rows <= M: q in -8..7, value k of row n at bits
// 4(k % 8).. of packed[n, k / 8] (stored as q + 8); each product is the reference's fp32 q * scale, summed in fp32.
template <typename T, int M>
__global__ void __launch_bounds__(kW4Warps * 32) w4a16_kernel(const T* __restrict__ x, int64_t x_stride, int rows,
                                                             const uint32_t* __restrict__ packed, int64_t words,
                                                             const float* __restrict__ scale, int64_t groups,
                                                             int64_t group_words, int64_t n_out, T* __restrict__ out) {
  const int lane = threadIdx.x % 32;
  const int64_t n0 = (static_cast<int64_t>(blockIdx.x) * kW4Warps + threadIdx.x / 32) * kW4Rows;
  if (n0 >= n_out) return;
  float acc[M][kW4Rows];
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int r = 0; r < kW4Rows; ++r) acc[m][r] = 0.0f;
  for (int64_t w = lane; w < words; w += 32) {
    float xv[M][8];
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
      for (int j = 0; j < 8; ++j) xv[m][j] = m < rows ? Num<T>::to_f(x[m * x_stride + w * 8 + j]) : 0.0f;
    const int64_t g = w / group_words;
#pragma unroll
    for (int r = 0; r < kW4Rows; ++r) {
      const int64_t n = n0 + r;
      if (n >= n_out) break;
      const uint32_t word = packed[n * words + w];
      const float s = scale[n * groups + g];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float wv = __fmul_rn(static_cast<float>(static_cast<int>((word >> (4 * j)) & 0xFu) - 8), s);
#pragma unroll
        for (int m = 0; m < M; ++m) acc[m][r] = fmaf(wv, xv[m][j], acc[m][r]);
      }
    }
  }
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int r = 0; r < kW4Rows; ++r) {
      float v = acc[m][r];
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
      if (lane == 0 && m < rows && n0 + r < n_out) out[m * n_out + n0 + r] = Num<T>::from_f(v);
    }
}

// nibble (stored q + 8) -> q as float, exactly: 2^23 + nibble as a float bit pattern, minus 2^23 + 8
__device__ __forceinline__ float int4_value(uint32_t word, int j) {
  return __int_as_float(0x4B000000u | ((word >> (4 * j)) & 0xFu)) - 8388616.0f;
}

constexpr int kW4VecRows = 4;  // output rows per warp in the vectorized kernel
constexpr int64_t kW4SplitBelow = 3072;  // output rows below which the vectorized kernel splits the row length

template <typename T> __device__ __forceinline__ void load8(const T* p, float (&out)[8]) {
  struct alignas(sizeof(T) * 8) P { T v[8]; };
  const P v = *reinterpret_cast<const P*>(p);
#pragma unroll
  for (int j = 0; j < 8; ++j) out[j] = Num<T>::to_f(v.v[j]);
}

// The same product for rows of 32-column multiples, 16-byte aligned: a warp computes 4 output rows; with SPLIT > 1,
// SPLIT warps of a block share those 4 rows' length (split-K inside the block, summed through shared memory), so
// narrow layers still keep every SM busy. Each lane reads 4 words (32 weights) per row per step with one 16-byte load (16 loads in
// flight), x 8 values at a time; per word the 8 products are summed, then scaled once: sum_j (q_j s) x_j ==
// s sum_j q_j x_j up to fp32 rounding.
template <typename T, int M, int SPLIT>
__global__ void __launch_bounds__(kW4Warps * 32) w4a16_vec_kernel(const T* __restrict__ x, int64_t x_stride, int rows,
                                                                 const uint4* __restrict__ packed, int64_t vecs,
                                                                 const float* __restrict__ scale, int64_t groups,
                                                                 int64_t group_words, int64_t n_out,
                                                                 T* __restrict__ out) {
  constexpr int kGroups = kW4Warps / SPLIT;  // row groups per block; SPLIT warps share each one's row length
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t n0 = (static_cast<int64_t>(blockIdx.x) * kGroups + warp / SPLIT) * kW4VecRows;
  if (SPLIT == 1 && n0 >= n_out) return;  // no block-wide sync below without split-K
  float acc[M][kW4VecRows];
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int r = 0; r < kW4VecRows; ++r) acc[m][r] = 0.0f;
  for (int64_t v = (warp % SPLIT) * 32 + lane; v < vecs; v += SPLIT * 32) {
    uint4 w[kW4VecRows];
#pragma unroll
    for (int r = 0; r < kW4VecRows; ++r)
      w[r] = n0 + r < n_out ? packed[(n0 + r) * vecs + v] : make_uint4(0x88888888u, 0x88888888u, 0x88888888u, 0x88888888u);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t word = v * 4 + i;
      float wf[kW4VecRows][8], s[kW4VecRows];
#pragma unroll
      for (int r = 0; r < kW4VecRows; ++r) {
        const uint32_t u = i == 0 ? w[r].x : i == 1 ? w[r].y : i == 2 ? w[r].z : w[r].w;
        s[r] = n0 + r < n_out ? scale[(n0 + r) * groups + word / group_words] : 0.0f;
#pragma unroll
        for (int j = 0; j < 8; ++j) wf[r][j] = int4_value(u, j);
      }
#pragma unroll
      for (int m = 0; m < M; ++m) {
        if (m >= rows) break;
        float xv[8];
        load8<T>(x + m * x_stride + word * 8, xv);
#pragma unroll
        for (int r = 0; r < kW4VecRows; ++r) {
          float d = 0.0f;
#pragma unroll
          for (int j = 0; j < 8; ++j) d = fmaf(wf[r][j], xv[j], d);
          acc[m][r] = fmaf(s[r], d, acc[m][r]);
        }
      }
    }
  }
  if constexpr (SPLIT == 1) {
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
      for (int r = 0; r < kW4VecRows; ++r) {
        float v = acc[m][r];
#pragma unroll
        for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
        if (lane == 0 && m < rows && n0 + r < n_out) out[m * n_out + n0 + r] = Num<T>::from_f(v);
      }
  } else {
    __shared__ float partial[kW4Warps][M][kW4VecRows];
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
      for (int r = 0; r < kW4VecRows; ++r) {
        float v = acc[m][r];
#pragma unroll
        for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
        if (lane == 0) partial[warp][m][r] = v;
      }
    __syncthreads();
    for (int idx = threadIdx.x; idx < kGroups * M * kW4VecRows; idx += kW4Warps * 32) {
      const int group = idx / (M * kW4VecRows), m = idx / kW4VecRows % M, r = idx % kW4VecRows;
      const int64_t n = (static_cast<int64_t>(blockIdx.x) * kGroups + group) * kW4VecRows + r;
      float v = 0.0f;
#pragma unroll
      for (int w = 0; w < SPLIT; ++w) v += partial[group * SPLIT + w][m][r];
      if (m < rows && n < n_out) out[m * n_out + n] = Num<T>::from_f(v);
    }
  }
}

// out [n_out, 8 * words] = q * scale in T (each product fp32-rounded, then rounded to T: the reference's steps)
template <typename T>
__global__ void __launch_bounds__(256) int4_dequant_kernel(const uint32_t* __restrict__ packed, int64_t words,
                                                           const float* __restrict__ scale, int64_t groups,
                                                           int64_t group_words, int64_t total, T* __restrict__ out) {
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t n = idx / words, w = idx % words;
    const uint32_t u = packed[idx];
    const float s = scale[n * groups + w / group_words];
    struct alignas(sizeof(T) * 8) P { T v[8]; } o;
#pragma unroll
    for (int j = 0; j < 8; ++j) o.v[j] = Num<T>::from_f(__fmul_rn(int4_value(u, j), s));
    *reinterpret_cast<P*>(out + idx * 8) = o;
  }
}

template <typename T, int M>
cudaError_t w4a16_launch(const void* x, int64_t x_stride, int rows, const void* packed, int64_t words,
                         const float* scale, int64_t groups, int64_t group_words, int64_t n_out, void* out,
                         cudaStream_t stream) {
  const bool vec = words % 4 == 0 && x_stride % 8 == 0 && reinterpret_cast<uintptr_t>(x) % (8 * sizeof(T)) == 0 &&
                   reinterpret_cast<uintptr_t>(packed) % 16 == 0;
  if (vec) {
    // measured on the H200: a warp per 4 rows over the whole row length wins from ~4k output rows; below, too few
    // warps are in flight, and 8 warps split each 4 rows' length (split-K)
    const int64_t groups_of_rows = (n_out + kW4VecRows - 1) / kW4VecRows;
    const uint4* p = static_cast<const uint4*>(packed);
    if (n_out < kW4SplitBelow) {
      w4a16_vec_kernel<T, M, kW4Warps><<<static_cast<unsigned>(groups_of_rows), kW4Warps * 32, 0, stream>>>(
          static_cast<const T*>(x), x_stride, rows, p, words / 4, scale, groups, group_words, n_out, static_cast<T*>(out));
    } else {
      const int64_t blocks = (groups_of_rows + kW4Warps - 1) / kW4Warps;
      w4a16_vec_kernel<T, M, 1><<<static_cast<unsigned>(blocks), kW4Warps * 32, 0, stream>>>(
          static_cast<const T*>(x), x_stride, rows, p, words / 4, scale, groups, group_words, n_out, static_cast<T*>(out));
    }
    return cudaGetLastError();
  }
  const int64_t warps = (n_out + kW4Rows - 1) / kW4Rows;
  const int64_t blocks = (warps + kW4Warps - 1) / kW4Warps;
  w4a16_kernel<T, M><<<static_cast<unsigned>(blocks), kW4Warps * 32, 0, stream>>>(
      static_cast<const T*>(x), x_stride, rows, static_cast<const uint32_t*>(packed), words, scale, groups,
      group_words, n_out, static_cast<T*>(out));
  return cudaGetLastError();
}

template <typename T>
cudaError_t w4a16_typed(const void* x, int64_t x_stride, int rows, const void* packed, int64_t words,
                        const float* scale, int64_t groups, int64_t group_words, int64_t n_out, void* out,
                        cudaStream_t stream) {
  if (rows <= 1) return w4a16_launch<T, 1>(x, x_stride, rows, packed, words, scale, groups, group_words, n_out, out, stream);
  if (rows <= 2) return w4a16_launch<T, 2>(x, x_stride, rows, packed, words, scale, groups, group_words, n_out, out, stream);
  if (rows <= 4) return w4a16_launch<T, 4>(x, x_stride, rows, packed, words, scale, groups, group_words, n_out, out, stream);
  return w4a16_launch<T, 8>(x, x_stride, rows, packed, words, scale, groups, group_words, n_out, out, stream);
}

}  // namespace

cudaError_t w4a16_gemm(const void* x, DType dtype, int64_t x_stride, int rows, const void* packed, int64_t words,
                       const float* scale, int64_t groups, int64_t group_words, int64_t n_out, void* out,
                       cudaStream_t stream) {
  if (rows == 0 || n_out == 0) return cudaSuccess;
  if (rows > kW4A16MaxRows) return cudaErrorInvalidValue;
  switch (dtype) {
    case kFloat32: return w4a16_typed<float>(x, x_stride, rows, packed, words, scale, groups, group_words, n_out, out, stream);
    case kFloat16: return w4a16_typed<__half>(x, x_stride, rows, packed, words, scale, groups, group_words, n_out, out, stream);
    case kBFloat16:
      return w4a16_typed<__nv_bfloat16>(x, x_stride, rows, packed, words, scale, groups, group_words, n_out, out, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t int4_dequantize(const void* packed, int64_t n_out, int64_t words, const float* scale, int64_t groups,
                            int64_t group_words, void* out, DType dtype, cudaStream_t stream) {
  const int64_t total = n_out * words;
  if (total == 0) return cudaSuccess;
  const int64_t blocks = (total + 255) / 256;
  const unsigned grid = static_cast<unsigned>(blocks < 65536 ? blocks : 65536);
  const uint32_t* p = static_cast<const uint32_t*>(packed);
  switch (dtype) {
    case kFloat32:
      int4_dequant_kernel<float><<<grid, 256, 0, stream>>>(p, words, scale, groups, group_words, total, static_cast<float*>(out));
      break;
    case kFloat16:
      int4_dequant_kernel<__half><<<grid, 256, 0, stream>>>(p, words, scale, groups, group_words, total, static_cast<__half*>(out));
      break;
    case kBFloat16:
      int4_dequant_kernel<__nv_bfloat16><<<grid, 256, 0, stream>>>(p, words, scale, groups, group_words, total,
                                                                  static_cast<__nv_bfloat16*>(out));
      break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace ddtree
