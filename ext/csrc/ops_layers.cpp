// The torch side of the decoder-layer ops (kernels in layers.cu and cache.cu): RMSNorm with and without a fused
// residual add, rope of q and k in place, SiLU-and-mul, the few-row GEMV (gemv.cu) and tensor-core GEMM (gemm_skinny.cu), FP8 activation quantization and the W4A16 GEMM (quant.cu), and the K+V cache
// write in one launch. Their schemas are
// a TORCH_LIBRARY_FRAGMENT of the `ddtree` namespace that ops.cpp defines; fakes in ext/fake.py. No op
// synchronizes with the host (CUDA-graph safe); outputs are fresh contiguous tensors.
#include <torch/library.h>

#include <optional>
#include <tuple>

#include <cstdio>

#include "ops_common.h"

namespace {

using at::Tensor;
using namespace ddtree_ops;

void check_float(const Tensor& t, const char* what) {
  const auto s = t.scalar_type();
  TORCH_CHECK(s == at::kFloat || s == at::kHalf || s == at::kBFloat16, "ddtree: ", what, " must be fp32, fp16 or bf16");
}

// x [rows, H] or [T, R, H] (unit last stride): rows, strides and weight checks shared by both norms.
ddtree::RmsNormParams norm_params(const Tensor& x, const Tensor& weight, double eps) {
  CHECK_CUDA(x); CHECK_CUDA(weight);
  check_float(x, "x"); check_float(weight, "weight");
  TORCH_CHECK((x.dim() == 2 || x.dim() == 3) && (x.stride(-1) == 1 || x.size(-1) == 1),
              "ddtree::rms_norm: x must be [rows, hidden] or [tokens, heads, hidden] with a unit last stride");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1) && weight.device() == x.device(),
              "ddtree::rms_norm: weight must be [hidden] on x's device");
  TORCH_CHECK(x.size(-1) < (int64_t{1} << 31), "ddtree::rms_norm: rows too long");
  ddtree::RmsNormParams p{};
  p.x = x.data_ptr();
  p.x_stride0 = x.stride(0);
  p.x_stride1 = x.dim() == 3 ? x.stride(1) : 0;
  p.inner = x.dim() == 3 ? x.size(1) : 1;
  p.rows = x.size(0) * p.inner;
  p.hidden = static_cast<int>(x.size(-1));
  p.eps = static_cast<float>(eps);
  return p;
}

Tensor rms_norm_out(const Tensor& x, const Tensor& weight) {
  return at::empty(x.sizes(), x.options().dtype(at::promote_types(x.scalar_type(), weight.scalar_type())));
}

Tensor rms_norm(Tensor x, Tensor weight, double eps) {
  ddtree::RmsNormParams p = norm_params(x, weight, eps);
  c10::cuda::CUDAGuard guard(x.device());
  Tensor w = weight.contiguous();
  Tensor out = rms_norm_out(x, weight);
  p.weight = w.data_ptr();
  p.out = out.data_ptr();
  p.pdl = pdl_enabled();
  check(ddtree::rms_norm(p, dtype_of(x), dtype_of(w), stream()), "rms_norm");
  return out;
}

std::tuple<Tensor, Tensor> fused_add_rmsnorm(Tensor x, Tensor residual, Tensor weight, double eps) {
  ddtree::RmsNormParams p = norm_params(x, weight, eps);
  CHECK_CUDA(residual);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type() &&
              residual.device() == x.device() && (residual.stride(-1) == 1 || x.size(-1) == 1),
              "ddtree::fused_add_rmsnorm: residual must match x (shape, dtype, device) with a unit last stride");
  c10::cuda::CUDAGuard guard(x.device());
  Tensor w = weight.contiguous();
  Tensor out = rms_norm_out(x, weight);
  Tensor new_residual = at::empty(x.sizes(), x.options());
  p.residual = residual.data_ptr();
  p.r_stride0 = residual.stride(0);
  p.r_stride1 = x.dim() == 3 ? residual.stride(1) : 0;
  p.weight = w.data_ptr();
  p.out = out.data_ptr();
  p.new_residual = new_residual.data_ptr();
  p.pdl = pdl_enabled();
  check(ddtree::rms_norm(p, dtype_of(x), dtype_of(w), stream()), "fused_add_rmsnorm");
  return {out, new_residual};
}

