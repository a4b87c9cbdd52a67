"""The decoder-layer ops on CPU: their PyTorch twins are bit-for-bit the eager math they replaced, the ops serve
them on CPU tensors, a reference call on CUDA tensors is counted as a fallback, and the Llama / Qwen3 forward with
the fused residual stream is bit-identical to the old h + attn(norm(h)) structure, captured layers included."""
from __future__ import annotations

import logging

import pytest
import torch

from engine.model.layers import RMSNorm
from ext import build, dispatch, layer_ops, ops, reference
from tests.ext.layer_cases import (SMOLLM2_135M, old_apply_rope, old_forward, old_rms_norm, old_silu_and_mul,
                                   step_inputs, tiny_model)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_twins_are_the_old_eager_math(dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3, 40, generator=gen).to(dtype)
    res = torch.randn(7, 3, 40, generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(40, generator=gen)).to(dtype)
    out, same = reference.fused_add_rmsnorm(x, None, w, 1e-6)
    assert same is x and torch.equal(out, old_rms_norm(x, w, 1e-6))
    out, new_res = reference.fused_add_rmsnorm(x, res, w, 1e-6)
    assert torch.equal(new_res, res + x)  # the old stream: h + attn_out
    assert torch.equal(out, old_rms_norm(res + x, w, 1e-6))
    w32 = w.float()  # an fp32 weight promotes, as the eager multiply does
    assert torch.equal(reference.fused_add_rmsnorm(x, None, w32, 1e-6)[0], old_rms_norm(x, w32, 1e-6))

    qkv = torch.randn(5, (4 + 2 + 2) * 16, generator=gen).to(dtype)
    q, k = qkv[:, :64].view(5, 4, 16), qkv[:, 64:96].view(5, 2, 16)
    cos, sin = torch.randn(5, 16, generator=gen).to(dtype), torch.randn(5, 16, generator=gen).to(dtype)
    want_q, want_k, v_before = old_apply_rope(q, cos, sin), old_apply_rope(k, cos, sin), qkv[:, 96:].clone()
    reference.rope_inplace(q, k, cos, sin)
    assert torch.equal(q, want_q) and torch.equal(k, want_k) and torch.equal(qkv[:, 96:], v_before)

    gate_up = torch.randn(6, 2 * 24, generator=gen).to(dtype)
    assert torch.equal(reference.silu_and_mul(gate_up), old_silu_and_mul(gate_up))

    caches = torch.randn(2, 4, 8, 2, 16, generator=gen).to(dtype)
    expect = caches.clone()
    slots = torch.tensor([3, -1, 17, 30, 0])
    reference.write_kv(expect[0], qkv[:, 64:96].view(5, 2, 16), slots)
    reference.write_kv(expect[1], qkv[:, 96:].reshape(5, 2, 16), slots)
    reference.write_kv_pair(caches[0], caches[1], qkv[:, 64:96].view(5, 2, 16), qkv[:, 96:].reshape(5, 2, 16), slots)
    assert torch.equal(caches, expect)


def test_cpu_ops_are_the_twins():
    gen = torch.Generator().manual_seed(1)
    before = ops.cuda_calls()
    ops.take_reference_fallbacks()
    x, res = torch.randn(9, 64, generator=gen), torch.randn(9, 64, generator=gen)
    w = torch.randn(64, generator=gen)
    for r in (None, res):
        got, want = ops.fused_add_rmsnorm(x, r, w, 1e-5), reference.fused_add_rmsnorm(x, r, w, 1e-5)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert ops.fused_add_rmsnorm(x, None, w, 1e-5)[1] is x
    q, k = torch.randn(9, 4, 16, generator=gen), torch.randn(9, 2, 16, generator=gen)
    cos, sin = torch.randn(9, 16, generator=gen), torch.randn(9, 16, generator=gen)
    q2, k2 = q.clone(), k.clone()
    ops.rope_inplace(q, k, cos, sin)
    reference.rope_inplace(q2, k2, cos, sin)
    assert torch.equal(q, q2) and torch.equal(k, k2)
    assert torch.equal(ops.silu_and_mul(x), reference.silu_and_mul(x))
    kc, vc = torch.zeros(3, 4, 2, 16), torch.zeros(3, 4, 2, 16)
    slots = torch.tensor([0, 5, -1, 11, 2, 3, 4, 6, 7])
    ops.write_kv_pair(kc, vc, k, k * 2, slots)
    assert torch.equal(kc.view(-1, 2, 16)[slots[slots >= 0]], k[slots >= 0])
    assert torch.equal(vc.view(-1, 2, 16)[slots[slots >= 0]], 2 * k[slots >= 0])
    q3, k3, kc3, vc3 = q2.clone(), k2.clone(), torch.zeros_like(kc), torch.zeros_like(vc)
    ops.rope_write_kv(q3, k3, k * 2, cos, sin, kc3, vc3, slots)
    reference.rope_inplace(q2, k2, cos, sin)
    reference.write_kv_pair(kc, vc, k2, k * 2, slots)
    assert torch.equal(q3, q2) and torch.equal(k3, k2) and torch.equal(kc3, kc) and torch.equal(vc3, vc)
    assert ops.take_reference_fallbacks() == {} and ops.cuda_calls() == before


