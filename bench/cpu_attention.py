"""The CPU's paged attention (ext/reference/attention.py, what the engine runs without CUDA): one layer of the
embedded model's heads (9 query heads over 3 KV heads of 64) at decode, tree-verify and prompt-chunk shapes, over
random KV in scattered blocks, median and 90th percentile of --iters calls; then, with --engine, the embedded model's
decoding step in the engine at --batch requests of --context tokens (drafter none), and with --prefill N one N-token
prompt's time to its first token. Runs against whichever tree is
first on PYTHONPATH, so two trees can be compared in one sitting; --save DIR writes each shape's output there, to
check that two trees compute the same values (--compare DIR).

    python bench/cpu_attention.py --engine
    PYTHONPATH=<other tree> python bench/cpu_attention.py --save /tmp/a; python bench/cpu_attention.py --compare /tmp/a
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

# after PYTHONPATH: the tree measured is the first there (this one by default)
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

# (sequences, keys each, queries each): decode at batch 1 / 16 / 64, trees of 5 at 16 / 64, a lone tree, prompt chunks
# (two of 200 after 300 of context each, a whole prompt of 2,048, 400 after 1,000 of context)
SHAPES = [(1, 1000, 1), (16, 400, 1), (64, 200, 1), (16, 400, 5), (64, 300, 5), (1, 1000, 16), (2, 500, 200),
          (1, 2048, 2048), (1, 1400, 400)]
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def layer_inputs(num_seqs: int, num_keys: int, num_q: int):
    """q, the caches and the step's metadata: every sequence num_keys long, its last num_q keys new (causal at one
    query, else a random tree mask whose diagonal is set), its blocks scattered over the cache."""
    from ext.metadata import AttentionMetadata

    gen = torch.Generator().manual_seed(0)
    blocks_each = -(-num_keys // BLOCK)
    num_blocks = num_seqs * blocks_each + 1
    k_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
    v_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
    tables = (torch.randperm(num_blocks - 1, generator=gen) + 1).view(num_seqs, blocks_each).int()
    q = torch.randn(num_seqs * num_q, HEADS, HEAD_DIM, generator=gen)
    tree = None
    if 1 < num_q <= 64:
        tree = (torch.rand(num_seqs * num_q, num_q, generator=gen) < 0.5) | torch.eye(num_q, dtype=torch.bool).repeat(
            num_seqs, 1)
    meta = AttentionMetadata(
        positions=torch.zeros(num_seqs * num_q, dtype=torch.long),
        slot_mapping=torch.zeros(num_seqs * num_q, dtype=torch.long),
        query_start_loc=torch.arange(0, num_seqs * num_q + 1, num_q).int(),
        seq_lens=torch.full((num_seqs,), num_keys).int(), block_tables=tables, block_size=BLOCK, tree_mask=tree,
        query_lens_host=[num_q] * num_seqs, seq_lens_host=[num_keys] * num_seqs)
    return q, k_cache, v_cache, meta


def time_layers(iters: int, save: str | None, compare: str | None) -> None:
    from ext.reference.attention import paged_attention

    for shape in SHAPES:
        q, k_cache, v_cache, meta = layer_inputs(*shape)
        out = paged_attention(q, k_cache, v_cache, meta, HEAD_DIM ** -0.5)
        name = "x".join(map(str, shape))
        if save:
            os.makedirs(save, exist_ok=True)
            torch.save(out, os.path.join(save, f"{name}.pt"))
        same = ""
        if compare:
            other = torch.load(os.path.join(compare, f"{name}.pt"))
            same = f"; equal to {compare}'s: {torch.equal(out, other)} (max diff {(out - other).abs().max():.3g})"
        times = []
        for _ in range(iters if shape[2] < 1024 else max(1, iters // 10)):  # (a long chunk: a tenth as many)
            t0 = time.perf_counter()
            paged_attention(q, k_cache, v_cache, meta, HEAD_DIM ** -0.5)
            times.append((time.perf_counter() - t0) * 1e3)
        times.sort()
        print(f"{shape[0]:3d} sequences x {shape[1]:4d} keys x {shape[2]:3d} queries: median "
              f"{statistics.median(times):.3f} ms a layer, p90 {times[int(0.9 * len(times))]:.3f}{same}", flush=True)


def time_engine(batch: int, context: int, steps: int) -> None:
    """Median wall time of the embedded model's decoding steps at `batch` requests, `context` prompt tokens each."""
    from engine import LLM, SamplingParams

    llm = LLM(None, device="cpu", drafter="none", max_num_seqs=batch)
    core = llm.engine
    for i in range(batch):
        prompt = [1] + [100 + (i * 7 + j * 13) % 5000 for j in range(context)]
        core.add_request(prompt, SamplingParams(max_tokens=steps + 64, temperature=0, ignore_eos=True))
    while any(r.num_computed_tokens < r.num_tokens - 1 for r in core.scheduler.running) or core.scheduler.waiting:
        core.step()  # the prompts
    for _ in range(3):
        core.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        core.step()
        times.append((time.perf_counter() - t0) * 1e3)
    print(f"engine, batch {batch}, {context}-token prompts: a decoding step {statistics.median(times):.1f} ms "
          f"(median of {steps})", flush=True)


def time_prefill(num_tokens: int, repeats: int = 3) -> None:
    """Median wall time of one prompt of num_tokens tokens to its first token (none cached), the embedded model."""
    from engine import LLM, SamplingParams

    llm = LLM(None, device="cpu", drafter="none")
    times = []
    for r in range(repeats + 1):
        prompt = [1 + r] + [100 + (j * 13 + r) % 5000 for j in range(num_tokens - 1)]
        t0 = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        times.append(time.perf_counter() - t0)
    print(f"engine, one {num_tokens}-token prompt to its first token: {statistics.median(times[1:]):.2f} s "
          f"(median of {repeats})", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--save", default=None)
    p.add_argument("--compare", default=None)
    p.add_argument("--engine", action="store_true")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=400)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--prefill", type=int, default=0, metavar="TOKENS",
                   help="also time one prompt of this many tokens to its first token")
    args = p.parse_args()
    time_layers(args.iters, args.save, args.compare)
    if args.engine:
        time_engine(args.batch, args.context, args.steps)
    if args.prefill:
        time_prefill(args.prefill)


if __name__ == "__main__":
    main()
