"""Host time of one CUDA graph launch (a replay, not waited for): graphs of 10-600 trivial kernels, every
captured engine graph of batch 1 (SmolLM2 shape, dummy weights, a B = 16 tree budget), and whether launching an
exec while the same exec is still running blocks the host (A then A, against A then B: a second capture of the
same work). Prints one JSON line per case; not a test.

    python bench/graph_launch.py
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402


def emit(**record) -> None:
    print(json.dumps(record), flush=True)


def launch_us(graph: torch.cuda.CUDAGraph, reps: int = 60) -> float:
    """Median host time of a replay with the device idle before it."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graph.replay()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return sorted(times)[reps // 2] * 1e6


def capture(x: torch.Tensor, num_kernels: int) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(num_kernels):
            x.add_(1)
    graph.replay()
    return graph


def trivial_graphs() -> None:
    x = torch.zeros(1024, device="cuda")
    for n in (10, 100, 300, 600):
        emit(graph=f"{n} x add_", launch_us=round(launch_us(capture(x, n)), 1))


def launch_while_running() -> None:
    """The second launch's host time right after a long graph was launched (not waited for)."""
    x = torch.zeros(1 << 24, device="cuda")
    a, b = capture(x, 300), capture(x, 300)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    a.replay()
    torch.cuda.synchronize()
    graph_ms = (time.perf_counter() - t0) * 1e3
    for label, second in (("A then A", a), ("A then B", b)):
        times = []
        for _ in range(10):
            torch.cuda.synchronize()
            a.replay()
            t0 = time.perf_counter()
            second.replay()
            times.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        emit(case=label, graph_ms=round(graph_ms, 2), second_launch_host_ms=round(sorted(times)[5], 3))


def engine_graphs() -> None:
    from bench.gpu_serving import SMOLLM2_135M
    from bench.step import FixedTreeDrafter
    from engine import LLM

    folder = tempfile.mkdtemp(prefix="graph-launch-")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(SMOLLM2_135M, f)
    llm = LLM(folder, load_format="dummy", device="cuda", max_num_seqs=4, max_model_len=2048,
              drafter=FixedTreeDrafter(SMOLLM2_135M["vocab_size"], 8, "cuda"), spec_budget=16, adaptive=False)
    graphs = llm.engine.runner.graphs
    for key in sorted(graphs.graphs):
        if key[0] == 1:
            emit(graph=f"engine {key}", launch_us=round(launch_us(graphs.graphs[key].graph), 1))


if __name__ == "__main__":
    trivial_graphs()
    launch_while_running()
    engine_graphs()
