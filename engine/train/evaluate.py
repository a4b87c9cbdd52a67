"""Acceptance of a drafter through our engine: tau (tokens per verify step, the bonus token included, what DDTree
and DFlash report), acceptance per depth and tokens/s, for plain decoding, the chain (the drafter's top-1 path,
block_size - 1 drafts) and DDTree at a fixed budget (no adaptive budget: every step verifies). Used by the
trainer's eval stage and by bench/accept.py; one loaded target serves every measurement.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from engine.config import EngineConfig, SpecConfig
from engine.request import SamplingParams
from engine.train.responses import run_requests

MODES = ("plain", "chain", "ddtree")


@dataclass
class Measurement:
    mode: str  # plain | chain | ddtree
    budget: int  # tree nodes per step (chain: block_size - 1; plain: 0)
    temperature: float
    prompts: int
    tokens: int  # generated tokens
    steps: int  # verify steps
    tau: float  # tokens per verify step (1.0 for plain decoding)
    accept_rate: list[float] = field(default_factory=list)  # [d]: fraction of verify steps accepting depth d+1
    elapsed_s: float = 0.0
    tokens_per_s: float = 0.0
    note: str = ""  # e.g. "grammar, pruned"

    def row(self, plain_tps: float | None = None) -> str:
        speed = f"{self.tokens_per_s:.1f}" + (f" ({self.tokens_per_s / plain_tps:.2f}x)" if plain_tps else "")
        rates = " ".join(f"{r:.2f}" for r in self.accept_rate[:8])
        mode = f"{self.mode} ({self.note})" if self.note else self.mode
        return (f"| {mode} | {self.budget} | {self.temperature:g} | {self.tau:.3f} | {rates} | {speed} | "
                f"{self.tokens} |")


TABLE_HEADER = ("| mode | budget | T | tau | acceptance at depth 1..8 | tokens/s (vs plain) | tokens |\n"
                "|---|---|---|---|---|---|---|")


def measure(loaded, base: EngineConfig, prompt_ids: list[list[int]], mode: str, *, draft_model: str | None = None,
            budget: int = 16, temperature: float = 0.0, max_tokens: int = 128, concurrency: int = 1, seed: int = 0,
            warmup: bool = True, grammar: str | None = None, grammar_pruning: bool = True) -> Measurement:
    """Generates every prompt with the target `loaded` (engine.model.loader.LoadedModel) in `mode`; `base` gives
    the engine settings (device, dtype, KV cache...), its spec is replaced. concurrency: requests in flight.
    grammar: every request's output is constrained to it (engine/grammar.py); grammar_pruning off verifies the
    drafter's own tree (forbidden nodes included) for comparison."""
    from engine.core import EngineCore

    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r} (choose {', '.join(MODES)})")
    if mode == "plain":
        spec = SpecConfig()
    else:
        spec = SpecConfig(drafter="dflash", draft_model=draft_model, budget=budget, chain=mode == "chain",
                          adaptive=False, grammar_pruning=grammar_pruning)
    core = EngineCore(dataclasses.replace(base, spec=spec, seed=seed), loaded=loaded)
    if warmup and prompt_ids:
        run_requests(core, [("warmup", prompt_ids[0], SamplingParams(max_tokens=4, temperature=0,
                                                                      detokenize=False))], lambda *a: None, 1)
    accept: list[int] = []
    generated = 0

    def done(_rid, tokens, delta) -> None:
        nonlocal generated
        generated += len(tokens)
        accept.extend(delta.accept_lengths)

    requests = [(f"eval-{i}", ids, SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed + i,
                                                  detokenize=False, grammar=grammar))
                for i, ids in enumerate(prompt_ids)]
    start = time.perf_counter()
    run_requests(core, requests, done, concurrency)
    elapsed = time.perf_counter() - start
    depth = max(accept, default=1) - 1
    rates = [sum(1 for n in accept if n - 1 > d) / len(accept) for d in range(depth)] if accept else []
    used = 0 if core.speculator is None else core.speculator.max_budget
    note = "" if grammar is None else "grammar" if mode == "plain" else \
        "grammar, " + ("pruned" if grammar_pruning else "not pruned")
    return Measurement(mode, used, temperature, len(prompt_ids), generated, len(accept),
                       sum(accept) / len(accept) if accept else 1.0, rates, elapsed, generated / max(elapsed, 1e-9),
                       note=note)


def evaluate_drafter(loaded, base: EngineConfig, draft_model: str, prompt_ids: list[list[int]], *, budget: int,
                     max_tokens: int, temperatures=(0.0,), concurrency: int = 8, seed: int = 0) -> list[Measurement]:
    """The chain and DDTree at `budget` for each temperature (the trainer's eval stage)."""
    out = []
    for t in temperatures:
        for mode in ("chain", "ddtree"):
            out.append(measure(loaded, base, prompt_ids, mode, draft_model=draft_model, budget=budget, temperature=t,
                               max_tokens=max_tokens, concurrency=concurrency, seed=seed, warmup=False))
    return out
