"""The OpenAI generation routes' logic: POST /v1/chat/completions and /v1/completions.

Each handler validates the request, tokenizes it (chat template or raw prompts), opens one engine request
per choice and answers with one JSON body, or an SSE stream in OpenAI/vLLM order: a role chunk per choice
(chat), content deltas, a finish chunk per choice (stop | length), a usage chunk when include_usage, then
`data: [DONE]`. A failure after the stream started is an error event followed by [DONE].
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, AsyncIterator, Callable, Optional, Sequence

from starlette.responses import Response

from server.engine_client import EngineInternalError, ServiceUnavailableError
from server.protocol import (SSE_DONE, ChatCompletion, ChatCompletionChoice, ChatCompletionChunk,
                             ChatCompletionDelta, ChatCompletionMessage, ChatCompletionRequest,
                             ChatCompletionStreamChoice, ChoiceLogprobs, Completion, CompletionChoice,
                             CompletionChunk, CompletionRequest, ErrorResponse, Usage, random_id, sse_event)
from server.serving import (ChoiceStream, ServerState, SSEResponse, all_or_cancel, close_all, drain,
                            json_response, merged_events, open_choices, parse_request, start_choices)
from server.tokenization import encode_chat, encode_prompt

logger = logging.getLogger("ddtree.server")


async def _run(choices: list[ChoiceStream], build: Callable[[], Response],
               stream: Callable[[], AsyncIterator[str]], streaming: bool) -> Response:
    await start_choices(choices)
    if streaming:
        return SSEResponse(stream(), choices)
    try:
        await all_or_cancel([drain(c) for c in choices])
    finally:
        await close_all(choices)
    return build()


def _log_ignored(req: Any) -> None:
    ignored = req.ignored_fields()
    if ignored:
        logger.info("ignoring unknown request fields: %s", ", ".join(ignored))


def _usage(prompts: list[list[int]], choices: Sequence[ChoiceStream]) -> Usage:
    return Usage.of(sum(len(p) for p in prompts), sum(len(c.token_ids) for c in choices))


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


# ------------------------------------------------------------------------------------------- chat

async def create_chat_completion(state: ServerState, body: Any, arrival: float) -> Response:
    req: ChatCompletionRequest = parse_request(ChatCompletionRequest, body)
    state.check_model(req.model)
    req.check_token_ids(state.info.vocab_size)
    _log_ignored(req)
    prompt_ids = await state.tokenize(encode_chat, req.messages, chat_template_kwargs=req.chat_template_kwargs,
                                      param="messages")
    cid, created = random_id("chatcmpl"), int(time.time())
    choices = open_choices(state, req, [prompt_ids], arrival, cid, "messages")
    fmt = state.formatter

    def logprobs_of(ids: list[int], lps: list[float], tops: list) -> Optional[ChoiceLogprobs]:
        return ChoiceLogprobs(content=fmt.chat_logprobs(ids, lps, tops)) if req.logprobs else None

    def build() -> Response:
        return json_response(ChatCompletion(
            id=cid, created=created, model=state.model_name, usage=_usage([prompt_ids], choices),
            choices=[ChatCompletionChoice(index=c.index, message=ChatCompletionMessage(content=c.text),
                                          logprobs=logprobs_of(c.token_ids, c.logprobs, c.top_logprobs),
                                          finish_reason=c.finish_reason, stop_reason=c.stop_reason)
                     for c in choices]))

    async def stream() -> AsyncIterator[str]:
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        completion_tokens = 0

        def chunk(items: list[ChatCompletionStreamChoice], usage: Optional[Usage] = None) -> str:
            return sse_event(ChatCompletionChunk(id=cid, created=created, model=state.model_name, choices=items,
                                                 usage=usage))

        for c in choices:
            yield chunk([ChatCompletionStreamChoice(index=c.index,
                                                    delta=ChatCompletionDelta(role="assistant", content=""))])
        async with contextlib.aclosing(merged_events(choices)) as events:
            async for out in events:
                completion_tokens += len(out.token_ids)
                usage = Usage.of(len(prompt_ids), completion_tokens) if continuous else None
                lp = logprobs_of(out.token_ids, out.logprobs, out.top_logprobs) if out.token_ids else None
                if out.text or lp is not None:
                    yield chunk([ChatCompletionStreamChoice(index=out.index, logprobs=lp,
                                                            delta=ChatCompletionDelta(content=out.text))], usage)
                if out.finish_reason is not None:
                    yield chunk([ChatCompletionStreamChoice(index=out.index, finish_reason=out.finish_reason,
                                                            stop_reason=out.stop_reason)], usage)
        if req.include_usage:
            yield chunk([], _usage([prompt_ids], choices))
        yield SSE_DONE

    return await _run(choices, build, lambda: _stream_errors(stream()), req.stream)


# ------------------------------------------------------------------------------------ completions

async def create_completion(state: ServerState, body: Any, arrival: float) -> Response:
    req: CompletionRequest = parse_request(CompletionRequest, body)
    state.check_model(req.model)
    req.check_token_ids(state.info.vocab_size)
    _log_ignored(req)
    prompts: list[list[int]] = []
    for p in req.prompts():
        prompts.append(list(p) if isinstance(p, list) else await state.tokenize(encode_prompt, p, param="prompt"))
    echo = [(p if isinstance(p, str) else state.tokenizer.decode(p)) if req.echo else ""
            for p in req.prompts()]
    cid, created = random_id("cmpl"), int(time.time())
    choices = open_choices(state, req, prompts, arrival, cid, "prompt")
    fmt = state.formatter

    def echo_of(c: ChoiceStream) -> str:
        return echo[c.index // req.n]

    def logprobs_of(c: ChoiceStream, ids: list[int], lps: list[float], tops: list):
        return fmt.completion_logprobs(ids, lps, tops, offset=c.offset) if req.logprobs is not None else None

    def build() -> Response:
        return json_response(Completion(
            id=cid, created=created, model=state.model_name, usage=_usage(prompts, choices),
            choices=[CompletionChoice(index=c.index, text=echo_of(c) + c.text,
                                      logprobs=logprobs_of(c, c.token_ids, c.logprobs, c.top_logprobs),
                                      finish_reason=c.finish_reason, stop_reason=c.stop_reason)
                     for c in choices]))

    async def stream() -> AsyncIterator[str]:
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        prompt_tokens, completion_tokens = sum(len(p) for p in prompts), 0
        by_index = {c.index: c for c in choices}

        def chunk(items: list[CompletionChoice], usage: Optional[Usage] = None) -> str:
            return sse_event(CompletionChunk(id=cid, created=created, model=state.model_name, choices=items,
                                             usage=usage))

        if req.echo:
            for c in choices:
                yield chunk([CompletionChoice(index=c.index, text=echo_of(c))])
        async with contextlib.aclosing(merged_events(choices)) as events:
            async for out in events:
                completion_tokens += len(out.token_ids)
                usage = Usage.of(prompt_tokens, completion_tokens) if continuous else None
                c = by_index[out.index]
                lp = logprobs_of(c, out.token_ids, out.logprobs, out.top_logprobs) if out.token_ids else None
                if out.text or lp is not None:
                    yield chunk([CompletionChoice(index=out.index, text=out.text, logprobs=lp)], usage)
                if out.finish_reason is not None:
                    yield chunk([CompletionChoice(index=out.index, text="", finish_reason=out.finish_reason,
                                                  stop_reason=out.stop_reason)], usage)
        if req.include_usage:
            yield chunk([], _usage(prompts, choices))
        yield SSE_DONE

    return await _run(choices, build, lambda: _stream_errors(stream()), req.stream)
