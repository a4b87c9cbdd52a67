"""server/tokenizer.py: the HTTP process's torch-free tokenizer (`tokenizers` + `jinja2`) encodes, decodes and
renders chat templates exactly as the engine's transformers tokenizer does (byte-level BPE with ChatML, Metaspace
with byte fallback, the embedded SmolLM2); --chat-template; logprob token strings/bytes (the detokenizer and stop
strings live in the engine: tests/engine/test_detokenizer.py)."""
from __future__ import annotations

import pytest

from server.errors import ProtocolError, error_response
from server.requests import ChatCompletionRequest
from server.tokenizer import (ChatTemplateError, LogprobFormatter, TextOffset, encode_chat, encode_prompt,
                              load_chat_template, render_chat)

MULTIBYTE = "Hello, wörld! 你好 🎉"
TEXTS = [MULTIBYTE, "def f(x):\n    return x  # naïve café\n", "日本語のテキスト、そして絵文字 👩‍👩‍👧 ok",
         "e\u0301 combining, ß, Ωmega, \u00a0nbsp", "tabs\tand  double  spaces   ",
         "🎉🎉🎉x🎉", " leading space", "", "<|im_start|>user\nhi<|im_end|>\n", "<s> a </s><unk>", "<0x41> ▁x"]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": MULTIBYTE},
     {"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "  spaces \n and lines \n"}],
]
# Every feature transformers gives a chat template: trim_blocks/lstrip_blocks, loopcontrols, tojson (no HTML
# escaping), the special tokens as variables, kwargs, {% generation %} and namespace().
FEATURES = """{{ bos_token }}{% set ns = namespace(n=0) %}
    {% for m in messages %}
        {% if m['role'] == 'system' %}{% continue %}{% endif %}
        {% set ns.n = ns.n + 1 %}
{{ m['role'] | upper }}: {{ m['content'] | trim }}{{ eos_token }}
        {% if loop.index > 3 %}{% break %}{% endif %}
    {% endfor %}
{{ {"n": ns.n, "html": "<a href='x'>&</a>", "u": "ö"} | tojson }}{{ messages | tojson(indent=2) }}
{% generation %}{{ extra | default('none') }}{% endgeneration %}
{% if add_generation_prompt %}ASSISTANT:{% endif %}"""


@pytest.fixture(scope="module")
def all_pairs(tokenizer, server_tokenizer, sp_tokenizer, server_sp_tokenizer, smollm2_tokenizers):
    """name -> (transformers tokenizer, server tokenizer)."""
    return {"bpe": (tokenizer, server_tokenizer), "sp": (sp_tokenizer, server_sp_tokenizer),
            "smollm2": smollm2_tokenizers}


# ------------------------------------------------------------------------------ equal to transformers

def test_encode_and_decode_equal_transformers(all_pairs):
    for name, (hf, tok) in all_pairs.items():
        for text in TEXTS:
            for special in (True, False):
                assert tok.encode(text, special) == hf.encode(text, add_special_tokens=special), (name, text)
                assert encode_prompt(tok, text, add_special_tokens=special) == tok.encode(text, special)
            ids = hf.encode(text)
            for skip in (True, False):
                assert tok.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip), (name, text, skip)
        assert tok.special_tokens_map == hf.special_tokens_map, name


def test_chat_templates_render_as_transformers(all_pairs):
    for name, (hf, tok) in all_pairs.items():
        if not hf.chat_template:
            assert tok.chat_template is None, name
            continue
        assert tok.chat_template == hf.chat_template, name
        for chat in CHATS:
            for generation_prompt in (True, False):
                expect = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=generation_prompt)
                assert render_chat(tok, chat, add_generation_prompt=generation_prompt) == expect, (name, chat)
                ids = hf.encode(expect, add_special_tokens=False)
                assert encode_chat(tok, chat, add_generation_prompt=generation_prompt) == ids, name


