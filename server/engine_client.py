"""Async bridge from the HTTP server to the engine process: `generate()` sends a request and yields its token
deltas; leaving the iterator early (client disconnect, stop string, error) aborts the request in the engine,
which frees its KV within one step. A reader thread moves engine messages onto the event loop, so neither
side ever blocks on the other.

Failures, and what each open request sees:
- the engine refuses one request (RequestError kind "invalid"): EngineRequestError, a 400;
- one request fails inside the engine, which goes on (kind "internal"): EngineInternalError, a 500;
- the engine process dies (a `Failed` message with its traceback, or the process exits: crash, SIGKILL):
  every open request gets EngineDeadError at once (a 503), later ones too, the traceback is logged at ERROR
  and the failure listeners run (the app resets its gauges and the server exits, see server/serve.py);
- the server cuts its open requests (`cut_all`: drain deadline, shutdown): RequestCutError, a 503.
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import signal
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.messages import (AbortRequest, AddRequest, Delta, Failed, Ready, RequestError, Shutdown, StepOutputs,
                             StepStats)
from engine.request import SamplingParams

logger = logging.getLogger("ddtree.server")

# After the engine process ends by itself (exit status 0 or 1), how long the watcher waits for the `Failed`
# message it sent last (which carries the traceback) before reporting the bare exit instead.
LAST_WORDS_S = 0.5


class EngineRequestError(ValueError):
    """The engine refused a request (bad token ids, does not fit): a 400 for the client."""


class EngineInternalError(RuntimeError):
    """Processing this one request failed inside the engine, which goes on serving the others: a 500."""

    def client_message(self) -> str:
        return f"The engine failed while processing this request: {self}"


class ServiceUnavailableError(RuntimeError):
    """The request cannot be served now (the engine is gone, or the server is stopping): a 503."""

    def client_message(self) -> str:
        return str(self)


class EngineDeadError(ServiceUnavailableError):
    """The engine process failed or exited: a 503 for the client."""

    def client_message(self) -> str:
        return f"The engine is not running: {self}"


class RequestCutError(ServiceUnavailableError):
    """The server cut the request before it finished (the drain deadline passed, or a second signal)."""


@dataclass
class _Cut:
    """Queued into an open request's stream by cut_all()."""
    message: str


def _coalesce(delta: Delta, q: asyncio.Queue) -> tuple[Delta, object | None]:
    """`delta` and the same request's deltas already queued behind it, as one delta, and the first other item
    taken from the queue (an error or a cut, for the reader's next turn) or None. A reader that fell behind (the
    event loop busy with other streams' chunks) then sends one chunk for several steps' tokens: a chunk has a fixed
    cost here that its tokens share (bench/stream_path.py --in-process on the 2-core CPU: ~20 us a chunk of one
    token; 58-69 us for chunks of 10-22), so one chunk a token would cap the streams below what a GPU engine makes
    at batch 64 (docs/BENCHMARKS.md)."""
    run = [delta]
    while not run[-1].finished and not q.empty():
        item = q.get_nowait()
        if not isinstance(item, Delta):
            return Delta.joined(run), item
        run.append(item)
    return Delta.joined(run), None