// Checks q [T, Hq, D], k [T, Hk, D], cos / sin [T, D] and fills the rope part of the parameters.
ddtree::RopeParams rope_params(const Tensor& q, const Tensor& k, const Tensor& cos, const Tensor& sin, const char* op) {
  CHECK_CUDA(q); CHECK_CUDA(k); CHECK_CUDA(cos); CHECK_CUDA(sin);
  check_float(q, "q");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && cos.dim() == 2 && sin.dim() == 2,
              "ddtree::", op, ": q [T, Hq, D], k [T, Hk, D], cos and sin [T, D]");
  const int64_t T = q.size(0), D = q.size(2);
  TORCH_CHECK(k.size(0) == T && cos.size(0) == T && sin.size(0) == T && k.size(2) == D && cos.size(1) == D &&
              sin.size(1) == D && D % 2 == 0, "ddtree::", op, ": shapes do not match (or an odd head_dim)");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && cos.scalar_type() == q.scalar_type() &&
              sin.scalar_type() == q.scalar_type(), "ddtree::", op, ": q, k, cos and sin must share a dtype");
  TORCH_CHECK(k.device() == q.device() && cos.device() == q.device() && sin.device() == q.device(),
              "ddtree::", op, ": all inputs must be on one device");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && cos.stride(1) == 1 && sin.stride(1) == 1,
              "ddtree::", op, ": last dims must be contiguous");
  TORCH_CHECK(T < (int64_t{1} << 31) && q.size(1) + k.size(1) < (int64_t{1} << 20) && D < (int64_t{1} << 20),
              "ddtree::", op, ": too many tokens or heads");
  ddtree::RopeParams p{};
  p.q = q.data_ptr(); p.q_stride_t = q.stride(0); p.q_stride_h = q.stride(1);
  p.k = k.data_ptr(); p.k_stride_t = k.stride(0); p.k_stride_h = k.stride(1);
  p.cos = cos.data_ptr(); p.sin = sin.data_ptr(); p.cos_stride_t = cos.stride(0); p.sin_stride_t = sin.stride(0);
  p.num_tokens = static_cast<int>(T);
  p.num_q_heads = static_cast<int>(q.size(1));
  p.num_k_heads = static_cast<int>(k.size(1));
  p.head_dim = static_cast<int>(D);
  return p;
}

void rope_inplace(Tensor q, Tensor k, Tensor cos, Tensor sin) {
  ddtree::RopeParams p = rope_params(q, k, cos, sin, "rope_inplace");
  if (p.num_tokens == 0) return;
  c10::cuda::CUDAGuard guard(q.device());
  p.pdl = pdl_enabled();
  check(ddtree::rope_inplace(p, dtype_of(q), stream()), "rope_inplace");
}

// The rope_write_kv parameters: q, k, cos, sin as rope_params checks them, then v [T, Hk, D] and the caches
// (contiguous [blocks, block_size, Hk, D], q's dtype) at slot_mapping (-1 skipped).
ddtree::RopeParams rope_write_kv_params(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cos,
                                       const Tensor& sin, const Tensor& k_cache, const Tensor& v_cache,
                                       const Tensor& slot_mapping, const char* op) {
  ddtree::RopeParams p = rope_params(q, k, cos, sin, op);
  CHECK_CUDA(v); CHECK_CUDA(k_cache); CHECK_CUDA(v_cache); CHECK_CUDA(slot_mapping);
  CHECK_TYPE(slot_mapping, at::kLong);
  TORCH_CHECK(v.sizes() == k.sizes() && v.scalar_type() == q.scalar_type() && v.stride(2) == 1,
              "ddtree::", op, ": v must match k (shape, dtype) with a unit last stride");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes() &&
              k_cache.dim() == 4 && k_cache.size(2) == k.size(1) && k_cache.size(3) == k.size(2) &&
              k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "ddtree::", op, ": caches must be contiguous [blocks, block_size, Hk, D] in q's dtype");
  TORCH_CHECK(slot_mapping.numel() == k.size(0) && slot_mapping.is_contiguous(),
              "ddtree::", op, ": one contiguous slot per token");
  TORCH_CHECK(v.device() == q.device() && k_cache.device() == q.device() && v_cache.device() == q.device() &&
              slot_mapping.device() == q.device(), "ddtree::", op, ": all inputs must be on one device");
  p.k_cache = k_cache.data_ptr(); p.v_cache = v_cache.data_ptr();
  p.v = v.data_ptr(); p.v_stride_t = v.stride(0); p.v_stride_h = v.stride(1);
  p.slots = slot_mapping.data_ptr<int64_t>();
  return p;
}