def test_every_template_feature_renders_as_transformers(all_pairs, monkeypatch):
    for name, (hf, tok) in all_pairs.items():
        monkeypatch.setattr(tok, "chat_template", FEATURES)
        for chat in CHATS:
            for kwargs in ({}, {"extra": "<x>"}, {"bos_token": "[OVERRIDDEN]"}):
                expect = hf.apply_chat_template(chat, chat_template=FEATURES, tokenize=False,
                                                add_generation_prompt=True, **kwargs)
                assert render_chat(tok, chat, chat_template_kwargs=kwargs) == expect, (name, kwargs)
        stamp = "{{ strftime_now('%Y') }}"
        monkeypatch.setattr(tok, "chat_template", stamp)
        assert render_chat(tok, CHATS[0]) == hf.apply_chat_template(CHATS[0], chat_template=stamp, tokenize=False)


def test_logprob_formatter_inputs_equal_transformers_over_the_whole_vocabulary(all_pairs):
    """LogprobFormatter reads only the decoder's kind, the added tokens, id -> token and the decode of one id:
    equal inputs for every id mean the same token strings and bytes as with the transformers tokenizer."""
    for name, (hf, tok) in all_pairs.items():
        assert repr(tok.backend.decoder) == repr(hf.backend_tokenizer.decoder), name
        assert tok.added_tokens() == {i: t.content for i, t in hf.added_tokens_decoder.items()}, name
        size = hf.backend_tokenizer.get_vocab_size(with_added_tokens=True)
        ids = range(size + 2)  # and two ids past the vocabulary
        assert [tok.id_to_token(i) for i in ids] == hf.convert_ids_to_tokens(list(ids)), name
        assert [tok.decode([i]) for i in ids] == [hf.decode([i]) for i in ids], name


# --------------------------------------------------------------------------------------- chat template

def test_render_chat_chatml(server_tokenizer):
    tok = server_tokenizer
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": MULTIBYTE}]
    text = render_chat(tok, msgs)
    assert text == f"<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n{MULTIBYTE}<|im_end|>\n" \
                   "<|im_start|>assistant\n"
    assert render_chat(tok, msgs, add_generation_prompt=False).endswith("<|im_end|>\n")
    ids = encode_chat(tok, msgs)
    assert ids == tok.encode(text, add_special_tokens=False) and isinstance(ids, list)
    assert ids[0] == tok.backend.token_to_id("<|im_start|>") and tok.decode(ids) == text
    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "developer", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]})
    rendered = render_chat(tok, req.messages)
    assert rendered.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi")
    assert encode_prompt(tok, "hi") == tok.encode("hi")


def test_chat_template_kwargs_reach_the_template(server_tokenizer, monkeypatch):
    monkeypatch.setattr(server_tokenizer, "chat_template", "{{ messages[0]['content'] }}{% if shout %}!{% endif %}")
    assert render_chat(server_tokenizer, [{"role": "user", "content": "a"}], chat_template_kwargs={"shout": True}) \
        == "a!"
    with pytest.raises(ChatTemplateError) as info:
        render_chat(server_tokenizer, [{"role": "user", "content": "a"}], chat_template_kwargs={"tokenize": True})
    assert info.value.param == "chat_template_kwargs"


def test_template_failures_are_client_errors(server_tokenizer, monkeypatch):
    tok = server_tokenizer
    monkeypatch.setattr(tok, "chat_template",
                        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('roles must alternate') }}"
                        "{% endif %}{{ messages[0]['content'] }}")
    with pytest.raises(ChatTemplateError) as info:
        render_chat(tok, [{"role": "assistant", "content": "x"}])
    err = error_response(info.value)
    assert err.status_code == 400 and err.error.param == "messages" and "roles must alternate" in err.error.message
    assert isinstance(info.value, ProtocolError)
    for bad in ("{{ messages[0]['content'] | nosuchfilter }}", "{{ messages.__class__.__mro__ }}{{ ''.join }}",
                "{% set _ = messages.append(1) %}"):  # unknown filter; the sandbox: no attributes, no mutation
        monkeypatch.setattr(tok, "chat_template", bad)
        with pytest.raises(ChatTemplateError):
            render_chat(tok, [{"role": "user", "content": "x"}])
    monkeypatch.setattr(tok, "chat_template", None)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        encode_chat(tok, [{"role": "user", "content": "x"}])


