"""The decoder-layer kernels (fused_add_rmsnorm, rope_inplace, silu_and_mul, write_kv_pair) against their PyTorch
twins run on the same CUDA tensors (the eager CUDA math they replace): fp32 tight, bf16/fp16 within a few units
in the last place of that dtype (rope bit-level: every rounding step is reproduced), cache writes and new
residuals exact. Shapes cover the vectorized and scalar paths, strided views of the fused qkv projection, the
warp-per-row and block-per-row norms. Plus opcheck, CUDA-graph replay, and a whole Llama / Qwen3 forward served
by the kernels against the eager forward of before the ops."""
from __future__ import annotations


import pytest
import torch

from ext import layer_ops, ops, reference
from tests.ext.layer_cases import SMOLLM2_135M, old_forward, step_inputs, tiny_model

pytestmark = pytest.mark.gpu
DEV = "cuda"
LAYER_OPS = ("fused_add_rmsnorm", "rope_write_kv", "silu_and_mul")  # what a GQA decoder layer calls
QWEN3_ROPE = "qk_norm_rope_write_kv"  # Qwen3's layers: its q/k norms, rope and the cache write


from tests.ext.gpu_util import cuda_ops, rng  # noqa: F401 (cuda_ops: an autouse fixture)


def randn(gen, *shape, dtype=torch.float32, scale=1.0):
    return (scale * torch.randn(*shape, generator=gen)).to(DEV, dtype)


def max_ulps(got: torch.Tensor, want: torch.Tensor, grain: torch.dtype) -> float:
    """Largest |got - want| in units in the last place of want in dtype `grain`; NaNs must coincide."""
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    fi = torch.finfo(grain)
    g, w = got.double().nan_to_num(0.0), want.double().nan_to_num(0.0)
    ulp = torch.exp2(torch.floor(torch.log2(w.abs().clamp(min=fi.tiny)))) * fi.eps
    return float(((g - w).abs() / ulp).max()) if w.numel() else 0.0


def assert_close_in_dtype(got, want, ulps: float, what: str, grain: torch.dtype | None = None):
    """`grain`: the coarsest dtype the math rounds to (default want's). fp32: tight relative closeness;
    bf16/fp16: at most `ulps` units in the last place of that dtype (an fp32 result of bf16-rounded
    intermediates, e.g. an fp32 norm weight times a bf16 normalised row, is measured in bf16 units)."""
    grain = grain or want.dtype
    if grain == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=what)
        return
    off = max_ulps(got, want, grain)
    print(f"{what}: {off:.2f} ulp")
    assert off <= ulps, (what, off)


def served(name: str, fn):
    before = ops.cuda_calls().get(name, 0)
    out = fn()
    assert ops.cuda_calls().get(name, 0) == before + 1, name
    return out


# ---- fused_add_rmsnorm ---------------------------------------------------------------------------------------

NORM_CASES = [  # (x dtype, weight dtype, rows, hidden)
    (torch.bfloat16, torch.bfloat16, 1, 576),     # SmolLM2 decode: block per row (few rows), vectorized
    (torch.bfloat16, torch.bfloat16, 300, 576),   # many rows: warp per row
    (torch.bfloat16, torch.bfloat16, 40, 128),    # Qwen3's per-head norm at decode: one warp covers a row
    (torch.bfloat16, torch.bfloat16, 3, 4096),    # block per row
    (torch.bfloat16, torch.bfloat16, 2, 40000),   # more vectors than the registers keep: re-read path
    (torch.float16, torch.float16, 17, 5120),
    (torch.float32, torch.float32, 33, 576),
    (torch.float32, torch.float32, 2, 20000),
    (torch.bfloat16, torch.float32, 9, 1024),     # fp32 weight: fp32 output (type promotion)
    (torch.float16, torch.bfloat16, 5, 64),       # mixed halves: fp32 output
    (torch.bfloat16, torch.bfloat16, 7, 100),     # not a multiple of 8: scalar path
    (torch.float32, torch.float32, 4, 3),
    (torch.bfloat16, torch.bfloat16, 5, 3000),    # block of 384 threads (not a power of two)
    (torch.float16, torch.float16, 6, 3001),      # scalar block path, re-reads past the cached vectors
]


