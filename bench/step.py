"""Anatomy of one engine step on one device: wall time, GPU busy time (kernels under the profiler) and GPU idle
time per step, for plain decoding (B = 0) and DDTree verify steps (B tree nodes) at context lengths L and batch
sizes N (`--batch`, default 1: N requests of the same prompt length).
The verify/decode ratio is each B's time over B = 0's at the same L. Prints one JSON line per (L, B) and a
table; not a test.

The tree comes from a drafter with no cost of its own (FixedTreeDrafter: the same best-first tree of random
tokens every step, so almost nothing is accepted): the step is the engine's own round (tree build, verify
rows, sampling, walk, compaction, bookkeeping) plus the target forward. `--drafter dflash` measures a real
DFlash drafter's round instead (`--draft-model`, default: the shipped one for the SmolLM2 shape).

    python bench/step.py --qwen3-8b --lengths 1024 4096 16384 32768 --budgets 0 16 64
    python bench/step.py --smollm2 --drafter dflash --lengths 512 --budgets 0 4 16 64
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from bench.gpu_serving import add_shape_args, free_engine_memory, shape_model  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402

class FixedTreeDrafter:
    """Proposes the same K random tokens per depth every step, from tensors made once per batch size: a full
    best-first tree whose drafting costs nothing."""

    target_layer_ids: tuple[int, ...] = ()

    def __init__(self, vocab_size: int, horizon: int, device: str):
        self.vocab_size, self.horizon, self.device = vocab_size, horizon, device
        self._cache: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def release(self, request_id: str) -> None:
        pass

    def propose_ahead(self, batch, top_k: int, root_ids, root_positions, num_new, feats=None, emitted_ids=None):
        return self.propose(batch, top_k)

    def propose(self, batch, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = (len(batch), top_k)
        if key not in self._cache:
            g = torch.Generator().manual_seed(0)
            ids = torch.stack([torch.randperm(self.vocab_size, generator=g)[:top_k]
                               for _ in range(len(batch) * self.horizon)]).view(len(batch), self.horizon, top_k)
            logprobs = -torch.arange(1, top_k + 1, dtype=torch.float32).expand(len(batch), self.horizon, top_k)
            self._cache[key] = (logprobs.contiguous().to(self.device), ids.to(self.device))
        return self._cache[key]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def gpu_busy(fn, top_ops: int = 0, top_kernels: int = 0, steps: int = 1,
             api_calls: dict | None = None) -> tuple[float, int]:
    """Runs fn under the profiler -> (seconds some kernel, copy or memset was running, number of them); prints
    the top_ops host operators by self CPU time and the top_kernels device kernels by time (per step); api_calls,
    when given, receives the host's CUDA runtime calls by name (launches, graph launches, copies: the host's
    work, which wall time on a shared host measures badly)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        sync()
    if top_ops:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top_ops), flush=True)
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as g:
            events = json.load(g)["traceEvents"]
    if api_calls is not None:
        for e in events:
            if e.get("cat") == "cuda_runtime":
                api_calls[e["name"]] = api_calls.get(e["name"], 0) + 1
    spans = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events
                   if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    if top_kernels:
        per_name: dict[str, list[float]] = {}
        for e in events:
            if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
                per_name.setdefault(e["name"][:90], []).append(e.get("dur", 0))
        ranked = sorted(per_name.items(), key=lambda kv: -sum(kv[1]))[:top_kernels]
        for name, durs in ranked:
            print(f"  {sum(durs) / steps:8.1f} us/step  {len(durs) / steps:6.1f}/step  {name}", flush=True)
    busy, end = 0.0, float("-inf")
    for s, e in spans:  # union of intervals (us)
        if e > end:
            busy += e - max(s, end)
            end = e
    return busy / 1e6, len(spans)


def measure(llm: LLM, length: int, steps: int, warmup: int, top_ops: int = 0, top_kernels: int = 0,
            batch: int = 1) -> dict:
    """`batch` requests with L-token random prompts: prefill, `warmup` steps, then `steps` timed steps (wall) and
    `steps` profiled steps (GPU busy)."""
    engine = llm.engine
    g = torch.Generator().manual_seed(length)
    rids = [engine.add_request(torch.randint(100, engine.vocab_size, (length,), generator=g).tolist(),
                               SamplingParams(max_tokens=64 * (warmup + 2 * steps + 2), temperature=0,
                                              ignore_eos=True, detokenize=False)) for _ in range(batch)]
    reqs = [engine.requests[rid] for rid in rids]
    while not all(req.output_token_ids for req in reqs):
        engine.step()
    for _ in range(warmup):
        engine.step()
    sync()
    timings: dict[str, list[float]] = {}
    modes, scheduling, tokens0 = set(), set(), sum(len(req.output_token_ids) for req in reqs)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
        for k, v in engine.last_stats.timings.items():
            timings.setdefault(k, []).append(v)
        modes.add(engine.last_stats.cuda_graph or "eager")
        scheduling.add(engine.last_stats.scheduling or "synchronous")
    sync()
    wall = (time.perf_counter() - t0) / steps
    tau = (sum(len(req.output_token_ids) for req in reqs) - tokens0) / steps / batch
    busy, kernels = gpu_busy(lambda: [engine.step() for _ in range(steps)], top_ops, top_kernels, steps)
    for rid in rids:
        engine.abort(rid)
    engine.step()
    return dict(wall_ms=wall * 1e3, gpu_busy_ms=busy / steps * 1e3, gpu_idle_ms=(wall - busy / steps) * 1e3,
                kernels_per_step=kernels / steps, tau=tau, graph=sorted(modes), scheduling=sorted(scheduling),
                phases_ms={k: round(statistics.mean(v) * 1e3, 3) for k, v in timings.items()})


