"""engine/detokenizer.py: incremental detokenization (checked against tokenizer.decode of all ids, for a
byte-level BPE and a Metaspace/byte-fallback tokenizer) and stop strings across token boundaries."""
from __future__ import annotations

import random

import pytest

from engine.detokenizer import Detokenizer, OutputText, StopStringMatcher
from tests.server.conftest import build_byte_level_tokenizer, build_sentencepiece_style_tokenizer

REPLACEMENT = "\ufffd"
MULTIBYTE = "Hello, wörld! 你好 🎉"
TEXTS = [MULTIBYTE, "def f(x):\n    return x  # naïve café\n", "日本語のテキスト、そして絵文字 👩‍👩‍👧 ok",
         "e\u0301 combining, ß, Ωmega, \u00a0nbsp", "tabs\tand  double  spaces   ",
         "🎉🎉🎉x🎉"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_byte_level_tokenizer(str(tmp_path_factory.mktemp("bpe-tokenizer")))


@pytest.fixture(scope="module")
def sp_tokenizer():
    return build_sentencepiece_style_tokenizer()


def random_chunks(rng: random.Random, ids: list[int]) -> list[list[int]]:
    chunks, i = [], 0
    while i < len(ids):
        n = rng.choice([1, 1, 1, 2, 3, 5])
        chunks.append(ids[i:i + n])
        i += n
    return chunks


def stream(tok, chunks, batched: bool = False, **kw) -> list[str]:
    """One delta per chunk (a speculative step commits several tokens at once), then the flush. batched: each
    chunk goes to step() as one list (one Rust call), as the scheduler does without stop strings."""
    detok = Detokenizer(tok, **kw)
    deltas = [detok.step(list(chunk)) if batched else "".join(detok.step(i) for i in chunk) for chunk in chunks]
    assert detok.output_ids == [i for chunk in chunks for i in chunk]
    return deltas + [detok.flush()]


def test_multibyte_one_token_at_a_time_equals_decode(tokenizer):
    ids = tokenizer.encode(MULTIBYTE, add_special_tokens=False)
    assert any(REPLACEMENT in tokenizer.decode([i]) for i in ids)  # the case under test really occurs
    deltas = stream(tokenizer, [[i] for i in ids])
    assert "".join(deltas) == tokenizer.decode(ids) == MULTIBYTE
    assert all(REPLACEMENT not in d for d in deltas)  # never a broken character


def test_random_chunkings_equal_decode_for_both_tokenizer_styles(tokenizer, sp_tokenizer):
    """Random chunkings, each chunk pushed token by token or as one list: the deltas concatenate to decode."""
    rng = random.Random(0)
    for tok in (tokenizer, sp_tokenizer):
        for text in TEXTS:
            ids = tok.encode(text, add_special_tokens=False)
            for i in range(16):  # token by token and, every other time, a chunk per call
                deltas = stream(tok, random_chunks(rng, ids), batched=i % 2 == 1)
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
    ids = tokenizer.encode("🎉", add_special_tokens=False)
    assert len(ids) > 1
    detok = Detokenizer(tokenizer)
    assert [detok.step(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.step(ids[-1]) == "🎉"
    assert detok.output_ids == ids and detok.flush() == ""


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


def test_stop_string_across_token_boundaries(tokenizer):
    text = "The answer is 42.\nUser: thanks"
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [tokenizer.decode([i]) for i in ids]
    assert "\nUser:" not in pieces and "\nUser" not in pieces  # the stop string spans several tokens
    out = OutputText(tokenizer, stop=["\nUser:"])
    results = [out.push(i) for i in ids]
    stopped_at = next(k for k, r in enumerate(results) if r.stopped)
    assert all(r == ("", True, "\nUser:") for r in results[stopped_at + 1:])
    assert out.text == "The answer is 42." and results[stopped_at].matched_stop == "\nUser:"
    assert all("\n" not in r.text for r in results)  # the held-back newline never leaked
    assert out.finish() == ("", True, "\nUser:")
    assert out.take() == "The answer is 42." and out.take() == ""


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


def test_output_text_finish_without_stop(tokenizer):
    ids = tokenizer.encode("partial </st", add_special_tokens=False)
    out = OutputText(tokenizer, stop=["</stop>"])
    emitted = "".join(out.push(i).text for i in ids)
    assert emitted == "partial " and out.finish() == ("</st", False, None) and out.text == "partial </st"


@pytest.mark.parametrize("drafter", ["none", "ngram"])
def test_engine_stops_at_a_stop_string_and_frees_the_request(tiny_checkpoints, tokenizer, tmp_path, drafter):
    """LLM.generate honours stop strings: the engine matches them in its own detokenized text (also inside a
    multi-token speculative step), cuts the text before the stop string, keeps the tokens up to the one that
    completed it, reports the string as stop_reason, and frees the request's KV blocks at once."""
    import shutil

    from engine import LLM, SamplingParams

    folder, _ = tiny_checkpoints("llama")
    model = str(tmp_path / "with-tokenizer")
    shutil.copytree(folder, model)
    tokenizer.save_pretrained(model)  # a 2048-id tokenizer for a 1000-id model: every emitted id decodes
    llm = LLM(model, dtype="fp32", drafter=drafter, spec_budget=8)
    prompt = [11, 12, 13, 11, 12, 13, 11, 12]
    free = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    (full,) = llm.generate([prompt], free)
    text = full.text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert len(stop) == 3 and text.find(stop) > 0
    (cut,) = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop]))
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == text[:text.find(stop)]
    assert full.token_ids[:len(cut.token_ids)] == cut.token_ids
    assert stop in tokenizer.decode(cut.token_ids) and stop not in tokenizer.decode(cut.token_ids[:-1])
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks and not llm.engine.requests