@pytest.mark.parametrize("case", range(len(NORM_CASES)))
@pytest.mark.parametrize("with_residual", [False, True])
def test_fused_add_rmsnorm(case, with_residual):
    r, gen = rng()
    dtype, wdtype, rows, hidden = NORM_CASES[case]
    x = randn(gen, rows, hidden, dtype=dtype, scale=3.0)
    residual = randn(gen, rows, hidden, dtype=dtype) if with_residual else None
    weight = randn(gen, hidden, dtype=wdtype, scale=0.3) + 1
    eps = r.choice([1e-5, 1e-6])
    out, new_res = served("fused_add_rmsnorm", lambda: ops.fused_add_rmsnorm(x, residual, weight, eps))
    want, want_res = reference.fused_add_rmsnorm(x, residual, weight, eps)
    assert out.dtype == want.dtype == torch.promote_types(dtype, wdtype) and out.shape == want.shape
    if residual is None:
        assert new_res is x
    else:
        assert torch.equal(new_res, want_res) and new_res.is_contiguous()
    assert_close_in_dtype(out, want, 3, f"rmsnorm {dtype} {wdtype} {rows}x{hidden}", grain=dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rmsnorm_of_strided_views(dtype):
    """Qwen3's per-head q/k norm on views of the fused qkv output [T, heads, head_dim] (token stride = the qkv
    width), and a residual add on row-strided views."""
    r, gen = rng()
    t, hq, hk, d = 11, 8, 2, 128
    qkv = randn(gen, t, (hq + 2 * hk) * d, dtype=dtype)
    q, k = qkv[:, :hq * d].view(t, hq, d), qkv[:, hq * d:(hq + hk) * d].view(t, hk, d)
    w = randn(gen, d, dtype=dtype, scale=0.3) + 1
    for view in (q, k):
        out, _ = ops.fused_add_rmsnorm(view, None, w, 1e-6)
        assert out.shape == view.shape and out.is_contiguous()
        assert_close_in_dtype(out, reference.fused_add_rmsnorm(view, None, w, 1e-6)[0], 3, "per-head norm")
    wide = randn(gen, t, 3 * 576, dtype=dtype)
    x, res = wide[:, :576], wide[:, 1001:1577]  # row stride 1728, a 16-byte-misaligned res: the scalar path
    wn = randn(gen, 576, dtype=dtype) + 1
    out, new_res = ops.fused_add_rmsnorm(x, res, wn, 1e-5)
    want, want_res = reference.fused_add_rmsnorm(x, res, wn, 1e-5)
    assert torch.equal(new_res, want_res)
    assert_close_in_dtype(out, want, 3, "strided residual")


# ---- rope_inplace ----------------------------------------------------------------------------------------------

ROPE_CASES = [  # (dtype, tokens, q heads, kv heads, head_dim, qkv views)
    (torch.bfloat16, 1, 9, 3, 64, True),          # SmolLM2 decode
    (torch.bfloat16, 513, 9, 3, 64, True),
    (torch.bfloat16, 7, 32, 8, 128, False),
    (torch.float16, 19, 16, 16, 128, True),
    (torch.float32, 40, 4, 2, 64, True),
    (torch.bfloat16, 5, 4, 2, 18, True),          # half = 9: scalar path
    (torch.float32, 3, 2, 1, 2, False),
]


@pytest.mark.parametrize("case", range(len(ROPE_CASES)))
@pytest.mark.parametrize("table", ["rotary", "random"])
def test_rope_inplace(case, table):
    r, gen = rng()
    dtype, t, hq, hk, d, views = ROPE_CASES[case]
    if views:
        qkv = randn(gen, t, (hq + 2 * hk) * d, dtype=dtype)
        q, k = qkv[:, :hq * d].view(t, hq, d), qkv[:, hq * d:(hq + hk) * d].view(t, hk, d)
        v_before = qkv[:, (hq + hk) * d:].clone()
    else:
        q, k = randn(gen, t, hq, d, dtype=dtype), randn(gen, t, hk, d, dtype=dtype)
    if table == "rotary":  # cos/sin as RotaryEmbedding.cos_sin makes them, at random positions
        positions = torch.randint(0, 40000, (t,), generator=gen).to(DEV)
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, device=DEV).float() / d))
        freqs = positions.float()[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    else:  # a general table (halves differ)
        cos, sin = randn(gen, t, d, dtype=dtype), randn(gen, t, d, dtype=dtype)
    want_q, want_k = q.clone(), k.clone()
    reference.rope_inplace(want_q, want_k, cos, sin)
    served("rope_inplace", lambda: ops.rope_inplace(q, k, cos, sin))
    assert_close_in_dtype(q, want_q, 1, f"rope q {dtype} d{d}")
    assert_close_in_dtype(k, want_k, 1, f"rope k {dtype} d{d}")
    if views:
        assert torch.equal(qkv[:, (hq + hk) * d:], v_before)  # V untouched


def cache_write_inputs(gen, dtype, t, hq, hk, d, scale=1.0):
    """One qkv row per token, rope tables, slots (a quarter -1) and NaN-filled caches; split(x) -> the q, k, v
    views of a qkv tensor as the attention layer passes them."""
    nb, bs = -(-t // 4) + 3, 4
    qkv = randn(gen, t, (hq + 2 * hk) * d, dtype=dtype, scale=scale)
    cos, sin = randn(gen, t, d, dtype=dtype), randn(gen, t, d, dtype=dtype)
    slots = torch.randperm(nb * bs, generator=gen)[:t]
    slots[torch.rand(t, generator=gen) < 0.25] = -1
    caches = torch.full((2, nb, bs, hk, d), float("nan")).to(DEV, dtype)

    def split(x):
        return (x[:, :hq * d].view(t, hq, d), x[:, hq * d:(hq + hk) * d].view(t, hk, d),
                x[:, (hq + hk) * d:].view(t, hk, d))

    return qkv, cos, sin, slots.to(DEV), caches, split


@pytest.mark.parametrize("case", range(len(ROPE_CASES)))
def test_rope_write_kv_equals_rope_then_the_cache_write(case):
    """One launch: q and k roped in place (bit for bit what rope_inplace gives) and the roped k and v written at
    the slots (-1 skipped), over views of one qkv row as the attention layer passes them."""
    r, gen = rng()
    dtype, t, hq, hk, d, _ = ROPE_CASES[case]
    qkv, cos, sin, slots, caches, split = cache_write_inputs(gen, dtype, t, hq, hk, d)
    want_qkv, want_caches = qkv.clone(), caches.clone()
    reference.rope_write_kv(*split(want_qkv), cos, sin, want_caches[0], want_caches[1], slots)
    served("rope_write_kv", lambda: ops.rope_write_kv(*split(qkv), cos, sin, caches[0], caches[1], slots))
    assert torch.equal(qkv, want_qkv)
    assert torch.equal(caches.nan_to_num(7.0), want_caches.nan_to_num(7.0))


QK_NORM_CASES = [  # (dtype, tokens, q heads, kv heads, head_dim): fused where a head's half is 1-16 vectors
    (torch.bfloat16, 1, 32, 8, 128),   # Qwen3-8B decode
    (torch.bfloat16, 37, 16, 8, 128),
    (torch.bfloat16, 3, 9, 3, 64),
    (torch.float16, 19, 16, 16, 256),
    (torch.float32, 40, 4, 2, 128),
    (torch.float32, 2, 4, 2, 16),      # two vectors a half
    (torch.bfloat16, 5, 4, 2, 48),     # three vectors a half: the norm and rope_write_kv kernels
    (torch.float32, 3, 2, 1, 256),     # 32 vectors a half: the same
]


@pytest.mark.parametrize("case", range(len(QK_NORM_CASES)))
def test_qk_norm_rope_write_kv_equals_the_norm_then_rope_kernels(case):
    """Qwen3's q/k norm folded into the rope + cache write launch: bit for bit the rms_norm kernel on each head
    followed by rope_write_kv (the norm's sum of squares in the same order), over views of one qkv row; shapes
    the fused kernel does not take run those two kernels instead."""
    r, gen = rng()
    dtype, t, hq, hk, d = QK_NORM_CASES[case]
    qkv, cos, sin, slots, caches, split = cache_write_inputs(gen, dtype, t, hq, hk, d, scale=3.0)
    qw, kw = randn(gen, d, dtype=dtype) + 1, randn(gen, d, dtype=dtype) + 1
    want_qkv, want_caches = qkv.clone(), caches.clone()
    wq, wk, wv = split(want_qkv)
    wq.copy_(served("fused_add_rmsnorm", lambda: ops.fused_add_rmsnorm(wq, None, qw, 1e-6))[0])
    wk.copy_(served("fused_add_rmsnorm", lambda: ops.fused_add_rmsnorm(wk, None, kw, 1e-6))[0])
    served("rope_write_kv", lambda: ops.rope_write_kv(wq, wk, wv, cos, sin, want_caches[0], want_caches[1], slots))
    fused = d // 2 // (16 // qkv.element_size()) in (1, 2, 4, 8, 16)
    before = ops.cuda_calls()
    ops.qk_norm_rope_write_kv(*split(qkv), cos, sin, caches[0], caches[1], slots, qw, kw, 1e-6)
    used = {k: v - before.get(k, 0) for k, v in ops.cuda_calls().items() if v != before.get(k, 0)}
    assert used == ({"qk_norm_rope_write_kv": 1} if fused else {"fused_add_rmsnorm": 2, "rope_write_kv": 1}), used
    assert torch.equal(qkv, want_qkv)
    assert torch.equal(caches.nan_to_num(7.0), want_caches.nan_to_num(7.0))
    assert ops.reference_fallbacks().get("qk_norm_rope_write_kv", 0) == 0


# ---- silu_and_mul ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,rows,inter,row_pad", [
    (torch.bfloat16, 1, 1536, 0), (torch.bfloat16, 300, 1536, 0), (torch.bfloat16, 3, 12288, 0),
    (torch.float16, 9, 768, 8), (torch.float32, 17, 96, 4), (torch.bfloat16, 5, 7, 0), (torch.float32, 2, 1, 3),
])
def test_silu_and_mul(dtype, rows, inter, row_pad):
    r, gen = rng()
    wide = randn(gen, rows, 2 * inter + row_pad, dtype=dtype, scale=4.0)
    x = wide[:, :2 * inter]  # row_pad > 0: a row stride wider than the row
    out = served("silu_and_mul", lambda: ops.silu_and_mul(x))
    want = reference.silu_and_mul(x)
    assert out.shape == want.shape == (rows, inter) and out.is_contiguous()
    assert_close_in_dtype(out, want, 3, f"silu_and_mul {dtype} {rows}x{inter}")


