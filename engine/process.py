"""The engine process: loads the model, then loops — drain the inbox (add / abort / shutdown), run one
EngineCore step, send the step's deltas and statistics to the server, then the requests that failed alone
(RequestError, kind "internal"; the engine goes on with the others). It never waits on HTTP: when idle it
blocks on the inbox; when busy it only polls it between steps.

Anything else that goes wrong (the model cannot load, an exception in a step) ends the process after one
`Failed` message that carries the one-line reason and the full traceback, which the server logs.

The server owns this process's lifetime: SIGINT and SIGTERM are ignored (a Ctrl-C reaches the whole process
group, and systemd's default stop signals every process of the service: either would kill the engine under
requests the server is still draining); the server stops it with a Shutdown message, or SIGKILL when it must.
If the server dies, the kernel kills this process too (Linux), and the loop also notices a changed parent."""
from __future__ import annotations

import ctypes
import logging
import os
import queue
import signal
import sys
import traceback

from engine.config import EngineConfig
from engine.messages import (AbortRequest, AddRequest, Failed, Ready, RequestError, Shutdown, StepOutputs,
                             StepStats)

logger = logging.getLogger("ddtree.engine")

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # the server's format (server/serve.py)


def configure_logging(level: int | str | None) -> None:
    """The engine's own log lines go to stderr (inherited from the server) at the server's level; tqdm
    progress bars write to stderr too."""
    if level is None:
        return
    logging.basicConfig(level=level, format=LOG_FORMAT, stream=sys.stderr, force=True)


def failure(prefix: str, e: BaseException) -> Failed:
    """A Failed message for the exception being handled: its last line, and the whole traceback."""
    line = f"{type(e).__name__}: {e}".splitlines()[0] if str(e) else type(e).__name__
    return Failed(prefix + line, traceback=traceback.format_exc())


def handle(core, msg, outbox) -> bool:
    """Applies one inbox message; False on shutdown."""
    if isinstance(msg, Shutdown):
        return False
    if isinstance(msg, AbortRequest):
        core.abort(msg.request_id)
    elif isinstance(msg, AddRequest):
        try:
            core.add_request(msg.prompt_token_ids, msg.sampling, msg.request_id)
        except ValueError as e:  # the request itself is bad: a 400 for the client
            outbox.put(RequestError(msg.request_id, str(e), kind="invalid"))
        except Exception as e:  # admitting this one request failed: it alone gets an internal error
            logger.exception("adding request %s failed", msg.request_id)
            core.abort(msg.request_id)
            outbox.put(RequestError(msg.request_id, f"{type(e).__name__}: {e}".splitlines()[0], kind="internal"))
    return True


def idle_stats(core) -> StepStats:
    """Scheduler state without a step: after an abort empties the engine no step runs, and the server's
    gauges (running, waiting, KV usage) would otherwise keep showing the aborted request."""
    return StepStats(num_running=len(core.scheduler.running), num_waiting=len(core.scheduler.waiting),
                     kv_cache_usage=core.blocks.usage, batch_size=0, num_preemptions=0, timings={})


def send_request_errors(core, outbox) -> bool:
    """Sends every request that failed alone since the last call; True if there was any."""
    errors = core.pop_request_errors()
    for error in errors:
        outbox.put(error)
    return bool(errors)


def serve_core(core, inbox, outbox, parent: int | None = None) -> None:
    """The step loop over a ready EngineCore, until Shutdown (or the server is gone). An exception escapes
    (the caller reports it as Failed)."""
    while True:
        # block while idle; between steps only take what is already there
        try:
            msg = inbox.get(timeout=0.5) if not core.has_unfinished() else inbox.get_nowait()
        except queue.Empty:
            msg = None
        if parent is not None and os.getppid() != parent:  # the server died without a Shutdown
            return
        core.check_ranks()  # tensor parallel: a dead rank ends the engine now, not at the next request
        alive, changed = True, False
        while msg is not None and alive:
            changed = changed or isinstance(msg, AbortRequest)
            alive = handle(core, msg, outbox)
            try:
                msg = inbox.get_nowait()
            except queue.Empty:
                msg = None
        if not alive:
            return
        changed = send_request_errors(core, outbox) or changed
        stepped = False
        if core.has_unfinished():
            deltas = core.step()
            if core.last_stats is not None:
                outbox.put(StepOutputs(deltas, core.last_stats))
                stepped = True
            changed = send_request_errors(core, outbox) or changed
        if changed and not stepped:  # a request left without a step: refresh the server's gauges
            outbox.put(StepOutputs([], idle_stats(core)))


def die_with_parent() -> None:
    """Linux: SIGKILL this process when the server process dies, so that a dead server never leaves an engine
    holding the GPU behind (the restarted server would find its memory taken)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def run_engine(config: EngineConfig, inbox, outbox, log_level: int | str | None = None) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):  # see the module docstring
        signal.signal(sig, signal.SIG_IGN)
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        die_with_parent()
    if os.getppid() != parent:  # the server died before the line above
        return
    configure_logging(log_level)
    try:
        from engine.core import EngineCore

        core = EngineCore(config, log_level=log_level)
        extras = ready_extras(core)
    except Exception as e:  # the one-line reason for /health and the exit message; the traceback for the log
        outbox.put(failure("", e))
        return
    outbox.put(Ready(core.vocab_size, core.max_model_len, core.eos_token_ids, core.blocks.num_blocks,
                     config.block_size, **extras))
    status = 0
    try:
        serve_core(core, inbox, outbox, parent)
    except Exception as e:  # the server logs the traceback (once) and fails the open requests
        outbox.put(failure("engine step failed: ", e))
        status = 1
    core.shutdown()  # tensor parallel: the other ranks exit too
    quick_exit(outbox, status)


def quick_exit(outbox, status: int) -> None:
    """Ends the process once the last messages are out. The interpreter's own teardown with torch loaded takes
    seconds (on a busy machine), which the server's shutdown would wait for; nothing here needs it."""
    try:
        outbox.close()
        outbox.join_thread()  # the queue's feeder thread has written everything to the pipe
    finally:
        fast_exit(status)


def fast_exit(status: int) -> None:
    """Ends this process now: multiprocessing's exit handlers (finalizers, tqdm's lock semaphore, child
    processes), the logs and the standard streams flushed, then os._exit, skipping the interpreter's teardown.
    Both processes end this way (server/serve.py too)."""
    try:
        from multiprocessing import util

        util._exit_function()
    except Exception:
        pass
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(status)


def ready_extras(core) -> dict:
    """Optional Ready fields the core may provide: sampling defaults from generation_config.json, and its
    tokenizer exported for the HTTP process (engine/tokenizer_export.py)."""
    from engine.tokenizer_export import export_tokenizer

    defaults = getattr(core, "default_sampling", None)
    extras = {"default_sampling": dict(defaults)} if isinstance(defaults, dict) else {}
    loaded = getattr(core, "loaded", None)
    extras["tokenizer_dir"] = export_tokenizer(getattr(core, "tokenizer", None), getattr(loaded, "path", None))
    return extras
