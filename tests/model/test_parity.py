"""Our models against HF transformers 5.17 (fp32): a tiny random checkpoint of every family, saved by
transformers and loaded by our loader, gives the same logits through the paged cache (prefill, chunked prefill,
32 incremental decode steps, page sizes 1 and 16, batched sequences) and the same greedy tokens."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.block_manager import BlockManager
from engine.model.loader import load_model
from engine.plan import ScheduledSeq, StepPlan
from engine.request import Request
from engine.runner import ModelRunner
from tests.conftest import FAMILIES

NUM_PROMPT, NUM_DECODE = 24, 32


def run_incremental(model, token_lists, chunks, block_size):
    """Feeds each sequence's tokens through our paged cache: first the prompt in `chunks`, then one token per
    step; all sequences step together. Returns per sequence the logits at every position [len, vocab]."""
    blocks = BlockManager(num_blocks=256 // block_size * 8, block_size=block_size)
    runner = ModelRunner(model, blocks.num_blocks, block_size, "cpu", torch.float32)
    reqs = [Request(list(t), SamplingParams()) for t in token_lists]
    schedules = [list(chunks) + [1] * (len(t) - sum(chunks)) for t in token_lists]
    logits = [[] for _ in reqs]
    for step in range(max(len(s) for s in schedules)):
        plan = StepPlan()
        for req, sched in zip(reqs, schedules):
            if step < len(sched):
                blocks.allocate(req, req.num_computed_tokens + sched[step])
                plan.seqs.append(ScheduledSeq(req, sched[step], sample=True))
        input_ids, meta, _ = runner.prepare(plan)
        with torch.inference_mode():
            hidden, _ = model(input_ids, meta, runner.kv_caches)
            out = model.compute_logits(hidden)
        row = 0
        for s in plan.seqs:
            i = reqs.index(s.request)
            logits[i].append(out[row : row + s.num_new_tokens])
            row += s.num_new_tokens
            s.request.num_computed_tokens += s.num_new_tokens
    return [torch.cat(x) for x in logits]


def assert_close(ours: torch.Tensor, ref: torch.Tensor):
    tol = 1e-4 * ref.abs().max().item()
    diff = (ours - ref).abs().max().item()
    assert diff <= tol, f"max |Δlogit| {diff:.3g} > {tol:.3g}"


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("block_size,chunks", [(16, [NUM_PROMPT]), (1, [NUM_PROMPT]), (16, [5, 11, 8]), (1, [7, 17])])
def test_logits_match_transformers(tiny_checkpoints, family, block_size, chunks):
    folder, hf = tiny_checkpoints(family)
    model = load_model(folder, "fp32").model
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 1000, (NUM_PROMPT + NUM_DECODE,), generator=g)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0].float()
    (ours,) = run_incremental(model, [ids.tolist()], chunks, block_size)
    assert_close(ours, ref)


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_sequences_match_transformers(tiny_checkpoints, family):
    """Sequences of different lengths stepping together each equal their own HF forward."""
    folder, hf = tiny_checkpoints(family)
    model = load_model(folder, "fp32").model
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 1000, (n,), generator=g) for n in (NUM_PROMPT + 8, NUM_PROMPT + 3, NUM_PROMPT + 20)]
    outs = run_incremental(model, [s.tolist() for s in seqs], [NUM_PROMPT], block_size=4)
    for s, ours in zip(seqs, outs):
        with torch.no_grad():
            assert_close(ours, hf(s[None]).logits[0].float())


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_match_transformers(tiny_checkpoints, family):
    folder, hf = tiny_checkpoints(family)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 1000, (NUM_PROMPT,), generator=g)
    with torch.no_grad():
        ref = hf.generate(prompt[None], max_new_tokens=32, do_sample=False, min_new_tokens=32,
                          pad_token_id=0)[0, NUM_PROMPT:].tolist()
    llm = LLM(folder, dtype="fp32", block_size=16)
    (out,) = llm.generate([prompt.tolist()], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    assert out.token_ids == ref
    assert out.finish_reason == "length"