# ---- gemv ------------------------------------------------------------------------------------------------------

GEMV_CASES = [  # (dtype, rows, out features, in features, x row padding, bias)
    (torch.bfloat16, 1, 960, 576, 0, False), (torch.bfloat16, 1, 49152, 576, 0, False),
    (torch.bfloat16, 3, 576, 1536, 8, False), (torch.bfloat16, 4, 4096, 4096, 0, True),
    (torch.float16, 2, 7, 8, 0, True), (torch.bfloat16, 5, 33, 1032, 16, False), (torch.bfloat16, 8, 130, 264, 0, True),
]


SKINNY_CASES = [  # (dtype, rows, out features, in features, x row padding, bias): every tile count (rows 3..32),
    # a partial feature group (n % 16), k of a chunk a warp or fewer (32, 96) and of several unrolled passes
    (torch.bfloat16, 17, 6144, 4096, 0, False), (torch.bfloat16, 32, 4096, 12288, 8, True),
    (torch.bfloat16, 9, 960, 576, 0, True), (torch.bfloat16, 3, 49152, 576, 16, False),
    (torch.float16, 24, 33, 1056, 0, True), (torch.bfloat16, 13, 7, 32, 0, False), (torch.float16, 8, 130, 96, 8, False),
]


def assert_few_rows_product(op, dtype, rows, n, k, pad, bias):
    """op(x, w, b) against the exact product of the same inputs: within one unit in the last place plus fp32
    accumulation's bound, and on average as close as cuBLAS is."""
    r, gen = rng()
    x = randn(gen, rows, k + pad, dtype=dtype)[:, :k]
    w = randn(gen, n, k, dtype=dtype, scale=k ** -0.5)
    b = randn(gen, n, dtype=dtype) if bias else None
    out = op(x, w, b, False)
    exact = x.double() @ w.double().T + (b.double() if bias else 0)
    assert out.shape == (rows, n) and out.dtype == dtype
    # rounding the exact result to the dtype (half a unit in its last place) plus fp32 accumulation of k products
    # (the textbook bound k * 2^-24 * sum |x w|; cancellation makes small outputs lose relative accuracy)
    magnitude = x.double().abs() @ w.double().abs().T + (b.double().abs() if bias else 0)
    fi = torch.finfo(dtype)
    ulp = torch.exp2(torch.floor(torch.log2(exact.abs().clamp(min=fi.tiny)))) * fi.eps
    err = (out.double() - exact).abs()
    assert bool((err <= 0.5 * ulp + (k + 1) * 2.0 ** -24 * magnitude + fi.tiny).all()), float((err / ulp).max())
    cublas_err = (torch.nn.functional.linear(x, w, b).double() - exact).abs()
    print(f"{op} {dtype} {rows}x{k} -> {n}: mean error {float(err.mean()):.3e}, cuBLAS {float(cublas_err.mean()):.3e}")
    assert float(err.mean()) <= 1.5 * float(cublas_err.mean()) + 1e-12


