"""engine/staging.py: host-to-device staging of a step's metadata. into() writes a host array straight into a
contiguous device tensor; on CUDA from a pinned region of the step's generation, which is not handed out again
before the generation after next (so a copy still in flight is never overwritten)."""
from __future__ import annotations

import pytest
import torch

from engine.staging import Staging


def test_into_writes_lists_and_arrays_into_the_destination():
    stage = Staging("cpu")
    dest = torch.full((2, 3), -1, dtype=torch.int32)
    stage.into(dest, [[1, 2, 3], [4, 5, 6]])
    assert dest.tolist() == [[1, 2, 3], [4, 5, 6]]
    floats = torch.zeros(4)
    stage.into(floats, [0.5, 1.5, 2.5, 3.5])
    assert floats.tolist() == [0.5, 1.5, 2.5, 3.5]


def test_into_refuses_a_strided_destination():
    with pytest.raises(ValueError, match="contiguous"):
        Staging("cpu").into(torch.zeros(4, 4)[:, :2], [0] * 8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_into_on_cuda_copies_from_pinned_regions_that_alternate_by_step():
    """Regions handed out in one step are distinct, and a step's regions are reused only two resets later; the
    copies land on the device in stream order (a kernel queued after them reads them)."""
    stage, dest = Staging("cuda"), torch.zeros(3, 1024, dtype=torch.int64, device="cuda")
    torch.cuda._sleep(50_000_000)  # keep the stream busy: the copies below are still queued when the host goes on
    stage.into(dest[0], list(range(1024)))
    stage.into(dest[1], list(range(1024, 2048)))
    total = dest.sum(dim=1)  # queued after the copies
    stage.reset()
    stage.into(dest[2], [7] * 1024)  # the other generation: the first two regions are untouched
    torch.cuda.synchronize()
    assert total[:2].tolist() == [sum(range(1024)), sum(range(1024, 2048))]
    assert dest[2].tolist() == [7] * 1024
    first = stage._generations[0][torch.int64]
    assert first.is_pinned() and first[:2048].tolist() == list(range(2048))
