"""The official `openai` SDK as the client: chat and completions, streaming and not, n, stop strings, seeds,
logprobs, usage, and errors surfacing as the SDK's typed exceptions."""
from __future__ import annotations

import math

import openai
import pytest

from tests.server.conftest import PLAIN_API_KEY

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
STORY = [{"role": "user", "content": "Write one sentence about a cat."}]


def stream_text(chunks) -> tuple[str, list]:
    chunks = list(chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


def test_chat_stream_equals_non_stream(oai, model_name):
    full = oai.chat.completions.create(model=model_name, messages=QUESTION, max_tokens=12, temperature=0)
    assert full.choices[0].message.role == "assistant"
    assert "Paris" in full.choices[0].message.content
    text, chunks = stream_text(oai.chat.completions.create(model=model_name, messages=QUESTION, max_tokens=12,
                                                           temperature=0, stream=True))
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert len({c.id for c in chunks}) == 1


def test_completions_stream_equals_non_stream(oai, model_name):
    prompt = "The three primary colors are"
    full = oai.completions.create(model=model_name, prompt=prompt, max_tokens=8, temperature=0)
    assert full.object == "text_completion" and full.choices[0].text
    chunks = list(oai.completions.create(model=model_name, prompt=prompt, max_tokens=8, temperature=0,
                                         stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_n_and_seed_reproducibility(oai, model_name):
    kw = dict(model=model_name, messages=STORY, max_tokens=12, temperature=1.0, seed=1234, n=2)
    first = oai.chat.completions.create(**kw)
    again = oai.chat.completions.create(**kw)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1]
    assert texts == [c.message.content for c in again.choices]  # same seed: the same two samples
    assert texts[0] != texts[1]  # choice i samples with seed + i
    single = oai.chat.completions.create(**{**kw, "n": 1})
    assert single.choices[0].message.content == texts[0]
    other_seed = oai.chat.completions.create(**{**kw, "n": 1, "seed": 99})
    assert other_seed.choices[0].message.content != texts[0]
    counted = oai.chat.completions.create(**kw, logprobs=True)
    assert [c.message.content for c in counted.choices] == texts  # logprobs do not change the samples
    assert counted.usage.completion_tokens == sum(len(c.logprobs.content) for c in counted.choices)


def test_stop_strings(oai, model_name):
    base = oai.chat.completions.create(model=model_name, messages=QUESTION, max_tokens=12, temperature=0)
    text = base.choices[0].message.content
    cut = text.index("France")
    stopped = oai.chat.completions.create(model=model_name, messages=QUESTION, max_tokens=12, temperature=0,
                                          stop=["France", "never-appears"])
    assert stopped.choices[0].message.content == text[:cut]
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens < base.usage.completion_tokens
    streamed, chunks = stream_text(oai.chat.completions.create(
        model=model_name, messages=QUESTION, max_tokens=12, temperature=0, stop="France", stream=True))
    assert streamed == text[:cut] and chunks[-1].choices[0].finish_reason == "stop"


def test_chat_logprobs(oai, model_name):
    r = oai.chat.completions.create(model=model_name, messages=QUESTION, max_tokens=8, temperature=0,
                                    logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the most likely token
        assert math.isclose(entry.top_logprobs[0].logprob, entry.logprob, abs_tol=1e-5)
        lps = [t.logprob for t in entry.top_logprobs]
        assert lps == sorted(lps, reverse=True)
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token or entry.token.startswith("bytes:")
    # the text leaves out the end-of-turn token; its logprob is still reported (it is a generated token)
    assert "".join(e.token for e in content).startswith(r.choices[0].message.content)
    chunks = list(oai.chat.completions.create(model=model_name, messages=QUESTION, max_tokens=8, temperature=0,
                                              logprobs=True, top_logprobs=3, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert all(math.isclose(a.logprob, b.logprob, abs_tol=1e-4) for a, b in zip(streamed, content))


def test_completion_logprobs(oai, model_name):
    r = oai.completions.create(model=model_name, prompt="One, two, three,", max_tokens=5, temperature=0,
                               logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert all(len(top) == 2 and max(top.values()) == pytest.approx(v, abs=1e-5)
               for top, v in zip(lp.top_logprobs, lp.token_logprobs))


def test_stream_usage(oai, model_name):
    chunks = list(oai.chat.completions.create(model=model_name, messages=STORY, max_tokens=6, temperature=0,
                                              n=2, stream=True, stream_options={"include_usage": True}))
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    full = oai.chat.completions.create(model=model_name, messages=STORY, max_tokens=6, temperature=0, n=2)
    assert last.usage.prompt_tokens == full.usage.prompt_tokens
    assert last.usage.completion_tokens == full.usage.completion_tokens
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens
    finished = {c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices and
                c.choices[0].finish_reason}
    assert set(finished) == {0, 1}


def test_typed_errors(oai, model_name, plain_server):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model_name, messages=QUESTION, temperature=-1)
    assert e.value.status_code == 400 and e.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model_name, messages=QUESTION, max_tokens=100_000)
    assert e.value.param == "max_tokens" and "maximum context length is 2048" in e.value.message
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=model_name, messages=[], max_tokens=1)
    with pytest.raises(openai.BadRequestError):  # a stream that would fail fails before it starts
        oai.chat.completions.create(model=model_name, messages=QUESTION, max_tokens=100_000, stream=True)
    with pytest.raises(openai.NotFoundError) as e:
        oai.chat.completions.create(model="no-such-model", messages=QUESTION, max_tokens=1)
    assert e.value.code == "model_not_found"
    with openai.OpenAI(base_url=plain_server.base_url + "/v1", api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.chat.completions.create(model=model_name, messages=QUESTION, max_tokens=1)
    with openai.OpenAI(base_url=plain_server.base_url + "/v1", api_key=PLAIN_API_KEY, max_retries=0) as good:
        assert good.models.list().data[0].id == model_name
