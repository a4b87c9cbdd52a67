"""The n-gram drafter on the target's device: engine.speculative.ngram's rule (ext.ops.ngram_propose, one block a
request), drafted from a table there that holds every running request's tokens, one row each. So a tree step can
be drafted before the previous tree step's results reach the host (propose_ahead: the kernel first writes the
tokens that step emitted into the table), and drafting costs a few launches instead of host time that grows with
the batch (the host drafter took 3-5.5 ms for 16 requests on the H200's host, against 0.8 ms steps).

The host writes each request's committed tokens into its row as they become known (only the new ones), so rows
stay right when a step was not drafted ahead. The calibration stays on the host (engine.speculative.ngram.
Calibration): each call's top candidates come back through a copy that does not block, are read at a later call
once it has landed, and are checked against the committed tokens as the host drafter checks its own; the hit
rates go to the device with the next call. Unlike the host drafter, one call's requests are all checked before
any of them is drafted.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.request import TokenView
from engine.speculative.drafter import DraftRequest, proposal_width
from engine.speculative.ngram import CAL_PRIOR, NgramRule, rewritten
from engine.staging import Staging
from ext import ops

MIN_WIDTH = 2048  # tokens a row holds at first; doubled as needed
MAX_SPARE = 8  # read-back buffers kept for reuse, the most recently read (their shapes: the batches drafted)


@dataclass
class _Slot:
    request_id: str
    row: int
    tokens: list[int] = field(default_factory=list)  # committed tokens written into the row from the host
    pending: list[list] = field(default_factory=list)  # the calibration's unchecked tops (Calibration.check)
    # the request's token lists when its tokens came as a TokenView (the engine only appends to them): while the
    # same lists come, the history was not rewritten and needs no check
    lists: tuple | None = None


class DeviceNgramDrafter(NgramRule):
    def __init__(self, vocab_size: int, horizon: int = 8, max_ngram: int = 4, max_matches: int = 32,
                 backoff: float = 0.1, recency: float = 1.0, calibrate: bool = True,
                 device: torch.device | str = "cpu"):
        super().__init__(vocab_size, horizon, max_ngram, max_matches, backoff, recency, calibrate)
        self.device = torch.device(device)
        self.stage = Staging(self.device)  # the runner's, once the speculator shares it (use_staging)
        self.table = torch.zeros((0, MIN_WIDTH), dtype=torch.int32, device=self.device)  # [rows, width]
        self._slots: dict[str, _Slot] = {}
        self._free: list[int] = []
        # tops copied back from earlier calls, oldest first: (event or None on the CPU, [N, 1 + 2L] host, slots)
        self._readbacks: deque[tuple[torch.cuda.Event | None, torch.Tensor, list[_Slot]]] = deque()
        # pinned buffers and events whose copies were read: reused (a pinned allocation and an event cost the host
        # more than the copy they serve)
        self._spare: list[tuple[torch.cuda.Event, torch.Tensor]] = []

    def release(self, request_id: str) -> None:
        slot = self._slots.pop(request_id, None)
        if slot is not None:
            self._free.append(slot.row)

    def propose(self, batch: list[DraftRequest], top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        slots = self._write(batch, extra=0)
        rows = self._to_device([s.row for s in slots])
        roots = self._to_device([len(r.token_ids) - 1 for r in batch])
        return self._draft(slots, top_k, rows, roots, None, None)

    def propose_ahead(self, batch: list[DraftRequest], top_k: int, root_ids: torch.Tensor,
                      root_positions: torch.Tensor, num_new: torch.Tensor, feats=None,
                      emitted_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """propose() for requests whose previous tree step has not reported: its emitted tokens (emitted_ids [N, A],
        num_new [N]) and root positions [N] are on the device; `batch` holds the tokens before it."""
        if emitted_ids is None:
            raise ValueError("the device n-gram drafter drafts ahead only from the emitted tokens (emitted_ids)")
        slots = self._write(batch, extra=emitted_ids.shape[1])
        rows = self._to_device([s.row for s in slots])
        return self._draft(slots, top_k, rows, root_positions, emitted_ids, num_new)

    def _draft(self, slots: list[_Slot], top_k: int, rows: torch.Tensor, roots: torch.Tensor,
               emitted_ids: torch.Tensor | None, num_new: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel's call, with the calibration brought up to date first and its tops sent back after."""
        cal = self.calibration
        if cal is not None:
            self._take_readbacks()
            for slot in slots:
                cal.check(slot)
        table = self.stage(cal.table, torch.float64) if cal is not None else None
        logprobs, token_ids, tops = ops.ngram_propose(
            self.table, rows, roots, emitted_ids, num_new, table, self.horizon,
            proposal_width(top_k, self.vocab_size), self.vocab_size, self.max_ngram, self.max_matches, self.backoff,
            self.recency, CAL_PRIOR)
        if cal is not None:
            self._send_back(tops, slots)
        return logprobs, token_ids

    def _send_back(self, tops: torch.Tensor, slots: list[_Slot]) -> None:
        """Starts the copy of a call's tops [N, 1 + 2L] to the host, read by a later call once it has landed."""
        if tops.is_cuda:
            spare = next((i for i, (_, h) in enumerate(self._spare) if h.shape == tops.shape), None)
            event, host = self._spare.pop(spare) if spare is not None else \
                (torch.cuda.Event(), torch.empty(tops.shape, dtype=tops.dtype, pin_memory=True))
            host.copy_(tops, non_blocking=True)
            event.record()
            self._readbacks.append((event, host, slots))
        else:
            self._readbacks.append((None, tops, slots))

    def _take_readbacks(self) -> None:
        """Every landed call's tops into its requests' pending checks (oldest first; a released request's are
        dropped, and a draft made again at the same length replaces the earlier one, as the host drafter does)."""
        horizon = self.horizon
        while self._readbacks and (self._readbacks[0][0] is None or self._readbacks[0][0].query()):
            event, host, slots = self._readbacks.popleft()
            if event is not None:
                self._spare.append((event, host))
                if len(self._spare) > MAX_SPARE:
                    self._spare.pop(0)
            for slot, top in zip(slots, host.tolist()):
                if top[0] < 0 or self._slots.get(slot.request_id) is not slot:
                    continue
                if slot.pending and slot.pending[-1][0] == top[0]:
                    slot.pending.pop()
                slot.pending.append([top[0], list(zip(top[1:1 + horizon], top[1 + horizon:])), 0])

    def _write(self, batch: list[DraftRequest], extra: int) -> list[_Slot]:
        """Each request's slot, its row holding its committed tokens (only the new ones are copied), with room for
        `extra` more past them."""
        slots = [self._slot(r) for r in batch]
        lengths = [len(r.token_ids) for r in batch]  # (a request's tokens are a TokenView: its len is a call)
        self._grow(max(lengths, default=-1) + extra + 1)
        width, starts, counts, values = self.table.shape[1], [], [], []
        for slot, req, num_tokens in zip(slots, batch, lengths):
            toks = req.token_ids
            lists = (toks.prompt, toks.output) if isinstance(toks, TokenView) else None
            same = lists is not None and slot.lists is not None and \
                lists[0] is slot.lists[0] and lists[1] is slot.lists[1]
            if not same and rewritten(slot.tokens, toks):
                slot.tokens, slot.pending = [], []  # write it all again
            slot.lists = lists
            done = len(slot.tokens)
            if done < num_tokens:
                new = toks[done:num_tokens]
                starts.append(slot.row * width + done)
                counts.append(len(new))
                values += new
                slot.tokens += new
        if values:
            # each request's run of positions, made by numpy: an interval draft catches up on 16-256 tokens a
            # request, and a list of every position cost ~30 ns a token more on the host
            counts = np.asarray(counts)
            offsets = np.repeat(np.asarray(starts) - (np.cumsum(counts) - counts), counts)
            positions = offsets + np.arange(len(values))
            self.table.view(-1).index_copy_(0, self._to_device(positions), self._to_device(values, torch.int32))
        return slots

    def _slot(self, req: DraftRequest) -> _Slot:
        if not req.token_ids:
            raise ValueError(f"request {req.request_id}: no committed tokens (the root token is needed)")
        slot = self._slots.get(req.request_id)
        if slot is None:
            row = self._free.pop() if self._free else len(self._slots)
            slot = self._slots[req.request_id] = _Slot(req.request_id, row)
        return slot

    def _grow(self, width: int) -> None:
        """Room for every slot's row and `width` tokens a row (sizes doubled; the tokens kept)."""
        rows = len(self._slots) + len(self._free)  # rows in use or freed: 0 .. rows - 1
        old_rows, old_width = self.table.shape
        if rows <= old_rows and width <= old_width:
            return
        new_rows, new_width = max(old_rows, 1), old_width
        while new_rows < rows:
            new_rows *= 2
        while new_width < width:
            new_width *= 2
        table = torch.zeros((new_rows, new_width), dtype=torch.int32, device=self.device)
        table[:old_rows, :old_width] = self.table
        self.table = table

    def _to_device(self, values: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return self.stage(values, dtype)
