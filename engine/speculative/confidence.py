"""The drafter's confidence in a tree node, binned: node q in [2^-(k+1), 2^-k) is bin k, the last bin holds
everything below. The adaptive budget keeps its reliability curve (accepted / predicted drafts) per bin, and the
metrics export it by each bin's lowest q."""
from __future__ import annotations

import numpy as np
import torch

NUM_BINS = 8
CONFIDENCE_LABELS = [f"{2.0 ** -(k + 1):g}" for k in range(NUM_BINS - 1)] + ["0"]  # each bin's lowest q


def node_confidence(node_q: torch.Tensor) -> torch.Tensor:
    """[N, B] float64 node probabilities q (best-first, padding 0) -> [N, 2B] float64: q, then each node's
    confidence bin, k for q in [2^-(k+1), 2^-k) (q = 1 in bin 0), the last bin for q below them or 0. Made on
    the device with the tree and brought back in the step's one result copy: at batch 64 binning 64 curves node
    by node in Python was the largest part of the controller's host time."""
    _, exponent = torch.frexp(node_q)  # q = m * 2^e, m in [0.5, 1): bin -e
    bins = (-exponent).clamp(0, NUM_BINS - 1).to(node_q.dtype)
    bins = torch.where(node_q > 0, bins, float(NUM_BINS - 1))
    return torch.cat([node_q, bins], dim=-1)


def with_bins(node_q: np.ndarray) -> np.ndarray:
    """node_confidence() on the host, for trees built eagerly (their q come back in the step's result copy and are
    binned here, in one numpy pass for the step): [N, B] float64 q -> [N, 2B]. On the device the binning took five
    launches, ~0.3 ms of host time on an H100's host at each step that drafted curves for a batch of 16; inside a
    CUDA graph (engine/round_graphs.py) it costs no launches and stays there."""
    _, exponent = np.frexp(node_q)  # the same convention as torch.frexp: mantissa in [0.5, 1)
    bins = np.where(node_q > 0, np.clip(-exponent, 0, NUM_BINS - 1), NUM_BINS - 1).astype(node_q.dtype)
    return np.concatenate([node_q, bins], axis=-1)