// rope_inplace, then k and v into the caches at slot_mapping: one launch.
void rope_write_kv(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor k_cache, Tensor v_cache,
                   Tensor slot_mapping) {
  ddtree::RopeParams p = rope_write_kv_params(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, "rope_write_kv");
  if (p.num_tokens == 0) return;
  c10::cuda::CUDAGuard guard(q.device());
  p.pdl = pdl_enabled();
  check(ddtree::rope_inplace(p, dtype_of(q), stream()), "rope_write_kv");
}

// Qwen3: q and k RMS-normalised per head in place (weights [D] in q's dtype, one eps), then rope_write_kv: one
// launch. The kernel needs 16-byte aligned rows and (D / 2) / (16 / element size) a power of two <= 16.
void qk_norm_rope_write_kv(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor k_cache, Tensor v_cache,
                           Tensor slot_mapping, Tensor q_norm, Tensor k_norm, double eps) {
  const char* op = "qk_norm_rope_write_kv";
  ddtree::RopeParams p = rope_write_kv_params(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, op);
  CHECK_CUDA(q_norm); CHECK_CUDA(k_norm);
  TORCH_CHECK(q_norm.dim() == 1 && k_norm.dim() == 1 && q_norm.size(0) == q.size(2) && k_norm.size(0) == q.size(2) &&
              q_norm.is_contiguous() && k_norm.is_contiguous() && q_norm.scalar_type() == q.scalar_type() &&
              k_norm.scalar_type() == q.scalar_type() && q_norm.device() == q.device() &&
              k_norm.device() == q.device(), "ddtree::", op, ": norm weights must be contiguous [D] in q's dtype");
  if (p.num_tokens == 0) return;
  c10::cuda::CUDAGuard guard(q.device());
  p.q_norm = q_norm.data_ptr(); p.k_norm = k_norm.data_ptr();
  p.norm_eps = static_cast<float>(eps);
  p.pdl = pdl_enabled();
  check(ddtree::rope_inplace(p, dtype_of(q), stream()), op);
}

Tensor silu_and_mul(Tensor x) {
  CHECK_CUDA(x);
  check_float(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "ddtree::silu_and_mul: x must be [tokens, 2 * intermediate]");
  TORCH_CHECK(x.size(1) < (int64_t{1} << 31), "ddtree::silu_and_mul: rows too long");
  c10::cuda::CUDAGuard guard(x.device());
  Tensor xr = x.size(1) > 1 && x.stride(1) != 1 ? x.contiguous() : x;
  const int64_t T = x.size(0), I = x.size(1) / 2;
  Tensor out = at::empty({T, I}, x.options());
  check(ddtree::silu_and_mul(xr.data_ptr(), dtype_of(xr), xr.stride(0), out.data_ptr(), T, static_cast<int>(I), stream()),
        "silu_and_mul");
  return out;
}