@pytest.mark.parametrize("dtype,rows,n,k,pad,bias", GEMV_CASES)
def test_gemv_against_fp64(cuda_ops, dtype, rows, n, k, pad, bias):
    """Every row count the kernel takes (1..8), short and long rows (the unrolled loop and its tail), strided x, bias."""
    assert_few_rows_product(cuda_ops.gemv, dtype, rows, n, k, pad, bias)


@pytest.mark.parametrize("dtype,rows,n,k,pad,bias", SKINNY_CASES)
def test_gemm_skinny_against_fp64(cuda_ops, dtype, rows, n, k, pad, bias):
    """The tensor-core GEMM's permuted-k fragments and split-k sums give the exact product to within rounding."""
    assert_few_rows_product(cuda_ops.gemm_skinny, dtype, rows, n, k, pad, bias)


@pytest.mark.parametrize("op,rows,inter,k", [
    ("gemv", 1, 1536, 576), ("gemv", 3, 7, 64), ("gemv", 8, 12288, 4096),
    ("gemm_skinny", 3, 7, 64), ("gemm_skinny", 17, 12288, 4096), ("gemm_skinny", 32, 1536, 576),
])
def test_few_rows_silu_mul_equals_the_two_ops(cuda_ops, op, rows, inter, k):
    """The fused [gate; up] product with SiLU-and-mul is bit for bit silu_and_mul of the plain product."""
    r, gen = rng()
    x = randn(gen, rows, k, dtype=torch.bfloat16)
    w = randn(gen, 2 * inter, k, dtype=torch.bfloat16, scale=2 * k ** -0.5)
    product = getattr(cuda_ops, op)
    assert torch.equal(product(x, w, None, True), ops.silu_and_mul(product(x, w, None, False)))


