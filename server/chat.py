"""POST /v1/chat/completions: validate the request, render the messages with the chat template and tokenize them
(in the tokenizer thread), then answer through the shared generation path (server/generation.py) with one
ChatCompletion, or an SSE stream in OpenAI/vLLM order: a role chunk per choice, content deltas, a finish chunk
per choice (stop | length | tool_calls), a usage chunk when include_usage, then `data: [DONE]`. With tools (and
tool_choice not "none") the output's tool-call blocks become `tool_calls` (server/tool_calls.py)."""
from __future__ import annotations

import contextlib
import time
from typing import Any, AsyncIterator, Optional

from starlette.responses import Response

from server.generation import json_response, log_ignored, merged_events, open_choices, respond, usage_of
from server.requests import ChatCompletionRequest, parse_request
from server.responses import (SSE_DONE, ChatCompletion, ChatCompletionChoice, ChatCompletionChunk,
                              ChatCompletionDelta, ChatCompletionMessage, ChatCompletionStreamChoice, ChoiceLogprobs,
                              ContentEvents, ToolCall, ToolCallDelta, ToolCallFunction, ToolCallFunctionDelta, Usage,
                              random_id, sse_event)
from server.state import ServerState
from server.tokenizer import encode_chat
from server.tool_calls import ParsedCall, ToolCallStream, parse_tool_calls


async def create_chat_completion(state: ServerState, body: Any, arrival: float) -> Response:
    req: ChatCompletionRequest = parse_request(ChatCompletionRequest, body)
    state.check_model(req.model)
    req.check_token_ids(state.info.vocab_size)
    log_ignored(req)
    tools = req.template_tools()
    prompt_ids = await state.tokenize(encode_chat, req.messages, chat_template_kwargs=req.chat_template_kwargs,
                                      tools=tools, param="messages")
    cid, created = random_id("chatcmpl"), int(time.time())
    choices = open_choices(state, req, [prompt_ids], arrival, cid, "messages")
    fmt = state.formatter

    def logprobs_of(ids: list[int], lps: list[float], tops: list) -> Optional[ChoiceLogprobs]:
        return ChoiceLogprobs(content=fmt.chat_logprobs(ids, lps, tops)) if req.logprobs else None

    def message(text: str, finish_reason) -> tuple[ChatCompletionMessage, object]:
        if not tools:
            return ChatCompletionMessage(content=text), finish_reason
        content, calls = parse_tool_calls(text)
        if not calls:
            return ChatCompletionMessage(content=text), finish_reason
        return ChatCompletionMessage(content=content, tool_calls=[
            ToolCall(id=c.id, function=ToolCallFunction(name=c.name, arguments=c.arguments)) for c in calls]), \
            "tool_calls"

    def build() -> Response:
        out = []
        for c in choices:
            msg, finish = message(c.text, c.finish_reason)
            out.append(ChatCompletionChoice(index=c.index, message=msg, finish_reason=finish,
                                            logprobs=logprobs_of(c.token_ids, c.logprobs, c.top_logprobs),
                                            stop_reason=c.stop_reason))
        return json_response(ChatCompletion(id=cid, created=created, model=state.model_name,
                                            usage=usage_of([prompt_ids], choices), choices=out))

    async def stream() -> AsyncIterator[str]:
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        completion_tokens = 0

        def chunk(items: list[ChatCompletionStreamChoice], usage: Optional[Usage] = None) -> str:
            return sse_event(ChatCompletionChunk(id=cid, created=created, model=state.model_name, choices=items,
                                                 usage=usage))

        content = ContentEvents(lambda index, text, usage: ChatCompletionChunk(
            id=cid, created=created, model=state.model_name, usage=usage,
            choices=[ChatCompletionStreamChoice(index=index, delta=ChatCompletionDelta(content=text))]))

        parsers = {c.index: ToolCallStream() for c in choices} if tools else {}
        num_calls = {c.index: 0 for c in choices}

        def call_chunks(index: int, calls: list[ParsedCall], usage: Optional[Usage]) -> list[str]:
            """Each call as OpenAI streams it: id, type and name first, then the arguments."""
            out = []
            for call in calls:
                k = num_calls[index]
                num_calls[index] += 1
                for d in (ToolCallDelta(index=k, id=call.id, type="function",
                                        function=ToolCallFunctionDelta(name=call.name, arguments="")),
                          ToolCallDelta(index=k, function=ToolCallFunctionDelta(arguments=call.arguments))):
                    out.append(chunk([ChatCompletionStreamChoice(index=index, delta=ChatCompletionDelta(
                        tool_calls=[d]))], usage))
            return out

        for c in choices:
            yield chunk([ChatCompletionStreamChoice(index=c.index,
                                                    delta=ChatCompletionDelta(role="assistant", content=""))])
        async with contextlib.aclosing(merged_events(choices)) as events:
            async for out in events:
                completion_tokens += len(out.token_ids)
                counts = (len(prompt_ids), completion_tokens) if continuous else None
                lp = logprobs_of(out.token_ids, out.logprobs, out.top_logprobs) if out.token_ids else None
                text, calls = parsers[out.index].feed(out.text) if tools else (out.text, [])
                if out.finish_reason is not None and tools:
                    rest, _ = parsers[out.index].finish()
                    text += rest
                # the models' usage only for the chunks built from models (a content chunk's template takes counts)
                modelled = lp is not None or calls or out.finish_reason is not None
                usage = Usage.of(*counts) if counts and modelled else None
                if lp is not None:
                    yield chunk([ChatCompletionStreamChoice(index=out.index, logprobs=lp,
                                                            delta=ChatCompletionDelta(content=text))], usage)
                elif text:
                    yield content.event(out.index, text, counts)
                for event in call_chunks(out.index, calls, usage):
                    yield event
                if out.finish_reason is not None:
                    finish = "tool_calls" if num_calls[out.index] else out.finish_reason
                    yield chunk([ChatCompletionStreamChoice(index=out.index, finish_reason=finish,
                                                            stop_reason=out.stop_reason)], usage)
        if req.include_usage:
            yield chunk([], usage_of([prompt_ids], choices))
        yield SSE_DONE

    return await respond(choices, build, stream, req.stream)
