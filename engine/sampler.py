"""The batched sampler: turns the logits of every row of a step into tokens on the model's device, for plain
decoding rows and DDTree verify rows alike, in a fixed handful of tensor ops (no per-request Python over the
vocabulary, no host sync).

Per row, in this order (the order plain decoding has always used): logit_bias; repetition, presence and
frequency penalties over the request's output (for a tree row: plus the drafted tokens on the path to it);
min_tokens (EOS and stop ids masked while the row's output index is below it); the grammar's bitmask (structured
output; for a tree row, of the grammar state after its path); then argmax at temperature 0,
or temperature, top-k, top-p, min-p and one draw.

The draw is inverse-CDF sampling with a counter-based uniform u = f(request seed, output index of the token):
the same seed gives the same tokens whatever else is in the batch, on any device, with speculation on or
off. Under DDTree the row that decides output position i uses exactly the uniform plain decoding would use at
position i, so a walk through the tree emits what plain sampling emits from the same logits (and is therefore
distributed exactly like it, ddtree.md §2.6).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.request import Request
from engine.staging import Staging
from engine.structured import apply_masks, masks_tensor
from engine.top_k_top_p import NUM_CANDIDATES, _filter_top_k_top_p, _scatter, _within_candidates, sample_candidates
from ext import ops


class RequestFault(Exception):
    """A failure tied to one request: the engine fails that request and goes on with the others."""

    def __init__(self, request_id: str, message: str):
        super().__init__(message)
        self.request_id = request_id


@dataclass
class SamplingBatch:
    """The rows to sample: request m owns the next num_rows[m] rows of the logits. Tree requests come last;
    their rows are `width` wide each, in the tree's row order."""

    requests: list[Request]
    num_rows: list[int]
    # [R] int64 on the device: how many tokens past the request's committed output the row's token lies (tree
    # depth of the row; 0 for plain rows). None = all rows at depth 0.
    depths: torch.Tensor | None = None
    # the trailing tree requests' node tokens [N, W] and ancestor-or-self visibility [N, W, W] (penalties)
    tree_tokens: torch.Tensor | None = None
    tree_visibility: torch.Tensor | None = None
    # structured output: rows restricted to a grammar's bitmask (engine/structured.py), one mask per row
    grammar_rows: list[int] | None = None
    grammar_masks: list[bytes] | None = None


@dataclass
class SampleOutput:
    tokens: torch.Tensor  # [R] int64 on the device
    logprob_rows: list[int]  # rows whose request asked for logprobs, ascending
    chosen_logprobs: torch.Tensor | None  # [len(logprob_rows)] fp32: the sampled token's logprob
    top_logprobs: torch.Tensor | None  # [len(logprob_rows), n] fp32 (n = the batch's largest request)
    top_ids: torch.Tensor | None  # [len(logprob_rows), n] int64


class _PenaltyState:
    """A penalized request's prompt tokens as a mask and its output tokens as counts, kept on the device and
    updated with the tokens committed since the last step."""

    def __init__(self, request: Request, vocab_size: int, device):
        self.prompt_mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        self.prompt_mask[torch.tensor(request.prompt_token_ids, device=device)] = True
        self.counts = torch.zeros(vocab_size, dtype=torch.int32, device=device)
        self.num_counted = 0

    def update(self, request: Request) -> None:
        new = request.output_token_ids[self.num_counted:]
        if new:
            ids = torch.tensor(new, device=self.counts.device)
            self.counts.index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
            self.num_counted += len(new)


def needs_penalty(request: Request) -> bool:
    sp = request.sampling
    return sp.repetition_penalty != 1.0 or sp.presence_penalty != 0.0 or sp.frequency_penalty != 0.0


