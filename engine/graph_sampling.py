"""Choosing the target's token inside a CUDA graph: the per-request sampling parameters, seeds and output
positions in static buffers, and the choice itself as a fixed sequence of tensor ops over every row of a
bucket: argmax, or engine/sampler.py's draw at temperature > 0 (min-p; top-k/top-p in a variant of its own,
which adds the floor kernel and a masking pass). The draw uses the sampler's counter-based uniform of (seed,
output position), so a graph draws what the sampler draws for the same logits. Steps whose requests need
more of the sampler (logprobs, penalties, logit bias, min_tokens, grammars) are not served here: `variant()`
says why. Used by the tree steps' whole rounds (engine/round_graphs.py) and plain decoding's epilogue
(engine/plain_graphs.py)."""
from __future__ import annotations

import numpy as np
import torch

from engine.plan import ScheduledSeq
from engine.sampler import needs_penalty
from engine.top_k_top_p import apply_top_k_top_p
from engine.staging import Staging
from ext import ops

# epilogue variants: how the target's token after each row is chosen
GREEDY, SAMPLED, TOP_K_P = "greedy", "sampled", "sampled with top-k/top-p"
VARIANTS = (GREEDY, SAMPLED, TOP_K_P)
# rows of GraphSampling.ints (int64) and .params (float32), per request of a bucket
SEED, OUTPUT, OFFSET = range(3)
TEMPERATURE, TOP_P, MIN_P, TOP_K = range(4)


def variant(seqs: list[ScheduledSeq], fault_injection: bool = False) -> tuple[str | None, str]:
    """(the variant that serves these requests, "") or (None, why none does)."""
    if fault_injection:
        return None, "requests face an injected fault"
    chosen = GREEDY
    for s in seqs:
        req, sp = s.request, s.request.sampling
        if sp.logprobs is not None:
            return None, "requests ask for logprobs"
        if sp.logit_bias or needs_penalty(req):
            return None, "requests have penalties or a logit bias"
        if sp.min_tokens > req.num_output_tokens:
            return None, "requests are below min_tokens"
        if req.constraint is not None:
            return None, "requests have a grammar"
        if not sp.greedy:
            top = (sp.top_k and sp.top_k > 0) or sp.top_p < 1.0
            chosen = TOP_K_P if top or chosen == TOP_K_P else SAMPLED
    return chosen, ""


class GraphSampling:
    def __init__(self, max_requests: int, device: torch.device):
        self.ints = torch.zeros(3, max_requests, dtype=torch.int64, device=device)  # SEED, OUTPUT, OFFSET
        self.params = torch.zeros(4, max_requests, dtype=torch.float32, device=device)  # TEMPERATURE .. TOP_K
        # the requests whose parameters and seeds the buffers hold, in row order (held, so that no other request
        # can take one's place unnoticed), and whether the OFFSET row holds offsets
        self._staged: list = []
        self._offsets = False

    def stage(self, seqs: list[ScheduledSeq], outputs: list[int], stage: Staging,
              offsets: torch.Tensor | None = None) -> None:
        """The requests' parameters, seeds and output positions (outputs: each request's output index of its first
        row; offsets [N] on the device: added to them, for a step launched ahead of the tokens before it). A
        request's parameters and seed never change, so for the requests of the step before, in the same rows,
        only the output row is written (at batch 64 the parameters' rows took ~2/3 of this on the host)."""
        num = len(seqs)
        requests = [s.request for s in seqs]
        if requests != self._staged:  # (Request compares by identity)
            # whole buffers, each in one copy straight from pinned memory (the rows past num: padding, greedy)
            params = np.zeros(self.params.shape, dtype=np.float32)  # [4, max_requests]
            params[:, :num] = np.array([(sp.temperature, sp.top_p, sp.min_p, sp.top_k if sp.top_k and sp.top_k > 0
                                         else 0) for sp in (r.sampling for r in requests)], dtype=np.float32).T
            stage.into(self.params, params)
            ints = np.zeros(self.ints.shape, dtype=np.int64)  # [3, max_requests]
            ints[SEED, :num], ints[OUTPUT, :num] = [r.seed for r in requests], outputs
            stage.into(self.ints, ints)
            self._staged, self._offsets = requests, False
        else:
            row = np.zeros(self.ints.shape[1], dtype=np.int64)
            row[:num] = outputs
            stage.into(self.ints[OUTPUT], row)
            if self._offsets and offsets is None:
                self.ints[OFFSET].zero_()
                self._offsets = False
        if offsets is not None:
            self.ints[OFFSET, :num].copy_(offsets)
            self._offsets = True

    def choose(self, logits: torch.Tensor, n: int, w: int, depths: torch.Tensor | None, chosen: str) -> torch.Tensor:
        """[n * w, vocab] logits of n requests' w rows each (fp32; the greedy variant takes the model's dtype)
        -> [n * w] int64 tokens: the argmax, or for the
        requests at temperature > 0 the draw (depths [n, w]: each row's output position past its request's
        first; None = 0)."""
        if chosen == GREEDY:
            return logits.argmax(-1)

        def per_row(values: torch.Tensor) -> torch.Tensor:  # [n] -> [n * w]
            return values[:n, None].expand(n, w).reshape(-1)

        temperature, top_p, min_p, top_k = (per_row(p) for p in self.params)
        sampled = temperature > 0
        x = logits / torch.where(sampled, temperature, 1.0)[:, None]
        if chosen == TOP_K_P:
            x = apply_top_k_top_p(x, top_k.to(torch.int64), top_p, inplace=True)
        output = per_row(self.ints[OUTPUT]) + per_row(self.ints[OFFSET])
        if depths is not None:
            output = output + depths.reshape(-1)
        # temperature 1 for the sampled rows (x is already scaled), 0 for the greedy ones: the kernel takes their
        # argmax (of x, whose filters keep each row's largest logit: the logits' argmax, ties to the lowest id)
        return ops.sample_tokens(x, sampled.float(), min_p, ops.seeded_uniforms(per_row(self.ints[SEED]), output))