def test_few_row_products_go_to_the_kernel_measured_faster():
    """The routing of ext.ops.linear on CUDA (shapes only, so meta tensors stand in): the GEMV for 1-2 rows; the
    tensor-core GEMM for 3-8 rows of weights up to 128 MB and 9-32 rows of weights up to 40 MB with K a multiple of
    32 (Qwen3-8B: every layer projection but gate_up at 3-8 rows, o_proj at 9-32; SmolLM2: every layer projection);
    cuBLAS for the rest (vocabulary projections above 2 rows, gate_up above 2, more than 32 rows, other K)."""
    def kernel(rows, n, k):
        return layer_ops._few_rows_kernel(torch.empty(rows, k, device="meta", dtype=torch.bfloat16),
                                          torch.empty(n, k, device="meta", dtype=torch.bfloat16), rows)

    qwen3 = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
             "lm_head": (151936, 4096)}
    assert {name: kernel(1, *shape) for name, shape in qwen3.items()} == dict.fromkeys(qwen3, "gemv")
    assert {name: kernel(2, *shape) for name, shape in qwen3.items()} == dict.fromkeys(qwen3, "gemv")
    for rows in (3, 8):
        assert {name: kernel(rows, *shape) for name, shape in qwen3.items()} == {
            "qkv": "gemm_skinny", "o": "gemm_skinny", "gate_up": None, "down": "gemm_skinny", "lm_head": None}
    for rows in (9, 17, 32):
        assert {name: kernel(rows, *shape) for name, shape in qwen3.items()} == {
            "qkv": None, "o": "gemm_skinny", "gate_up": None, "down": None, "lm_head": None}
    smollm2 = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
    for rows in (3, 17, 32):
        assert {name: kernel(rows, *shape) for name, shape in smollm2.items()} == dict.fromkeys(smollm2, "gemm_skinny")
    assert kernel(33, 576, 576) is None and kernel(17, 64, 48) is None
    assert kernel(0, 64, 64) is None  # an empty product is cuBLAS's (both kernels refuse zero rows)