// x [rows, K] . weight [N, K]^T through one of the few-row kernels (gemv.cu, gemm_skinny.cu): `name` for the
// messages, at most `max_rows` rows, K a multiple of `k_multiple` (the limits spelled out in the two messages).
template <typename Kernel>
Tensor few_rows_product(const char* name, Kernel kernel, int max_rows, int64_t k_multiple, const char* rows_message,
                        const char* k_message, Tensor x, Tensor weight, std::optional<Tensor> bias, bool silu_mul) {
  CHECK_CUDA(x); CHECK_CUDA(weight);
  // Each failure raises one preformatted "<name>: <what>" string. Written as TORCH_CHECKs with several message
  // parts, a failing check here segfaulted the process on the H200 (2026-12-04, K not a multiple of 32, reproduced
  // alone; cause not found); tests/ext/test_layers_gpu.py tries this op's and other ops' refusals.
  char msg[160];
  auto require = [&](bool ok, const char* what) {
    if (ok) return;
    std::snprintf(msg, sizeof msg, "%s: %s", name, what);
    TORCH_CHECK(false, msg);
  };
  require(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf, "x must be bf16 or fp16");
  require(weight.scalar_type() == x.scalar_type(), "weight must have x's dtype");
  require(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "x [rows, K], weight [N, K]");
  require(x.size(0) >= 1 && x.size(0) <= max_rows, rows_message);
  require(x.size(1) % k_multiple == 0 && x.stride(1) == 1 && x.stride(0) % 8 == 0 && aligned16(x), k_message);
  require(weight.is_contiguous() && aligned16(weight), "weight must be contiguous and 16-byte aligned");
  require(weight.device() == x.device(), "x and weight must be on one device");
  require(!silu_mul || (weight.size(0) % 2 == 0 && !bias.has_value()),
          "silu_mul takes a [gate; up] weight with an even row count and no bias");
  if (bias.has_value()) {
    CHECK_CUDA(*bias);
    require(bias->scalar_type() == x.scalar_type() && bias->dim() == 1 && bias->size(0) == weight.size(0) &&
            bias->is_contiguous() && bias->device() == x.device(), "bias must be contiguous [N] in x's dtype");
  }
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t n_out = silu_mul ? weight.size(0) / 2 : weight.size(0);
  Tensor out = at::empty({x.size(0), n_out}, x.options());
  ddtree::GemvParams p{};
  p.x = x.data_ptr(); p.x_stride = x.stride(0); p.rows = static_cast<int>(x.size(0));
  p.w = weight.data_ptr(); p.bias = bias.has_value() ? bias->data_ptr() : nullptr;
  p.n_out = n_out; p.k = x.size(1); p.out = out.data_ptr(); p.out_stride = out.stride(0);
  p.pdl = pdl_enabled();
  check(kernel(p, dtype_of(x), silu_mul, stream()), name);
  return out;
}

Tensor gemv(Tensor x, Tensor weight, std::optional<Tensor> bias, bool silu_mul) {
  static_assert(ddtree::kGemvMaxRows == 8, "the message below");
  return few_rows_product("ddtree::gemv", ddtree::gemv, ddtree::kGemvMaxRows, 8, "1 to 8 rows",
                          "K must be a multiple of 8 and x rows 16-byte aligned with a unit last stride", x, weight,
                          bias, silu_mul);
}

Tensor gemm_skinny(Tensor x, Tensor weight, std::optional<Tensor> bias, bool silu_mul) {
  static_assert(ddtree::kSkinnyMaxRows == 32, "the message below");
  return few_rows_product("ddtree::gemm_skinny", ddtree::gemm_skinny, ddtree::kSkinnyMaxRows, 32, "1 to 32 rows",
                          "K must be a multiple of 32 and x rows 16-byte aligned with a unit last stride", x, weight,
                          bias, silu_mul);
}

std::tuple<Tensor, Tensor> quantize_fp8_blockwise(Tensor x, int64_t padded_rows, double amax_floor) {
  CHECK_CUDA(x);
  check_float(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 128 == 0 && (x.stride(1) == 1 || x.size(1) == 0),
              "ddtree::quantize_fp8_blockwise: x must be [rows, cols] with cols % 128 == 0 and a unit last stride");
  TORCH_CHECK(padded_rows >= x.size(0), "ddtree::quantize_fp8_blockwise: padded_rows < rows");
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t cols = x.size(1);
  Tensor q = at::empty({padded_rows, cols}, x.options().dtype(at::kFloat8_e4m3fn));
  Tensor scale_t = at::empty({cols / 128, padded_rows}, x.options().dtype(at::kFloat));
  check(ddtree::quantize_fp8_blockwise(x.data_ptr(), dtype_of(x), x.stride(0), x.size(0), padded_rows, cols,
                                       static_cast<float>(amax_floor), q.data_ptr(), scale_t.data_ptr<float>(),
                                       stream()),
        "quantize_fp8_blockwise");
  return {q, scale_t};
}

