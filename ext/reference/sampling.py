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


MASS_SCALE = 1 << 24  # top-p's masses are integers: floor(exp(x - max) * 2^24), so sums are exact in any order


# splitmix64's constants as signed int64 (torch's int64 arithmetic wraps, as the kernel's uint64 does)
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)


def _shift_right(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    z = x + _GOLDEN
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    return z ^ _shift_right(z, 31)


def seeded_uniforms(seeds: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """[R] int64 seeds, [R] int64 output indices -> [R] float64 uniforms in [0, 1), a pure function of both:
    (h >> 11) * 2^-53 for h = splitmix64(splitmix64(seed) + index) (the `seeded_uniforms` kernel's definition)."""
    h = _splitmix64(_splitmix64(seeds) + indices)
    return _shift_right(h, 11).double() * (1.0 / (1 << 53))


def top_k_top_p_floor(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """PyTorch twin of the `top_k_top_p_floor` kernel (ext/csrc/sampling_filter.cu), and its definition: logits
    [R, V] float, top_k [R] (outside (0, V) = off), top_p [R] (>= 1 = off) -> [R] fp32, the smallest value each row
    keeps, so that `x >= floor` is the kept set (-inf: the row keeps everything).

    Per row of x in fp32 (-0.0 as +0.0): kth = the k-th largest value (with multiplicity; -inf when top-k is off);
    with top-p on, q_i = floor(exp(x_i - max x) * 2^24) for x_i >= kth (else 0), Z = sum q, and the floor is the
    largest value t whose keep-set {x >= t} holds (double) sum q >= (double) top_p * (double) Z (in descending
    order: the value of the first token whose running mass reaches top_p of Z, as a sort-based top-p keeps it,
    with ties at the boundary kept); with top-p off it is kth. A row without a finite max (a NaN, +inf, all -inf)
    gets -inf."""
    if logits.dim() != 2:
        raise ValueError(f"top_k_top_p_floor: logits must be [rows, V], got shape {tuple(logits.shape)}")
    rows, vocab = logits.shape
    device = logits.device
    out = torch.empty(rows, dtype=torch.float32, device=device)
    top_k = top_k.to(device, torch.int64).reshape(rows)
    top_p = top_p.to(device, torch.float32).reshape(rows)
    step = max(1, _BLOCK_ELEMS // max(vocab, 1))
    for a in range(0, rows, step):
        b = min(rows, a + step)
        out[a:b] = _floor_block(logits[a:b].float() + 0.0, top_k[a:b], top_p[a:b])
    return out


def _floor_block(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    vocab = x.shape[-1]
    use_k, use_p = (top_k > 0) & (top_k < vocab), top_p < 1.0
    values = x.sort(dim=-1, descending=True).values  # NaN first
    top = values[:, 0]
    neg_inf = torch.full_like(top, float("-inf"))
    kth = values.gather(1, (torch.where(use_k, top_k, vocab) - 1)[:, None])[:, 0]
    kth = torch.where(use_k, kth, neg_inf)
    weights = torch.exp(values - top[:, None])  # fp32, as the kernel
    q = (weights.double() * MASS_SCALE).floor().to(torch.int64)
    q = torch.where(values >= kth[:, None], q, torch.zeros_like(q))
    cumulative = q.cumsum(-1)
    target = top_p.double() * cumulative[:, -1].double()
    first = (cumulative.double() >= target[:, None]).to(torch.int8).argmax(-1)
    by_p = values.gather(1, first[:, None])[:, 0]
    floor = torch.where(use_p, by_p, kth)
    return torch.where(torch.isfinite(top), floor, neg_inf)