def test_few_rows_do_not_depend_on_each_other(cuda_ops):
    """A row's result is bit for bit the same computed alone or beside others (seeded sampling of a request alone
    and as choice 0 of n = 2 must agree; a tree's row must not depend on the tree's size)."""
    r, gen = rng()
    x = randn(gen, 32, 576, dtype=torch.bfloat16)
    w = randn(gen, 960, 576, dtype=torch.bfloat16, scale=576 ** -0.5)
    alone = cuda_ops.gemv(x[:1], w, None, False)
    for rows in range(2, 9):
        assert torch.equal(cuda_ops.gemv(x[:rows], w, None, False)[:1], alone), rows
    assert torch.equal(ops.linear(x[:2], w)[:1], ops.linear(x[:1], w))
    each = torch.cat([cuda_ops.gemm_skinny(x[i:i + 1], w, None, False) for i in range(32)])
    for rows in range(2, 33):
        assert torch.equal(cuda_ops.gemm_skinny(x[:rows], w, None, False), each[:rows]), rows


def test_gemm_skinny_refuses_what_it_cannot_take(cuda_ops):
    """K not a multiple of 32 and more than 32 rows are refused with the op's name, not computed wrong."""
    r, gen = rng()
    with pytest.raises(RuntimeError, match="gemm_skinny.*multiple of 32"):
        cuda_ops.gemm_skinny(randn(gen, 4, 40, dtype=torch.bfloat16), randn(gen, 64, 40, dtype=torch.bfloat16),
                             None, False)
    with pytest.raises(RuntimeError, match="gemm_skinny.*1 to 32 rows"):
        cuda_ops.gemm_skinny(randn(gen, 33, 64, dtype=torch.bfloat16), randn(gen, 64, 64, dtype=torch.bfloat16),
                             None, False)


def test_layer_ops_refuse_bad_inputs_with_their_reasons(cuda_ops):
    """Checks whose messages are built from several parts (a tensor's role, a limit) raise a RuntimeError naming
    the problem. On the H200 (2026-12-04) the few-row product's first checks, TORCH_CHECKs with several message
    parts, segfaulted the process on a K that is not a multiple of 32 (reproduced alone; the same check through one
    preformatted string raises; cause not found): a bad input must never take the engine down, so another
    multi-part check is tried here too."""
    r, gen = rng()
    with pytest.raises(RuntimeError, match="x must be fp32, fp16 or bf16"):
        cuda_ops.rms_norm(torch.ones(4, 64, device=DEV, dtype=torch.int32), torch.ones(64, device=DEV), 1e-5)
    with pytest.raises(RuntimeError, match="ddtree::gemv: 1 to 8 rows"):
        cuda_ops.gemv(randn(gen, 9, 64, dtype=torch.bfloat16), randn(gen, 96, 64, dtype=torch.bfloat16), None, False)


def test_linear_routes_few_rows_to_their_kernels():
    """ops.linear serves up to GEMV_MAX_ROWS bf16 rows with the GEMV, up to SKINNY_MAX_ROWS with the tensor-core
    GEMM (K a multiple of 32, weights up to a limit that is larger for up to SKINNY_FEW_ROWS rows), more rows,
    other K, larger weights and fp32 with cuBLAS; the model's fused MLP does so through linear_silu_mul."""
    r, gen = rng()
    w = randn(gen, 96, 64, dtype=torch.bfloat16)
    for rows in (1, ops.GEMV_MAX_ROWS):
        served("gemv", lambda: ops.linear(randn(gen, rows, 64, dtype=torch.bfloat16), w))
        served("gemv", lambda: ops.linear_silu_mul(randn(gen, rows, 64, dtype=torch.bfloat16), w))
    for rows in (ops.GEMV_MAX_ROWS + 1, 17, ops.SKINNY_MAX_ROWS):
        served("gemm_skinny", lambda: ops.linear(randn(gen, rows, 64, dtype=torch.bfloat16), w))
        served("gemm_skinny", lambda: ops.linear_silu_mul(randn(gen, rows, 64, dtype=torch.bfloat16), w))
    before = dict(ops.cuda_calls())
    ops.linear(randn(gen, ops.SKINNY_MAX_ROWS + 1, 64, dtype=torch.bfloat16), w)
    ops.linear(randn(gen, 17, 48, dtype=torch.bfloat16), randn(gen, 96, 48, dtype=torch.bfloat16))
    # 9-32 rows: weights up to SKINNY_MAX_WEIGHT_BYTES; 3-8 rows: up to SKINNY_FEW_ROWS_MAX_WEIGHT_BYTES
    big = torch.empty(layer_ops.SKINNY_MAX_WEIGHT_BYTES // 2 // 64 + 1, 64, device=DEV, dtype=torch.bfloat16)
    larger = torch.empty(layer_ops.SKINNY_FEW_ROWS_MAX_WEIGHT_BYTES // 2 // 64 + 1, 64, device=DEV,
                         dtype=torch.bfloat16)
    ops.linear(randn(gen, layer_ops.SKINNY_FEW_ROWS + 1, 64, dtype=torch.bfloat16), big)
    ops.linear(randn(gen, layer_ops.SKINNY_FEW_ROWS, 64, dtype=torch.bfloat16), larger)
    ops.linear(randn(gen, 1, 64), w.float())
    for kernel in ("gemv", "gemm_skinny"):
        assert ops.cuda_calls().get(kernel, 0) == before.get(kernel, 0)
        assert kernel not in ops.reference_fallbacks()
    served("gemm_skinny", lambda: ops.linear(randn(gen, layer_ops.SKINNY_FEW_ROWS, 64, dtype=torch.bfloat16), big))


# ---- write_kv_pair ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cache_dtype,rows_dtype,hk,d", [
    (torch.bfloat16, torch.bfloat16, 3, 64), (torch.float32, torch.float32, 2, 16), (torch.float16, torch.float16, 1, 6),
    (torch.bfloat16, torch.float32, 8, 128), (torch.float32, torch.bfloat16, 2, 64),
])
def test_write_kv_pair(cache_dtype, rows_dtype, hk, d):
    r, gen = rng()
    nb, bs, hq = r.randrange(3, 30), r.choice([1, 16]), 2 * hk
    caches = torch.full((2, nb, bs, hk, d), float("nan")).to(DEV, cache_dtype)
    t = r.randrange(1, nb * bs)
    slots = torch.randperm(nb * bs, generator=gen)[:t]
    slots[torch.rand(t, generator=gen) < 0.2] = -1
    slots = slots.to(DEV)
    qkv = randn(gen, t, (hq + 2 * hk) * d, dtype=rows_dtype)
    k, v = qkv[:, hq * d:(hq + hk) * d].view(t, hk, d), qkv[:, (hq + hk) * d:].reshape(t, hk, d)
    expect = caches.clone()
    reference.write_kv_pair(expect[0], expect[1], k, v, slots)
    served("write_kv_pair", lambda: ops.write_kv_pair(caches[0], caches[1], k, v, slots))
    assert torch.equal(caches.nan_to_num(7.0), expect.nan_to_num(7.0))


