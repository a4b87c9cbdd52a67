"""What the drafter costs the adaptive budget (adaptive.py) per drafted request: decayed sums of its calls' seconds
and requests (host time on the CPU, CUDA events on the GPU), the first call left out (it pays one-time costs:
allocations, lazy initialisation) and a slow call (a GC pause, a busy host) clipped to a few times the average."""
from __future__ import annotations

from engine.speculative.cost_fit import DECAY

SPIKE_CLIP = 4.0  # a drafter call counts at most this many times the running per-request average
MIN_DRAFT_CALLS = 1  # drafter calls measured before their cost counts (the first is discarded)


class DraftCost:
    def __init__(self):
        self.seconds = self.requests = 0.0  # decayed sums: drafter seconds, requests drafted
        self.calls = 0

    def observe(self, num_requests: int, seconds: float) -> None:
        """The drafter ran for num_requests requests this step and took `seconds`."""
        if num_requests <= 0:
            return
        self.calls += 1
        if self.calls == 1:
            return
        if self.requests > 0:
            seconds = min(seconds, SPIKE_CLIP * num_requests * self.seconds / self.requests)
        self.seconds = DECAY * self.seconds + seconds
        self.requests = DECAY * self.requests + num_requests

    def per_request(self) -> float | None:
        """Seconds a drafted request costs; None until more than MIN_DRAFT_CALLS calls were seen."""
        return self.seconds / self.requests if self.calls > MIN_DRAFT_CALLS else None
