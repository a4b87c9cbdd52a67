"""Admission steps as graph replays (engine/admission.py), on the CPU with the graph layout emulated (the same
static buffers and padding, run eagerly): prompt chunks beside decoding requests run as causal pieces of the
prompt buckets, one a replay, chunks longer than the widest one in several, the decoding rows' tokens chosen by the
plain-decoding sampling graph, and the output equals an engine without graphs, greedy and seeded, with plain
decoding and with DDTree trees beside the pieces; with --admission-decode-rows the prompt chunks run as one-row
requests in one plain-decoding replay beside the decoders, with the same output. The GPU test replays real graphs
(tests/ext/test_engine_gpu.py)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine import LLM, SamplingParams, admission, cuda_graphs
from engine.admission import Piece, pick_rows, plan_replays, rows_as_decodes
from engine.staging import Staging
from engine.speculative.oracle import OracleDrafter
from tests.engine.test_cuda_graphs import graph_modes
from tests.speculative.test_ddtree_e2e import golden_lookup


def staggered(n: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """n distinct prompts of 3..40 tokens (one of 80: past MAX_REPLAYS pieces of 9) and output lengths 4..24:
    behind 3 seats, requests finish apart and admissions run beside decoding ones."""
    g = torch.Generator().manual_seed(seed)
    lengths = [int(torch.randint(3, 40, (1,), generator=g)) for _ in range(n - 1)] + [80]
    ps = [torch.randint(0, 1000, (k,), generator=g).tolist() for k in lengths]
    return ps, [int(torch.randint(4, 25, (1,), generator=g)) for _ in range(n)]


def run(llm, ps, max_tokens, temperature=0.0):
    params = [SamplingParams(max_tokens=m, temperature=temperature, seed=i, ignore_eos=True)
              for i, m in enumerate(max_tokens)]
    return graph_modes(llm, ps, params=params)


@pytest.fixture
def narrow_prompt_graphs(monkeypatch):
    """Prompt pieces of at most 9 rows, so the test's prompts need several replays."""
    monkeypatch.setattr(cuda_graphs, "PROMPT_WIDTHS", (5, 9))


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_admission_steps_replay_prompt_pieces_as_eager_computes_them(tiny_checkpoints, narrow_prompt_graphs,
                                                                     temperature):
    folder, _ = tiny_checkpoints("llama")
    ps, max_tokens = staggered(9)
    ref, _ = run(LLM(folder, dtype="fp32", max_num_seqs=3), ps, max_tokens, temperature)
    llm = LLM(folder, dtype="fp32", max_num_seqs=3, admission_decode_rows=0)  # pieces, not one-row requests
    llm.engine.enable_graphs(emulate=True)
    graphs = llm.engine.runner.plain_graphs
    chosen, tokens = [], graphs.tokens
    graphs.tokens = lambda *args: chosen.append(tokens(*args)) or chosen[-1]  # (called by admission steps only)
    out, modes = run(llm, ps, max_tokens, temperature)
    assert out == ref
    assert "replay: admission" in modes, modes
    assert chosen and all(t is not None for t in chosen)  # the decoders' tokens chosen by the sampling graph
    assert f"eager: prompt chunks beyond {admission.MAX_REPLAYS} replays" in modes, modes  # the 60-token prompt


