"""Long whole prompts through torch's fused attention (cuDNN, else FlashAttention) on CUDA (ext/prefill.py): the
split step is as close to the exact attention as the paged kernel is, cuDNN's padding changes no row, and greedy
decoding of long prompts is unchanged by the route."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from ext import ops, prefill, reference
from tests.ext.gpu_util import cuda_ops, rng  # noqa: F401 (cuda_ops: an autouse fixture)
from tests.ext.prefill_cases import mixed_step

pytestmark = pytest.mark.gpu


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref.double()).norm() / ref.double().norm())


@pytest.mark.parametrize("specs,num_paged", [
    ([(1, 40), (1, 700), (37, 90), (2100, 0), (2300, 0)], 3),  # decodes, a short chunk after context, two prompts
    ([(1, 40), (2100, 3000), (300, 0)], 1),  # a long chunk after cached context (gathered), a prompt after it
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_long_prefill_chunks_take_fused_attention_as_accurately_as_the_kernel(dtype, specs, num_paged):
    r, gen = rng()
    q, k, v, k_cache, v_cache, meta = mixed_step(gen, specs, device="cuda", dtype=dtype, heads=8, kv_heads=2,
                                                 head_dim=128)
    scale = 128 ** -0.5
    meta.dense_prefill_min_tokens = 2048
    exact = reference.paged_attention(q.float(), k_cache.float(), v_cache.float(), meta, scale)
    before = ops.cuda_calls().get("dense_prefill_attention", 0)
    routed = ops.paged_attention(q, k_cache, v_cache, meta, scale, k=k, v=v)
    assert ops.cuda_calls().get("dense_prefill_attention", 0) == before + len(specs) - num_paged
    kernel = ops.paged_attention(q, k_cache, v_cache, meta, scale)
    rows = sum(n for n, _ in specs[:num_paged])  # the other sequences: the kernel again, on a prefix of the step
    for part in (slice(0, rows), slice(rows, None)):
        err, base = rel_err(routed[part], exact[part]), rel_err(kernel[part], exact[part])
        print(f"{dtype} rows {part}: routed {err:.2e}, kernel {base:.2e}")
        assert err <= 2 * base + 1e-6


@pytest.mark.parametrize("step_tokens", [None, 128])  # 128: the prompts are chunked, later chunks after context
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_decoding_of_long_prompts_is_unchanged_by_the_route(tiny_checkpoints, family, step_tokens):
    folder, _ = tiny_checkpoints(family)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in (5, 300, 260)]  # admitted in this order: the prompts last
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)

    def run(min_tokens: int) -> list[list[int]]:
        llm = LLM(folder, dtype="fp32", device="cuda", dense_prefill_min_tokens=min_tokens,
                  max_num_batched_tokens=step_tokens)
        return [o.token_ids for o in llm.generate(prompts, sp)]

    before = ops.cuda_calls()
    routed = run(64)
    after = ops.cuda_calls()
    assert after.get("dense_prefill_attention", 0) > before.get("dense_prefill_attention", 0)
    if step_tokens:
        assert after.get("dense_prefill_context", 0) > before.get("dense_prefill_context", 0)
    assert routed == run(0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cudnn_serves_half_precision_prompts_and_its_padding_changes_no_row(dtype):
    """A 700-row prompt is padded to CUDNN_LENGTH_STEP rows for cuDNN: its rows equal the first 700 rows of the
    1024-row prompt that extends it (causal: no row sees what follows it), and match fp32 attention."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(1024, h, 128, device="cuda", dtype=dtype, generator=gen) for h in (32, 8, 8))
    before = ops.cuda_calls().get("dense_prefill_cudnn", 0)
    full = prefill.causal_self_attention(q, k, v, 128 ** -0.5)
    part = prefill.causal_self_attention(q[:700], k[:700], v[:700], 128 ** -0.5)
    assert ops.cuda_calls().get("dense_prefill_cudnn", 0) == before + 2
    assert 1024 % prefill.CUDNN_LENGTH_STEP == 0 and 700 % prefill.CUDNN_LENGTH_STEP
    torch.testing.assert_close(part, full[:700], rtol=0, atol=0)
    group = 32 // 8
    exact = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(0, 1), k.float().repeat_interleave(group, 1).transpose(0, 1),
        v.float().repeat_interleave(group, 1).transpose(0, 1), is_causal=True, scale=128 ** -0.5).transpose(0, 1)
    assert rel_err(full, exact) < 1e-2


def test_fp32_prompts_take_flash_attention_without_asking_cudnn():
    gen = torch.Generator(device="cuda").manual_seed(4)
    q, k, v = (torch.randn(600, h, 64, device="cuda", generator=gen) for h in (8, 2, 2))
    before = ops.cuda_calls()
    out = prefill.causal_self_attention(q, k, v, 0.125)
    after = ops.cuda_calls()
    assert after.get("dense_prefill_flash", 0) == before.get("dense_prefill_flash", 0) + 1
    assert after.get("dense_prefill_cudnn", 0) == before.get("dense_prefill_cudnn", 0)
    exact = torch.nn.functional.scaled_dot_product_attention(
        q.double().transpose(0, 1), k.double().repeat_interleave(4, 1).transpose(0, 1),
        v.double().repeat_interleave(4, 1).transpose(0, 1), is_causal=True, scale=0.125).transpose(0, 1)
    assert rel_err(out, exact) < 1e-4


def test_a_cudnn_decline_is_logged_once_and_counted(monkeypatch, caplog):
    def declined(*args):
        raise RuntimeError("No available kernel. Aborting execution.")

    monkeypatch.setattr(prefill, "_cudnn_declined", {})
    monkeypatch.setattr(prefill, "_cudnn_attention", declined)
    gen = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.randn(600, h, 64, device="cuda", dtype=torch.bfloat16, generator=gen) for h in (8, 2, 2))
    ops.take_reference_fallbacks()
    with caplog.at_level("WARNING", logger="ddtree.ext"):
        outs = [prefill.causal_self_attention(q, k, v, 0.125) for _ in range(3)]
    assert sum("cuDNN attention declined" in r.message for r in caplog.records) == 1
    assert ops.take_reference_fallbacks().get("dense_prefill_cudnn") == 3
    exact = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(0, 1), k.float().repeat_interleave(4, 1).transpose(0, 1),
        v.float().repeat_interleave(4, 1).transpose(0, 1), is_causal=True, scale=0.125).transpose(0, 1)
    assert all(rel_err(out, exact) < 1e-2 for out in outs)


def test_warm_up_builds_every_padded_length_a_whole_prompt_can_take():
    before = ops.cuda_calls().get("dense_prefill_cudnn", 0)
    lengths = prefill.warm_up({(8, 2, 64), (4, 4, 128)}, torch.bfloat16, torch.device("cuda"), 1000, 2100)
    assert lengths == [512, 1024, 1536, 2048, 2560]  # from 512: a short whole prompt may follow a long one
    assert ops.cuda_calls().get("dense_prefill_cudnn", 0) == before + 10
    assert prefill.warm_up({(8, 2, 64)}, torch.float32, torch.device("cuda"), 1000, 2100) == []
    assert prefill.warm_up({(8, 2, 64)}, torch.bfloat16, torch.device("cuda"), 0, 2100) == []
