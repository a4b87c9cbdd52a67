"""The n-gram drafting kernel (ext/csrc/ngram.cu) against its PyTorch reference (ext/reference/ngram.py), and the
device n-gram drafter in the engine on CUDA: the default `--drafter ngram` drafts there, tree steps are drafted
ahead of their predecessor's results, greedy output equals plain decoding, and sampled requests run beside."""
from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.speculative.drafter import DraftRequest
from engine.speculative.ngram_device import DeviceNgramDrafter
from ext import build, ops, reference
from tests.speculative.test_ddtree_e2e import prompts

pytestmark = pytest.mark.gpu
TOL = 1e-4  # fp32 kernel against the float64 reference


def histories(rng: random.Random, num: int, vocab: int) -> list[list[int]]:
    """Token histories with recurring stretches (copied spans) and fresh tokens, of lengths 1 .. ~3000."""
    out = []
    for _ in range(num):
        t = [rng.randrange(vocab) for _ in range(rng.randrange(1, 8))]
        target = rng.choice([1, 5, 40, 300, 3000])
        while len(t) < target:
            if rng.random() < 0.5:
                start = rng.randrange(len(t))
                t += t[start:start + rng.randrange(1, 12)]
            else:
                t.append(rng.randrange(vocab))
        out.append(t[:target])
    return out


def assert_rows_agree(want: tuple, got: tuple, horizon: int) -> int:
    """Per request, depth by depth: identical ids and log-probs within TOL, or candidates whose scores tie within
    fp32 rounding swapped (then the deeper depths follow another top and are not compared). Returns the rows
    compared."""
    (w_lp, w_ids, w_tops), (g_lp, g_ids, g_tops) = [[t.cpu() for t in x] for x in (want, got)]
    assert torch.equal(w_tops[:, 0], g_tops[:, 0])
    compared = 0
    for i in range(w_lp.shape[0]):
        for d in range(horizon):
            compared += 1
            assert torch.allclose(w_lp[i, d], g_lp[i, d], atol=TOL, rtol=1e-6), (i, d)  # padding sits at ~-1e4
            if torch.equal(w_ids[i, d], g_ids[i, d]):
                continue
            differ = (w_ids[i, d] != g_ids[i, d]).nonzero()[:, 0]
            assert differ.numel() >= 2 and all(  # a swap of near-equal candidates
                (w_lp[i, d, differ] - w_lp[i, d, j]).abs().min() < TOL for j in differ.tolist()), (i, d)
            break
    return compared


@pytest.mark.parametrize("calibrate", [False, True])
@pytest.mark.parametrize("vocab", [7, 50, 32000])
def test_kernel_equals_reference(vocab, calibrate):
    assert build.load_ops() is not None, build.load_error()
    rng = random.Random(vocab + calibrate)
    hist = histories(rng, 48, vocab)
    horizon, k = 8, min(16, vocab)
    width = max(map(len, hist)) + 16
    table = torch.zeros((64, width), dtype=torch.int32)
    rows = torch.tensor(rng.sample(range(64), len(hist)))
    for r, t in zip(rows.tolist(), hist):
        table[r, :len(t)] = torch.tensor(t)
    # half the requests also get 1..5 emitted tokens written first (the previous step's, drafted ahead)
    num_new = torch.tensor([rng.randrange(1, 6) if rng.random() < 0.5 and len(t) > 6 else 0 for t in hist])
    emitted = torch.full((len(hist), 5), -1, dtype=torch.int64)
    for i, (t, n) in enumerate(zip(hist, num_new.tolist())):
        if n:
            emitted[i, :n] = torch.tensor(t[len(t) - n:])
            table[rows[i], len(t) - n:len(t)] = 0  # not there until the kernel writes them
    roots = torch.tensor([len(t) - 1 for t in hist])
    cal = torch.tensor([[rng.random() * 5 for _ in range(30)], [5 + rng.random() * 5 for _ in range(30)]],
                       dtype=torch.float64)
    args = (horizon, k, vocab, 4, 32, 0.1, 1.0, 2.0)
    cal = cal if calibrate else None
    ref_table = table.clone()
    want = reference.ngram_propose(ref_table, rows, roots, emitted, num_new, cal, *args)
    gpu_table = table.cuda()
    before = ops.cuda_calls().get("ngram_propose", 0)
    got = ops.ngram_propose(gpu_table, rows.cuda(), roots.cuda(), emitted.cuda(), num_new.cuda(),
                            cal.cuda() if cal is not None else None, *args)
    assert ops.cuda_calls().get("ngram_propose", 0) == before + 1
    assert torch.equal(gpu_table.cpu(), ref_table)  # the emitted tokens written where the reference writes them
    assert assert_rows_agree(want, got, horizon) >= len(hist)
    matched = want[2][:, 0] >= 0
    assert matched.sum() >= len(hist) // 2  # most histories had a suffix to continue
    assert torch.equal(want[2][matched, 1], got[2][matched, 1].cpu())  # the depth-1 tops (never after a swap)


