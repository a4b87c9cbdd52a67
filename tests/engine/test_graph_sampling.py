"""engine/graph_sampling.py's staging: the buffers a sampling graph reads (parameters, seeds, output positions,
offsets) after any sequence of steps hold what one fresh staging of the last step writes, though a step of the same
requests as the step before writes only their output positions (and clears offsets a step before left)."""
from __future__ import annotations

import random

import pytest
import torch

from engine.graph_sampling import GraphSampling
from engine.plan import ScheduledSeq
from engine.request import Request, SamplingParams
from engine.staging import Staging

MAX_REQUESTS = 8


def request(rng: random.Random) -> Request:
    sampling = SamplingParams(temperature=rng.choice([0.0, 0.7, 1.0]), top_p=rng.choice([1.0, 0.9]),
                              min_p=rng.choice([0.0, 0.05]), top_k=rng.choice([0, -1, 20]))
    return Request([1, 2, 3], sampling, seed=rng.getrandbits(40))


def fresh(seqs, outputs, offsets, device) -> GraphSampling:
    """What the buffers should hold: one staging of this step alone."""
    sampling = GraphSampling(MAX_REQUESTS, torch.device(device))
    sampling.stage(seqs, outputs, Staging(device), offsets)
    return sampling


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_the_buffers_hold_the_last_step_whatever_came_before(device):
    rng = random.Random(5)
    pool = [request(rng) for _ in range(12)]
    sampling, stage = GraphSampling(MAX_REQUESTS, torch.device(device)), Staging(device)
    seqs = [ScheduledSeq(r, 1, True) for r in pool[:5]]
    kinds = set()
    for step in range(300):
        change = rng.random()
        if change < 0.15:  # requests leave or join, or another request takes a row
            seqs = [ScheduledSeq(r, 1, True) for r in rng.sample(pool, rng.randint(1, MAX_REQUESTS))]
        elif change < 0.2:  # the same requests in another order
            seqs = rng.sample(seqs, len(seqs))
        outputs = [rng.randrange(1000) for _ in seqs]
        offsets = torch.tensor([rng.randrange(8) for _ in seqs], device=device) if rng.random() < 0.3 else None
        kinds.add((change < 0.2, offsets is not None))
        stage.reset()
        sampling.stage(seqs, outputs, stage, offsets)
        want = fresh(seqs, outputs, offsets, device)
        assert torch.equal(sampling.params, want.params), step
        assert torch.equal(sampling.ints, want.ints), step
    assert len(kinds) == 4  # new and repeated requests, each with and without offsets


def test_a_repeated_step_writes_only_the_output_row():
    """The point of the cache: the same requests again cost one row's copy, not the parameter and seed rows."""
    rng = random.Random(1)
    seqs = [ScheduledSeq(request(rng), 1, True) for _ in range(4)]
    sampling, stage = GraphSampling(MAX_REQUESTS, torch.device("cpu")), Staging("cpu")
    sampling.stage(seqs, [1, 2, 3, 4], stage)
    written = []
    stage.into = lambda dest, values: written.append(dest.shape)
    sampling.stage(seqs, [2, 3, 4, 5], stage)
    assert written == [torch.Size([MAX_REQUESTS])]
