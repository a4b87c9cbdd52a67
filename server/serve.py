"""Runs the app under uvicorn for `ddtree serve`: logging, graceful drain on SIGTERM/SIGINT (/health turns
503 at once, open streams get ServerConfig.drain_timeout_s to finish), and a non-zero exit when the
engine cannot start."""
from __future__ import annotations

import logging
import signal
import threading
import time

import uvicorn

from engine.config import EngineConfig
from server.app import create_app
from server.config import ServerConfig


class _DrainingServer(uvicorn.Server):
    """uvicorn would close its listening socket at the first SIGTERM, so late clients would see a refused
    connection. Instead: mark the server draining (/health and new requests answer 503, which load balancers
    understand), let open requests finish for up to drain_timeout_s, and only then let uvicorn stop. A second
    signal stops at once."""

    def __init__(self, config: uvicorn.Config, state, drain_timeout_s: float):
        super().__init__(config)
        self.state, self.drain_timeout_s = state, drain_timeout_s

    def handle_exit(self, sig, frame) -> None:
        if self.state.draining:
            return self._exit(sig, frame)
        self.state.draining = True
        deadline = time.monotonic() + self.drain_timeout_s

        def wait_then_exit() -> None:
            while self.state.num_in_flight > 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            self._exit(sig, frame)

        threading.Thread(target=wait_then_exit, name="ddtree-drain", daemon=True).start()

    def _exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        if sig == signal.SIGTERM:
            # A drained SIGTERM is a normal stop (exit 0); uvicorn would re-raise it once done, and dying by
            # the signal skips the interpreter's cleanup.
            captured = getattr(self, "_captured_signals", None)
            if captured and captured[-1] == sig:
                captured.pop()


def serve(server_config: ServerConfig, engine_config: EngineConfig) -> int:
    """Blocks until the server stops; returns the process exit status."""
    level = server_config.log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(server_config, engine_config)
    state = app.state.server
    config = uvicorn.Config(app, host=server_config.host, port=server_config.port, log_level=level.lower(),
                            access_log=server_config.access_log,
                            timeout_graceful_shutdown=server_config.drain_timeout_s, lifespan="on")
    server = _DrainingServer(config, state, server_config.drain_timeout_s)
    failed: list[str] = []

    def on_fatal(message: str) -> None:
        failed.append(message)
        server.should_exit = True

    state.on_fatal = on_fatal
    logging.getLogger("ddtree.server").info("serving %s on http://%s:%d (loading the model)", state.model_name,
                                            server_config.host, server_config.port)
    server.run()
    return 1 if failed else 0
