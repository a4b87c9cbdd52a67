"""POST /v1/chat/completions: validate the request, render the messages with the chat template and tokenize them
(in the tokenizer thread), then answer through the shared generation path (server/generation.py) with one
ChatCompletion, or an SSE stream in OpenAI/vLLM order: a role chunk per choice, content deltas, a finish chunk
per choice (stop | length), a usage chunk when include_usage, then `data: [DONE]`."""
from __future__ import annotations

import contextlib
import time
from typing import Any, AsyncIterator, Optional

from starlette.responses import Response

from server.generation import json_response, log_ignored, merged_events, open_choices, respond, usage_of
from server.requests import ChatCompletionRequest, parse_request
from server.responses import (SSE_DONE, ChatCompletion, ChatCompletionChoice, ChatCompletionChunk,
                              ChatCompletionDelta, ChatCompletionMessage, ChatCompletionStreamChoice, ChoiceLogprobs,
                              Usage, random_id, sse_event)
from server.state import ServerState
from server.tokenizer import encode_chat


async def create_chat_completion(state: ServerState, body: Any, arrival: float) -> Response:
    req: ChatCompletionRequest = parse_request(ChatCompletionRequest, body)
    state.check_model(req.model)
    req.check_token_ids(state.info.vocab_size)
    log_ignored(req)
    prompt_ids = await state.tokenize(encode_chat, req.messages, chat_template_kwargs=req.chat_template_kwargs,
                                      param="messages")
    cid, created = random_id("chatcmpl"), int(time.time())
    choices = open_choices(state, req, [prompt_ids], arrival, cid, "messages")
    fmt = state.formatter

    def logprobs_of(ids: list[int], lps: list[float], tops: list) -> Optional[ChoiceLogprobs]:
        return ChoiceLogprobs(content=fmt.chat_logprobs(ids, lps, tops)) if req.logprobs else None

    def build() -> Response:
        return json_response(ChatCompletion(
            id=cid, created=created, model=state.model_name, usage=usage_of([prompt_ids], choices),
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
            yield chunk([], usage_of([prompt_ids], choices))
        yield SSE_DONE

    return await respond(choices, build, stream, req.stream)