Tensor w4a16_gemm(Tensor x, Tensor packed, Tensor scale, int64_t group_size) {
  CHECK_CUDA(x); CHECK_CUDA(packed); CHECK_CUDA(scale);
  check_float(x, "x");
  CHECK_TYPE(packed, at::kInt); CHECK_TYPE(scale, at::kFloat);
  TORCH_CHECK(packed.dim() == 2 && packed.is_contiguous() && scale.dim() == 2 && scale.is_contiguous() &&
              scale.size(0) == packed.size(0), "ddtree::w4a16_gemm: packed [n, words] and scale [n, groups], contiguous");
  const int64_t words = packed.size(1), cols = words * 8;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == cols && (x.stride(1) == 1 || cols == 0),
              "ddtree::w4a16_gemm: x must be [rows, 8 * words] with a unit last stride");
  TORCH_CHECK(x.size(0) <= ddtree::kW4A16MaxRows, "ddtree::w4a16_gemm: at most ", ddtree::kW4A16MaxRows, " rows");
  TORCH_CHECK(group_size > 0 && group_size % 8 == 0 && scale.size(1) == (cols + group_size - 1) / group_size,
              "ddtree::w4a16_gemm: group_size must be a positive multiple of 8 with one scale per group");
  TORCH_CHECK(x.device() == packed.device() && x.device() == scale.device(), "ddtree::w4a16_gemm: one device");
  c10::cuda::CUDAGuard guard(x.device());
  Tensor out = at::empty({x.size(0), packed.size(0)}, x.options());
  check(ddtree::w4a16_gemm(x.data_ptr(), dtype_of(x), x.stride(0), static_cast<int>(x.size(0)), packed.data_ptr(),
                           words, scale.data_ptr<float>(), scale.size(1), group_size / 8, packed.size(0),
                           out.data_ptr(), stream()),
        "w4a16_gemm");
  return out;
}

Tensor int4_dequantize(Tensor packed, Tensor scale, int64_t group_size, at::ScalarType dtype) {
  CHECK_CUDA(packed); CHECK_CUDA(scale);
  CHECK_TYPE(packed, at::kInt); CHECK_TYPE(scale, at::kFloat);
  TORCH_CHECK(packed.dim() == 2 && packed.is_contiguous() && scale.dim() == 2 && scale.is_contiguous() &&
              scale.size(0) == packed.size(0), "ddtree::int4_dequantize: packed [n, words] and scale [n, groups]");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
              "ddtree::int4_dequantize: dtype must be fp32, fp16 or bf16");
  const int64_t words = packed.size(1), cols = words * 8;
  TORCH_CHECK(group_size > 0 && group_size % 8 == 0 && scale.size(1) == (cols + group_size - 1) / group_size,
              "ddtree::int4_dequantize: group_size must be a positive multiple of 8 with one scale per group");
  c10::cuda::CUDAGuard guard(packed.device());
  Tensor out = at::empty({packed.size(0), cols}, packed.options().dtype(dtype));
  check(ddtree::int4_dequantize(packed.data_ptr(), packed.size(0), words, scale.data_ptr<float>(), scale.size(1),
                                group_size / 8, out.data_ptr(), dtype_of(out), stream()),
        "int4_dequantize");
  return out;
}

