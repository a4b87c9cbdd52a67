"""A stream's plain content chunks are rendered from templates (server/responses.py ContentEvents) rather than
by building and serializing the response models for every token; the bytes must be pydantic's, whatever the text
(escapes, '%', braces, line separators, astral characters), the choice index, the usage, and the id and model name
(which could hold a template's markers)."""
from __future__ import annotations

import json
import random

import pytest

from server.responses import (ChatCompletionChunk, ChatCompletionDelta, ChatCompletionStreamChoice, CompletionChoice,
                              CompletionChunk, ContentEvents, Usage, sse_event)

TEXTS = ["", " hello", 'say "hi"\\n', "100% {done} %s %d %%", "\u2028\u2029\x85\x0b\x0c\r\n\t", "\x00\x01\x1f\x7f",
         "Grüße, 世界 😀", "\ud7ff\ue000\uffff\U0010ffff", "</script>&<'>"]


def chat_maker(cid: str, model: str):
    return lambda index, text, usage: ChatCompletionChunk(
        id=cid, created=1765000000, model=model, usage=usage,
        choices=[ChatCompletionStreamChoice(index=index, delta=ChatCompletionDelta(content=text))])


def completion_maker(cid: str, model: str):
    return lambda index, text, usage: CompletionChunk(
        id=cid, created=1765000000, model=model, usage=usage, choices=[CompletionChoice(index=index, text=text)])


def random_texts(num: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    planes = [(0, 0x80), (0x80, 0x800), (0x800, 0xD800), (0xE000, 0x10000), (0x10000, 0x110000)]
    out = []
    for _ in range(num):
        chars = []
        for _ in range(rng.randint(1, 12)):
            lo, hi = rng.choice(planes)
            chars.append(chr(rng.randrange(lo, hi)))
        out.append("".join(chars))
    return out


@pytest.mark.parametrize("maker", [chat_maker, completion_maker])
@pytest.mark.parametrize("cid, model", [
    ("chatcmpl-0123abcd", "SmolLM2-135M-Instruct"),
    ("cmpl-%s%d{x}", "model 100% {name} %(x)s"),
    ("id-9000000001", "9000000001 9000000002 \u0000text\u0000"),  # the default markers, in the id and the name
])
def test_content_events_are_the_models_bytes(maker, cid, model):
    make = maker(cid, model)
    events = ContentEvents(make)
    for i, text in enumerate(TEXTS + random_texts(300)):
        index, counts = i % 3, (17 + i, i)
        assert events.event(index, text) == sse_event(make(index, text, None)), text
        assert events.event(index, text, counts) == sse_event(make(index, text, Usage.of(*counts))), text
        payload = json.loads(events.event(index, text, counts)[len("data: "):])
        assert payload["usage"]["total_tokens"] == 17 + 2 * i and payload["model"] == model
