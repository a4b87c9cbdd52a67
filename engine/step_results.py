"""A step's results on their way to the host: everything the host needs (sampled tokens, accepted paths, node
confidence, logprobs) packed on the device and brought over in one non-blocking copy into pinned memory, then
unpacked into Python lists once the copy's event has completed."""
from __future__ import annotations

import torch

from engine.sampler import SampleOutput
from engine.speculative.speculator import Walk


class HostResults:
    """The step's results after the one device-to-host copy."""

    def __init__(self, values: list[float], num_plain: int, walk: Walk | None, out: SampleOutput,
                 curve: torch.Tensor | None):
        pos = 0

        def take(n: int) -> list:
            nonlocal pos
            part = values[pos:pos + n]
            pos += n
            return part

        self.tokens = [int(t) for t in take(num_plain)]
        self.accept_len, self.accepted, self.emitted = [], [], []
        if walk is not None:
            num_reqs, width = walk.accepted_nodes.shape
            self.accept_len = [int(t) for t in take(num_reqs)]
            # per request, width values each; only the first accept_len are read (converted there)
            self.accepted = [take(width) for _ in range(num_reqs)]
            self.emitted = [take(width) for _ in range(num_reqs)]
        self.curves = [take(curve.shape[1]) for _ in range(curve.shape[0])] if curve is not None else []
        self._lp_index = {row: k for k, row in enumerate(out.logprob_rows)}
        self._chosen = take(len(out.logprob_rows))
        n_top = out.top_ids.shape[1] if out.top_ids is not None else 0
        self._top_vals = [take(n_top) for _ in out.logprob_rows]
        self._top_ids = [[int(t) for t in take(n_top)] for _ in out.logprob_rows]

    @classmethod
    def of_round(cls, rows: list[list[float]], num_accepted: int) -> "HostResults":
        """The results of a whole-round graph (engine/round_graphs.py): per request one row of accept length,
        accepted rows [A], emitted tokens [A] and node confidence (A = num_accepted); no sampled plain rows and
        no logprobs."""
        out = cls.__new__(cls)
        a = num_accepted
        out.tokens, out._lp_index, out._chosen, out._top_vals, out._top_ids = [], {}, [], [], []
        out.accept_len = [int(r[0]) for r in rows]
        out.accepted = [r[1:1 + a] for r in rows]
        out.emitted = [r[1 + a:1 + 2 * a] for r in rows]
        out.curves = [r[1 + 2 * a:] for r in rows]
        return out

    def logprob(self, row: int, num_top: int) -> tuple[float, list[tuple[int, float]]]:
        k = self._lp_index[row]
        return self._chosen[k], list(zip(self._top_ids[k][:num_top], self._top_vals[k][:num_top]))


class _HostCopy:
    """One device-to-host copy of a packed step result: on CUDA non-blocking into pinned memory, with an event
    the host waits on only when it reads the values."""

    def __init__(self, packed: torch.Tensor, owned: bool):
        """owned: the packed tensor is a buffer the next step rewrites (copied even on the CPU)."""
        self.event = None
        if packed.is_cuda:
            self.host = packed.to("cpu", non_blocking=True)  # into pinned memory
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = packed.clone() if owned else packed

    def values(self) -> list:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


class ResultCopy(_HostCopy):
    """Everything the host needs from a step, packed on the device and copied to the host in one copy, so the
    host can launch the next step before waiting."""

    def __init__(self, out: SampleOutput, walk: Walk | None, num_plain: int, curve: torch.Tensor | None):
        self.out, self.walk, self.num_plain, self.curve = out, walk, num_plain, curve
        parts = [out.tokens[:num_plain]]
        if walk is not None:
            parts += [walk.accept_len, walk.accepted_nodes, walk.emitted]
        if curve is not None:
            parts.append(curve)
        if out.logprob_rows:
            parts.append(out.chosen_logprobs)
            if out.top_ids is not None:
                parts += [out.top_logprobs, out.top_ids]
        # one part (plain decoding without logprobs): copied as it is; several: packed as float64 (exact for ids)
        packed = parts[0].reshape(-1) if len(parts) == 1 else torch.cat([p.reshape(-1).to(torch.float64)
                                                                          for p in parts])
        super().__init__(packed, owned=False)

    def wait(self) -> HostResults:
        return HostResults(self.values(), self.num_plain, self.walk, self.out, self.curve)


class RoundCopy(_HostCopy):
    """The one copy of a whole-round graph's packed results ([N, 1 + 2A + 2B] float64 on the device)."""

    def __init__(self, packed: torch.Tensor, num_accepted: int):
        self.num_accepted = num_accepted
        super().__init__(packed, owned=True)

    def wait(self) -> HostResults:
        return HostResults.of_round(self.values(), self.num_accepted)
