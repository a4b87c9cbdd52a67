"""Host time of a few pieces of a step, outside any engine, in microseconds a call: the staging of a small array
(pinned and copied on CUDA), the adaptive budget's width prices (StepCosts.width_seconds, 16 widths), a batch's
block-table rows as an array (block_table_rows: every row, as plain steps wrote them before 2026-12-07, against
TableMirror's comparison and the changed rows only), and the scheduler's side of a batch's plain decoding step
planned ahead (Scheduler.schedule_ahead, then the results applied: Scheduler.update and each request's Delta, as
EngineCore._complete does; no speculation, prefix caching on, a block filled every 16 steps per request), and
the sampling parameters of a sampled plain step staged for its graph (GraphSampling.stage), and the CPU's top-p
(0.9) on the embedded model's 49,152 logits: rows the largest logits decide (peaked) and rows they do not (flat,
N(0, 1) / 0.7), apply_top_k_top_p beside sorting the rows. Runs against whichever tree is first on PYTHONPATH
(pieces a tree lacks are skipped), so two trees can be compared in one sitting.

    python bench/host_pieces.py --device cuda
    PYTHONPATH=<other tree> python bench/host_pieces.py
"""
from __future__ import annotations

import argparse
import os
import random
import sys

# after PYTHONPATH: the tree measured is the first there (this one by default)
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.budget_host import per_step_us as per_call_us  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--blocks", type=int, default=33, help="blocks a request holds (its context / block size)")
    p.add_argument("--changed", type=int, default=4, help="rows whose lists grew since the last step")
    args = p.parse_args()
    from engine.cuda_graphs import graph_shape
    from engine.speculative.step_costs import StepCosts
    from engine.staging import Staging
    from ext.metadata import block_table_rows

    stage = Staging(args.device)
    values = list(range(16))
    print(f"Staging(16 ints): {per_call_us(lambda: (stage.reset(), stage(values))):.1f} us")
    costs = StepCosts(graph_shape)
    for _ in range(5):
        for n, w, s in ((1, 1, 7e-4), (1, 3, 1.1e-3), (1, 9, 1.3e-3), (64, 1, 1.5e-3), (64, 5, 3e-3)):
            costs.observe(n, w, s)
    for n in (1, 64):
        print(f"width_seconds(batch {n}, 16 widths): {per_call_us(lambda: costs.width_seconds(n, 16, 1e-6)):.1f} us")
    rng = random.Random(0)
    tables = [[rng.randrange(10000) for _ in range(args.blocks)] for _ in range(args.batch)]
    print(f"block_table_rows(all {args.batch} rows of {args.blocks}): "
          f"{per_call_us(lambda: block_table_rows(tables)):.1f} us")
    try:
        from engine.table_mirror import TableMirror
    except ImportError:
        return
    mirror = TableMirror()
    mirror.changed(tables)
    grown = tables[:]

    def changed_rows():
        for i in range(args.changed):  # a few lists grew by a block since the last step
            grown[i] = tables[i] + [1] if grown[i] is tables[i] else tables[i]
        rows = mirror.changed(grown)
        return block_table_rows([grown[i] for i in rows])

    print(f"TableMirror.changed + the {args.changed} changed rows: {per_call_us(changed_rows):.1f} us")
    print(f"a plain step's scheduling and completion, batch {args.batch}: {plain_step_us(args.batch):.1f} us")
    print(f"GraphSampling.stage, batch {args.batch} at T = 1, the requests of the step before: "
          f"{sampling_stage_us(args.batch, args.device):.1f} us")
    for rows in (1, 8):
        for kind in ("peaked", "flat"):
            ours, by_sort = top_p_us(rows, kind)
            print(f"CPU top-p 0.9, {rows} {kind} row(s) of 49,152 logits: apply_top_k_top_p {ours:.0f} us, "
                  f"sorting them {by_sort:.0f} us")


def top_p_us(rows: int, kind: str) -> tuple[float, float]:
    """(apply_top_k_top_p, sort_top_k_top_p) microseconds a call on the CPU, top-p 0.9 and top-k off."""
    import torch

    import engine.sampler

    if hasattr(engine.sampler, "sort_top_k_top_p"):  # trees before 2026-12-08 kept them in the sampler (asked
        apply_top_k_top_p, sort_top_k_top_p = engine.sampler.apply_top_k_top_p, engine.sampler.sort_top_k_top_p
    else:  # first: an editable install finds engine.top_k_top_p in its own tree for a tree that lacks it)
        from engine.top_k_top_p import apply_top_k_top_p, sort_top_k_top_p
    vocab = 49152
    x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) / 0.7
    if kind == "peaked":
        x[:, :5] += 20  # the nucleus closes within the 64 largest
    top_k, top_p = torch.zeros(rows, dtype=torch.int64), torch.full((rows,), 0.9)
    return (per_call_us(lambda: apply_top_k_top_p(x, top_k, top_p)),
            per_call_us(lambda: sort_top_k_top_p(x, torch.full((rows,), vocab), top_p)))


def sampling_stage_us(batch: int, device: str) -> float:
    """A sampled plain step's parameters, seeds and output positions staged for its sampling graph."""
    import torch

    from engine.graph_sampling import GraphSampling
    from engine.plan import ScheduledSeq
    from engine.request import Request, SamplingParams
    from engine.staging import Staging

    seqs = [ScheduledSeq(Request([1], SamplingParams(temperature=1.0, top_p=0.9), seed=i), 1, True)
            for i in range(batch)]
    sampling, stage = GraphSampling(batch, torch.device(device)), Staging(device)
    outputs = list(range(batch))
    return per_call_us(lambda: (stage.reset(), sampling.stage(seqs, outputs, stage)))


def plain_step_us(batch: int, prompt_len: int = 121) -> float:
    """Microseconds a step of the scheduler's side of plain decoding (module docstring), the batch decoding."""
    import time

    from engine.block_manager import BlockManager
    from engine.config import EngineConfig
    from engine.request import Request, SamplingParams
    from engine.scheduler import Scheduler
    from engine.step_outputs import step_delta
    from engine.step_results import StepResult

    config = EngineConfig(max_num_seqs=batch, max_num_batched_tokens=max(2048, batch * prompt_len))
    sched = Scheduler(config, BlockManager(batch * 300, 16), max_model_len=8192)
    for i in range(batch):
        sched.add(Request([1000 + i] + [7] * (prompt_len - 1), SamplingParams(max_tokens=4000, ignore_eos=True,
                                                                              detokenize=False)))
    plan = sched.schedule()  # the prompts, then a token each

    def results(plan) -> StepResult:
        result = StepResult()
        for s in plan.seqs:
            result.new_token_ids[s.request.request_id] = [5 + len(s.request.output_token_ids) % 1000]
        return result

    step = 0

    def one_step():
        nonlocal plan, step
        ahead = sched.schedule_ahead(plan)
        live = [(s.request, len(s.request.output_token_ids)) for s in plan.seqs if not s.request.finished]
        sched.update(plan, results(plan), in_flight=ahead)
        now = time.monotonic()
        [d for d in (step_delta(req, n, now) for req, n in live) if d]
        plan, step = ahead, step + 1

    one_step()
    return per_call_us(one_step, steps=1000) - per_call_us(lambda: results(plan), steps=1000)


if __name__ == "__main__":
    main()
