"""Async bridge from the HTTP server to the engine process: `generate()` sends a request and yields its token
deltas; leaving the iterator early (client disconnect, stop string, error) aborts the request in the engine,
which frees its KV within one step. A reader thread moves engine messages onto the event loop, so neither
side ever blocks on the other."""
from __future__ import annotations

import asyncio
import multiprocessing as mp
import threading
from collections.abc import AsyncIterator, Callable

from engine.config import EngineConfig
from engine.messages import (AbortRequest, AddRequest, Delta, Failed, Ready, RequestError, Shutdown, StepOutputs,
                             StepStats)
from engine.request import SamplingParams


class EngineRequestError(ValueError):
    """The engine refused a request (bad token ids, does not fit): a 400 for the client."""


class EngineDeadError(RuntimeError):
    """The engine process failed or exited: a 503 for the client."""


class EngineClient:
    def __init__(self, config: EngineConfig, on_step: Callable[[StepStats], None] | None = None):
        self.config = config
        self.on_step = on_step
        ctx = mp.get_context("spawn")
        self.inbox, self.outbox = ctx.Queue(), ctx.Queue()
        from engine.process import run_engine

        self.process = ctx.Process(target=run_engine, args=(config, self.inbox, self.outbox), daemon=True,
                                   name="ddtree-engine")
        self.streams: dict[str, asyncio.Queue] = {}
        self.info: Ready | None = None
        self.failure: str | None = None
        self.ready_event = asyncio.Event()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.last_stats: StepStats | None = None

    @property
    def ready(self) -> bool:
        return self.info is not None and self.failure is None

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.process.start()
        threading.Thread(target=self._read, name="ddtree-engine-reader", daemon=True).start()
        threading.Thread(target=self._watch, name="ddtree-engine-watch", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                msg = self.outbox.get()
            except (EOFError, OSError):
                return
            self.loop.call_soon_threadsafe(self._dispatch, msg)
            if isinstance(msg, Failed):
                return

    def _watch(self) -> None:
        self.process.join()
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._dispatch, Failed(f"engine process exited ({self.process.exitcode})"))

    def _dispatch(self, msg) -> None:
        if isinstance(msg, StepOutputs):
            self.last_stats = msg.stats
            if self.on_step is not None:
                self.on_step(msg.stats)
            for delta in msg.deltas:
                q = self.streams.get(delta.request_id)
                if q is not None:
                    q.put_nowait(delta)
        elif isinstance(msg, RequestError):
            q = self.streams.get(msg.request_id)
            if q is not None:
                q.put_nowait(msg)
        elif isinstance(msg, Ready):
            self.info = msg
            self.ready_event.set()
        elif isinstance(msg, Failed):
            if self.failure is None:
                self.failure = msg.message
            self.ready_event.set()
            for q in self.streams.values():
                q.put_nowait(msg)

    async def wait_ready(self) -> Ready:
        await self.ready_event.wait()
        if self.failure is not None:
            raise EngineDeadError(self.failure)
        return self.info

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       sampling: SamplingParams) -> AsyncIterator[Delta]:
        if self.failure is not None:
            raise EngineDeadError(self.failure)
        q: asyncio.Queue = asyncio.Queue()
        self.streams[request_id] = q
        self.inbox.put(AddRequest(request_id, prompt_token_ids, sampling))
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, RequestError):
                    finished = True
                    raise EngineRequestError(item.message)
                if isinstance(item, Failed):
                    finished = True
                    raise EngineDeadError(item.message)
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self.streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        if self.process.is_alive():
            self.inbox.put(AbortRequest(request_id))

    def num_in_flight(self) -> int:
        return len(self.streams)

    def shutdown(self, timeout: float = 5.0) -> None:
        if self.process.is_alive():
            self.inbox.put(Shutdown())
            self.process.join(timeout)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout)
