"""The n-gram drafter on the device (engine/speculative/ngram_device.py) through ext.ops.ngram_propose's PyTorch
reference (the CUDA kernel is checked against that reference in tests/ext/test_ngram_gpu.py): the same proposals as
the host drafter (engine/speculative/ngram.py: an incremental index, a different implementation of the rule) call
after call with its calibration learning, for several requests at once; drafting ahead from the emitted tokens
equals drafting from the host's tokens; rows reused, grown and rewritten; and in the engine, tree steps drafted
ahead of their predecessor's results decode exactly as plain decoding."""
from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.speculative.drafter import DraftRequest
from engine.speculative.ngram import NgramDrafter
from engine.speculative.ngram_device import MIN_WIDTH, DeviceNgramDrafter
from tests.engine.test_async_trees import plain_greedy, tree_steps_ahead
from tests.engine.test_cuda_graphs import prompts


def grow(rng: random.Random, toks: list[int], vocab: int) -> list[int]:
    """A few more tokens: half fresh, half copied from earlier (so suffixes recur)."""
    return [rng.randrange(vocab) if rng.random() < 0.5 else toks[-rng.randrange(1, len(toks) + 1)]
            for _ in range(rng.randrange(1, 4))]


def assert_same(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor], where) -> None:
    assert torch.equal(a[1], b[1]), where
    assert torch.equal(a[0], b[0]), where


@pytest.mark.parametrize("seed", range(12))
def test_the_device_rule_equals_the_host_drafter_as_it_learns(seed):
    rng = random.Random(seed)
    vocab = rng.choice([5, 12, 50])
    toks = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
    host, dev = NgramDrafter(vocab, horizon=6), DeviceNgramDrafter(vocab, horizon=6)
    for step in range(25):
        assert_same(host.propose([DraftRequest("a", list(toks))], 8),
                    dev.propose([DraftRequest("a", list(toks))], 8), (seed, step))
        toks += grow(rng, toks, vocab)
    assert sum(host.calibration.seen) > 5 and host.calibration.seen == dev.calibration.seen


def test_a_batch_of_requests_equals_the_host_drafter():
    """Several requests a call, joining and leaving (rows freed and reused), without calibration (the host drafter
    checks and drafts request by request, the device one checks a whole call first)."""
    rng = random.Random(7)
    host, dev = NgramDrafter(30, calibrate=False), DeviceNgramDrafter(30, calibrate=False)
    live = {f"r{i}": [rng.randrange(30) for _ in range(rng.randrange(1, 40))] for i in range(5)}
    for step in range(30):
        batch = sorted(live)
        assert_same(host.propose([DraftRequest(r, list(live[r])) for r in batch], 16),
                    dev.propose([DraftRequest(r, list(live[r])) for r in batch], 16), step)
        for r in batch:
            live[r] += grow(rng, live[r], 30)
        if step % 6 == 5:  # one leaves, a new one comes
            gone = batch[step % len(batch)]
            host.release(gone)
            dev.release(gone)
            del live[gone]
            live[f"n{step}"] = [rng.randrange(30) for _ in range(rng.randrange(1, 20))]
    assert dev.table.shape[0] <= 8  # rows of released requests were reused


