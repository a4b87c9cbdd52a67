"""Inclusive host time of the engine's methods over a window of steps, from perf_counter wrappers around them
(bench/step_log.py --host-times). cProfile misattributes time around C calls: under it a CUDA graph replay
looked like 0.4 ms of host time where it takes 7-20 us (docs/BENCHMARKS.md, 2026-12-04); a wrapper times only
what it wraps (plus ~1 us of its own per call, so nested entries include their children's wrappers)."""
from __future__ import annotations

import functools
import importlib
import time
from collections import Counter, defaultdict

from torch.utils._python_dispatch import TorchDispatchMode

# "module:Class" -> the methods timed; "module:" -> functions of that module's namespace (where they are called
# from: a function imported by name is timed in the module that imported it)
METHODS = {
    "engine.core:EngineCore": "step _complete _observe_budgets",
    "engine.core:": "step_delta step_stats",
    "engine.ahead:AheadLauncher": "plain trees _launch _plain",
    "engine.scheduler:Scheduler": "schedule schedule_ahead schedule_ahead_trees update wants_trees one_width",
    "engine.runner:ModelRunner": "launch _launch_tree_ahead _launch_round _launch _decode_in_graph _run _forward "
                                 "_sample collect _tree_results _watch_ahead",
    "engine.runner:": "prepare_inputs",
    "engine.cuda_graphs:CudaGraphs": "run write_decode replay_rows set_layout bucket",
    "engine.plain_graphs:PlainGraphs": "plan run",
    "engine.graph_sampling:GraphSampling": "stage",
    "engine.step_results:ResultCopy": "__init__ wait",
    "engine.pending:PendingStep": "successors accepted_features sampled_tokens",
    "engine.speculative.speculator:Speculator": "propose build confirm_ahead curves _full_trees",
    "engine.round_graphs:RoundGraphs": "run _stage_inputs",
    "engine.step_results:RoundCopy": "wait",
    "engine.speculative.adaptive:BudgetController": "observe_request budget harmonize should_draft budgets_of "
                                                    "count_plain drafts_of uniform",
    "engine.staging:Staging": "__call__ pack",
    "torch.cuda:CUDAGraph": "replay",
}


class HostTimers:
    def __init__(self, extra: dict[type, str] | None = None, only: set[str] | None = None):
        """extra: more classes to time (e.g. the engine's drafter) -> their methods, space-separated. only: time
        just these labels ("Class.method"): a run's few calls a step, with no wrappers elsewhere to slow it."""
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.calls: Counter[str] = Counter()
        self.active = False  # counting only while True (the window)
        self._originals: list[tuple[object, str, object]] = []
        classes = {}
        for key, names in METHODS.items():
            module, name = key.split(":")
            module = importlib.import_module(module)
            classes[getattr(module, name) if name else module] = names
        classes.update(extra or {})
        for cls, names in classes.items():
            for name in names.split():
                if hasattr(cls, name) and (only is None or f"{cls.__name__.split('.')[-1]}.{name}" in only):
                    self._wrap(cls, name)

    def _wrap(self, cls, name: str) -> None:
        """cls: a class (its method `name`) or a module (its function `name`)."""
        original, label = cls.__dict__.get(name, getattr(cls, name)), f"{cls.__name__.split('.')[-1]}.{name}"
        if isinstance(original, (staticmethod, classmethod)):
            return
        seconds, calls = self.seconds, self.calls

        @functools.wraps(original)
        def timed(*args, **kwargs):
            if not self.active:
                return original(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                seconds[label] += time.perf_counter() - t0
                calls[label] += 1

        self._originals.append((cls, name, cls.__dict__.get(name)))
        setattr(cls, name, timed)

    def remove(self) -> None:
        """Puts every wrapped method back."""
        for cls, name, original in reversed(self._originals):
            if original is None:
                delattr(cls, name)
            else:
                setattr(cls, name, original)
        self._originals.clear()

    def report(self, num_steps: int) -> list[str]:
        """One line per method, slowest first: microseconds a step (inclusive) and calls a step."""
        return [f"{label:48s} {s / num_steps * 1e6:9.1f} us/step {self.calls[label] / num_steps:6.1f} calls/step"
                for label, s in sorted(self.seconds.items(), key=lambda kv: -kv[1])]


class HostOps(TorchDispatchMode):
    """The torch operators the host issues while active (a graph replay is one call, its kernels none): per
    operator, calls and the seconds its dispatch took below Python (launch included). On a small model's GPU step
    each costs the host ~5-20 us, so their count is a step's fixed host cost (bench/step_kinds.py --host-ops). Ops
    an extension calls from C++ are counted as the one op Python called."""

    def __init__(self):
        super().__init__()
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        t0 = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket)
        self.seconds[name] += time.perf_counter() - t0
        self.calls[name] += 1
        return out


def host_speed_us(repeats: int = 7) -> float:
    """Median microseconds of a fixed pure-Python loop: the host CPU's speed at this moment. On the GPU machines
    it swings by 1.7x between runs of the same process (docs/BENCHMARKS.md, 2026-12-05 18:04), and a small model's
    steps are bound by host work, so a run's tokens/s follows it; benchmarks print it beside each run."""
    times = []
    for _ in range(repeats):
        t0, x = time.perf_counter(), 0
        for i in range(3000):
            x += i * i
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e6
