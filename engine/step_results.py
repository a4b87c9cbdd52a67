"""A step's results on their way to the host: everything the host needs (sampled tokens, accepted paths, node
confidence, logprobs) packed on the device and brought over in one non-blocking copy into pinned memory, then
unpacked into Python lists once the copy's event has completed."""
from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from engine.plan import StepResult
from engine.sampler import SampleOutput
from engine.speculative.confidence import confidence_rows
from engine.speculative.speculator import TreeBatch, Walk


class HostResults:
    """The step's results after the one device-to-host copy, as Python lists (converted in a few numpy calls:
    at batch 64, value by value was a visible part of the host's step)."""

    def __init__(self, values: np.ndarray, num_plain: int, walk: Walk | None, out: SampleOutput,
                 curve: torch.Tensor | None):
        """values: the packed copy, flat (float64 when several parts were packed)."""
        pos = 0

        def take(*shape: int) -> np.ndarray:
            nonlocal pos
            n = math.prod(shape)  # (np.prod: ~3.5 us a call, four or more calls a step)
            part = values[pos:pos + n].reshape(shape)
            pos += n
            return part

        self.tokens = take(num_plain).astype(np.int64).tolist()
        self.accept_len, self.accepted, self.emitted = [], [], []
        if walk is not None:
            num_reqs, width = walk.accepted_nodes.shape
            self.accept_len = take(num_reqs).astype(np.int64).tolist()
            self.accepted = take(num_reqs, width).astype(np.int64).tolist()
            self.emitted = take(num_reqs, width).astype(np.int64).tolist()
        self.curves = confidence_rows(take(*curve.shape)) if curve is not None else []  # [N] of (q, bins)
        self._lp_index = {row: k for k, row in enumerate(out.logprob_rows)}
        self._chosen = take(len(out.logprob_rows)).tolist()
        n_top = out.top_ids.shape[1] if out.top_ids is not None else 0
        self._top_vals = take(len(out.logprob_rows), n_top).tolist()
        self._top_ids = take(len(out.logprob_rows), n_top).astype(np.int64).tolist()

    @classmethod
    def of_round(cls, rows: np.ndarray, num_accepted: int) -> "HostResults":
        """The results of a whole-round graph (engine/round_graphs.py): per request one row of accept length,
        accepted rows [A], emitted tokens [A] and node q [B] (A = num_accepted); no sampled plain rows and
        no logprobs."""
        out = cls.__new__(cls)
        a = num_accepted
        out.tokens, out._lp_index, out._chosen, out._top_vals, out._top_ids = [], {}, [], [], []
        ints = rows[:, :1 + 2 * a].astype(np.int64)
        out.accept_len = ints[:, 0].tolist()
        out.accepted = ints[:, 1:1 + a].tolist()
        out.emitted = ints[:, 1 + a:].tolist()
        out.curves = confidence_rows(rows[:, 1 + 2 * a:])
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

    def values(self) -> np.ndarray:
        """The copied values as an array (a view of the host buffer)."""
        if self.event is not None:
            self.event.synchronize()
        return self.host.numpy()


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
        return HostResults(self.values().reshape(-1), self.num_plain, self.walk, self.out, self.curve)


class RoundCopy(_HostCopy):
    """The one copy of a whole-round graph's packed results ([N, 1 + 2A + B] float64 on the device)."""

    def __init__(self, packed: torch.Tensor, num_accepted: int):
        self.num_accepted = num_accepted
        super().__init__(packed, owned=True)

    def wait(self) -> HostResults:
        return HostResults.of_round(self.values(), self.num_accepted)


def tree_results(batch: TreeBatch, tree_row0: int, host: HostResults, num_plain: int, features: torch.Tensor | None,
                 result: StepResult, record_hidden: Callable[[str, torch.Tensor], None]) -> None:
    """A step's trees into its StepResult: each request's emitted tokens (accepted drafts then the bonus), curves,
    logprobs, accepted rows and the acceptance statistics; the accepted rows' target features go to
    record_hidden (a drafter fed by them). tree_row0: the first verify row among the step's rows."""
    width, curves = batch.width, len(host.curves) > 0
    for i, s in enumerate(batch.seqs):
        req = s.request
        tau = host.accept_len[i]
        # accepted rows; drafts then the bonus
        acc, emitted = host.accepted[i][:tau], host.emitted[i][:tau]
        result.new_token_ids[req.request_id] = emitted
        if curves and batch.drafted[i]:
            result.curves[req.request_id] = host.curves[i]
        if req.sampling.logprobs is not None:  # token j was chosen at accepted row acc[j]
            result.logprobs[req.request_id] = [host.logprob(num_plain + i * width + a, req.sampling.logprobs)
                                               for a in acc]
        if features is not None:
            base = tree_row0 + i * width
            record_hidden(req.request_id, features[[base + a for a in acc]])
        if batch.budgets[i] == 0:
            continue  # a root-only tree (CUDA-graph layout): a plain decoding step, not speculation
        result.accepted_rows[req.request_id] = acc[1:]
        result.num_draft_tokens[req.request_id] = batch.budgets[i]
        result.accept_lengths.append(tau)
        result.tree_nodes.append(batch.budgets[i])
        for d in range(tau - 1):
            if d >= len(result.accepted_per_position):
                result.accepted_per_position.append(0)
            result.accepted_per_position[d] += 1
