// The torch side of the sampling ops (kernels in sampling.cu and sampling_filter.cu): the token per row, the
// top-k / top-p floor per row and the rows' counter-based uniforms. Their schemas are a TORCH_LIBRARY_FRAGMENT of
// the `ddtree` namespace that ops.cpp defines; fakes in ext/fake.py. None synchronizes with the host (CUDA-graph
// safe).
#include <torch/library.h>

#include "ops_common.h"

namespace {

using at::Tensor;
using namespace ddtree_ops;

Tensor sample_tokens(Tensor logits, Tensor temperature, Tensor min_p, Tensor uniform) {
  CHECK_CUDA(logits); CHECK_CUDA(temperature); CHECK_CUDA(min_p); CHECK_CUDA(uniform);
  CHECK_TYPE(temperature, at::kFloat); CHECK_TYPE(min_p, at::kFloat); CHECK_TYPE(uniform, at::kDouble);
  TORCH_CHECK(logits.dim() == 2, "ddtree::sample_tokens: logits must be [rows, V]");
  const int64_t R = logits.size(0), V = logits.size(1);
  TORCH_CHECK(temperature.dim() == 1 && temperature.size(0) == R && min_p.dim() == 1 && min_p.size(0) == R &&
              uniform.dim() == 1 && uniform.size(0) == R,
              "ddtree::sample_tokens: temperature, min_p and uniform must be [rows]");
  TORCH_CHECK(temperature.device() == logits.device() && min_p.device() == logits.device() &&
              uniform.device() == logits.device(), "ddtree::sample_tokens: all inputs must be on the logits' device");
  TORCH_CHECK(R < (int64_t{1} << 31) && V <= ddtree::kSampleMaxVocab, "ddtree::sample_tokens: too many rows or tokens");
  c10::cuda::CUDAGuard guard(logits.device());
  Tensor out = at::empty({R}, logits.options().dtype(at::kLong));
  if (R == 0) return out;
  TORCH_CHECK(V > 0, "ddtree::sample_tokens: empty vocabulary");
  Tensor x = logits.contiguous(), t = temperature.contiguous(), mp = min_p.contiguous(), u = uniform.contiguous();
  check(ddtree::sample_tokens(x.data_ptr(), dtype_of(x), static_cast<int>(R), static_cast<int>(V), t.data_ptr<float>(),
                              mp.data_ptr<float>(), u.data_ptr<double>(), out.data_ptr<int64_t>(), stream()),
        "sample_tokens");
  return out;
}

Tensor seeded_uniforms(Tensor seeds, Tensor indices) {
  CHECK_CUDA(seeds); CHECK_CUDA(indices);
  CHECK_TYPE(seeds, at::kLong); CHECK_TYPE(indices, at::kLong);
  TORCH_CHECK(seeds.dim() == 1 && indices.dim() == 1 && seeds.size(0) == indices.size(0),
              "ddtree::seeded_uniforms: seeds and indices must be [rows]");
  TORCH_CHECK(seeds.device() == indices.device(), "ddtree::seeded_uniforms: seeds and indices on different devices");
  const int64_t R = seeds.size(0);
  TORCH_CHECK(R < (int64_t{1} << 31), "ddtree::seeded_uniforms: too many rows");
  c10::cuda::CUDAGuard guard(seeds.device());
  Tensor out = at::empty({R}, seeds.options().dtype(at::kDouble));
  Tensor s = seeds.contiguous(), i = indices.contiguous();
  check(ddtree::seeded_uniforms(s.data_ptr<int64_t>(), i.data_ptr<int64_t>(), static_cast<int>(R),
                                out.data_ptr<double>(), stream()),
        "seeded_uniforms");
  return out;
}

Tensor top_k_top_p_floor(Tensor logits, Tensor top_k, Tensor top_p) {
  CHECK_CUDA(logits); CHECK_CUDA(top_k); CHECK_CUDA(top_p);
  CHECK_TYPE(top_k, at::kLong); CHECK_TYPE(top_p, at::kFloat);
  TORCH_CHECK(logits.dim() == 2, "ddtree::top_k_top_p_floor: logits must be [rows, V]");
  const int64_t R = logits.size(0), V = logits.size(1);
  TORCH_CHECK(top_k.dim() == 1 && top_k.size(0) == R && top_p.dim() == 1 && top_p.size(0) == R,
              "ddtree::top_k_top_p_floor: top_k and top_p must be [rows]");
  TORCH_CHECK(top_k.device() == logits.device() && top_p.device() == logits.device(),
              "ddtree::top_k_top_p_floor: all inputs must be on the logits' device");
  TORCH_CHECK(R < (int64_t{1} << 31) && V <= ddtree::kSampleMaxVocab, "ddtree::top_k_top_p_floor: too many rows or tokens");
  c10::cuda::CUDAGuard guard(logits.device());
  Tensor out = at::empty({R}, logits.options().dtype(at::kFloat));
  if (R == 0) return out;
  TORCH_CHECK(V > 0, "ddtree::top_k_top_p_floor: empty vocabulary");
  Tensor x = logits.contiguous(), k = top_k.contiguous(), p = top_p.contiguous();
  check(ddtree::top_k_top_p_floor(x.data_ptr(), dtype_of(x), static_cast<int>(R), static_cast<int>(V),
                                  k.data_ptr<int64_t>(), p.data_ptr<float>(), out.data_ptr<float>(), stream()),
        "top_k_top_p_floor");
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ddtree, m) {
  m.def("sample_tokens(Tensor logits, Tensor temperature, Tensor min_p, Tensor uniform) -> Tensor");
  m.def("top_k_top_p_floor(Tensor logits, Tensor top_k, Tensor top_p) -> Tensor");
  m.def("seeded_uniforms(Tensor seeds, Tensor indices) -> Tensor");
}

TORCH_LIBRARY_IMPL(ddtree, CUDA, m) {
  m.impl("sample_tokens", &sample_tokens);
  m.impl("top_k_top_p_floor", &top_k_top_p_floor);
  m.impl("seeded_uniforms", &seeded_uniforms);
}
