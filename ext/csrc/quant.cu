// FP8 activation quantization for the blockwise-scaled GEMM (engine/model/fp8_linear.py): each row's 128-column
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
