"""The serving machinery under the OpenAI routes: the server state (`ServerState`, on app.state.server:
engine client, tokenizer, metrics, readiness), `ChoiceStream` (one engine request turned into text with
incremental UTF-8-safe detokenization and stop strings, kept token ids and logprobs, and its Prometheus
measurements), and the request-path steps every generation route shares: parse, check the context
(vLLM's messages), admit (429), open one ChoiceStream per choice, prime them (SGLang style: the first
engine event is awaited before answering, so an engine refusal is still an HTTP 400), merge their outputs.

Invariants: every ChoiceStream is closed exactly once (stream end, client disconnect, error), and closing
an unfinished one aborts it in the engine, which frees its KV within one step; `num_in_flight` counts the
open ones and is what the 429 admission limit reads.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Optional, Sequence

from pydantic import BaseModel
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from engine.config import EngineConfig
from engine.messages import Delta, Ready, StepStats
from engine.request import SamplingParams
from server.config import ServerConfig
from server.engine_client import EngineClient, EngineDeadError, EngineRequestError
from server.metrics import Metrics, RequestStats
from server.protocol import ErrorResponse, ProtocolError, error_response, model_not_found
from server.tokenization import LogprobFormatter, TextOffset

logger = logging.getLogger("ddtree.server")


class ApiError(Exception):
    """Raised anywhere in a request; the app answers with its envelope and status."""

    def __init__(self, error: ErrorResponse):
        super().__init__(error.error.message)
        self.error = error

    @classmethod
    def make(cls, message: str, status_code: int = 400, **kwargs: Any) -> "ApiError":
        return cls(ErrorResponse.make(message, status_code, **kwargs))


def json_response(payload: BaseModel, status_code: int = 200) -> Response:
    return Response(payload.model_dump_json(), status_code=status_code, media_type="application/json")


def load_server_tokenizer(model: Optional[str]):
    """The tokenizer of the model the engine serves (the engine process loads its own copy)."""
    from engine.model.loader import load_tokenizer

    if model is None:
        from engine.model.embedded import embedded_model_dir

        return load_tokenizer(embedded_model_dir())  # converted by the engine already: a cache hit
    path = os.path.expanduser(model)
    if os.path.isfile(path):
        from engine.model.gguf import load_gguf_tokenizer

        return load_gguf_tokenizer(path)
    return load_tokenizer(path)


# ------------------------------------------------------------------------------------------- state

class ServerState:
    """Everything a request needs: configs, the engine client, the tokenizer, the metrics registry."""

    def __init__(self, config: ServerConfig, engine_config: EngineConfig):
        self.config, self.engine_config = config, engine_config
        self.model_name = config.model_name(engine_config.model)
        self.metrics = Metrics(self.model_name)
        self.client: Optional[EngineClient] = None
        self.info: Optional[Ready] = None
        self.tokenizer: Any = None
        self.formatter: Optional[LogprobFormatter] = None
        self.startup_error: Optional[str] = None
        self.draining = False
        self.num_in_flight = 0  # open ChoiceStreams (engine requests)
        self.on_fatal: Optional[Callable[[str], None]] = None  # the runner exits when startup fails
        # One thread: HF fast tokenizers are not safe to call from several threads at once.
        self.tokenizer_pool = ThreadPoolExecutor(1, thread_name_prefix="ddtree-tokenize")
        self._startup: Optional[asyncio.Task] = None

    # lifecycle -----------------------------------------------------------------------------------
    async def start(self) -> None:
        """Starts the engine process and returns at once: /health answers 503 until loading is done."""
        self.client = EngineClient(self.engine_config, on_step=self._on_step)
        await self.client.start()
        self._startup = asyncio.create_task(self._finish_startup())

    async def _finish_startup(self) -> None:
        try:
            info = await self.client.wait_ready()
            tokenizer = await asyncio.get_running_loop().run_in_executor(
                self.tokenizer_pool, load_server_tokenizer, self.engine_config.model)
            if tokenizer is None:
                raise ValueError("the model has no tokenizer (tokenizer.json); the server needs one")
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
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self.tokenizer_pool, functools.partial(fn, self.tokenizer, *args, **kwargs))
        except ProtocolError:
            raise
        except Exception as e:  # e.g. lone surrogates in the text: the client's input, not a server fault
            raise ApiError.make(f"The input could not be tokenized: {e}", 400, param=param,
                                code="invalid_value") from e


# ---------------------------------------------------------------------------------------- choices

@dataclass
class ChoiceOutput:
    """What one engine delta added to a choice (after stop strings)."""
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    finish_reason: Optional[str]
    stop_reason: Any


class ChoiceStream:
    """One engine request. prime() submits it and waits for its first delta; events() yields a
    ChoiceOutput per delta; close() aborts it if unfinished and records its metrics (idempotent)."""

    def __init__(self, state: ServerState, index: int, request_id: str, prompt_ids: list[int],
                 sampling: SamplingParams, *, arrival: float):
        self.state, self.index, self.request_id = state, index, request_id
        self.prompt_ids, self.sampling, self.arrival = prompt_ids, sampling, arrival
        self.text = ""  # the engine's detokenized output so far (stop strings already cut there)
        self.offset = TextOffset()  # legacy completions text_offset, across the chunks of this choice
        self.token_ids: list[int] = []  # kept output tokens (nothing past a matched stop string)
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[int, float]]] = []
        self.finish_reason: Optional[str] = None
        self.stop_reason: Any = None
        self._gen = state.client.generate(request_id, prompt_ids, sampling)
        self._first: Optional[Delta] = None
        self._refused = False
        self._seen_delta = False
        self._closed = False
        self._first_token_time: Optional[float] = None
        self._last_token_time = 0.0
        self._queue_time: Optional[float] = None
        state.num_in_flight += 1

    async def prime(self) -> None:
        try:
            self._first = await anext(self._gen)
        except EngineRequestError:
            self._refused = True
            raise

    async def events(self) -> AsyncIterator[ChoiceOutput]:
        try:
            if self._first is not None:
                first, self._first = self._first, None
                yield self._on_delta(first)
            while self.finish_reason is None:
                try:
                    delta = await anext(self._gen)
                except StopAsyncIteration:
                    raise EngineDeadError("the engine ended a request without finishing it") from None
                yield self._on_delta(delta)
        finally:
            await self.close()

    def _on_delta(self, delta: Delta) -> ChoiceOutput:
        now, metrics, new = time.monotonic(), self.state.metrics, delta.new_token_ids
        if not self._seen_delta:
            self._seen_delta = True
            metrics.record_tokens(prompt_tokens=delta.num_prompt_tokens)
        # Token latencies are observed as they happen (live dashboards); the rest when the request ends.
        if new:
            if self._first_token_time is None:
                self._first_token_time = now
                metrics.time_to_first_token.observe(now - self.arrival)
            else:
                metrics.observe_inter_token_latency(now - self._last_token_time, len(new))
            self._last_token_time = now
            metrics.record_tokens(generation_tokens=len(new))
        # The engine detokenized the tokens and matched stop strings: what arrives is already cut.
        lps = delta.new_logprobs or []
        out = ChoiceOutput(self.index, delta.text, list(new), [lp[0] for lp in lps],
                           [list(lp[1]) for lp in lps], None, None)
        if delta.finished:
            self.finish_reason, self.stop_reason = delta.finish_reason or "stop", delta.stop_reason
            self._queue_time = delta.queue_time
        out.finish_reason, out.stop_reason = self.finish_reason, self.stop_reason
        self.text += out.text
        self.token_ids.extend(out.token_ids)
        self.logprobs.extend(out.logprobs)
        self.top_logprobs.extend(out.top_logprobs)
        return out

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self._gen.aclose()  # unfinished (stop string, disconnect, error): aborts in the engine
        except RuntimeError:  # still being iterated by a task that is being torn down: abort directly
            self.state.client.abort(self.request_id)
        finally:
            self.state.num_in_flight -= 1
            if not self._refused:
                self._record()

    def _record(self) -> None:
        self.state.metrics.record_request(RequestStats(
            finished_reason=self.finish_reason or "abort", queue_time=self._queue_time,
            e2e_latency=time.monotonic() - self.arrival))


async def all_or_cancel(aws: Sequence[Awaitable[Any]]) -> list[Any]:
    """gather() that, when one fails or we are cancelled, cancels and awaits the rest (no task outlives it,
    so nothing is still iterating an engine stream when the caller closes it)."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def close_all(choices: Sequence[ChoiceStream]) -> None:
    for c in choices:
        await c.close()


