"""Admission steps as graph replays (engine/admission.py), on the CPU with the graph layout emulated (the same
static buffers and padding, run eagerly): prompt chunks beside decoding requests run as causal pieces of the
prompt buckets, one a replay, chunks longer than the widest one in several, the decoding rows' tokens chosen by the
plain-decoding sampling graph, and the output equals an engine without graphs, greedy and seeded, with plain
decoding and with DDTree trees beside the pieces. The GPU test replays
real graphs (tests/ext/test_engine_gpu.py)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine import LLM, SamplingParams, admission, cuda_graphs
from engine.admission import Piece, plan_replays
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
    llm = LLM(folder, dtype="fp32", max_num_seqs=3)
    llm.engine.enable_graphs(emulate=True)
    graphs = llm.engine.runner.plain_graphs
    chosen, tokens = [], graphs.tokens
    graphs.tokens = lambda *args: chosen.append(tokens(*args)) or chosen[-1]  # (called by admission steps only)
    out, modes = run(llm, ps, max_tokens, temperature)
    assert out == ref
    assert "replay: admission" in modes, modes
    assert chosen and all(t is not None for t in chosen)  # the decoders' tokens chosen by the sampling graph
    assert f"eager: prompt chunks beyond {admission.MAX_REPLAYS} replays" in modes, modes  # the 60-token prompt


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