# ---- registration, capture, the model ----------------------------------------------------------------------------

def test_opcheck_layer_ops(cuda_ops):
    r, gen = rng()
    utils = ("test_schema", "test_faketensor")
    x, res = randn(gen, 5, 576, dtype=torch.bfloat16), randn(gen, 5, 576, dtype=torch.bfloat16)
    w = randn(gen, 576, dtype=torch.bfloat16) + 1
    torch.library.opcheck(cuda_ops.rms_norm.default, (x, w, 1e-5), test_utils=utils)
    torch.library.opcheck(cuda_ops.rms_norm.default, (x.view(5, 9, 64), w[:64].float(), 1e-5), test_utils=utils)
    torch.library.opcheck(cuda_ops.fused_add_rmsnorm.default, (x, res, w, 1e-5), test_utils=utils)
    q, k = randn(gen, 5, 9, 64, dtype=torch.bfloat16), randn(gen, 5, 3, 64, dtype=torch.bfloat16)
    cos, sin = randn(gen, 5, 64, dtype=torch.bfloat16), randn(gen, 5, 64, dtype=torch.bfloat16)
    torch.library.opcheck(cuda_ops.rope_inplace.default, (q, k, cos, sin), test_utils=utils)
    kv = torch.zeros(2, 4, 16, 3, 64, device=DEV, dtype=torch.bfloat16)
    torch.library.opcheck(cuda_ops.rope_write_kv.default,
                          (q, k, randn(gen, 5, 3, 64, dtype=torch.bfloat16), cos, sin, kv[0], kv[1],
                           torch.tensor([5, -1, 9, 0, 63], device=DEV)), test_utils=utils)
    q8, k8 = randn(gen, 5, 8, 64, dtype=torch.bfloat16), randn(gen, 5, 3, 64, dtype=torch.bfloat16)
    torch.library.opcheck(cuda_ops.qk_norm_rope_write_kv.default,
                          (q8, k8, randn(gen, 5, 3, 64, dtype=torch.bfloat16), cos, sin, kv[0], kv[1],
                           torch.tensor([5, -1, 9, 0, 63], device=DEV), w[:64], w[64:128], 1e-6), test_utils=utils)
    torch.library.opcheck(cuda_ops.silu_and_mul.default, (randn(gen, 5, 2 * 96),), test_utils=utils)
    gw = randn(gen, 96, 576, dtype=torch.bfloat16)
    torch.library.opcheck(cuda_ops.gemv.default, (x[:3], gw, None, False), test_utils=utils)
    torch.library.opcheck(cuda_ops.gemv.default, (x[:2], gw, randn(gen, 96, dtype=torch.bfloat16), False),
                          test_utils=utils)
    torch.library.opcheck(cuda_ops.gemv.default, (x[:1], gw, None, True), test_utils=utils)
    sx = randn(gen, 17, 576, dtype=torch.bfloat16)
    torch.library.opcheck(cuda_ops.gemm_skinny.default, (sx, gw, None, False), test_utils=utils)
    torch.library.opcheck(cuda_ops.gemm_skinny.default, (sx[:9], gw, randn(gen, 96, dtype=torch.bfloat16), False),
                          test_utils=utils)
    torch.library.opcheck(cuda_ops.gemm_skinny.default, (sx, gw, None, True), test_utils=utils)
    caches = torch.zeros(2, 4, 16, 3, 64, device=DEV)
    torch.library.opcheck(cuda_ops.write_kv_pair.default,
                          (caches[0], caches[1], randn(gen, 3, 3, 64), randn(gen, 3, 3, 64),
                           torch.tensor([5, -1, 9], device=DEV)), test_utils=utils)


