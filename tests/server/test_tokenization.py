"""server/tokenization.py: chat template rendering, the incremental detokenizer (checked against
tokenizer.decode of all ids), stop strings across token boundaries, and logprob token strings/bytes."""
from __future__ import annotations

import random

import pytest

from server.protocol import ChatCompletionRequest, ProtocolError, error_response
from server.tokenization import (REPLACEMENT, ChatTemplateError, IncrementalDetokenizer, LogprobFormatter,
                                 StopStringMatcher, TextOffset, TextStream, encode_chat, encode_prompt,
                                 render_chat)

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


def stream(tok, chunks, **kw) -> list[str]:
    detok = IncrementalDetokenizer(tok, **kw)
    return [detok.step(c) for c in chunks] + [detok.flush()]


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

def test_multibyte_one_token_at_a_time_equals_decode(tokenizer):
    ids = tokenizer.encode(MULTIBYTE, add_special_tokens=False)
    assert any(REPLACEMENT in tokenizer.decode([i]) for i in ids)  # the case under test really occurs
    deltas = stream(tokenizer, [[i] for i in ids])
    assert "".join(deltas) == tokenizer.decode(ids) == MULTIBYTE
    assert all(REPLACEMENT not in d for d in deltas)  # never a broken character


def test_random_chunkings_equal_decode_for_both_tokenizer_styles(tokenizer, sp_tokenizer):
    rng = random.Random(0)
    for tok in (tokenizer, sp_tokenizer):
        for text in TEXTS:
            ids = tok.encode(text, add_special_tokens=False)
            for _ in range(8):
                deltas = stream(tok, random_chunks(rng, ids))
                assert "".join(deltas) == tok.decode(ids), (text, deltas)
                assert all(REPLACEMENT not in d for d in deltas)


def test_special_tokens_skipped_or_kept(tokenizer):
    end, start = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|im_start|>")
    ids = [start] + tokenizer.encode("ok 🎉", add_special_tokens=False) + [end]
    for skip in (True, False):
        for chunks in ([[i] for i in ids], [ids]):
            got = "".join(stream(tokenizer, chunks, skip_special_tokens=skip))
            assert got == tokenizer.decode(ids, skip_special_tokens=skip)
    assert "".join(stream(tokenizer, [ids])) == "ok 🎉"


def test_incomplete_character_is_held_until_complete(tokenizer):
    raw = "🎉".encode()
    ids = tokenizer.encode("🎉", add_special_tokens=False)
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.step([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.step(ids[-1:]) == "🎉" == raw.decode()
    assert detok.output_ids == ids


def test_multi_token_step_ending_mid_character_emits_the_complete_part(tokenizer):
    head = tokenizer.encode("abc def", add_special_tokens=False)
    emoji = tokenizer.encode("🎉", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.step(head + emoji[:1]) == "abc def"  # speculative burst: 4+ tokens, last one partial
    assert detok.step(emoji[1:]) == "🎉"
    assert detok.flush() == ""


def test_flush_releases_truly_invalid_bytes_like_decode(tokenizer):
    ids = tokenizer.encode("ok🎉", add_special_tokens=False)[:-1]  # cut inside the emoji
    deltas = stream(tokenizer, [[i] for i in ids])
    assert deltas[-1].endswith(REPLACEMENT) and "".join(deltas) == tokenizer.decode(ids)


def test_prompt_context_keeps_the_leading_space_of_a_continuation(sp_tokenizer):
    prompt = sp_tokenizer.encode("The answer is", add_special_tokens=False)
    both = sp_tokenizer.encode("The answer is forty two", add_special_tokens=False)
    assert both[:len(prompt)] == prompt
    out = both[len(prompt):]
    alone = "".join(stream(sp_tokenizer, [[i] for i in out]))
    assert alone == sp_tokenizer.decode(out) == "forty two"  # decode() of the output alone drops the space
    with_ctx = "".join(stream(sp_tokenizer, [[i] for i in out], prompt_ids=prompt))
    assert with_ctx == " forty two"


# ----------------------------------------------------------------------------------------- stop strings

def test_stop_string_across_token_boundaries(tokenizer):
    text = "The answer is 42.\nUser: thanks"
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [tokenizer.decode([i]) for i in ids]
    assert "\nUser:" not in pieces and "\nUser" not in pieces  # the stop string spans several tokens
    ts = TextStream(tokenizer, stop=["\nUser:"])
    results = [ts.push([i]) for i in ids]
    stopped_at = next(k for k, r in enumerate(results) if r.stopped)
    assert all(r == ("", True, "\nUser:") for r in results[stopped_at + 1:])
    assert ts.text == "The answer is 42." and results[stopped_at].matched_stop == "\nUser:"
    assert all("\n" not in r.text for r in results)  # the held-back newline never leaked
    assert ts.finish() == ("", True, "\nUser:")


def test_stop_matching_is_independent_of_chunking():
    rng = random.Random(1)
    cases = [("abcabd", ["abd"]), ("xxabcd", ["abcd", "bc"]), ("hello world", ["wor", "o w"]),
             ("aaab", ["aab"]), ("no stop here", ["zzz"]), ("ends with a partial st", ["stop"]),
             ("one 🎉 two", ["🎉"]), ("prefix-ab", ["ab", "b"])]
    for text, stops in cases:
        expected = None
        for _ in range(20):
            m = StopStringMatcher(stops)
            cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(0, 4))))
            parts = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
            out, matched = "", None
            for p in parts:
                r = m.feed(p)
                out += r.text
                matched = r.matched_stop or matched
            if not m.stopped:
                out += m.flush()
            expected = expected or (out, matched)
            assert (out, matched) == expected, (text, stops, parts)
    # first stop to *end* wins; same end: the longer one
    assert StopStringMatcher(["abcd", "bc"]).feed("abcd") == ("a", True, "bc")
    assert StopStringMatcher(["ab", "b"]).feed("xab") == ("x", True, "ab")
    assert StopStringMatcher(["world", "o w"]).feed("hello world") == ("hell", True, "o w")


def test_stop_holdback_and_release():
    m = StopStringMatcher(["STOP"])
    assert m.feed("abc ST") == ("abc ", False, None)
    assert m.feed("OR") == ("STOR", False, None)  # was not the stop string after all
    assert m.feed("xS") == ("x", False, None)
    assert m.flush() == "S"  # finished for another reason: held text is plain output
    inc = StopStringMatcher(["</s>"], include_stop_str_in_output=True)
    assert inc.feed("a</") == ("a", False, None) and inc.feed("s>b") == ("</s>", True, "</s>")
    assert StopStringMatcher().feed("anything") == ("anything", False, None)
    with pytest.raises(ValueError):
        StopStringMatcher([""])


def test_text_stream_finish_without_stop(tokenizer):
    ids = tokenizer.encode("partial </st", add_special_tokens=False)
    ts = TextStream(tokenizer, stop=["</stop>"])
    emitted = "".join(ts.push([i]).text for i in ids)
    assert emitted == "partial " and ts.finish() == ("</st", False, None) and ts.text == "partial </st"


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
