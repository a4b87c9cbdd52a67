"""POST /v1/completions (legacy): validate the request, tokenize each text prompt (token-id prompts go as they
are), then answer through the shared generation path (server/generation.py) with one Completion, or an SSE
stream: the echoed prompt per choice when echo, text deltas, a finish chunk per choice, a usage chunk when
include_usage, then `data: [DONE]`. Choice index = prompt_index * n + j."""
from __future__ import annotations

import contextlib
import time
from typing import Any, AsyncIterator, Optional

from starlette.responses import Response

from server.generation import (ChoiceStream, json_response, log_ignored, merged_events, open_choices, respond,
                               usage_of)
from server.requests import CompletionRequest, parse_request
from server.responses import (SSE_DONE, Completion, CompletionChoice, CompletionChunk, ContentEvents, Usage,
                              random_id, sse_event)
from server.state import ServerState
from server.tokenizer import encode_prompt


async def create_completion(state: ServerState, body: Any, arrival: float) -> Response:
    req: CompletionRequest = parse_request(CompletionRequest, body)
    state.check_model(req.model)
    req.check_token_ids(state.info.vocab_size)
    log_ignored(req)
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
            id=cid, created=created, model=state.model_name, usage=usage_of(prompts, choices),
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

        content = ContentEvents(lambda index, text, usage: CompletionChunk(
            id=cid, created=created, model=state.model_name, usage=usage,
            choices=[CompletionChoice(index=index, text=text)]))

        if req.echo:
            for c in choices:
                yield chunk([CompletionChoice(index=c.index, text=echo_of(c))])
        async with contextlib.aclosing(merged_events(choices)) as events:
            async for out in events:
                completion_tokens += len(out.token_ids)
                counts = (prompt_tokens, completion_tokens) if continuous else None
                c = by_index[out.index]
                lp = logprobs_of(c, out.token_ids, out.logprobs, out.top_logprobs) if out.token_ids else None
                # the models' usage only for the chunks built from models (a content chunk's template takes counts)
                modelled = lp is not None or out.finish_reason is not None
                usage = Usage.of(*counts) if counts and modelled else None
                if lp is not None:
                    yield chunk([CompletionChoice(index=out.index, text=out.text, logprobs=lp)], usage)
                elif out.text:
                    yield content.event(out.index, out.text, counts)
                if out.finish_reason is not None:
                    yield chunk([CompletionChoice(index=out.index, text="", finish_reason=out.finish_reason,
                                                  stop_reason=out.stop_reason)], usage)
        if req.include_usage:
            yield chunk([], usage_of(prompts, choices))
        yield SSE_DONE

    return await respond(choices, build, stream, req.stream)