@pytest.mark.parametrize("calibrate", [False, True])
def test_drafting_ahead_from_the_emitted_tokens_equals_drafting_from_the_host(calibrate):
    """propose_ahead with the host's tokens one tree step behind and that step's emitted tokens on the device (-1
    padded past each request's count) drafts what propose drafts from the whole history. With calibration the
    ahead drafter checks its tops a step later (against the host's tokens): the same tops, the same observations
    once both have caught up, probabilities a step behind."""
    rng = random.Random(3)
    sync, ahead = DeviceNgramDrafter(20, horizon=5, calibrate=calibrate), \
        DeviceNgramDrafter(20, horizon=5, calibrate=calibrate)
    live = {f"r{i}": [rng.randrange(20) for _ in range(rng.randrange(2, 30))] for i in range(3)}
    before = {r: list(t) for r, t in live.items()}  # the host's tokens, a step behind
    for step in range(20):
        batch = sorted(live)
        want = sync.propose([DraftRequest(r, list(live[r])) for r in batch], 8)
        width = 4
        emitted = torch.full((len(batch), width), -1, dtype=torch.int64)
        for i, r in enumerate(batch):
            new = live[r][len(before[r]):]
            emitted[i, :len(new)] = torch.tensor(new)
        num_new = torch.tensor([len(live[r]) - len(before[r]) for r in batch])
        positions = torch.tensor([len(live[r]) - 1 for r in batch])
        roots = torch.tensor([live[r][-1] for r in batch])
        got = ahead.propose_ahead([DraftRequest(r, list(before[r])) for r in batch], 8, roots, positions, num_new,
                                  emitted_ids=emitted)
        if calibrate:
            assert torch.equal(want[1][..., 0], got[1][..., 0]), step  # the same tops
        else:
            assert_same(want, got, step)
        before = {r: list(t) for r, t in live.items()}
        for r in batch:  # the next step emits 1..4 tokens
            live[r] += grow(rng, live[r], 20)[:width]
    if calibrate:
        for drafter in (sync, ahead):  # both check what is left against the whole history
            drafter.propose([DraftRequest(r, list(live[r])) for r in sorted(live)], 8)
        assert sum(sync.calibration.seen) > 5
        assert sync.calibration.seen == pytest.approx(ahead.calibration.seen)
        assert sync.calibration.hits == pytest.approx(ahead.calibration.hits)


def test_long_histories_grow_the_table_and_a_rewritten_history_is_written_again():
    rng = random.Random(11)
    host, dev = NgramDrafter(40), DeviceNgramDrafter(40)
    toks = [rng.randrange(40) for _ in range(MIN_WIDTH + 300)]
    assert_same(host.propose([DraftRequest("a", toks)], 8), dev.propose([DraftRequest("a", toks)], 8), "long")
    assert dev.table.shape[1] >= MIN_WIDTH + 301
    other = toks[:100] + [(t + 1) % 40 for t in toks[100:400]]  # same id, another history
    host.release("a")
    assert_same(NgramDrafter(40).propose([DraftRequest("a", other)], 8),
                dev.propose([DraftRequest("a", other)], 8), "rewritten")


def test_a_requests_token_view_is_written_as_it_grows_and_a_new_request_under_its_id_is_written_again():
    """Tokens as the engine passes them (a TokenView over the request's own lists): while the same lists come the
    drafter writes only their new tokens; a new request under the same id (other lists, another history) is
    written again from the start."""
    from engine.request import TokenView
    rng = random.Random(5)
    prompt, output = [rng.randrange(30) for _ in range(50)], []
    host, dev = NgramDrafter(30), DeviceNgramDrafter(30)
    for step in range(20):
        output += grow(rng, prompt + output, 30)
        assert_same(host.propose([DraftRequest("a", prompt + output)], 8),
                    dev.propose([DraftRequest("a", TokenView(prompt, output))], 8), step)
    assert dev._slots["a"].tokens == prompt + output
    other = [(t + 1) % 30 for t in prompt + output]  # same id, another request: its own lists
    host.release("a")
    assert_same(host.propose([DraftRequest("a", other)], 8),
                dev.propose([DraftRequest("a", TokenView(other[:40], other[40:]))], 8), "another request")
    assert dev._slots["a"].tokens == other


def test_the_device_drafter_needs_the_emitted_tokens_to_draft_ahead():
    dev = DeviceNgramDrafter(20)
    one = torch.tensor([1])
    with pytest.raises(ValueError, match="emitted"):
        dev.propose_ahead([DraftRequest("a", [1, 2, 1])], 4, one, torch.tensor([3]), one)