def test_chat_template_flag_reads_a_file_or_an_inline_template(tmp_path, server_tokenizer):
    from engine.config import EngineConfig
    from engine.messages import Ready
    from server.cli import parser, serve_configs
    from server.config import ServerConfig
    from server.state import ServerState

    path = tmp_path / "template.jinja"
    path.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    assert load_chat_template(str(path)) == path.read_text()
    inline = "{% for m in messages %}<{{ m['content'] }}>\\n{% endfor %}ö"  # escapes decoded, as vLLM does
    assert load_chat_template(inline) == "{% for m in messages %}<{{ m['content'] }}>\n{% endfor %}ö"
    with pytest.raises(ValueError, match="looks like a file path"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="not a valid Jinja template"):
        load_chat_template("{% for m in messages %}")
    server, _ = serve_configs(parser().parse_args(["serve", "--chat-template", str(path)]))
    assert server.chat_template == str(path)
    with pytest.raises(ValueError, match="looks like a file path"):
        serve_configs(parser().parse_args(["serve", "--chat-template", "nope.jinja"]))
    ready = Ready(100, 64, (0,), 8, 16, tokenizer_dir=server_tokenizer.folder)  # what the engine sends
    for flag in (str(path), path.read_text()):
        tok = ServerState(ServerConfig(chat_template=flag), EngineConfig())._load_tokenizer(ready)
        assert render_chat(tok, CHATS[0]) == "[user] What is the capital of France?\n"
    tok = ServerState(ServerConfig(), EngineConfig())._load_tokenizer(ready)
    assert tok.chat_template == server_tokenizer.chat_template


# --------------------------------------------------------------------------------------------- logprobs

def test_token_bytes_reassemble_the_text(server_tokenizer, server_sp_tokenizer):
    for tok in (server_tokenizer, server_sp_tokenizer):
        fmt = LogprobFormatter(tok)
        for text in TEXTS[:6]:
            ids = tok.encode(text, add_special_tokens=False)
            joined = b"".join(fmt.token_bytes(i) for i in ids)
            expect = text.encode() if tok is server_tokenizer else (" " + text).encode()  # Metaspace: a space
            assert joined == expect, text


def test_token_strings_for_partial_characters_and_specials(server_tokenizer, server_sp_tokenizer):
    tok, sp_tok = server_tokenizer, server_sp_tokenizer
    fmt = LogprobFormatter(tok)
    ids = tok.encode("🎉", add_special_tokens=False)
    first = fmt.token_str(ids[0])
    assert first.startswith("bytes:\\x") and bytes(fmt.chat_logprobs([ids[0]], [-1.0])[0].bytes) == \
        fmt.token_bytes(ids[0])
    end = tok.backend.token_to_id("<|im_end|>")
    assert fmt.token_str(end) == "<|im_end|>" and fmt.token_bytes(end) == b"<|im_end|>"
    sp = LogprobFormatter(sp_tok)
    byte_tok = sp_tok.backend.token_to_id("<0xE4>")
    assert sp.token_bytes(byte_tok) == b"\xe4" and sp.token_str(byte_tok) == "bytes:\\xe4"
    word = sp_tok.encode("hello world", add_special_tokens=False)
    assert "".join(sp.token_str(i) for i in word) == " hello world"


def test_chat_and_completion_logprob_shapes(server_tokenizer):
    tok = server_tokenizer
    fmt = LogprobFormatter(tok)
    ids = tok.encode("a 你", add_special_tokens=False)
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


def test_the_engines_export_is_cached_per_checkpoint_state(tokenizer, tmp_path):
    import os

    from engine.tokenizer_export import export_tokenizer

    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer.json").write_text("{}")
    (model / "model.safetensors").write_text("weights are not part of the key")
    first = export_tokenizer(tokenizer, str(model), cache_root=str(tmp_path))
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= set(os.listdir(first))
    stamp = os.stat(os.path.join(first, "tokenizer.json")).st_mtime_ns
    (model / "model.safetensors").write_text("new weights, same tokenizer")
    assert export_tokenizer(tokenizer, str(model), cache_root=str(tmp_path)) == first
    assert os.stat(os.path.join(first, "tokenizer.json")).st_mtime_ns == stamp  # not written again
    (model / "tokenizer.json").write_text("{ }")
    assert export_tokenizer(tokenizer, str(model), cache_root=str(tmp_path)) != first
    assert export_tokenizer(None, str(model), cache_root=str(tmp_path)) is None
    assert not [n for n in os.listdir(tmp_path / "tokenizers") if n.startswith(".tmp-")]
