"""Long whole prompts through torch's FlashAttention on CUDA (ext/prefill.py): the split step is as close to the
exact attention as the paged kernel is, and greedy decoding of long prompts is unchanged by the route."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from ext import ops, reference
from tests.ext.gpu_util import cuda_ops, rng  # noqa: F401 (cuda_ops: an autouse fixture)
from tests.ext.prefill_cases import mixed_step

pytestmark = pytest.mark.gpu


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref.double()).norm() / ref.double().norm())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_long_prompts_take_flash_attention_as_accurately_as_the_kernel(dtype):
    r, gen = rng()
    specs = [(1, 40), (1, 700), (37, 90), (2100, 0), (2300, 0)]  # decodes, a chunk after context, two prompts
    q, k, v, k_cache, v_cache, meta = mixed_step(gen, specs, device="cuda", dtype=dtype, heads=8, kv_heads=2,
                                                 head_dim=128)
    scale = 128 ** -0.5
    meta.dense_prefill_min_tokens = 2048
    exact = reference.paged_attention(q.float(), k_cache.float(), v_cache.float(), meta, scale)
    before = ops.cuda_calls().get("dense_prefill_attention", 0)
    routed = ops.paged_attention(q, k_cache, v_cache, meta, scale, k=k, v=v)
    assert ops.cuda_calls().get("dense_prefill_attention", 0) == before + 2
    kernel = ops.paged_attention(q, k_cache, v_cache, meta, scale)
    rows = sum(n for n, _ in specs[:3])  # the other sequences: the kernel again, on a prefix of the step
    for part in (slice(0, rows), slice(rows, None)):
        err, base = rel_err(routed[part], exact[part]), rel_err(kernel[part], exact[part])
        print(f"{dtype} rows {part}: routed {err:.2e}, kernel {base:.2e}")
        assert err <= 2 * base + 1e-6


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_decoding_of_long_prompts_is_unchanged_by_the_route(tiny_checkpoints, family):
    folder, _ = tiny_checkpoints(family)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in (5, 300, 260)]  # admitted in this order: the prompts last
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)

    def run(min_tokens: int) -> list[list[int]]:
        llm = LLM(folder, dtype="fp32", device="cuda", dense_prefill_min_tokens=min_tokens)
        return [o.token_ids for o in llm.generate(prompts, sp)]

    before = ops.cuda_calls().get("dense_prefill_attention", 0)
    routed = run(64)
    assert ops.cuda_calls().get("dense_prefill_attention", 0) > before
    assert routed == run(0)