@pytest.mark.parametrize("batch", [1, 17])
def test_tree_steps_drafted_ahead_on_the_device_equal_plain_decoding(tiny_checkpoints, batch):
    """The engine with the device drafter, CUDA-graph layout emulated and asynchronous scheduling on: tree steps
    are drafted ahead of their predecessor's results, and greedy output equals plain decoding."""
    folder, _ = tiny_checkpoints("llama")
    ps = prompts(batch)
    params = [SamplingParams(max_tokens=40 - i % 7, temperature=0, ignore_eos=True) for i in range(batch)]
    ref = plain_greedy(folder, ps, params)
    llm = LLM(folder, dtype="fp32", drafter=DeviceNgramDrafter(1000, horizon=6), spec_budget=6, adaptive=False,
              max_num_seqs=32)
    llm.engine.enable_graphs(emulate=True)
    llm.engine.overlap = llm.engine.budgets.pipelined = True
    accepted, step = [], llm.engine.step

    def spy():
        deltas = step()
        if llm.engine.last_stats is not None:
            accepted.extend(llm.engine.last_stats.accepted_per_position)
        return deltas

    llm.engine.step = spy
    out, _, ahead = tree_steps_ahead(llm.engine, ps, params)
    assert out == ref
    assert ahead >= 3, ahead
    assert sum(accepted) > 0  # the drafts were right now and then (the tiny model repeats itself)


def test_plain_steps_ahead_draft_their_curves_from_the_device(tiny_checkpoints, monkeypatch):
    """With a drafter that drafts from the device, a plain step scheduled ahead of its predecessor's results still
    drafts the curves the adaptive budget asks for (its roots are the tokens fed from the device), so those drafts
    do not make the step synchronous; greedy output equals plain decoding."""
    from engine.pending import PendingStep

    folder, _ = tiny_checkpoints("llama")
    ps = prompts(5)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    ref = plain_greedy(folder, ps, params)
    calls, watch_inputs = [], PendingStep.watch_inputs

    def spy(self, watch, *args):
        calls.append(len(watch))
        return watch_inputs(self, watch, *args)

    monkeypatch.setattr(PendingStep, "watch_inputs", spy)
    llm = LLM(folder, dtype="fp32", drafter=DeviceNgramDrafter(1000, horizon=6), spec_budget=6, max_num_seqs=8)
    llm.engine.enable_graphs(emulate=True)
    llm.engine.overlap = True
    out, _, _ = tree_steps_ahead(llm.engine, ps, params)
    assert out == ref
    assert sum(calls) > 0, calls


def test_abort_and_arrival_while_a_tree_step_drafted_on_the_device_runs_ahead(tiny_checkpoints):
    """A request aborted while the tree step after it is in flight frees its row of the token table; a request
    arriving then takes that row (its history written in full) and decodes exactly as plain decoding, as does the
    request that ran throughout."""
    folder, _ = tiny_checkpoints("llama")
    ps = prompts(3)
    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    ref = plain_greedy(folder, ps, sp)
    drafter = DeviceNgramDrafter(1000, horizon=6)
    llm = LLM(folder, dtype="fp32", drafter=drafter, spec_budget=6, adaptive=False, max_num_seqs=8)
    llm.engine.enable_graphs(emulate=True)
    core = llm.engine
    core.overlap = core.budgets.pipelined = True
    ids = [core.add_request(p, sp) for p in ps[:2]]
    out = {i: [] for i in ids}
    while not (core.inflight is not None and core.inflight.step.is_tree_step):
        for d in core.step():
            out[d.request_id].extend(d.new_token_ids)
    assert core.abort(ids[1])
    late = core.add_request(ps[2], sp)
    out[late] = []
    while core.has_unfinished():
        for d in core.step():
            out[d.request_id].extend(d.new_token_ids)
    assert out[ids[0]] == ref[0] and out[late] == ref[2]
    assert drafter.table.shape[0] == 2  # the late request took the aborted one's row (a third would double it)