def llm_vocab(model: str, load_format: str) -> int:
    from engine.model.loader import read_config

    return int(read_config(model)["vocab_size"]) if os.path.isdir(model) else 49152


def attention_tiles(device: str) -> str:
    """What runs the attention's tiles past 64 rows on this device (DDTREE_WGMMA=0 A/B runs say mma.sync)."""
    from ext import build

    ops = build.load_ops() if device.startswith("cuda") else None
    return "cpu" if ops is None else ("wgmma" if ops.attention_wgmma() else "mma.sync")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(p)
    p.add_argument("--device", default="cuda")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    p.add_argument("--budgets", type=int, nargs="+", default=[0, 16, 64])
    p.add_argument("--drafter", choices=("fixed", "dflash"), default="fixed")
    p.add_argument("--draft-model", default=None, help="DFlash folder (default: the shipped SmolLM2 drafter)")
    p.add_argument("--chain", action="store_true", help="dflash: verify the drafter's top-1 path (B ignored)")
    p.add_argument("--depth", type=int, default=8, help="fixed drafter's horizon")
    p.add_argument("--batch", type=int, nargs="+", default=[1], help="requests per step")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--top-ops", type=int, default=0, help="print the N host operators with most self CPU time")
    p.add_argument("--top-kernels", type=int, default=0,
                   help="print the N device kernels with most time per step (under programmatic dependent launch a "
                        "kernel's span overlaps its neighbours', so the spans add up to more than the step: "
                        "DDTREE_PDL=0 gives them one at a time)")
    p.add_argument("--cublas-few-rows", action="store_true",
                   help="A/B baseline: 3-32-row projections through cuBLAS instead of the tensor-core few-row GEMM")
    args = p.parse_args()
    if args.cublas_few_rows:
        from ext import layer_ops

        layer_ops.SKINNY_MAX_ROWS = layer_ops.GEMV_MAX_ROWS  # read at every call: nothing above 2 rows is ours

    model, load_format = shape_model(args, "step-shape-")
    common = dict(device=args.device, load_format=load_format, max_num_seqs=max(args.batch), enforce_eager=args.enforce_eager,
                  max_model_len=max(args.lengths) + 64 * (args.warmup + 2 * args.steps + 4),
                  enable_prefix_caching=False)
    draft_model = args.draft_model
    if args.drafter == "dflash" and draft_model is None:
        from engine.drafters import shipped_drafter_dir

        draft_model = shipped_drafter_dir()
    rows = []
    # every budget twice: each step waiting for its results, then asynchronous scheduling (tree steps run ahead
    # of their predecessor's results where the drafter can draft from the device: the fixed drafter can)
    runs = [(b, a) for b in args.budgets for a in (False, True)]
    for budget, overlap in runs:
        if budget == 0:
            llm = LLM(model, async_scheduling=overlap, **common)
        elif args.drafter == "dflash":
            llm = LLM(model, drafter="dflash", draft_model=draft_model, spec_budget=budget, adaptive=False,
                      chain=args.chain, async_scheduling=overlap, **common)
        else:
            drafter = FixedTreeDrafter(llm_vocab(model, load_format), args.depth, args.device)
            llm = LLM(model, drafter=drafter, spec_budget=budget, adaptive=False, async_scheduling=overlap,
                      **common)
        for length, batch in ((n, b) for n in args.lengths for b in args.batch):
            r = dict(bench="step", shape=("qwen3-8b" if args.qwen3_8b else "smollm2" if args.smollm2 else
                                          args.dummy_config or model), eager=args.enforce_eager, async_scheduling=overlap,
                     attention_tiles=attention_tiles(args.device),
                     drafter=(args.drafter + (" chain" if args.chain else "")) if budget else "none", L=length, B=budget,
                     N=batch, **measure(llm, length, args.steps, args.warmup, args.top_ops if overlap else 0,
                                          args.top_kernels if overlap else 0, batch))
            rows.append(r)
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}), flush=True)
        del llm
        free_engine_memory()
    print("\n| L | N | B | wall ms/step | GPU busy ms | GPU idle ms | kernels/step | verify/decode (wall, GPU) |")
    print("|---|---|---|---|---|---|---|---|")
    base = {(r["L"], r["N"]): r for r in rows if r["B"] == 0 and r["async_scheduling"]}  # plain decoding as it ships
    for r in sorted(rows, key=lambda r: (r["L"], r["N"], r["B"], r["async_scheduling"])):
        b = base.get((r["L"], r["N"]))
        gpu = f"{r['gpu_busy_ms'] / b['gpu_busy_ms']:.2f}" if b and b["gpu_busy_ms"] else "-"
        ratio = f"{r['wall_ms'] / b['wall_ms']:.2f}, {gpu}" if b else ""
        label = f"{r['B']}" + ("" if r["async_scheduling"] else " (sync steps)")
        print(f"| {r['L']} | {r['N']} | {label} | {r['wall_ms']:.2f} | {r['gpu_busy_ms']:.2f} | {r['gpu_idle_ms']:.2f} | "
              f"{r['kernels_per_step']:.0f} | {ratio} |")

if __name__ == "__main__":
    main()
