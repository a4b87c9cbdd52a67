"""A stand-in EngineCore for the engine-process tests: no model, no torch. The real engine/process.py runs
around it (`crashing_engine` is a spawn target), so the message flow, the `Failed` traceback and the process
exit are the real ones. Kept apart from the test modules so that the spawned child imports little."""
from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field

from engine.messages import Delta, StepStats


@dataclass
class _Blocks:
    num_blocks: int = 8
    usage: float = 0.0


@dataclass
class _Scheduler:
    running: list = field(default_factory=list)
    waiting: list = field(default_factory=list)


class FakeCore:
    """Each request produces one token per step, forever. A request whose prompt starts with FAIL fails alone
    (fail_request) at its first step; one that starts with CRASH makes step() raise."""
    FAIL, CRASH = 7, 13

    def __init__(self, config=None, log_level=None):
        self.vocab_size, self.max_model_len, self.eos_token_ids = 100, 64, (0,)
        self.blocks, self.scheduler = _Blocks(), _Scheduler()
        self.prompts: dict[str, list[int]] = {}
        self.errors: list = []
        self.last_stats = None

    def add_request(self, prompt_token_ids, sampling, request_id):
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        self.prompts[request_id] = list(prompt_token_ids)
        self.scheduler.running.append(request_id)
        return request_id

    def abort(self, request_id):
        self.prompts.pop(request_id, None)
        if request_id in self.scheduler.running:
            self.scheduler.running.remove(request_id)

    def shutdown(self):
        pass

    def check_ranks(self):
        pass

    def fail_request(self, request_id, message):
        from engine.messages import RequestError

        self.abort(request_id)
        self.errors.append(RequestError(request_id, message, kind="internal"))

    def pop_request_errors(self):
        errors, self.errors = self.errors, []
        return errors

    def has_unfinished(self):
        return bool(self.prompts)

    def step(self):
        for rid, prompt in list(self.prompts.items()):
            if prompt[0] == self.FAIL:
                self.fail_request(rid, "RuntimeError: this request alone failed")
            elif prompt[0] == self.CRASH:
                explode_in_step()
        deltas = [Delta(rid, [1], False, None) for rid in self.prompts]
        self.last_stats = StepStats(num_running=len(self.prompts), num_waiting=0, kv_cache_usage=0.5,
                                    batch_size=len(self.prompts), num_preemptions=0, timings={}) if deltas else None
        return deltas


def explode_in_step():
    raise ZeroDivisionError("the step blew up")


def crashing_engine(inbox, outbox) -> None:
    """Spawn target: the real run_engine around FakeCore."""
    module = types.ModuleType("engine.core")
    module.EngineCore = FakeCore
    sys.modules["engine.core"] = module  # run_engine imports EngineCore from here
    from engine.config import EngineConfig
    from engine.process import run_engine

    run_engine(EngineConfig(), inbox, outbox, "WARNING")