def test_layer_ops_replay_in_a_cuda_graph():
    """Norm, rope, cache write, SiLU-and-mul and the GEMVs captured once, replayed over new inputs written in place (new
    slots included): each replay equals the eager ops on the same inputs."""
    r, gen = rng()
    t, hq, hk, d, hidden, inter, nb, bs = 3, 9, 3, 64, 576, 1536, 8, 16
    bf = dict(dtype=torch.bfloat16)
    x, res = randn(gen, t, hidden, **bf), randn(gen, t, hidden, **bf)
    w = randn(gen, hidden, **bf) + 1
    qkv = randn(gen, t, (hq + 2 * hk) * d, **bf)
    cos, sin = randn(gen, t, d, **bf), randn(gen, t, d, **bf)
    gate_up = randn(gen, t, 2 * inter, **bf)
    caches = torch.zeros(2, nb, bs, hk, d, device=DEV, **bf)
    slots = torch.tensor([0, 17, -1], device=DEV)
    proj, mlp = randn(gen, 960, hidden, **bf), randn(gen, 2 * inter, hidden, **bf)

    def layer(qkv, caches):
        out, new_res = ops.fused_add_rmsnorm(x, res, w, 1e-5)
        q, k = qkv[:, :hq * d].view(t, hq, d), qkv[:, hq * d:(hq + hk) * d].view(t, hk, d)
        ops.rope_write_kv(q, k, qkv[:, (hq + hk) * d:].reshape(t, hk, d), cos, sin, caches[0], caches[1], slots)
        return out, new_res, ops.silu_and_mul(gate_up), ops.linear(out[:1], proj), ops.linear_silu_mul(out[:2], mlp)

    layer(qkv.clone(), caches.clone())  # warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = layer(qkv, caches)
    for _ in range(3):
        for buf in (x, res, cos, sin, gate_up):
            buf.copy_(randn(gen, *buf.shape, **bf))
        fresh = randn(gen, *qkv.shape, **bf)
        qkv.copy_(fresh)
        caches.zero_()
        slots.copy_(torch.randperm(nb * bs, generator=gen)[:t].to(DEV))
        graph.replay()
        torch.cuda.synchronize()
        want_caches = torch.zeros_like(caches)
        want = layer(fresh.clone(), want_caches)
        assert all(torch.equal(a, b) for a, b in zip(outs, want))
        assert torch.equal(caches, want_caches) and int((caches != 0).sum()) > 0


def test_dependent_launches_wait_for_their_producers():
    """On sm_90 the norm, rope and GEMV kernels start as programmatic dependents of the kernel before them (the
    GEMV prefetches its weight meanwhile): a chain where each kernel reads the one before it, replayed in a CUDA
    graph and run eagerly, equals the same ops with the device synchronized between them (no overlap)."""
    r, gen = rng()
    hidden, inter, n_qkv, hq, hk, d = 576, 1536, 960, 9, 3, 64
    bf = dict(dtype=torch.bfloat16)
    x, res = randn(gen, 2, hidden, **bf), randn(gen, 2, hidden, **bf)
    w = randn(gen, hidden, **bf) + 1
    w_qkv, w_o = randn(gen, n_qkv, hidden, **bf, scale=0.05), randn(gen, hidden, hq * d, **bf, scale=0.05)
    w_up, w_down = randn(gen, 2 * inter, hidden, **bf, scale=0.05), randn(gen, hidden, inter, **bf, scale=0.05)
    cos, sin = randn(gen, 2, d, **bf), randn(gen, 2, d, **bf)

    def chain(x, res, sync):
        step = torch.cuda.synchronize if sync else (lambda: None)
        h, res = ops.fused_add_rmsnorm(x, res, w, 1e-5); step()
        qkv = ops.linear(h, w_qkv); step()
        q, k = qkv[:, :hq * d].view(2, hq, d), qkv[:, hq * d:(hq + hk) * d].view(2, hk, d)
        ops.rope_inplace(q, k, cos, sin); step()
        o = ops.linear(q.reshape(2, hq * d), w_o); step()
        h, res = ops.fused_add_rmsnorm(o, res, w, 1e-5); step()
        m = ops.linear_silu_mul(h, w_up); step()
        return ops.linear(m, w_down), res

    chain(x, res, False)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = chain(x, res, False)
    for _ in range(10):
        x.copy_(randn(gen, *x.shape, **bf))
        res.copy_(randn(gen, *res.shape, **bf))
        want = chain(x, res, True)
        graph.replay()
        eager = chain(x, res, False)
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) and torch.equal(c, b) for a, b, c in zip(outs, want, eager))


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref.double()).norm() / ref.double().norm().clamp(min=1e-30))


