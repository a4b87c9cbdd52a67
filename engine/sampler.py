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


NUM_CANDIDATES = 512  # CPU: the largest logits a row's top-k / top-p is decided from (else the sort)
FIRST_CANDIDATES = 64  # CPU: tried first (the embedded model's chats at T = 0.7, top_p 0.9: 62 of 64 steps decided)


def apply_top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                      num_candidates: int = NUM_CANDIDATES, inplace: bool = False) -> torch.Tensor:
    """x [S, V] tempered logits; top_k [S] (0 = off), top_p [S] (1 = off) -> x with dropped tokens at -inf.
    inplace: x may be overwritten (a caller's own temporary; off the CPU it then is, and no second [S, V] tensor is
    made: inside a CUDA graph that would be one more in its memory pool).
    top-k keeps every token at least as large as the k-th largest (ties at the boundary stay); top-p then
    drops a token when the probability mass before it (in descending order) already reaches top_p.

    On the CPU the rows are first decided from their FIRST_CANDIDATES, then num_candidates, largest logits
    (_candidates): sorting a 49,152-token row took 4 ms of a 57 ms decoding step of the embedded model at T = 1,
    top_p 0.9. Elsewhere each row's floor comes from ops.top_k_top_p_floor (no sort, no host sync; its top-p sums
    integer masses, so a token at the boundary can differ from the CPU's fp32 sums)."""
    filtered, decided = _filter_top_k_top_p(x, top_k, top_p, num_candidates, inplace)
    return filtered if decided is None else _scatter(x, decided)


def _filter_top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, m: int,
                        inplace: bool = False) -> tuple[torch.Tensor | None, tuple | None]:
    """apply_top_k_top_p's work: (x filtered, None) by the floor kernel (not on the CPU) or by sorting the rows, or
    on the CPU (None, _candidates' decision) when each row's m largest logits decide it."""
    if x.device.type != "cpu":  # the floor without a sort, in one launch (no host sync: graphs capture it)
        dropped = x < ops.top_k_top_p_floor(x, top_k, top_p)[:, None]  # the kernel reads k outside (0, V) as off
        return (x.masked_fill_(dropped, float("-inf")) if inplace else x.masked_fill(dropped, float("-inf"))), None
    vocab = x.shape[-1]
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    if vocab > 2 * m:
        for size in sorted({min(FIRST_CANDIDATES, m), m}):  # topk of 64 costs a third of topk of 512 (72 rows)
            decided = _candidates(x, k, top_p, size)
            if decided is not None:
                return None, decided
    return sort_top_k_top_p(x, k, top_p), None


def sort_top_k_top_p(x: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """apply_top_k_top_p by sorting every row (k [S] in 1..V): the CPU's last resort, and what CUDA did before the
    floor kernel (bench/kernels.py times it beside the kernel)."""
    ordered, order = x.sort(dim=-1, descending=True)
    kth = ordered.gather(1, (k - 1)[:, None])
    ordered = ordered.masked_fill(ordered < kth, float("-inf"))
    probs = ordered.softmax(-1)
    # top_p 1 is off: in float32 the cumulative mass reaches 1 before the tail, which it would drop
    drop = ((probs.cumsum(-1) - probs) >= top_p[:, None]) & (top_p[:, None] < 1.0)
    drop[:, 0] = False  # the top token always stays
    ordered = ordered.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(1, order, ordered)


def _scatter(x: torch.Tensor, decided: tuple) -> torch.Tensor:
    """x [S, V] filtered as _candidates decided: each row's kept candidates, -inf elsewhere; unchanged rows as x."""
    kept, order, unchanged = decided
    out = torch.full_like(x, float("-inf")).scatter_(1, order, kept)
    return torch.where(unchanged[:, None], x, out)


def _within_candidates(decided: tuple) -> bool:
    """Every row filtered (none passes unchanged) with a finite largest logit: no token outside the candidates
    can be drawn (sample_candidates serves)."""
    kept, _, unchanged = decided
    return not bool(unchanged.any()) and bool(torch.isfinite(kept[:, 0]).all())


def sample_candidates(kept: torch.Tensor, order: torch.Tensor, min_p: torch.Tensor,
                      uniform: torch.Tensor) -> torch.Tensor:
    """sample_tokens(x, 1, min_p, uniform) of rows x that are -inf outside their candidates, from the candidates
    alone: kept [S, m] their logits (-inf where a filter dropped one; the first, the row's largest, finite), order
    [S, m] their vocabulary ids -> [S] ids. The same tokens as the whole rows: the kept weights in vocabulary order
    and their fp64 running sum, to which every other token adds an exact zero (a tree step's 72 rows of the
    embedded model's 49,152-token vocabulary: ~50 ms filtered and drawn whole on two cores)."""
    ids, perm = order.sort(dim=-1)  # [S, m]: vocabulary order
    picked = ops.sample_tokens(kept.gather(1, perm), torch.ones_like(min_p), min_p, uniform)  # [S] columns
    return ids.gather(1, picked[:, None])[:, 0]


def _candidates(x: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor,
                m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """apply_top_k_top_p decided from each row's m largest logits: (kept [S, m] those logits with -inf where the
    filters drop them, order [S, m] their vocabulary ids, unchanged [S] rows no filter touches), or None when they
    do not decide every row (the caller then sorts). A row is decided when top-k keeps fewer than m tokens (its
    k-th largest logit is above the m-th, so no token outside is kept), or top-k is off and the m candidates
    already hold top_p of the mass (every token after them has that much before it), or neither filter is on."""
    vocab = x.shape[-1]
    values, order = x.topk(m, dim=-1)  # [S, m], descending
    kth = values.gather(1, (k.clamp(max=m) - 1)[:, None])  # [S, 1]
    by_k = (k < m) & (values[:, -1] < kth[:, 0])
    off = k >= vocab
    masked = values.masked_fill(by_k[:, None] & (values < kth), float("-inf"))
    # the normaliser of top-p's probabilities: the kept candidates, or (top-k off) the whole row
    norm = torch.where(by_k, masked.logsumexp(-1), x.logsumexp(-1))
    probs = (masked - norm[:, None]).exp()
    cumulative = probs.cumsum(-1)
    unchanged = off & (top_p >= 1.0)
    if not bool((by_k | unchanged | (off & (cumulative[:, -1] >= top_p))).all()):
        return None
    drop = (cumulative - probs) >= top_p[:, None]
    drop[:, 0] = False  # the top token always stays
    return masked.masked_fill(drop, float("-inf")), order, unchanged


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