async def drain(choice: ChoiceStream) -> None:
    async with contextlib.aclosing(choice.events()) as events:
        async for _ in events:
            pass


async def merged_events(choices: Sequence[ChoiceStream]) -> AsyncIterator[ChoiceOutput]:
    """Every choice's outputs, in arrival order."""
    if len(choices) == 1:
        async with contextlib.aclosing(choices[0].events()) as events:
            async for out in events:
                yield out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(choice: ChoiceStream) -> None:
        try:
            async with contextlib.aclosing(choice.events()) as events:
                async for out in events:
                    queue.put_nowait(out)
        except Exception as e:
            queue.put_nowait(e)
        finally:
            queue.put_nowait(done)

    tasks = [asyncio.ensure_future(pump(c)) for c in choices]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class SSEResponse(StreamingResponse):
    """text/event-stream whose body generator is closed, and whose choices are closed, however the response
    ends: finished, client gone, or the body never started because the client left first."""

    def __init__(self, body: AsyncIterator[str], choices: Sequence[ChoiceStream]):
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._body, self._choices = body, choices

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._body.aclose()
            await close_all(self._choices)


# ------------------------------------------------------------------------------------ request path

def parse_request(model: type, body: Any):
    """JSON value -> request model; every failure becomes a 400 envelope (never FastAPI's 422)."""
    try:
        return model.model_validate(body)
    except ValueError as e:  # pydantic's ValidationError and our ProtocolError are ValueErrors
        raise ApiError(error_response(e)) from None