class Sampler:
    def __init__(self, vocab_size: int, device, fault_seed: int | None = None):
        self.vocab_size, self.device, self.fault_seed = vocab_size, torch.device(device), fault_seed
        self._penalties: dict[str, _PenaltyState] = {}
        self.stage = Staging(device)  # the runner shares its own (reset every step)

    def release(self, request_id: str) -> None:
        self._penalties.pop(request_id, None)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SampleOutput:
        """logits [R, V] fp32 (raw, from the model) -> tokens and logprobs (all on the device)."""
        rows = _RowPlan(batch, self.fault_seed)
        processed = logits
        if rows.bias_rows:
            processed = processed.clone()
            index = (self._tensor(rows.bias_rows), self._tensor(rows.bias_tokens))
            processed.index_put_(index, self._tensor(rows.bias_values, torch.float32), accumulate=True)
        if rows.penalized:
            processed = self._apply_penalties(processed, batch, rows)
        if rows.min_token_rows:
            processed = self._mask_min_tokens(processed, batch, rows)
        if batch.grammar_rows:  # last: no bias or penalty can bring back a token the grammar forbids
            processed = apply_masks(processed, self._tensor(batch.grammar_rows),
                                    masks_tensor(batch.grammar_masks, self.device))
        tokens = processed.argmax(-1)
        if rows.sampled_rows:
            tokens = self._draw(processed, tokens, batch, rows)
        return self._logprobs(logits, tokens, rows)

    # ------------------------------------------------------------------------------------------- steps

    def _tensor(self, values, dtype=torch.int64) -> torch.Tensor:
        return self.stage(values, dtype)

    def _row_depths(self, batch: SamplingBatch, index: torch.Tensor) -> torch.Tensor:
        if batch.depths is None:
            return torch.zeros_like(index)
        return batch.depths[index]

    def _apply_penalties(self, logits: torch.Tensor, batch: SamplingBatch, rows: "_RowPlan") -> torch.Tensor:
        """Repetition (prompt and output), presence and frequency (output) penalties on the penalized rows."""
        pen_rows = self._tensor(rows.penalty_rows)  # [Rp]
        states = []
        for m in rows.penalized:
            req = batch.requests[m]
            state = self._penalties.get(req.request_id)
            if state is None:
                state = self._penalties[req.request_id] = _PenaltyState(req, self.vocab_size, self.device)
            state.update(req)
            states.append(state)
        counts = torch.stack([s.counts for s in states])[self._tensor(rows.penalty_state_of_row)]  # [Rp, V]
        prompt = torch.stack([s.prompt_mask for s in states])[self._tensor(rows.penalty_state_of_row)]
        if batch.tree_tokens is not None and rows.penalty_tree_rows:
            counts = counts + self._path_counts(batch, rows, len(rows.penalty_rows))
        params = self._tensor(rows.penalty_params, torch.float32)  # [Rp, 3]: repetition, presence, frequency
        rep, presence, frequency = params[:, 0:1], params[:, 1:2], params[:, 2:3]
        x = logits[pen_rows]
        seen = prompt | (counts > 0)
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        x = x - frequency * counts.to(x.dtype) - presence * (counts > 0).to(x.dtype)
        return logits.index_copy(0, pen_rows, x)

    def _path_counts(self, batch: SamplingBatch, rows: "_RowPlan", num_rows: int) -> torch.Tensor:
        """[Rp, V] counts of the drafted tokens on the path to each penalized tree row (root excluded: it is
        already in the output)."""
        out = torch.zeros(num_rows, self.vocab_size, dtype=torch.int32, device=self.device)
        local = self._tensor([i for i, _ in rows.penalty_tree_rows])  # position among the penalized rows
        tree_index = self._tensor([n for _, n in rows.penalty_tree_rows])  # (request, row) flat in [N * W]
        width = batch.tree_tokens.shape[1]
        vis = batch.tree_visibility.reshape(-1, width)[tree_index, 1:].to(torch.int32)  # [Rt, W-1]
        tokens = batch.tree_tokens[tree_index // width, 1:].clamp(min=0)  # [Rt, W-1]
        path = torch.zeros(len(rows.penalty_tree_rows), self.vocab_size, dtype=torch.int32, device=self.device)
        path.scatter_add_(1, tokens, vis)
        return out.index_copy(0, local, path)

    def _mask_min_tokens(self, logits: torch.Tensor, batch: SamplingBatch, rows: "_RowPlan") -> torch.Tensor:
        """EOS and stop ids get -inf on rows whose output index (committed output + depth) is below min_tokens."""
        row_t, tok_t = self._tensor(rows.min_token_rows), self._tensor(rows.min_token_ids)
        limit = self._tensor(rows.min_token_limits)  # min_tokens - committed output, per pair
        active = self._row_depths(batch, row_t) < limit
        logits = logits.clone()
        current = logits[row_t, tok_t]
        logits[row_t, tok_t] = torch.where(active, torch.full_like(current, float("-inf")), current)
        return logits

    def _draw(self, logits: torch.Tensor, greedy: torch.Tensor, batch: SamplingBatch,
              rows: "_RowPlan") -> torch.Tensor:
        """Temperature, top-k, top-p, min-p and one inverse-CDF draw per sampled row."""
        index = self._tensor(rows.sampled_rows)
        params = self._tensor(rows.sampled_params, torch.float32)  # [S, 4]: temperature, top_p, min_p, top_k
        seeds_and_pos = self._tensor(rows.sampled_keys)  # [S, 2]: seed, committed output length
        x = logits[index] / params[:, 0:1]
        u = ops.seeded_uniforms(seeds_and_pos[:, 0], seeds_and_pos[:, 1] + self._row_depths(batch, index))
        min_p = params[:, 2]
        if rows.any_top_k_top_p:
            top_k, top_p = params[:, 3].to(torch.int64), params[:, 1]
            filtered, decided = _filter_top_k_top_p(x, top_k, top_p, NUM_CANDIDATES, inplace=True)
            if decided is not None and _within_candidates(decided):
                return greedy.index_copy(0, index, sample_candidates(decided[0], decided[1], min_p, u))
            x = filtered if decided is None else _scatter(x, decided)
        drawn = ops.sample_tokens(x, torch.ones_like(params[:, 0]), min_p, u)
        return greedy.index_copy(0, index, drawn)

    def _logprobs(self, logits: torch.Tensor, tokens: torch.Tensor, rows: "_RowPlan") -> SampleOutput:
        """The model's own logprobs (raw logits, before any processing) of the chosen tokens and the top n."""
        if not rows.logprob_rows:
            return SampleOutput(tokens, [], None, None, None)
        index = self._tensor(rows.logprob_rows)
        logp = logits[index].log_softmax(-1)
        chosen = logp.gather(1, tokens[index][:, None])[:, 0]
        top = logp.topk(rows.max_top_logprobs, dim=-1) if rows.max_top_logprobs else None
        return SampleOutput(tokens, rows.logprob_rows, chosen, top.values if top is not None else None,
                            top.indices if top is not None else None)


class _RowPlan:
    """Host-side description of what each row needs, built from the requests' parameters in one pass (the only
    per-request Python of a sampling step; a failure here is tied to its request)."""

    def __init__(self, batch: SamplingBatch, fault_seed: int | None):
        self.bias_rows: list[int] = []
        self.bias_tokens: list[int] = []
        self.bias_values: list[float] = []
        self.penalized: list[int] = []  # request indices
        self.penalty_rows: list[int] = []
        self.penalty_state_of_row: list[int] = []
        self.penalty_params: list[tuple[float, float, float]] = []
        self.penalty_tree_rows: list[tuple[int, int]] = []  # (position among penalty rows, flat tree row)
        self.min_token_rows: list[int] = []
        self.min_token_ids: list[int] = []
        self.min_token_limits: list[int] = []
        self.sampled_rows: list[int] = []
        self.sampled_params: list[tuple[float, float, float, float]] = []
        self.sampled_keys: list[tuple[int, int]] = []
        self.any_top_k_top_p = False
        self.logprob_rows: list[int] = []
        self.max_top_logprobs = 0
        first_tree = len(batch.requests) - (batch.tree_tokens.shape[0] if batch.tree_tokens is not None else 0)
        row = 0
        for m, (req, n) in enumerate(zip(batch.requests, batch.num_rows)):
            try:
                self._add(req, m, row, n, m >= first_tree, first_tree, batch, fault_seed)
            except Exception as e:
                raise RequestFault(req.request_id, f"{type(e).__name__}: {e}") from e
            row += n

    def _add(self, req: Request, m: int, row: int, n: int, is_tree: bool, first_tree: int,
             batch: SamplingBatch, fault_seed: int | None) -> None:
        sp = req.sampling
        if fault_seed is not None and sp.seed == fault_seed and req.output_token_ids:
            raise RuntimeError("injected fault (test_fault_seed)")
        rows = range(row, row + n)
        for token, value in (sp.logit_bias or {}).items():
            for r in rows:
                self.bias_rows.append(r)
                self.bias_tokens.append(int(token))
                self.bias_values.append(float(value))
        if needs_penalty(req):
            state = len(self.penalized)
            self.penalized.append(m)
            for j, r in enumerate(rows):
                if is_tree:
                    width = n
                    self.penalty_tree_rows.append((len(self.penalty_rows), (m - first_tree) * width + j))
                self.penalty_rows.append(r)
                self.penalty_state_of_row.append(state)
                self.penalty_params.append((sp.repetition_penalty, sp.presence_penalty, sp.frequency_penalty))
        remaining = sp.min_tokens - req.num_output_tokens
        if remaining > 0:
            for r in rows:
                for token in sorted(req.stop_ids):
                    self.min_token_rows.append(r)
                    self.min_token_ids.append(int(token))
                    self.min_token_limits.append(remaining)
        if not sp.greedy:
            top_k = sp.top_k if sp.top_k and sp.top_k > 0 else 0
            self.any_top_k_top_p |= bool(top_k) or sp.top_p < 1.0
            for r in rows:
                self.sampled_rows.append(r)
                self.sampled_params.append((sp.temperature, sp.top_p, sp.min_p, float(top_k)))
                self.sampled_keys.append((req.seed, req.num_output_tokens))
        if sp.logprobs is not None:
            self.logprob_rows.extend(rows)
            self.max_top_logprobs = max(self.max_top_logprobs, sp.logprobs)

