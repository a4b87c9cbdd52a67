"""The generation path that /v1/chat/completions (server/chat.py) and /v1/completions (server/completions.py)
share, from token ids to the HTTP response: check each prompt against the context (vLLM's messages) and the
admission limit (429), open one `ChoiceStream` per choice (one engine request each), prime them (SGLang style:
the first engine event is awaited before answering, so an engine refusal is still an HTTP 400), then answer
with one JSON body or an SSE stream of their merged outputs (a failure after the stream started is an error
event followed by [DONE]).

Invariants: every ChoiceStream is closed exactly once (stream end, client disconnect, error), and closing an
unfinished one aborts it in the engine, which frees its KV within one step; `state.num_in_flight` counts the
open ones and is what the 429 admission limit reads.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator, Awaitable, Callable, Optional, Sequence

from pydantic import BaseModel
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from engine.detokenizer import OutputText
from engine.messages import Delta
from engine.request import SamplingParams
from server.engine_client import EngineDeadError, EngineInternalError, EngineRequestError, ServiceUnavailableError
from server.errors import ApiError, ErrorResponse
from server.metrics import RequestStats
from server.responses import SSE_DONE, Usage, sse_event
from server.state import ServerState
from server.tokenizer import TextOffset

logger = logging.getLogger("ddtree.server")


def json_response(payload: BaseModel, status_code: int = 200) -> Response:
    return Response(payload.model_dump_json(), status_code=status_code, media_type="application/json")


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
        self._texts: list[str] = []  # the detokenized output so far (stop strings already cut in the engine)
        # Without stop strings the engine needs no text, so its tokens are detokenized here, beside the engine's
        # steps instead of on its step loop (~9 us a token there: ~0.6 ms of a batch-64 step on the 2-core CPU).
        # With stop strings the engine detokenizes, so a request that hits one ends, and frees its KV, that step.
        self._detokenizer: Optional[OutputText] = None
        if sampling.detokenize and not sampling.stop:
            self._detokenizer = OutputText(state.tokenizer.decoding, skip_special_tokens=sampling.skip_special_tokens,
                                           prompt_ids=prompt_ids)
            sampling = replace(sampling, detokenize=False)
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

    @property
    def text(self) -> str:
        """The detokenized output so far."""
        return "".join(self._texts)

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
        # Stop strings were matched in the engine: what arrives is already cut.
        text = delta.text if self._detokenizer is None else self._detokenize(new, delta.finished)
        lps = delta.new_logprobs or []
        out = ChoiceOutput(self.index, text, list(new), [lp[0] for lp in lps],
                           [list(lp[1]) for lp in lps], None, None)
        if delta.finished:
            self.finish_reason, self.stop_reason = delta.finish_reason or "stop", delta.stop_reason
            self._queue_time = delta.queue_time
        out.finish_reason, out.stop_reason = self.finish_reason, self.stop_reason
        if out.text:
            self._texts.append(out.text)
        self.token_ids.extend(out.token_ids)
        self.logprobs.extend(out.logprobs)
        self.top_logprobs.extend(out.top_logprobs)
        return out

    def _detokenize(self, new: Sequence[int], finished: bool) -> str:
        """The text a delta's tokens complete (and, when it finishes the request, what was held back)."""
        if new:
            self._detokenizer.push(list(new))
        if finished:
            self._detokenizer.finish()
        return self._detokenizer.take()

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

def log_ignored(req: Any) -> None:
    ignored = req.ignored_fields()
    if ignored:
        logger.info("ignoring unknown request fields: %s", ", ".join(ignored))


def usage_of(prompts: list[list[int]], choices: Sequence[ChoiceStream]) -> Usage:
    return Usage.of(sum(len(p) for p in prompts), sum(len(c.token_ids) for c in choices))


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


async def _stream_errors(body: AsyncIterator[str]) -> AsyncIterator[str]:
    """A failure after the 200 went out is an error event followed by [DONE]."""
    try:
        async with contextlib.aclosing(body) as events:
            async for event in events:
                yield event
    except ServiceUnavailableError as e:  # the engine died, or the server cut the stream (drain deadline)
        yield sse_event(ErrorResponse.make(e.client_message(), 503, code="service_unavailable"))
        yield SSE_DONE
    except EngineInternalError as e:  # this request failed in the engine; the others go on
        yield sse_event(ErrorResponse.make(e.client_message(), 500, code="internal_error"))
        yield SSE_DONE
    except Exception:
        logger.exception("stream failed")
        yield sse_event(ErrorResponse.make("Internal server error while streaming.", 500))
        yield SSE_DONE


async def respond(choices: list[ChoiceStream], build: Callable[[], Response],
                  stream: Callable[[], AsyncIterator[str]], streaming: bool) -> Response:
    """Submits every choice and awaits its first delta (on any failure all are closed: a 400 for a refusal),
    then answers: the SSE stream of `stream()`, or, once every choice finished, the JSON body of `build()`."""
    try:
        await all_or_cancel([c.prime() for c in choices])
    except BaseException:
        await close_all(choices)
        raise
    if streaming:
        return SSEResponse(_stream_errors(stream()), choices)
    try:
        await all_or_cancel([drain(c) for c in choices])
    finally:
        await close_all(choices)
    return build()
