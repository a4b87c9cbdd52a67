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
    first = stage._generations[0][torch.int64][0]
    assert first.is_pinned() and first[:2048].tolist() == list(range(2048))


@pytest.mark.parametrize("device", ["cpu", "cpu-as-pinned", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_staged_values_arrive_whole_in_their_shape_and_dtype(device, monkeypatch):
    """A step's staged lists, nested lists, host tensors (bf16, which numpy lacks, too), packs and scalars each come
    back on the device as given, none overwriting another before the generation after next. cpu-as-pinned: the CUDA
    path's regions and numpy views on the CPU (its buffers unpinned, its copies to the CPU returning the regions)."""
    if device == "cpu-as-pinned":
        real_empty = torch.empty
        monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: real_empty(*a, **k))
        stage = Staging("cpu")
        stage.pinned = True
        device = "cpu"
    else:
        stage = Staging(device)
    if device == "cuda":
        torch.cuda._sleep(50_000_000)  # the copies are still queued while the host stages the rest
    flat = stage(list(range(5)))
    nested = stage([[1, 2, 3], [4, 5, 6]], torch.int32)
    floats = stage([0.25, 0.5], torch.float64)
    host = torch.arange(6, dtype=torch.int64).view(2, 3)
    from_tensor = stage(host * 10)
    bf16 = stage(torch.tensor([[1.5, -2.0]]), torch.bfloat16)
    a, empty, b = stage.pack([[9, 8], [], [7]])
    scalar = stage(3)
    stage.reset()
    stage([-1] * 64)  # the other generation
    got = [t.cpu() for t in (flat, nested, floats, from_tensor, bf16, a, b, scalar)]
    assert all(t.device.type == torch.device(device).type for t in (flat, nested, bf16, scalar))
    assert got[0].tolist() == [0, 1, 2, 3, 4] and got[0].dtype == torch.int64
    assert got[1].tolist() == [[1, 2, 3], [4, 5, 6]] and got[1].dtype == torch.int32
    assert got[2].tolist() == [0.25, 0.5] and got[2].dtype == torch.float64
    assert got[3].tolist() == (host * 10).tolist()
    assert got[4].tolist() == [[1.5, -2.0]] and got[4].dtype == torch.bfloat16
    assert (got[5].tolist(), empty.numel(), got[6].tolist()) == ([9, 8], 0, [7])
    assert got[7].tolist() == 3 and got[7].shape == ()