@pytest.mark.parametrize("specs", [((5, 37), (60, 1)), ((200, 1),)], ids=["mixed", "decode"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_model_forward_through_the_kernels(family, specs):
    """A SmolLM2-shaped Llama (and a small Qwen3 with q/k norms) forward served by the kernels: fp32 equals the
    eager forward of before the ops (references on CUDA, old residual structure) to fp32 accuracy; bf16 is as close
    to that fp32 forward as the old eager bf16 forward is (captured layers too), and no layer op fell back. The
    decode-shaped step (one request, one token) runs its projections through the GEMV kernel."""
    shape = SMOLLM2_135M if family == "llama" else dict(hidden=256, heads=8, kv_heads=2, head_dim=128, inter=512)
    m32 = tiny_model(family, torch.float32, device=DEV, **shape)
    m16 = tiny_model(family, torch.bfloat16, device=DEV, **shape)
    with torch.no_grad():
        for (name, p16), (_, p32) in zip(m16.named_parameters(), m32.named_parameters()):
            p16.copy_(p32)
    capture = (0, 1)
    fallbacks = ops.reference_fallbacks()
    with torch.inference_mode():
        ids, meta, caches = step_inputs(m32, device=DEV, specs=specs)
        ref32 = old_forward(m32, ids, meta, [c.clone() for c in caches], capture)
        before = ops.cuda_calls()
        got32 = m32(ids, meta, caches, capture_layer_ids=capture)
        used = {k: v - before.get(k, 0) for k, v in ops.cuda_calls().items()}
        ids, meta, caches16 = step_inputs(m16, device=DEV, specs=specs)
        old16 = old_forward(m16, ids, meta, [c.clone() for c in caches16], capture)
        gemv_before = ops.cuda_calls().get("gemv", 0)
        got16 = m16(ids, meta, caches16, capture_layer_ids=capture)
        gemv_calls = ops.cuda_calls().get("gemv", 0) - gemv_before
    # fp32: no GEMV, the ops as before (Qwen3's q/k norms inside the rope + cache write)
    layer_ops = [QWEN3_ROPE if family == "qwen3" and name == "rope_write_kv" else name for name in LAYER_OPS]
    assert all(used.get(name, 0) > 0 for name in layer_ops), used
    assert gemv_calls == (4 * m16.num_layers if len(specs) == 1 else 0), gemv_calls  # qkv, o, gate_up + SiLU, down
    assert {k: v for k, v in ops.reference_fallbacks().items() if k in layer_ops} == \
        {k: v for k, v in fallbacks.items() if k in layer_ops}
    for got, ref in zip([got32[0], *got32[1]], [ref32[0], *ref32[1]]):
        assert rel_err(got, ref) < 2e-5, rel_err(got, ref)
    for got, old, ref in zip([got16[0], *got16[1]], [old16[0], *old16[1]], [ref32[0], *ref32[1]]):
        err, base = rel_err(got, ref), rel_err(old, ref)
        print(f"{family} bf16: kernels {err:.3e}, old eager {base:.3e}")
        assert got.dtype == torch.bfloat16 and err <= 2 * base + 1e-3, (err, base)


def decode_kernels(layers: int) -> list[str]:
    """CUDA kernels of one batch-1 bf16 decode forward of a SmolLM2-shaped model with `layers` layers."""
    from torch.profiler import ProfilerActivity, profile

    model = tiny_model("llama", torch.bfloat16, device=DEV, **dict(SMOLLM2_135M, layers=layers))
    ids, meta, caches = step_inputs(model, device=DEV, specs=((300, 1),))
    with torch.inference_mode():
        model(ids, meta, caches)  # warm-up (cuBLAS handles, first launches)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            model(ids, meta, caches)
            torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
            and not e.name.startswith(("Memcpy", "Memset"))]


def test_a_decode_layer_is_a_handful_of_kernels():
    """Per decoder layer of a batch-1 decode step: 2 norms, 4 GEMMs, rope, the K+V write, attention and
    SiLU-and-mul (today about 56 launches before the ops); printed for the record, bounded loosely because cuBLAS
    may split a GEMM."""
    two, four = decode_kernels(2), decode_kernels(4)
    per_layer = (len(four) - len(two)) / 2
    print(f"kernels per decode layer: {per_layer}; a 2-layer step: {len(two)}")
    for name in two:
        print("   ", name[:120])
    assert per_layer <= 16, per_layer
