"""Turns next-token logits into tokens: logit bias, repetition / presence / frequency penalties, temperature,
top-k, top-p, min-p, then greedy argmax or a draw from the request's own seeded generator (so a seeded
request gives the same tokens whatever else is in the batch). Also the target model's logprobs."""
from __future__ import annotations

import torch

from engine.request import Request


def apply_penalties_and_bias(logits: torch.Tensor, request: Request, history: list[int] | None = None) -> torch.Tensor:
    """logits [vocab] fp32 -> a processed copy. `history` = tokens generated so far (default: the request's)."""
    sp = request.sampling
    out = logits
    if sp.logit_bias:
        out = out.clone()
        ids = torch.tensor(list(sp.logit_bias.keys()), dtype=torch.long, device=out.device)
        out[ids] += torch.tensor(list(sp.logit_bias.values()), dtype=out.dtype, device=out.device)
    generated = request.output_token_ids if history is None else history
    if sp.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(request.prompt_token_ids) | set(generated)), dtype=torch.long, device=out.device)
        if len(seen):
            out = out.clone()
            vals = out[seen]
            out[seen] = torch.where(vals > 0, vals / sp.repetition_penalty, vals * sp.repetition_penalty)
    if (sp.presence_penalty or sp.frequency_penalty) and generated:
        ids, counts = torch.tensor(generated, dtype=torch.long, device=out.device).unique(return_counts=True)
        out = out.clone()
        out[ids] -= sp.frequency_penalty * counts.to(out.dtype) + sp.presence_penalty
    return out


def sampling_probs(logits: torch.Tensor, request: Request) -> torch.Tensor:
    """Processed logits [vocab] -> the distribution plain sampling draws from: temperature, top-k, top-p, min-p."""
    sp = request.sampling
    logits = logits / sp.temperature
    if sp.top_k and sp.top_k > 0 and sp.top_k < logits.shape[-1]:
        kth = logits.topk(sp.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if sp.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # drop a token when the mass before it already reaches top_p (the top token always stays)
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= sp.top_p
        probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
    if sp.min_p > 0:
        probs = probs.masked_fill(probs < sp.min_p * probs.max(), 0.0)
    return probs / probs.sum()


def choose(logits: torch.Tensor, request: Request, history: list[int] | None = None) -> int:
    """One next token from raw logits [vocab] for `request`."""
    processed = apply_penalties_and_bias(logits, request, history)
    if request.sampling.greedy:
        return int(processed.argmax())
    probs = sampling_probs(processed, request)
    return int(torch.multinomial(probs, 1, generator=request.generator))


def token_logprobs(logits: torch.Tensor, token_id: int, num_top: int) -> tuple[float, list[tuple[int, float]]]:
    """The target model's logprob of `token_id` and its top-`num_top` alternatives, from raw logits [vocab]."""
    logp = logits.float().log_softmax(-1)
    top = []
    if num_top > 0:
        vals, ids = logp.topk(num_top)
        top = list(zip(ids.tolist(), vals.tolist()))
    return float(logp[token_id]), top


def sample(logits: torch.Tensor, requests: list[Request]) -> tuple[list[int], list]:
    """logits [num_requests, vocab] fp32 -> (token ids, per-request logprob entries or None)."""
    tokens, logprobs = [], []
    for row, request in zip(logits, requests):
        t = choose(row, request)
        tokens.append(t)
        n = request.sampling.logprobs
        logprobs.append(token_logprobs(row, t, n) if n is not None else None)
    return tokens, logprobs