def _context_checks(state: ServerState, prompt_len: int, max_tokens: Optional[int], input_param: str) -> int:
    """The resolved max_tokens, or a 400 with vLLM's message shapes."""
    limit = state.info.max_model_len
    if prompt_len >= limit:
        raise ApiError.make(
            f"This model's maximum context length is {limit} tokens. However, your request has {prompt_len} "
            f"input tokens. Please reduce the length of the input.", 400, param=input_param,
            code="context_length_exceeded")
    if max_tokens is None:
        return limit - prompt_len
    if prompt_len + max_tokens > limit:
        raise ApiError.make(
            f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum context "
            f"length is {limit} tokens and your request has {prompt_len} input tokens ({max_tokens} > {limit} - "
            f"{prompt_len}).", 400, param="max_tokens", code="context_length_exceeded")
    return max_tokens


def open_choices(state: ServerState, req: Any, prompts: list[list[int]], arrival: float, base_id: str,
                 input_param: str) -> list[ChoiceStream]:
    """Validates every prompt against the context and the admission limit, then opens prompts x n
    ChoiceStreams (choice index = prompt_index * n + j; with a seed, choice i samples with seed + i)."""
    kwargs = req.to_sampling_kwargs(state.info.default_sampling)
    n = kwargs.pop("n")
    asked = req._max_new_tokens()  # the client's own; a generation_config default is clamped, never refused
    max_tokens = [_context_checks(state, len(p), asked, input_param) for p in prompts]
    if asked is None and kwargs["max_tokens"] is not None:
        max_tokens = [min(m, kwargs["max_tokens"]) for m in max_tokens]
    wanted, limit = len(prompts) * n, state.config.max_queue_len
    if wanted > limit:  # could never be admitted: retrying (what a 429 invites) would not help
        raise ApiError.make(f"This request needs {wanted} engine requests (prompts x n); the server admits at "
                            f"most {limit} at once.", 400, param="n", code="invalid_value")
    if state.num_in_flight + wanted > limit:
        raise ApiError.make(f"The server is busy: {state.num_in_flight} requests are in flight and the limit is "
                            f"{limit}. Retry later.", 429, code="queue_full")
    choices = []
    for p, (prompt_ids, new_tokens) in enumerate(zip(prompts, max_tokens)):
        for j in range(n):
            index = p * n + j
            seed = kwargs["seed"]
            sampling = SamplingParams(**{**kwargs, "max_tokens": new_tokens,
                                         "seed": None if seed is None else (seed + index) % 2 ** 64,
                                         "skip_special_tokens": req.skip_special_tokens,
                                         "include_stop_str_in_output": req.include_stop_str_in_output})
            choices.append(ChoiceStream(state, index, f"{base_id}-{index}", prompt_ids, sampling,
                                        arrival=arrival))
    return choices


async def start_choices(choices: list[ChoiceStream]) -> None:
    """Submit and await each choice's first delta; on any failure close them all (a 400 for a refusal)."""
    try:
        await all_or_cancel([c.prime() for c in choices])
    except BaseException:
        await close_all(choices)
        raise
