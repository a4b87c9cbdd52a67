"""PyTorch twin of the `sample_tokens` kernel (ext/csrc/sampling.cu): one token per row from a caller-supplied
uniform, so a run is reproducible from its uniforms alone and CPU and CUDA pick the same tokens.

Per row r, with x = logits[r] in fp32 and T = temperature[r]:
  - T < 1e-5 (or NaN): argmax of x (NaN counts as the largest value, equal values -> the lowest id);
  - else the weights e = exp((x - max x) * (1 / T)) in fp32 (so e = p / max p for p = softmax(x / T); -inf
    logits get e = 0), kept where e > 0 and e >= min_p[r] (min_p = 0 keeps every token with p > 0). The token is
    the first one, in vocabulary order, whose cumulative kept mass (fp64) exceeds uniform[r] * the total kept
    mass; it always has a positive kept weight. When rounding leaves no crossing (uniform within 2^-52 of 1),
    it is the last kept token. A row without a finite max (all -inf, a NaN, a +inf) takes the argmax.
"""
from __future__ import annotations

import torch

GREEDY_BELOW = 1e-5  # temperatures below this are greedy
_BLOCK_ELEMS = 1 << 20  # rows are processed in blocks of about this many logits (bounds the fp64 temporaries)


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, min_p: torch.Tensor,
                  uniform: torch.Tensor) -> torch.Tensor:
    """logits [R, V] float, temperature [R], min_p [R], uniform [R] in [0, 1) -> [R] int64 (see the module doc)."""
    if logits.dim() != 2:
        raise ValueError(f"sample_tokens: logits must be [rows, V], got shape {tuple(logits.shape)}")
    rows, vocab = logits.shape
    device = logits.device
    temperature = temperature.to(device, torch.float32).reshape(rows)
    min_p = min_p.to(device, torch.float32).reshape(rows)
    uniform = uniform.to(device, torch.float64).reshape(rows)
    out = torch.empty(rows, dtype=torch.int64, device=device)
    step = max(1, _BLOCK_ELEMS // max(vocab, 1))
    for a in range(0, rows, step):
        b = min(rows, a + step)
        out[a:b] = _sample_block(logits[a:b].float(), temperature[a:b], min_p[a:b], uniform[a:b])
    return out


def kept_weights(x: torch.Tensor, temperature: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """fp32 logits [R, V] -> the kernel's fp32 kept weights [R, V] (0 where a token is not kept)."""
    m = x.amax(-1, keepdim=True)
    inv_t = 1.0 / temperature  # fp32, as the kernel
    e = torch.exp((x - m) * inv_t[:, None])
    kept = (e > 0) & (e >= min_p[:, None])
    return torch.where(kept, e, torch.zeros((), dtype=e.dtype, device=e.device))


def _sample_block(x: torch.Tensor, temperature: torch.Tensor, min_p: torch.Tensor,
                  uniform: torch.Tensor) -> torch.Tensor:
    greedy_ids = x.argmax(-1)
    w = kept_weights(x, temperature, min_p)
    kept = w > 0
    cum = w.double().cumsum(-1)
    total = cum[:, -1]
    target = uniform * total
    cross = kept & (cum > target[:, None])
    first = cross.to(torch.int8).argmax(-1)  # the first True
    last = (x.shape[-1] - 1) - kept.flip(-1).to(torch.int8).argmax(-1)
    pick = torch.where(cross.any(-1), first, last)
    sampled = (temperature >= GREEDY_BELOW) & (total > 0)
    return torch.where(sampled, pick, greedy_ids)
