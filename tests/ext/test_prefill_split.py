"""The dense-prefill split on CPU: which sequences take torch's attention (a suffix of long prefill chunks), and
that splitting a step there gives the paged attention of the whole step (the reference on both sides)."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from ext import ops, prefill, reference
from tests.ext.prefill_cases import mixed_step


@pytest.mark.parametrize("specs,first", [
    ([(1, 40), (1, 7), (300, 0), (260, 0)], 2),   # decodes, then two whole prompts
    ([(1, 40), (300, 0), (50, 0)], 1),            # a short prompt after a long one (or padding rows) goes along
    ([(1, 40), (50, 0), (300, 0), (12, 0)], 2),   # a short prompt before the first long one stays paged
    ([(1, 40), (50, 0), (60, 0)], 3),             # no long prompt: nothing
    ([(300, 0), (1, 9), (280, 0)], 2),            # a prompt before a decode stays paged
    ([(1, 40), (300, 20)], 1),                    # a long chunk after cached context is taken
    ([(1, 40), (300, 20), (40, 0)], 1),           # ... with a short prompt after it
    ([(1, 40), (50, 20), (300, 0)], 2),           # a short chunk after cached context stays paged
    ([(300, 20), (50, 10), (280, 0)], 2),         # ... and ends the run
    ([(256, 0)], 0),
    ([(1, 40), (300, 0)], 1),
])
def test_the_dense_suffix_is_long_whole_prompts_at_the_end(specs, first):
    *_, meta = mixed_step(torch.Generator().manual_seed(0), specs)
    assert prefill.dense_suffix(meta, 256) == first
    assert prefill.dense_suffix(meta, 0) == meta.num_seqs  # 0: off


def test_tree_verify_steps_are_never_split():
    *_, meta = mixed_step(torch.Generator().manual_seed(0), [(1, 9), (300, 0)])
    meta.tree_mask = torch.ones(301, 300, dtype=torch.bool).tril()
    assert prefill.dense_suffix(meta, 256) == meta.num_seqs
    with pytest.raises(ValueError):
        meta.prefix(1)


@pytest.mark.parametrize("specs", [
    [(1, 40), (3, 17), (300, 0), (270, 0)],
    [(280, 0)],
    [(1, 33), (5, 0), (290, 0)],
    [(1, 33), (290, 0), (40, 0)],  # padding rows after the prompt
    [(1, 33), (300, 20)],          # a chunk after cached context: its context gathered from the cache
    [(7, 0), (270, 45), (300, 0), (30, 0)],
])
def test_a_split_step_equals_the_paged_attention_of_the_whole_step(specs):
    gen = torch.Generator().manual_seed(len(specs))
    q, k, v, k_cache, v_cache, meta = mixed_step(gen, specs)
    first = prefill.dense_suffix(meta, 256)
    assert first < meta.num_seqs
    scale = 32 ** -0.5
    want = reference.paged_attention(q, k_cache, v_cache, meta, scale)
    got = prefill.split_attention(q, k, v, k_cache, v_cache, meta, first, scale,
                                  lambda rows, sub: reference.paged_attention(rows, k_cache, v_cache, sub, scale))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_cpu_attention_ignores_the_dense_rows():
    """On CPU the reference serves every sequence: passing the dense rows changes nothing."""
    q, k, v, k_cache, v_cache, meta = mixed_step(torch.Generator().manual_seed(5), [(1, 12), (2100, 0)])
    meta.dense_prefill_min_tokens = 1024
    before = ops.cuda_calls()
    got = ops.paged_attention(q, k_cache, v_cache, meta, 0.2, k=k, v=v)
    assert torch.equal(got, reference.paged_attention(q, k_cache, v_cache, meta, 0.2))
    assert ops.cuda_calls() == before


def test_the_engine_setting_reaches_every_layers_attention(tiny_checkpoints, monkeypatch):
    """--dense-prefill-min-tokens travels in each step's metadata to every GQA layer, which passes its dense new
    rows along (on CPU the reference then serves them all)."""
    folder, _ = tiny_checkpoints("qwen3")
    seen = []
    paged = ops.paged_attention

    def spy(q, k_cache, v_cache, meta, scale, k=None, v=None):
        seen.append((meta.dense_prefill_min_tokens, k is not None and v is not None and k.shape[0] == q.shape[0]))
        return paged(q, k_cache, v_cache, meta, scale, k=k, v=v)

    monkeypatch.setattr(ops, "paged_attention", spy)
    llm = LLM(folder, dtype="fp32", dense_prefill_min_tokens=64)
    llm.generate([list(range(1, 90))], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert seen and set(seen) == {(64, True)}
    with pytest.raises(ValueError, match="dense_prefill_min_tokens"):
        EngineConfig(dense_prefill_min_tokens=-1)


class _KernelStandIn:
    """The extension's paged_attention signature served by the reference on CPU tensors (the CUDA door's routing
    and metadata handling run as on the GPU; only the kernel is swapped)."""

    def __init__(self):
        self.calls = []

    def paged_attention(self, q, k_cache, v_cache, qsl, seq_lens, tables, tree_bits, max_q, max_kv, scale):
        from ext.metadata import AttentionMetadata

        assert qsl.dtype == seq_lens.dtype == tables.dtype == torch.int32 and tree_bits is None
        lens = seq_lens.tolist()
        query_lens = (qsl[1:] - qsl[:-1]).tolist()
        self.calls.append((q.shape[0], query_lens, max_q, max_kv))
        meta = AttentionMetadata(positions=torch.zeros(q.shape[0], dtype=torch.int64), slot_mapping=torch.zeros(
            q.shape[0], dtype=torch.int64), query_start_loc=qsl, seq_lens=seq_lens, block_tables=tables,
            block_size=k_cache.shape[1], query_lens_host=query_lens, seq_lens_host=lens)
        return reference.paged_attention(q, k_cache, v_cache, meta, scale)


def test_the_cuda_door_routes_the_suffix_and_hands_the_kernel_the_prefix(monkeypatch):
    stand_in = _KernelStandIn()
    monkeypatch.setattr(ops, "_cuda_ops", lambda t: stand_in)
    specs = [(1, 40), (7, 30), (300, 0), (20, 0)]  # decodes, a chunk after context, a prompt, padding rows
    q, k, v, k_cache, v_cache, meta = mixed_step(torch.Generator().manual_seed(9), specs)
    meta.dense_prefill_min_tokens = 256
    before = ops.cuda_calls().get("dense_prefill_attention", 0)
    got = ops.paged_attention(q, k_cache, v_cache, meta, 0.25, k=k, v=v)
    assert ops.cuda_calls().get("dense_prefill_attention", 0) == before + 2
    assert stand_in.calls == [(8, [1, 7], 7, 41)]  # the kernel saw the first two sequences only
    torch.testing.assert_close(got, reference.paged_attention(q, k_cache, v_cache, meta, 0.25), rtol=1e-5, atol=1e-5)
    meta.dense_prefill_min_tokens = 0  # off: the kernel takes the whole step
    ops.paged_attention(q, k_cache, v_cache, meta, 0.25, k=k, v=v)
    assert stand_in.calls[-1][1] == [1, 7, 300, 20]


def test_warm_up_asks_nothing_off_cuda():
    assert prefill.warm_up({(8, 2, 64)}, torch.bfloat16, torch.device("cpu"), 1000, 2100) == []


def test_an_eager_steps_padding_rows_take_no_attention_call(monkeypatch):
    """An eager step's padding rows (the last sequence, flagged in the metadata) get zeros, not a cuDNN call per
    layer: nothing reads their output. The real rows are unchanged."""
    monkeypatch.setattr(ops, "_cuda_ops", lambda t: _KernelStandIn())
    q, k, v, k_cache, v_cache, meta = mixed_step(torch.Generator().manual_seed(3), [(1, 40), (300, 0), (20, 0)])
    meta.dense_prefill_min_tokens, meta.padded = 256, True
    before = ops.cuda_calls().get("dense_prefill_attention", 0)
    got = ops.paged_attention(q, k_cache, v_cache, meta, 0.25, k=k, v=v)
    assert ops.cuda_calls().get("dense_prefill_attention", 0) == before + 1  # the prompt only
    assert torch.count_nonzero(got[301:]) == 0
    torch.testing.assert_close(got[:301], reference.paged_attention(q, k_cache, v_cache, meta, 0.25)[:301],
                               rtol=1e-5, atol=1e-5)


def test_prepare_inputs_flags_the_padding_rows():
    from engine.inputs import prepare_inputs
    from engine.plan import ScheduledSeq
    from engine.request import Request

    req = Request(list(range(1, 12)), SamplingParams(max_tokens=1))
    req.block_ids = [0]
    seq = ScheduledSeq(req, num_new_tokens=11, sample=True)
    assert prepare_inputs([seq], None, 16, torch.device("cpu"), pad_to=8).meta.padded
    assert prepare_inputs([seq], None, 16, torch.device("cpu"), pad_to=8).meta.query_lens_host == [11, 5]
    assert not prepare_inputs([seq], None, 16, torch.device("cpu")).meta.padded
