"""What the GPU kernel tests share: the loaded extension (the tests fail, naming the reason, when it does not
load) and fresh random inputs every run, their seed printed so a failure can be replayed."""
from __future__ import annotations

import random

import pytest
import torch

from ext import build


@pytest.fixture(scope="module", autouse=True)
def cuda_ops():
    lib = build.load_ops(verbose=True)
    assert lib is not None, build.load_error()
    return lib


def rng():
    seed = random.SystemRandom().randrange(2**31)
    print("seed", seed)
    return random.Random(seed), torch.Generator().manual_seed(seed)
