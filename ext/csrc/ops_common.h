// Helpers shared by the torch-facing files (ops.cpp, ops_layers.cpp): input checks, dtype mapping, launch error
// reporting, the current stream. Torch headers are fine here; the .cu kernel files never include this.
#pragma once
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <cstdlib>
#include <string>

#include "kernels.h"

#define CHECK_CUDA(x) TORCH_CHECK((x).is_cuda(), "ddtree: " #x " must be a CUDA tensor")
#define CHECK_TYPE(x, t) TORCH_CHECK((x).scalar_type() == (t), "ddtree: " #x " must be " #t ", got ", (x).scalar_type())

namespace ddtree_ops {

inline ddtree::DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return ddtree::kFloat32;
    case at::kHalf: return ddtree::kFloat16;
    case at::kBFloat16: return ddtree::kBFloat16;
    default: TORCH_CHECK(false, "ddtree: unsupported dtype ", t.scalar_type());
  }
}

inline void check(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, "ddtree::", op, " launch failed: ", cudaGetErrorString(err));
}

inline cudaStream_t stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

inline int num_sms() {
  int device = 0, sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  return sms > 0 ? sms : 1;
}

inline int compute_major() {
  int device = 0, major = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  return major;
}

inline int compute_minor() {
  int device = 0, minor = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  return minor;
}

// A per-device switch, decided once per device by `decide` (it is asked on every launch): unless the
// environment variable `env` is "0" (A/B measurements), decide() says whether the device takes the feature.
template <typename Decide>
inline bool device_switch(int (&cached)[64], const char* env, Decide decide) {  // cached: 0 not asked, 1 off, 2 on
  int device = 0;
  cudaGetDevice(&device);
  if (device < 0 || device >= 64) return false;
  if (cached[device] == 0) {
    const char* value = std::getenv(env);
    cached[device] = !(value != nullptr && std::string(value) == "0") && decide() ? 2 : 1;
  }
  return cached[device] == 2;
}

// The attention's warpgroup-MMA tiles (attention_mma.cuh, WG): on compute capability 9.0 with a library holding
// sm_90a machine code, unless DDTREE_WGMMA=0. A 9.0 device without it says so once: its tiles past 64 rows then
// run as mma.sync.
inline bool wgmma_enabled() {
  static int cached[64] = {};
  return device_switch(cached, "DDTREE_WGMMA", [] {
    const bool hopper = compute_major() == 9 && compute_minor() == 0;
    if (hopper && !ddtree::attn_wgmma_built())
      TORCH_WARN_ONCE("ddtree: this CUDA extension was built without sm_90a (DDTREE_CUDA_ARCH_LIST lacks 9.0a), so "
                      "tree-verify and prefill attention run mma.sync tiles, not warpgroup MMAs");
    return hopper && ddtree::attn_wgmma_built();
  });
}

// Programmatic dependent launch (common.cuh) for the layer kernels: on sm_90 and newer unless DDTREE_PDL=0.
inline bool pdl_enabled() {
  static int cached[64] = {};
  return device_switch(cached, "DDTREE_PDL", [] { return compute_major() >= 9; });
}

inline bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

}  // namespace ddtree_ops
