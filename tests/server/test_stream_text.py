"""Where a choice's text is made (server/generation.py ChoiceStream): a request without stop strings reaches the
engine with detokenize=False and the server detokenizes its tokens, so its deltas' text equals what transformers
decodes, whatever the chunking; a request with stop strings is detokenized (and cut) by the engine, whose text
passes through. No engine process: a stub client plays the engine's deltas."""
from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from engine.messages import Delta
from engine.request import SamplingParams
from server.generation import ChoiceStream
from server.metrics import Metrics

TEXT = "Grüße, 世界! def f(x):\n    return x  # 😀 done"


class StubClient:
    """Yields the given deltas for every request and records the sampling parameters the engine would get."""

    def __init__(self, deltas: list[Delta]):
        self.deltas, self.sent = deltas, []

    async def generate(self, request_id, prompt_ids, sampling):
        self.sent.append(sampling)
        for delta in self.deltas:
            yield delta

    def abort(self, request_id):
        pass


def stream_texts(server_tokenizer, prompt_ids: list[int], sampling: SamplingParams, deltas: list[Delta]
                 ) -> tuple[list[str], SamplingParams]:
    """The text of each ChoiceOutput the deltas turn into, and what the engine was sent."""
    client = StubClient(deltas)
    state = SimpleNamespace(client=client, metrics=Metrics("m"), num_in_flight=0, tokenizer=server_tokenizer)

    async def collect():
        choice = ChoiceStream(state, 0, "r-0", prompt_ids, sampling, arrival=time.monotonic())
        return [out.text async for out in choice.events()]

    return asyncio.run(collect()), client.sent[0]


def chunked(ids: list[int], sizes=(1, 3, 2)) -> list[list[int]]:
    chunks, i, k = [], 0, 0
    while i < len(ids):
        chunks.append(ids[i:i + sizes[k % len(sizes)]])
        i, k = i + len(chunks[-1]), k + 1
    return chunks


@pytest.mark.parametrize("which", ["byte-level", "metaspace"])
def test_the_server_detokenizes_a_request_without_stop_strings(which, tokenizer, server_tokenizer, sp_tokenizer,
                                                               server_sp_tokenizer):
    hf, served = (tokenizer, server_tokenizer) if which == "byte-level" else (sp_tokenizer, server_sp_tokenizer)
    prompt = hf.encode("Say it:", add_special_tokens=False)
    ids = hf.encode(TEXT, add_special_tokens=False) + [hf.eos_token_id]
    chunks = chunked(ids)
    deltas = [Delta("r-0", c, i == len(chunks) - 1, "stop" if i == len(chunks) - 1 else None)
              for i, c in enumerate(chunks)]  # (text "": an engine asked not to detokenize sends none)
    texts, sent = stream_texts(served, prompt, SamplingParams(max_tokens=100), deltas)
    assert sent.detokenize is False
    full = hf.decode(prompt + ids, skip_special_tokens=True)
    assert "".join(texts) == full[len(hf.decode(prompt, skip_special_tokens=True)):]
    assert len(texts) == len(chunks) and sum(1 for t in texts if t) > len(chunks) // 2  # streamed as it comes


def test_a_request_with_stop_strings_takes_the_engines_text(tokenizer, server_tokenizer):
    ids = tokenizer.encode("abc def", add_special_tokens=False)
    deltas = [Delta("r-0", ids[:1], False, None, text="engine "), Delta("r-0", ids[1:], True, "stop", text="cut")]
    texts, sent = stream_texts(server_tokenizer, [1, 2], SamplingParams(max_tokens=10, stop=["zzz"]), deltas)
    assert sent.detokenize is True and sent.stop == ["zzz"]
    assert texts == ["engine ", "cut"]