@pytest.mark.parametrize("overlap", [False, True], ids=["synchronous", "ahead"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_admission_steps_as_decode_rows_equal_eager_steps(tiny_checkpoints, narrow_prompt_graphs, temperature,
                                                          overlap, monkeypatch):
    """Prompt chunks as one-row requests (causal through their KV lengths) beside the decoding rows, in one replay
    of a plain bucket past max_num_seqs, their tokens and the decoders' chosen by its sampling graph: the output of
    an engine without graphs, also when the step is launched ahead (the decoders' tokens fed from the device); the
    80-token prompt (82 rows past the 48-row bucket) replays as pieces instead."""
    folder, _ = tiny_checkpoints("llama")
    ps, max_tokens = staggered(9)
    ref, _ = run(LLM(folder, dtype="fp32", max_num_seqs=3), ps, max_tokens, temperature)
    llm = LLM(folder, dtype="fp32", max_num_seqs=3, admission_decode_rows=40)
    llm.engine.enable_graphs(emulate=True)
    llm.engine.overlap = overlap
    assert llm.engine.runner.graphs.row_sizes == [4, 6, 8, 12, 16, 24, 32, 48]
    runner, ahead = llm.engine.runner, []
    rows = runner._admission_rows

    def spy(prompts, decoders, watched, ahead_ids, *args):
        ahead.append(ahead_ids is not None)
        return rows(prompts, decoders, watched, ahead_ids, *args)

    monkeypatch.setattr(runner, "_admission_rows", spy)
    out, modes = run(llm, ps, max_tokens, temperature)
    assert out == ref
    assert "replay: admission rows" in modes, modes
    assert any(ahead) == overlap, ahead
    assert f"eager: prompt chunks beyond {admission.MAX_REPLAYS} replays" in modes, modes  # the 80-token prompt


def test_dflash_drafts_alike_from_admission_rows(tiny_checkpoints, tmp_path):
    """A DFlash drafter reads the target's features of every prompt row: run as one-row requests the rows give it
    the features prompt pieces give (its drafts agree within fp32 rounding), and greedy output equals plain
    decoding's."""
    from tests.engine.test_async_trees import dflash_setup

    folder, ps, params, ref = dflash_setup(tiny_checkpoints, tmp_path, "cpu")
    drafts, modes = {}, {}
    for rows in (0, 64):
        llm = LLM(folder, dtype="fp32", drafter="dflash", draft_model=str(tmp_path), spec_budget=6, adaptive=True,
                  max_num_seqs=2, admission_decode_rows=rows)
        llm.engine.enable_graphs(emulate=True)
        drafter, calls = llm.engine.speculator.drafter, drafts.setdefault(rows, [])
        propose = drafter.propose

        def spy(batch, top_k, propose=propose, calls=calls):
            out = propose(batch, top_k)
            calls.append(out[0].clone())
            return out

        drafter.propose = spy
        out, modes[rows] = graph_modes(llm, ps, params=params)
        assert out == ref
    assert "replay: admission rows" in modes[64] and "replay: admission rows" not in modes[0], modes
    assert len(drafts[0]) == len(drafts[64]) > 0
    for want, got in zip(drafts[0], drafts[64]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_admission_decode_rows_are_a_cli_flag_and_never_negative():
    """On by default (256 rows: on an H100 at batch 64 it took a loaded run from 31,231 to 37,570 tok/s,
    docs/BENCHMARKS.md); --admission-decode-rows 0 turns it off."""
    from engine.config import EngineConfig
    from server.cli import engine_config, parser

    with pytest.raises(ValueError, match="admission_decode_rows"):
        EngineConfig(admission_decode_rows=-1)
    assert EngineConfig().admission_decode_rows == 256
    args = parser().parse_args(["serve"])
    assert engine_config(args).admission_decode_rows == 256
    args = parser().parse_args(["serve", "--admission-decode-rows", "0"])
    assert engine_config(args).admission_decode_rows == 0


def test_admission_rows_buckets_reach_past_max_num_seqs(caplog):
    """The plain buckets captured for admission rows: past max_num_seqs up to the one holding max_num_seqs + N rows
    (the largest batch size when none does), within the step's token budget; none without the flag."""
    def sizes(max_num_seqs, rows, max_tokens=8192):
        graphs = cuda_graphs.CudaGraphs(None, [], 16, list(range(17)), max_num_seqs, 1, max_tokens, 64, 4, (),
                                        torch.device("cpu"), emulate=True, admission_rows=rows)
        return graphs.row_sizes, graphs.max_decode_rows

    assert sizes(64, 0) == ([], 64)
    assert sizes(64, 128) == ([96, 128, 192], 192)
    assert sizes(256, 1000) == ([384, 512], 512)
    assert sizes(64, 1000, max_tokens=300) == ([96, 128, 192, 256], 256)
    with caplog.at_level("WARNING", logger="ddtree.engine"):
        assert sizes(512, 64) == ([], 512)  # nothing past the largest batch size: said once
    assert "no plain bucket past 512 requests" in caplog.text


def test_decode_rows_of_an_admission_step():
    """Two prompt chunks and two decoders as one-row requests: each prompt row's KV length ends at its own token,
    the rows a step samples are each sampling chunk's last and the decoders', the fed rows the decoders ahead."""
    def seq(prompt, computed, n, sample, ahead=0, blocks=(7, 3)):
        req = SimpleNamespace(num_computed_tokens=computed, num_tokens=len(prompt), block_ids=list(blocks),
                              token_ids=lambda a, b: prompt[a:b])
        return SimpleNamespace(request=req, num_new_tokens=n, sample=sample, num_ahead=ahead)

    first = seq(list(range(100, 120)), 2, 3, False)  # a middle chunk: tokens 2..4, nothing sampled
    second = seq([5, 6, 7], 0, 3, True, blocks=(9,))
    decoders = [seq(list(range(30)), 29, 1, True, ahead=1, blocks=(1, 2)), seq([1, 2], 1, 1, True, blocks=(4,))]
    rows = rows_as_decodes([first, second], decoders, 16, 8)
    assert rows.ids == [102, 103, 104, 5, 6, 7, 0, 2]
    assert rows.positions == [2, 3, 4, 0, 1, 2, 30, 1]  # (the decoder ahead: past its 30 host tokens)
    assert rows.slots == [7 * 16 + 2, 7 * 16 + 3, 7 * 16 + 4, 9 * 16, 9 * 16 + 1, 9 * 16 + 2, 2 * 16 + 14, 4 * 16 + 1]
    assert rows.seq_lens == [3, 4, 5, 1, 2, 3, 31, 2]
    assert rows.sampled == [5, 6, 7] and rows.fed == [6]
    assert rows.tables[:3] == [[7, 3]] * 3 and rows.seqs[3] is second
    assert rows_as_decodes([first, second], decoders, 16, 7) == "8 rows past the largest plain bucket (7)"
    long = seq(list(range(300)), 0, 200, True)
    assert "keys" in rows_as_decodes([long], decoders, 16, 512)
    values = torch.arange(10) * 10
    assert pick_rows(values, [5, 6, 7], Staging("cpu")).tolist() == [50, 60, 70]
    assert pick_rows(values, [2, 6, 7], Staging("cpu")).tolist() == [20, 60, 70]


def test_trees_beside_prompt_pieces_equal_plain_greedy(tiny_checkpoints, narrow_prompt_graphs, monkeypatch):
    folder, _ = tiny_checkpoints("llama")
    ps, max_tokens = staggered(7, seed=1)
    ref, _ = run(LLM(folder, dtype="fp32", max_num_seqs=3), ps, max_tokens)
    oracle = OracleDrafter(golden_lookup([(p + r, len(p)) for p, r in zip(ps, ref)]), 1000, horizon=7,
                           noise=0.3, noise_rank=2, seed=1)
    llm = LLM(folder, dtype="fp32", drafter=oracle, spec_budget=3, adaptive=False, max_num_seqs=3)
    llm.engine.enable_graphs(emulate=True)
    launched = []
    launch = llm.engine.runner._launch_admission

    def spy(plain, batch, *args):
        launched.append(batch is not None)
        return launch(plain, batch, *args)

    monkeypatch.setattr(llm.engine.runner, "_launch_admission", spy)
    out, modes = run(llm, ps, max_tokens)
    assert out == ref
    assert "replay: admission" in modes and any(launched), (modes, launched)  # trees replayed beside pieces


def test_each_piece_of_a_chunk_replays_in_order():
    graphs = SimpleNamespace(prompt_widths=[5, 9])
    prompts = [SimpleNamespace(num_new_tokens=k) for k in (20, 3, 9)]
    assert plan_replays(prompts, graphs) == [Piece(0, 0, 9), Piece(0, 9, 9), Piece(0, 18, 2), Piece(1, 0, 3),
                                             Piece(2, 0, 9)]
    long = [SimpleNamespace(num_new_tokens=9 * admission.MAX_REPLAYS + 1)]
    assert plan_replays(long, graphs) == f"prompt chunks beyond {admission.MAX_REPLAYS} replays"
    assert plan_replays(prompts, SimpleNamespace(prompt_widths=[])) == "no prompt graphs"
