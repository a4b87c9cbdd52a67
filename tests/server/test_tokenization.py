"""server/tokenization.py: chat template rendering and logprob token strings/bytes (the detokenizer and stop
strings live in the engine: tests/engine/test_detokenizer.py)."""
from __future__ import annotations

import random

import pytest

from server.protocol import ChatCompletionRequest, ProtocolError, error_response
from server.tokenization import ChatTemplateError, LogprobFormatter, TextOffset, encode_chat, encode_prompt, render_chat

MULTIBYTE = "Hello, wörld! 你好 🎉"
TEXTS = [MULTIBYTE, "def f(x):\n    return x  # naïve café\n", "日本語のテキスト、そして絵文字 👩‍👩‍👧 ok",
         "e\u0301 combining, ß, Ωmega, \u00a0nbsp", "tabs\tand  double  spaces   ",
         "🎉🎉🎉x🎉"]


def random_chunks(rng: random.Random, ids: list[int]) -> list[list[int]]:
    chunks, i = [], 0
    while i < len(ids):
        n = rng.choice([1, 1, 1, 2, 3, 5])
        chunks.append(ids[i:i + n])
        i += n
    return chunks


# ---------------------------------------------------------------------------------------- chat template

def test_render_chat_chatml(tokenizer):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": MULTIBYTE}]
    text = render_chat(tokenizer, msgs)
    assert text == f"<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n{MULTIBYTE}<|im_end|>\n" \
                   "<|im_start|>assistant\n"
    assert render_chat(tokenizer, msgs, add_generation_prompt=False).endswith("<|im_end|>\n")
    ids = encode_chat(tokenizer, msgs)
    assert ids == tokenizer.encode(text, add_special_tokens=False) and isinstance(ids, list)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>") and tokenizer.decode(ids) == text
    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "developer", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]})
    rendered = render_chat(tokenizer, req.messages)
    assert rendered.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi")
    assert encode_prompt(tokenizer, "hi") == tokenizer.encode("hi")


def test_chat_template_kwargs_reach_the_template(tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer, "chat_template", "{{ messages[0]['content'] }}{% if shout %}!{% endif %}")
    assert render_chat(tokenizer, [{"role": "user", "content": "a"}], chat_template_kwargs={"shout": True}) == "a!"
    with pytest.raises(ChatTemplateError) as info:
        render_chat(tokenizer, [{"role": "user", "content": "a"}], chat_template_kwargs={"tokenize": True})
    assert info.value.param == "chat_template_kwargs"


def test_template_failures_are_client_errors(tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer, "chat_template",
                        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('roles must alternate') }}"
                        "{% endif %}{{ messages[0]['content'] }}")
    with pytest.raises(ChatTemplateError) as info:
        render_chat(tokenizer, [{"role": "assistant", "content": "x"}])
    err = error_response(info.value)
    assert err.status_code == 400 and err.error.param == "messages" and "roles must alternate" in err.error.message
    assert isinstance(info.value, ProtocolError)
    monkeypatch.setattr(tokenizer, "chat_template", "{{ messages[0]['content'] | nosuchfilter }}")
    with pytest.raises(ChatTemplateError):
        render_chat(tokenizer, [{"role": "user", "content": "x"}])
    monkeypatch.setattr(tokenizer, "chat_template", None)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        encode_chat(tokenizer, [{"role": "user", "content": "x"}])


# ------------------------------------------------------------------------------------------ detokenizer

# --------------------------------------------------------------------------------------------- logprobs

def test_token_bytes_reassemble_the_text(tokenizer, sp_tokenizer):
    for tok in (tokenizer, sp_tokenizer):
        fmt = LogprobFormatter(tok)
        for text in TEXTS:
            ids = tok.encode(text, add_special_tokens=False)
            joined = b"".join(fmt.token_bytes(i) for i in ids)
            expect = text.encode() if tok is tokenizer else (" " + text).encode()  # Metaspace prepends a space
            assert joined == expect, text


def test_token_strings_for_partial_characters_and_specials(tokenizer, sp_tokenizer):
    fmt = LogprobFormatter(tokenizer)
    ids = tokenizer.encode("🎉", add_special_tokens=False)
    first = fmt.token_str(ids[0])
    assert first.startswith("bytes:\\x") and bytes(fmt.chat_logprobs([ids[0]], [-1.0])[0].bytes) == \
        fmt.token_bytes(ids[0])
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert fmt.token_str(end) == "<|im_end|>" and fmt.token_bytes(end) == b"<|im_end|>"
    sp = LogprobFormatter(sp_tokenizer)
    byte_tok = sp_tokenizer.convert_tokens_to_ids("<0xE4>")
    assert sp.token_bytes(byte_tok) == b"\xe4" and sp.token_str(byte_tok) == "bytes:\\xe4"
    word = sp_tokenizer.encode("hello world", add_special_tokens=False)
    assert "".join(sp.token_str(i) for i in word) == " hello world"


def test_chat_and_completion_logprob_shapes(tokenizer):
    fmt = LogprobFormatter(tokenizer)
    ids = tokenizer.encode("a 你", add_special_tokens=False)
    tops = [[(i, -0.1), (0, float("-inf"))] for i in ids]
    entries = fmt.chat_logprobs(ids, [-0.1] * len(ids), tops)
    assert [e.token for e in entries][0] == "a" and entries[0].top_logprobs[1].logprob == -9999.0
    assert b"".join(bytes(e.bytes) for e in entries) == "a 你".encode()
    offset = TextOffset()
    half = len(ids) // 2
    first = fmt.completion_logprobs(ids[:half], [-1.0] * half, offset=offset)
    rest = fmt.completion_logprobs(ids[half:], [None] + [-2.0] * (len(ids) - half - 1),
                                   [None] * (len(ids) - half), offset=offset)
    offsets = first.text_offset + rest.text_offset
    assert offsets[0] == 0 and offsets == sorted(offsets) and offset.chars == len("a 你")
    assert rest.token_logprobs[0] is None and rest.top_logprobs == [None] * (len(ids) - half)
    echo = fmt.completion_logprobs(ids[:1], [-1.0], [[(ids[0], -1.0)]], offset=TextOffset(chars=10))
    assert echo.text_offset == [10] and echo.top_logprobs == [{"a": -1.0}]
