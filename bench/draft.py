"""The DFlash drafter's call on its own: wall time and GPU busy time of `propose` at batch N, each request with an
L-token context, every call taking `--new-rows` new context rows per request (as after a round that accepted that
many tokens). The target is a dummy-weight shape (bench/gpu_serving.py's); the drafter is the shipped one for the
SmolLM2 shape, or a random one of the same layout (`--random`, any shape). Prints one JSON line per batch size and a
table; not a test.

    python bench/draft.py --smollm2 --batch 1 8 64 --lengths 512 [--graphs]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from bench.gpu_serving import add_shape_args, shape_model  # noqa: E402
from bench.step import gpu_busy, sync  # noqa: E402
from engine.config import SpecConfig  # noqa: E402
from engine.model.loader import load_model, read_config  # noqa: E402
from engine.speculative.drafter import DraftRequest, make_drafter  # noqa: E402


def drafter_folder(args, target_cfg: dict) -> str:
    if not args.random:
        from engine.drafters import shipped_drafter_dir

        return shipped_drafter_dir()
    from engine.speculative.dflash_files import save_random_dflash

    folder = tempfile.mkdtemp(prefix="draft-bench-")
    n = target_cfg["num_hidden_layers"]
    save_random_dflash(folder, target_cfg, num_layers=3, block_size=16, target_layer_ids=[1, n // 3, n // 2, n - 3])
    return folder


def measure(drafter, width: int, batch: int, length: int, new_rows: int, calls: int, top_k: int) -> dict:
    """Shows each request its context, then `calls` timed calls (wall) and `calls` profiled ones (GPU busy)."""
    device = drafter.device
    g = torch.Generator().manual_seed(batch * 7 + length)
    vocab = drafter.vocab_size
    total = length + new_rows * (2 * calls + 2)
    tokens = [torch.randint(0, vocab, (total,), generator=g).tolist() for _ in range(batch)]
    feats = torch.randn(total, width, generator=g).to(device, drafter.dtype)  # the same rows for every request
    ends = [length] * batch

    def call() -> None:
        reqs = []
        for i in range(batch):
            seen = drafter.context_len(f"r{i}")
            reqs.append(DraftRequest(f"r{i}", tokens[i][:ends[i]], feats[seen:ends[i] - 1] if ends[i] - 1 > seen
                                     else None))
            ends[i] += new_rows
        drafter.propose(reqs, top_k)

    call()  # the whole context, then steady state
    call()
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        call()
    sync()
    wall = (time.perf_counter() - t0) / calls
    api: dict[str, int] = {}
    busy, kernels = gpu_busy(lambda: [call() for _ in range(calls)], api_calls=api)
    for i in range(batch):
        drafter.release(f"r{i}")
    launches = sum(v for k, v in api.items() if k.startswith(("cudaLaunch", "cudaGraphLaunch", "cudaMemcpy",
                                                                "cudaMemset")))
    return dict(wall_ms=wall * 1e3, gpu_busy_ms=busy / calls * 1e3, kernels_per_call=kernels / calls,
                host_launches_per_call=launches / calls, api_calls={k: v / calls for k, v in sorted(api.items())})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(p)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bf16", help="the target's and drafter's (the CPU engine serves fp32)")
    p.add_argument("--random", action="store_true", help="a random drafter of the shipped layout")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--lengths", type=int, nargs="+", default=[512])
    p.add_argument("--new-rows", type=int, default=2, help="context rows each call adds per request")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--top-k", type=int, default=16)
    p.add_argument("--graphs", action="store_true", help="capture the drafter's CUDA graphs (as the engine does)")
    p.add_argument("--max-model-len", type=int, default=4096, help="with --graphs: the graphs' context capacity")
    args = p.parse_args()

    model, load_format = shape_model(args, "draft-shape-")
    target_cfg = read_config(model) if os.path.isdir(model) else None
    loaded = load_model(model, args.dtype, device=args.device, load_format=load_format)
    folder = drafter_folder(args, target_cfg)
    drafter = make_drafter(SpecConfig(drafter="dflash", budget=args.top_k, draft_model=folder), loaded.model,
                           loaded.model.vocab_size, device=args.device)
    width = len(drafter.target_layer_ids) * loaded.model.hidden_size
    if args.graphs:
        drafter.reserve_kv(max(args.batch) * (max(args.lengths) + 64 * args.calls), max(args.batch))
        drafter.capture_graphs(sorted(set(args.batch)), args.top_k, args.max_model_len)
    rows = []
    for length in args.lengths:
        for batch in args.batch:
            r = dict(bench="draft", L=length, N=batch, new_rows=args.new_rows, graphs=args.graphs,
                     **measure(drafter, width, batch, length, args.new_rows, args.calls, args.top_k))
            rows.append(r)
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}), flush=True)
    print("\n| L | N | wall ms/call | GPU busy ms | kernels/call | host launches and copies/call |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['L']} | {r['N']} | {r['wall_ms']:.2f} | {r['gpu_busy_ms']:.2f} | {r['kernels_per_call']:.0f} | "
              f"{r['host_launches_per_call']:.0f} |")


if __name__ == "__main__":
    main()
