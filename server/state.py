"""`ServerState` (on app.state.server): what every request needs. The configs, the engine client (the engine
process starts with the app and is stopped with it), the tokenizer (loaded from the folder the engine exported
its own into, so the two tokenize alike), the metrics registry, readiness (/health's answer), and the count of
open engine requests that the 429 admission limit reads."""
from __future__ import annotations

import asyncio
import functools
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

from engine.config import EngineConfig
from engine.messages import Ready, StepStats
from server.config import ServerConfig
from server.engine_client import EngineClient
from server.errors import ApiError, ProtocolError, model_not_found
from server.metrics import Metrics
from server.tokenizer import LogprobFormatter, Tokenizer, load_chat_template

logger = logging.getLogger("ddtree.server")


class ServerState:
    def __init__(self, config: ServerConfig, engine_config: EngineConfig):
        self.config, self.engine_config = config, engine_config
        self.model_name = config.model_name(engine_config.model)
        self.metrics = Metrics(self.model_name)
        self.client: Optional[EngineClient] = None
        self.info: Optional[Ready] = None
        self.tokenizer: Optional[Tokenizer] = None
        self.formatter: Optional[LogprobFormatter] = None
        self.startup_error: Optional[str] = None
        self.draining = False
        self.num_in_flight = 0  # open ChoiceStreams (engine requests)
        self.on_fatal: Optional[Callable[[str], None]] = None  # the runner exits when startup fails
        # One thread: tokenization stays off the event loop, and one tokenizer is never called from two threads.
        self.tokenizer_pool = ThreadPoolExecutor(1, thread_name_prefix="ddtree-tokenize")
        self._startup: Optional[asyncio.Task] = None

    # lifecycle -----------------------------------------------------------------------------------
    async def start(self) -> None:
        """Starts the engine process and returns at once: /health answers 503 until loading is done."""
        self.client = EngineClient(self.engine_config, on_step=self._on_step)
        await self.client.start()
        self._startup = asyncio.create_task(self._finish_startup())

    def _load_tokenizer(self, info: Ready) -> Tokenizer:
        if info.tokenizer_dir is None:
            raise ValueError("the model has no tokenizer (tokenizer.json); the server needs one")
        template = self.config.chat_template
        return Tokenizer(info.tokenizer_dir, chat_template=load_chat_template(template) if template else None)

    async def _finish_startup(self) -> None:
        try:
            info = await self.client.wait_ready()
            tokenizer = await asyncio.get_running_loop().run_in_executor(
                self.tokenizer_pool, self._load_tokenizer, info)
            self.formatter = LogprobFormatter(tokenizer)
            self.tokenizer, self.info = tokenizer, info
            logger.info("ready: model %s, max_model_len %d, %d KV blocks of %d tokens", self.model_name,
                        info.max_model_len, info.num_kv_blocks, info.block_size)
        except Exception as e:
            self.startup_error = f"{type(e).__name__}: {e}".splitlines()[0]
            logger.error("startup failed: %s", self.startup_error)
            if self.on_fatal is not None:
                self.on_fatal(self.startup_error)

    async def stop(self) -> None:
        self.draining = True
        if self._startup is not None:
            self._startup.cancel()
        if self.client is not None:
            await asyncio.to_thread(self.client.shutdown)
        self.tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    def _on_step(self, stats: StepStats) -> None:
        try:
            self.metrics.record_step(stats)
        except Exception:  # metrics must never cost a step's deltas (they are dispatched after this call)
            logger.exception("recording step metrics failed")

    # readiness -----------------------------------------------------------------------------------
    def unavailable_reason(self) -> Optional[str]:
        if self.client is not None and self.client.failure is not None:
            return f"The engine is not running: {self.startup_error or self.client.failure}"
        if self.startup_error is not None:
            return f"The server failed to start: {self.startup_error}"
        if self.draining:
            return "The server is shutting down."
        if self.tokenizer is None:
            return "Loading model."
        return None

    def check_ready(self) -> None:
        reason = self.unavailable_reason()
        if reason is not None:
            raise ApiError.make(reason, 503, code="service_unavailable")

    def check_model(self, model: Optional[str]) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(model_not_found(model))

    async def tokenize(self, fn: Callable[..., list[int]], *args: Any, param: str, **kwargs: Any) -> list[int]:
        """fn(tokenizer, *args, **kwargs) in the tokenizer thread; a failure is the client's 400."""
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self.tokenizer_pool, functools.partial(fn, self.tokenizer, *args, **kwargs))
        except ProtocolError:
            raise
        except Exception as e:  # e.g. lone surrogates in the text: the client's input, not a server fault
            raise ApiError.make(f"The input could not be tokenized: {e}", 400, param=param,
                                code="invalid_value") from e