def test_calibration_on_cuda_learns_as_on_the_cpu_through_reused_read_back_buffers():
    """The device drafter on CUDA over calls of changing batches (requests joining and leaving), each call's tops
    read back once landed (synchronized here, so at the next call, as on the CPU): its drafts and calibration
    equal the CPU drafter's, and its read-back copies go through a few reused pinned buffers, not one each."""
    assert build.load_ops() is not None, build.load_error()
    rng = random.Random(3)
    vocab = 32000
    cpu, gpu = DeviceNgramDrafter(vocab), DeviceNgramDrafter(vocab, device="cuda")
    live = dict(zip("abc", histories(rng, 3, vocab)))
    buffers = {}  # id -> the read-back buffer (held, so no id is reused)
    for step in range(30):
        batch = [DraftRequest(r, list(t)) for r, t in live.items() if rng.random() < 0.8] or \
            [DraftRequest(r, list(t)) for r, t in live.items()]
        want = cpu.propose(batch, 8)
        got = gpu.propose(batch, 8)
        torch.cuda.synchronize()
        buffers.update((id(h), h) for _, h, _ in gpu._readbacks)
        assert torch.equal(want[1], got[1].cpu()) and torch.allclose(want[0], got[0].cpu(), atol=TOL), step
        for r in live:  # each grows by a copied stretch or a fresh token
            t = live[r]
            start = rng.randrange(len(t))
            live[r] = t + (t[start:start + rng.randrange(1, 6)] if rng.random() < 0.7 else [rng.randrange(vocab)])
    assert sum(cpu.calibration.seen) > 20
    assert cpu.calibration.seen == pytest.approx(gpu.calibration.seen)
    assert cpu.calibration.hits == pytest.approx(gpu.calibration.hits)
    assert len(buffers) <= 6  # 30 calls over 3 batch sizes (without reuse: one a call)


def test_the_engine_drafts_on_the_device_ahead_of_results(tiny_checkpoints):
    """--drafter ngram on CUDA is the device drafter; with asynchronous scheduling (CUDA's default) tree steps are
    drafted ahead, the kernel serves every draft, greedy output equals plain decoding, and sampled requests (T > 0,
    top_p) run beside greedy ones."""
    assert build.load_ops() is not None, build.load_error()
    folder, _ = tiny_checkpoints("llama")
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    ref = [o.token_ids for o in LLM(folder, dtype="fp32", device="cuda").generate(prompts(), greedy)]
    llm = LLM(folder, dtype="fp32", device="cuda", drafter="ngram", spec_budget=6, adaptive=False)
    core = llm.engine
    assert isinstance(core.speculator.drafter, DeviceNgramDrafter) and core.overlap
    schedulings, step = [], core.step

    def spy():
        deltas = step()
        if core.last_stats is not None and any(core.last_stats.spec_budgets):
            schedulings.append(core.last_stats.scheduling)
        return deltas

    core.step = spy
    fallbacks = ops.reference_fallbacks().get("ngram_propose", 0)
    assert [o.token_ids for o in llm.generate(prompts(), greedy)] == ref
    assert schedulings.count("ahead") >= 3, schedulings
    assert ops.reference_fallbacks().get("ngram_propose", 0) == fallbacks
    sampled = [SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True)
               for i in range(len(ref))]
    outs = llm.generate(prompts() * 2, [greedy] * len(ref) + sampled)
    assert [o.token_ids for o in outs[:len(ref)]] == ref
    assert all(len(o.token_ids) == 40 for o in outs[len(ref):])


def test_switches_into_and_out_of_trees_run_ahead_on_cuda(tiny_checkpoints):
    """Captured graphs, the root-only round graphs among them: with the adaptive budget's answers alternating
    (tests/engine/test_async_switches.py), every decoding step runs ahead (switches included), root-only steps
    replay a whole round, greedy output equals plain decoding, and seeded sampling equals the same engine stepping
    synchronously."""
    from tests.engine.test_async_switches import alternating, step_kinds

    assert build.load_ops() is not None, build.load_error()
    folder, _ = tiny_checkpoints("llama")
    ps = prompts()
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    ref = [o.token_ids for o in LLM(folder, dtype="fp32", device="cuda").generate(ps, greedy)]
    sampled = [SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True)
               for i in range(len(ps))]
    outs = {}
    for overlap in (True, False):
        core = LLM(folder, dtype="fp32", device="cuda", drafter="ngram", spec_budget=6,
                   async_scheduling=overlap).engine
        assert core.runner.rounds is not None and core.overlap == overlap
        alternating(core)
        modes = []
        got, kinds = step_kinds(core, ps, [greedy] * len(ps), modes)
        assert got == ref
        if overlap:
            assert all(mode == "ahead" for _, mode in kinds[2:]), kinds
            assert "tree" in {k for k, _ in kinds}, kinds
            assert ("root-only", "replay: whole round") in modes, modes  # the width-1 round graphs replayed
        outs[overlap] = step_kinds(core, ps, sampled)[0]
    assert outs[True] == outs[False]