// rows [T, ...] of one cache row each -> (cache view, rows [T, elems] with a unit last stride)
ddtree::KvRows kv_rows(const Tensor& cache, const Tensor& rows, int64_t T, Tensor& keep) {
  TORCH_CHECK(cache.dim() >= 2 && cache.is_contiguous(),
              "ddtree::write_kv_pair: caches must be contiguous [blocks, block_size, ...]");
  TORCH_CHECK(rows.dim() >= 1 && rows.size(0) == T, "ddtree::write_kv_pair: one row of k and of v per slot");
  const int64_t slots = cache.size(0) * cache.size(1);
  const int64_t elems = slots == 0 ? 0 : cache.numel() / slots;
  TORCH_CHECK(rows.numel() == T * elems, "ddtree::write_kv_pair: row shape does not match the cache row");
  keep = rows.reshape({T, elems});
  if (elems > 0 && keep.stride(1) != 1) keep = keep.contiguous();
  return ddtree::KvRows{cache.data_ptr(), keep.data_ptr(), keep.stride(0), elems};
}

void write_kv_pair(Tensor k_cache, Tensor v_cache, Tensor k, Tensor v, Tensor slot_mapping) {
  CHECK_CUDA(k_cache); CHECK_CUDA(v_cache); CHECK_CUDA(k); CHECK_CUDA(v); CHECK_CUDA(slot_mapping);
  CHECK_TYPE(slot_mapping, at::kLong);
  check_float(k_cache, "k_cache"); check_float(k, "k");
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k.scalar_type(),
              "ddtree::write_kv_pair: the caches must share a dtype, and so must k and v");
  TORCH_CHECK(v_cache.device() == k_cache.device() && k.device() == k_cache.device() && v.device() == k_cache.device() &&
              slot_mapping.device() == k_cache.device(), "ddtree::write_kv_pair: all inputs must be on one device");
  const int64_t T = slot_mapping.numel();
  TORCH_CHECK(T < (int64_t{1} << 31), "ddtree::write_kv_pair: too many tokens");
  c10::cuda::CUDAGuard guard(k_cache.device());
  Tensor kr, vr;
  const ddtree::KvRows a = kv_rows(k_cache, k, T, kr), b = kv_rows(v_cache, v, T, vr);
  if (T == 0) return;
  Tensor sm = slot_mapping.contiguous();
  check(ddtree::write_kv_pair(a, b, dtype_of(k_cache), dtype_of(k), sm.data_ptr<int64_t>(), static_cast<int>(T), stream()),
        "write_kv_pair");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ddtree, m) {
  m.set_python_module("ext.fake");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rmsnorm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rope_inplace(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
  m.def("rope_write_kv(Tensor(a!) q, Tensor(b!) k, Tensor v, Tensor cos, Tensor sin, Tensor(c!) k_cache, "
        "Tensor(d!) v_cache, Tensor slot_mapping) -> ()");
  m.def("qk_norm_rope_write_kv(Tensor(a!) q, Tensor(b!) k, Tensor v, Tensor cos, Tensor sin, Tensor(c!) k_cache, "
        "Tensor(d!) v_cache, Tensor slot_mapping, Tensor q_norm, Tensor k_norm, float eps) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("gemv(Tensor x, Tensor weight, Tensor? bias, bool silu_mul) -> Tensor");
  m.def("gemm_skinny(Tensor x, Tensor weight, Tensor? bias, bool silu_mul) -> Tensor");
  m.def("quantize_fp8_blockwise(Tensor x, int padded_rows, float amax_floor) -> (Tensor, Tensor)");
  m.def("w4a16_gemm(Tensor x, Tensor packed, Tensor scale, int group_size) -> Tensor");
  m.def("int4_dequantize(Tensor packed, Tensor scale, int group_size, ScalarType dtype) -> Tensor");
  m.def("write_kv_pair(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(ddtree, CUDA, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rmsnorm", &fused_add_rmsnorm);
  m.impl("rope_inplace", &rope_inplace);
  m.impl("rope_write_kv", &rope_write_kv);
  m.impl("qk_norm_rope_write_kv", &qk_norm_rope_write_kv);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("gemv", &gemv);
  m.impl("gemm_skinny", &gemm_skinny);
  m.impl("quantize_fp8_blockwise", &quantize_fp8_blockwise);
  m.impl("w4a16_gemm", &w4a16_gemm);
  m.impl("int4_dequantize", &int4_dequantize);
  m.impl("write_kv_pair", &write_kv_pair);
}
