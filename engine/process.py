"""The engine process: loads the model, then loops — drain the inbox (add / abort / shutdown), run one
EngineCore step, send the step's deltas and statistics to the server. It never waits on HTTP: when idle it
blocks on the inbox; when busy it only polls it between steps."""
from __future__ import annotations

import os
import queue
import signal
import traceback

from engine.config import EngineConfig
from engine.messages import (AbortRequest, AddRequest, Failed, Ready, RequestError, Shutdown, StepOutputs,
                             StepStats)


def handle(core, msg, outbox) -> bool:
    """Applies one inbox message; False on shutdown."""
    if isinstance(msg, Shutdown):
        return False
    if isinstance(msg, AbortRequest):
        core.abort(msg.request_id)
    elif isinstance(msg, AddRequest):
        try:
            core.add_request(msg.prompt_token_ids, msg.sampling, msg.request_id)
        except ValueError as e:
            outbox.put(RequestError(msg.request_id, str(e)))
    return True


def idle_stats(core) -> StepStats:
    """Scheduler state without a step: after an abort empties the engine no step runs, and the server's
    gauges (running, waiting, KV usage) would otherwise keep showing the aborted request."""
    return StepStats(num_running=len(core.scheduler.running), num_waiting=len(core.scheduler.waiting),
                     kv_cache_usage=core.blocks.usage, batch_size=0, num_preemptions=0, timings={})


def run_engine(config: EngineConfig, inbox, outbox) -> None:
    # Ctrl-C reaches the whole process group; the server shuts this process down itself (Shutdown message).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()
    try:
        from engine.core import EngineCore

        core = EngineCore(config)
    except Exception as e:  # report the one-line reason; the server turns /health to 503
        outbox.put(Failed(f"{type(e).__name__}: {e}".splitlines()[0]))
        return
    outbox.put(Ready(core.vocab_size, core.max_model_len, core.eos_token_ids, core.blocks.num_blocks,
                     config.block_size))
    try:
        while True:
            # block while idle; between steps only take what is already there
            try:
                msg = inbox.get(timeout=0.5) if not core.has_unfinished() else inbox.get_nowait()
            except queue.Empty:
                msg = None
                if os.getppid() != parent:  # the server died without a Shutdown: do not linger as an orphan
                    return
            alive, aborted = True, False
            while msg is not None and alive:
                aborted = aborted or isinstance(msg, AbortRequest)
                alive = handle(core, msg, outbox)
                try:
                    msg = inbox.get_nowait()
                except queue.Empty:
                    msg = None
            if not alive:
                return
            if core.has_unfinished():
                deltas = core.step()
                if core.last_stats is not None:
                    outbox.put(StepOutputs(deltas, core.last_stats))
            elif aborted:
                outbox.put(StepOutputs([], idle_stats(core)))
    except Exception:
        outbox.put(Failed("engine step failed: " + traceback.format_exc().strip().splitlines()[-1]))