@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rope_write_kv_is_qwen3s_attention_prologue(dtype):
    """Qwen3's q/k norm, rope and cache write in one op, in place on views of the qkv projection: equal to
    transformers' own Qwen3RMSNorm and apply_rotary_pos_emb on the same inputs (the cache gets the roped k, v)."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(3)
    t, hq, hk, d, eps = 5, 4, 2, 32, 1e-6
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=gen).to(dtype)
    q, k, v = qkv[:, :hq * d].view(t, hq, d), qkv[:, hq * d:(hq + hk) * d].view(t, hk, d), qkv[:, (hq + hk) * d:]
    v = v.view(t, hk, d)
    cos, sin = torch.randn(t, d, generator=gen).to(dtype), torch.randn(t, d, generator=gen).to(dtype)
    norms = []
    for _ in range(2):
        norm = Qwen3RMSNorm(d, eps=eps).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(1 + 0.1 * torch.randn(d, generator=gen))
        norms.append(norm)
    with torch.no_grad():  # HF's layout: [batch, heads, tokens, head_dim]
        hf_q, hf_k = apply_rotary_pos_emb(norms[0](q).transpose(0, 1)[None], norms[1](k).transpose(0, 1)[None],
                                          cos[None], sin[None])
    want_v = v.clone()
    caches = torch.zeros(2, 3, 4, hk, d, dtype=dtype)
    slots = torch.tensor([0, 5, -1, 11, 2])
    ops.qk_norm_rope_write_kv(q, k, v, cos, sin, caches[0], caches[1], slots, norms[0].weight.detach(),
                              norms[1].weight.detach(), eps)
    tol = dict(rtol=0, atol=0) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(q, hf_q[0].transpose(0, 1), **tol)
    torch.testing.assert_close(k, hf_k[0].transpose(0, 1), **tol)
    written = slots >= 0
    assert torch.equal(caches[0].view(-1, hk, d)[slots[written]], k[written])
    assert torch.equal(caches[1].view(-1, hk, d)[slots[written]], want_v[written])


def test_rmsnorm_module_keeps_its_one_argument_form():
    norm = RMSNorm(32, 1e-6)
    x, r = torch.randn(3, 32), torch.randn(3, 32)
    assert torch.equal(norm(x), old_rms_norm(x, norm.weight, 1e-6))
    out, stream = norm(x, r)
    assert torch.equal(stream, r + x) and torch.equal(out, old_rms_norm(r + x, norm.weight, 1e-6))


def test_layer_op_fallbacks_are_counted(monkeypatch, caplog):
    """CUDA-looking tensors without the extension: every decoder-layer op runs its twin, counted and warned."""
    monkeypatch.setattr(dispatch, "_on_cuda", lambda t: True)
    monkeypatch.setattr(build, "load_ops", lambda verbose=False: None)
    monkeypatch.setattr(build, "load_error", lambda: "no CUDA compiler (test)")
    monkeypatch.setattr(dispatch, "_warned", set())
    ops.take_reference_fallbacks()
    x = torch.randn(4, 32)
    with caplog.at_level(logging.WARNING, logger="ddtree.ext"):
        ops.fused_add_rmsnorm(x, x, torch.ones(32), 1e-6)
        ops.fused_add_rmsnorm(x, None, torch.ones(32), 1e-6)
        ops.rope_inplace(x.view(4, 2, 16), x.clone().view(4, 2, 16), torch.ones(4, 16), torch.zeros(4, 16))
        ops.silu_and_mul(x)
        ops.write_kv_pair(torch.zeros(2, 4, 32), torch.zeros(2, 4, 32), x, x, torch.tensor([0, 1, -1, 7]))
        # the fused rope + cache write without the extension: its two reference halves, each counted
        ops.rope_write_kv(x.view(4, 2, 16), x.clone().view(4, 2, 16), x.view(4, 2, 16), torch.ones(4, 16),
                          torch.zeros(4, 16), torch.zeros(2, 4, 2, 16), torch.zeros(2, 4, 2, 16),
                          torch.tensor([0, 1, -1, 7]))
        # Qwen3's norms + rope + cache write: the norms' and the rope + cache write's reference halves
        ops.qk_norm_rope_write_kv(x.clone().view(4, 2, 16), x.clone().view(4, 2, 16), x.view(4, 2, 16),
                                  torch.ones(4, 16), torch.zeros(4, 16), torch.zeros(2, 4, 2, 16),
                                  torch.zeros(2, 4, 2, 16), torch.tensor([0, 1, -1, 7]), torch.ones(16),
                                  torch.ones(16), 1e-6)
    assert ops.take_reference_fallbacks() == {"fused_add_rmsnorm": 4, "rope_inplace": 3, "silu_and_mul": 1,
                                              "write_kv_pair": 3}
    assert len([r for r in caplog.records if r.name == "ddtree.ext"]) == 4


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_residual_forward_is_bit_identical(family, dtype):
    """The (x, residual) layers and the final fused norm give exactly the old forward: hidden states, the
    captured layers (the residual stream after layer i; the last one after the final norm) and the KV caches."""
    shape = dict(SMOLLM2_135M, layers=3) if family == "llama" else {}
    model = tiny_model(family, dtype, **shape)
    ids, meta, caches = step_inputs(model)
    old_caches = [c.clone() for c in caches]
    capture = (2, 0, 1)
    with torch.inference_mode():
        out, captured = model(ids, meta, caches, capture_layer_ids=capture)
        want, want_captured = old_forward(model, ids, meta, old_caches, capture_layer_ids=capture)
    assert out.dtype == dtype and torch.equal(out, want)
    assert len(captured) == 3 and all(torch.equal(a, b) for a, b in zip(captured, want_captured))
    assert torch.equal(captured[0], out)  # layer 2 is the last: taken after the final norm, as HF
    assert all(torch.equal(a, b) for a, b in zip(caches, old_caches))
