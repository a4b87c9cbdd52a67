"""Runs the app under uvicorn for `ddtree serve`: logging, the graceful drain on SIGTERM/SIGINT, and the exit
when the engine cannot start or dies.

Lifecycle (the listening socket stays open, answering 503, until the very end):
- SIGTERM/SIGINT: /health and new requests answer 503 at once; open requests get `drain_timeout_s` in
  total to finish. At that deadline the ones still open are cut: streams end with an SSE error event then
  `[DONE]`, non-streaming requests get a 503 envelope, and each is aborted in the engine. Their responses get
  up to CUT_FLUSH_S to go out, the engine stops, and only then does uvicorn close the socket (with a short
  graceful timeout: nothing is left to wait for). Exit status 0 (SIGINT: re-raised, as for Ctrl-C). A second
  signal cuts at once; a third stops without waiting for anything.
- The engine fails to start, or dies later: every open request has its error already and /health answers
  503; the server keeps answering for DEATH_LINGER_S (and until the failed responses went out, at most
  CUT_FLUSH_S more), then exits with status 1 so that the orchestrator restarts it. The server never restarts
  the engine itself (deploy/README.md: why).
"""
from __future__ import annotations

import asyncio
import logging
import signal
import time
from typing import Optional

import uvicorn

from engine.config import EngineConfig
from server.app import create_app
from server.config import ServerConfig

logger = logging.getLogger("ddtree.server")

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
CUT_FLUSH_S = 1.0  # after requests were cut or failed: how long their error events and [DONE] get to go out
DEATH_LINGER_S = 2.0  # after the engine died: keep answering 503 this long before exiting
GRACEFUL_S = 1.0  # uvicorn's own wait for connections once we let it stop (everything was flushed already)
POLL_S = 0.02


class _LifecycleServer(uvicorn.Server):
    """uvicorn would close its listening socket at the first SIGTERM, so late clients would see a refused
    connection, and its graceful timeout would come on top of ours. Instead the signal starts our own stop
    sequence (`_stop`), which sets uvicorn's should_exit only when everything is done."""

    def __init__(self, config: uvicorn.Config, state, drain_timeout_s: float):
        super().__init__(config)
        self.state, self.drain_timeout_s = state, drain_timeout_s
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.fatal: Optional[str] = None  # why the server exits non-zero
        self._signals = 0
        self._hurry: Optional[asyncio.Event] = None  # set: stop waiting for open requests, cut them now
        self._stop_task: Optional[asyncio.Task] = None

    async def serve(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        self._hurry = asyncio.Event()
        await super().serve(sockets)

    # triggers ------------------------------------------------------------------------------------
    def handle_exit(self, sig, frame) -> None:
        """The signal handler (main thread, between two bytecodes of the loop): flags, and schedules the rest."""
        self._signals += 1
        if self._signals == 1:
            self.state.draining = True  # /health and new requests: 503 from now on
            if sig == signal.SIGINT:
                self._captured_signals.append(sig)  # uvicorn re-raises it when done: Ctrl-C ends as usual
        elif self._signals > 2:
            self.should_exit = self.force_exit = True
        self._call(self._on_signal, sig, self._signals)

    def _on_signal(self, sig: int, count: int) -> None:
        name = signal.Signals(sig).name
        if count == 1:
            logger.info("%s: draining; open requests get %g s in total", name, self.drain_timeout_s)
            self._begin_stop(True, 0.0)
        elif count == 2:
            logger.warning("second %s: cutting the open requests now", name)
            self._hurry.set()
        else:
            logger.warning("%s again: stopping without waiting", name)

    def on_fatal(self, message: str) -> None:
        """The engine could not start or died (called on the loop): exit non-zero soon."""
        if self.fatal is None:
            self.fatal = message
            logger.error("exiting with status 1 so that the server is restarted: %s", message)
        if self._stop_task is None:
            self._begin_stop(False, DEATH_LINGER_S)
        else:
            self._hurry.set()  # draining already: the engine is gone, there is nothing left to wait for

    def _call(self, fn, *args) -> None:
        if self.loop is None:  # not serving yet
            self.should_exit = True
            return
        self.loop.call_soon_threadsafe(fn, *args)

    def _begin_stop(self, drain: bool, linger: float) -> None:
        if self._stop_task is None:
            self._stop_task = self.loop.create_task(self._stop(drain, linger))

    # the stop sequence ---------------------------------------------------------------------------
    def _busy(self) -> bool:
        """Requests in flight: engine requests, or HTTP requests being handled (a 503 takes milliseconds)."""
        return self.state.num_in_flight > 0 or bool(self.server_state.tasks)

    async def _wait(self, condition, until: float, *, hurry: bool = False) -> None:
        while condition() and time.monotonic() < until and not (hurry and self._hurry.is_set()):
            await asyncio.sleep(POLL_S)

    async def _stop(self, drain: bool, linger: float) -> None:
        state, start = self.state, time.monotonic()
        try:
            if drain:  # open requests, and requests still on their way to the engine (tokenizing, say)
                await self._wait(self._busy, start + self.drain_timeout_s, hurry=True)
            client = state.client
            if client is not None and client.failure is None:
                if self._hurry.is_set():
                    why = "a second stop signal cut the drain short"
                else:
                    why = f"it did not finish within the drain timeout ({self.drain_timeout_s:g} s)"
                cut = client.cut_all(f"The server is shutting down: this request was cut because {why}.")
                if cut:
                    logger.warning("cut %d open request(s): %s", cut, why)
            # let the cut or failed responses send their error event and [DONE] (or their 503 envelope)
            await self._wait(self._busy, time.monotonic() + CUT_FLUSH_S)
            if linger:
                await asyncio.sleep(max(0.0, start + linger - time.monotonic()))
            # Stop a serving engine while still answering 503. One still loading is left to the lifespan's
            # shutdown, which cancels the startup first (else it would report the stop as a startup failure).
            if client is not None and client.info is not None:
                t0 = time.monotonic()
                await asyncio.to_thread(client.shutdown)
                logger.info("engine stopped in %.2f s", time.monotonic() - t0)
        except Exception:
            logger.exception("error while stopping")
        finally:
            self.config.timeout_graceful_shutdown = GRACEFUL_S
            self.should_exit = True


def serve(server_config: ServerConfig, engine_config: EngineConfig) -> int:
    """Blocks until the server stops; returns the process exit status."""
    level = server_config.log_level.upper()
    logging.basicConfig(level=level, format=LOG_FORMAT)
    app = create_app(server_config, engine_config)
    state = app.state.server
    config = uvicorn.Config(app, host=server_config.host, port=server_config.port, log_level=level.lower(),
                            access_log=server_config.access_log, timeout_graceful_shutdown=GRACEFUL_S,
                            lifespan="on")
    server = _LifecycleServer(config, state, server_config.drain_timeout_s)
    state.on_fatal = server.on_fatal
    logger.info("serving %s on http://%s:%d (loading the model)", state.model_name, server_config.host,
                server_config.port)
    server.run()
    return 1 if server.fatal is not None else 0


def exit_now(status: int) -> None:
    """Ends the server process once serve() returned (the engine process is gone already), skipping the
    interpreter's teardown, which nothing here needs and which an orchestrator's grace period and the drain
    timeout would otherwise have to cover."""
    from engine.process import fast_exit

    fast_exit(status)