def describe_exit(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"the engine process was killed by {name}"
    return f"the engine process exited with status {exitcode}"


class EngineClient:
    def __init__(self, config: EngineConfig, on_step: Callable[[StepStats], None] | None = None,
                 log_level: int | str | None = None):
        self.config = config
        self.on_step = on_step
        ctx = mp.get_context("spawn")
        self.inbox, self.outbox = ctx.Queue(), ctx.Queue()
        # At exit, never wait for the inbox's feeder thread: with the engine dead, a full pipe would block it.
        self.inbox.cancel_join_thread()
        from engine.process import run_engine

        if log_level is None:  # the engine logs at the server's level (serve() configures the root logger)
            log_level = logging.getLogger().getEffectiveLevel()
        self.process = ctx.Process(target=run_engine, args=(config, self.inbox, self.outbox, log_level),
                                   daemon=True, name="ddtree-engine")
        self.streams: dict[str, asyncio.Queue] = {}
        self.info: Ready | None = None
        self.failure: str | None = None  # set once: why the engine is not running
        self.cut_reason: str | None = None  # set by cut_all(): new requests are refused with it
        self.closing = False  # shutdown() was called: the engine's exit is expected, not a failure
        self.ready_event = asyncio.Event()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.last_stats: StepStats | None = None
        self._failure_listeners: list[Callable[[str], None]] = []
        self._last_words = threading.Event()  # the reader got the engine's Failed message
        # Set by the watcher once it has reaped the process: the one liveness test here. Process.is_alive() or
        # join() from a second thread would race the watcher's waitpid (and see a reaped process as alive).
        self._exited = threading.Event()
        self._started = False

    @property
    def ready(self) -> bool:
        return self.info is not None and self.failure is None

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.process.start()
        self._started = True
        threading.Thread(target=self._read, name="ddtree-engine-reader", daemon=True).start()
        threading.Thread(target=self._watch, name="ddtree-engine-watch", daemon=True).start()

    def add_failure_listener(self, listener: Callable[[str], None]) -> None:
        """`listener(message)` runs on the event loop once, when the engine dies unexpectedly (at once if it
        already has). Not called for the engine's exit after shutdown()."""
        self._failure_listeners.append(listener)
        if self.failure is not None and not self.closing and self.loop is not None:
            self.loop.call_soon(listener, self.failure)

    # engine -> loop ------------------------------------------------------------------------------
    def _post(self, msg) -> None:
        try:
            self.loop.call_soon_threadsafe(self._dispatch, msg)
        except RuntimeError:  # the loop is closed: the server is gone already
            pass

    def _read(self) -> None:
        while True:
            try:
                msg = self.outbox.get()
            except (EOFError, OSError, ValueError):
                return
            if isinstance(msg, Failed):
                self._last_words.set()
            self._post(msg)
            if isinstance(msg, Failed):
                return

    def _watch(self) -> None:
        """Notices the process's end within milliseconds (the join waits on its sentinel), however it ends."""
        self.process.join()
        exitcode = self.process.exitcode
        self._exited.set()
        if exitcode is not None and exitcode >= 0 and not self.closing:
            self._last_words.wait(LAST_WORDS_S)  # it ended itself: its Failed (with the traceback) comes first
        if self.loop is not None and not self.loop.is_closed():
            self._post(Failed(describe_exit(exitcode)))

    def _dispatch(self, msg) -> None:
        if isinstance(msg, StepOutputs):
            if self.failure is not None:  # late statistics must not overwrite the gauges' reset
                return
            self.last_stats = msg.stats
            if self.on_step is not None:
                self.on_step(msg.stats)
            for delta in msg.deltas:
                q = self.streams.get(delta.request_id)
                if q is not None:
                    q.put_nowait(delta)
        elif isinstance(msg, RequestError):
            if msg.kind == "internal":
                logger.error("request %s failed in the engine (the engine goes on): %s", msg.request_id,
                             msg.message)
            q = self.streams.get(msg.request_id)
            if q is not None:
                q.put_nowait(msg)
        elif isinstance(msg, Ready):
            self.info = msg
            self.ready_event.set()
        elif isinstance(msg, Failed):
            self._on_failed(msg)

    def _on_failed(self, msg: Failed) -> None:
        first = self.failure is None
        if first:
            self.failure = "it was stopped (the server is shutting down)" if self.closing else msg.message
        self.ready_event.set()
        for q in self.streams.values():
            q.put_nowait(msg)
        if not first or self.closing:
            return
        if self.info is None:  # failed while loading: the server reports the one-line reason and exits
            if msg.traceback:
                logger.debug("engine traceback:\n%s", msg.traceback.rstrip())
        else:
            logger.error("the engine died: %s; failing %d open request(s)%s", msg.message, len(self.streams),
                         "\n" + msg.traceback.rstrip() if msg.traceback else "")
        for listener in self._failure_listeners:
            try:
                listener(msg.message)
            except Exception:
                logger.exception("engine failure listener failed")

    async def wait_ready(self) -> Ready:
        await self.ready_event.wait()
        if self.failure is not None:
            raise EngineDeadError(self.failure)
        return self.info

    # requests ------------------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       sampling: SamplingParams) -> AsyncIterator[Delta]:
        if self.failure is not None:
            raise EngineDeadError(self.failure)
        if self.cut_reason is not None:
            raise RequestCutError(self.cut_reason)
        q: asyncio.Queue = asyncio.Queue()
        self.streams[request_id] = q
        self.inbox.put(AddRequest(request_id, prompt_token_ids, sampling))
        finished, pending = False, None
        try:
            while True:
                item = pending if pending is not None else await q.get()
                pending = None
                if isinstance(item, Delta):
                    item, pending = _coalesce(item, q)
                if isinstance(item, RequestError):
                    finished = True  # the engine has dropped it already
                    if item.kind == "internal":
                        raise EngineInternalError(item.message)
                    raise EngineRequestError(item.message)
                if isinstance(item, Failed):
                    finished = True
                    raise EngineDeadError(self.failure or item.message)
                if isinstance(item, _Cut):
                    raise RequestCutError(item.message)  # unfinished: aborted in the engine below
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self.streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def cut_all(self, message: str) -> int:
        """Ends every open request with RequestCutError(message) (each aborts itself in the engine as it
        unwinds) and refuses new ones. Returns how many were open."""
        self.cut_reason = message
        for q in self.streams.values():
            q.put_nowait(_Cut(message))
        return len(self.streams)

    @property
    def alive(self) -> bool:
        return self._started and not self._exited.is_set()

    def abort(self, request_id: str) -> None:
        if self.failure is None and self.alive:
            self.inbox.put(AbortRequest(request_id))

    def num_in_flight(self) -> int:
        return len(self.streams)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stops the engine process (blocking: call it in a thread from the event loop)."""
        self.closing = True
        if not self.alive:
            return
        if self.info is None:  # still loading: it reads no messages yet, and there is nothing to save
            self.process.kill()
        else:
            try:
                self.inbox.put(Shutdown())
            except (OSError, ValueError):
                pass
        if self._exited.wait(timeout):
            return
        logger.warning("the engine did not stop within %.0f s; killing it", timeout)
        self.process.kill()  # it ignores SIGTERM (engine/process.py)
        self._exited.wait(timeout)
