"""Bad input never hurts the server: every case gets a 4xx OpenAI error envelope (never a 422, never a 500),
and the server keeps serving afterwards (/health and a good request)."""
from __future__ import annotations

import json

import pytest

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]


def chat_body(**fields) -> bytes:
    return json.dumps({"messages": MSG, "max_tokens": 2, **fields}).encode()


# (id, path, raw body, expected status, expected param or None)
CASES = [
    ("malformed-json", CHAT, b'{"messages": [', 400, None),
    ("trailing-garbage", CHAT, chat_body() + b"}", 400, None),
    ("not-an-object", CHAT, b"[1, 2, 3]", 400, None),
    ("empty-body", CHAT, b"", 400, None),
    ("nan-literal", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400, None),
    ("deeply-nested", CHAT, b"[" * 200_000 + b"]" * 200_000, 400, None),
    ("invalid-utf8", CHAT, b'{"messages": [{"role": "user", "content": "\xff\xfe\xc3"}]}', 400, None),
    ("missing-messages", CHAT, b'{"max_tokens": 2}', 400, "messages"),
    ("messages-not-a-list", CHAT, json.dumps({"messages": "hi"}).encode(), 400, "messages"),
    ("content-wrong-type", CHAT, json.dumps({"messages": [{"role": "user", "content": 5}]}).encode(), 400,
     "messages[0].content"),
    ("empty-messages", CHAT, chat_body(messages=[]), 400, "messages"),
    ("unknown-role", CHAT, chat_body(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages[0].role"),
    ("tool-role", CHAT, chat_body(messages=[{"role": "tool", "content": "hi"}]), 400, "messages[0].tool_call_id"),
    ("max-tokens-string", CHAT, chat_body(max_tokens="5"), 400, "max_tokens"),
    ("max-tokens-float", CHAT, chat_body(max_tokens=2.5), 400, "max_tokens"),
    ("max-tokens-negative", CHAT, chat_body(max_tokens=-1), 400, "max_tokens"),
    ("max-tokens-zero", CHAT, chat_body(max_tokens=0), 400, "max_tokens"),
    ("max-tokens-huge", CHAT, chat_body(max_tokens=10 ** 12), 400, "max_tokens"),
    ("max-tokens-past-context", CHAT, chat_body(max_tokens=2040), 400, "max_tokens"),
    ("prompt-longer-than-context", CHAT, chat_body(messages=[{"role": "user", "content": "hello " * 3000}]), 400,
     "messages"),
    ("n-zero", CHAT, chat_body(n=0), 400, "n"),
    ("n-huge", CHAT, chat_body(n=10_000), 400, "n"),
    ("temperature-negative", CHAT, chat_body(temperature=-0.5), 400, "temperature"),
    ("temperature-string", CHAT, chat_body(temperature="hot"), 400, "temperature"),
    ("top-p-zero", CHAT, chat_body(top_p=0), 400, "top_p"),
    ("stream-not-bool", CHAT, chat_body(stream="yes"), 400, "stream"),
    ("top-logprobs-without-logprobs", CHAT, chat_body(top_logprobs=2), 400, "top_logprobs"),
    ("top-logprobs-too-many", CHAT, chat_body(logprobs=True, top_logprobs=1000), 400, "top_logprobs"),
    ("stop-token-out-of-vocab", CHAT, chat_body(stop_token_ids=[10 ** 8]), 400, "stop_token_ids[0]"),
    ("logit-bias-out-of-vocab", CHAT, chat_body(logit_bias={"99999999": 5}), 400, "logit_bias"),
    ("logit-bias-by-text", CHAT, chat_body(logit_bias={"hello": 5}), 400, "logit_bias"),
    ("empty-stop-string", CHAT, chat_body(stop=[""]), 400, "stop"),
    ("tools-bad-schema", CHAT, chat_body(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}]), 400, "tools[0].function.parameters"),
    ("seed-too-big", CHAT, chat_body(seed=2 ** 70), 400, "seed"),
    ("lone-surrogate", CHAT, b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}', 400,
     None),
    ("unknown-model", CHAT, chat_body(model="gpt-17"), 404, "model"),
    ("prompt-empty-string", COMPLETIONS, json.dumps({"prompt": ""}).encode(), 400, "prompt"),
    ("prompt-empty-list", COMPLETIONS, json.dumps({"prompt": []}).encode(), 400, "prompt"),
    ("prompt-mixed-list", COMPLETIONS, json.dumps({"prompt": ["a", 1]}).encode(), 400, "prompt"),
    ("prompt-negative-id", COMPLETIONS, json.dumps({"prompt": [1, -1]}).encode(), 400, "prompt[1]"),
    ("prompt-id-out-of-vocab", COMPLETIONS, json.dumps({"prompt": [1, 10 ** 9]}).encode(), 400, "prompt[1]"),
    ("prompt-ids-too-long", COMPLETIONS, json.dumps({"prompt": [1] * 2048}).encode(), 400, "prompt"),
    ("echo-with-logprobs", COMPLETIONS, json.dumps({"prompt": "a", "echo": True, "logprobs": 1}).encode(), 400,
     "echo"),
    ("tokenize-neither", "/tokenize", b"{}", 400, "prompt"),
    ("detokenize-bad-ids", "/detokenize", json.dumps({"tokens": [-5]}).encode(), 400, "tokens[0]"),
]


def check_envelope(r, status: int, param) -> dict:
    assert r.status_code == status, r.text[:500]
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    if param is not None:
        assert error["param"] == param, error
    return error


@pytest.mark.parametrize("name,path,raw,status,param", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_an_envelope(http, name, path, raw, status, param):
    r = http.post(path, content=raw, headers={"Content-Type": "application/json"})
    check_envelope(r, status, param)


def test_context_messages_use_vllm_shapes(http):
    err = check_envelope(http.post(CHAT, content=chat_body(max_tokens=2040)), 400, "max_tokens")
    assert err["message"].startswith("'max_tokens' or 'max_completion_tokens' is too large: 2040.")
    assert "maximum context length is 2048 tokens" in err["message"]
    err = check_envelope(http.post(CHAT, content=chat_body(messages=[{"role": "user", "content": "hello " * 3000}])),
                         400, "messages")
    assert err["message"].startswith("This model's maximum context length is 2048 tokens. However, your request has")


def test_oversized_body_is_413(http):
    body = b'{"messages": [{"role": "user", "content": "' + b"x" * (10 << 20) + b'"}]}'
    error = check_envelope(http.post(CHAT, content=body), 413, None)
    assert error["code"] == "request_too_large"

    def chunked():  # no Content-Length: the cap applies while reading
        for _ in range(10):
            yield b" " * (1 << 20)

    check_envelope(http.post(CHAT, content=chunked()), 413, None)


def test_unknown_route_and_method(http):
    check_envelope(http.get("/v1/does-not-exist"), 404, None)
    check_envelope(http.put(CHAT, content=chat_body()), 405, None)


def test_server_keeps_serving_after_bad_input(http):
    for _, path, raw, _, _ in CASES:
        http.post(path, content=raw)
    assert http.get("/health").status_code == 200
    r = http.post(CHAT, json={"messages": MSG, "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    metrics = http.get("/metrics").text
    assert 'status="500"' not in metrics and 'status="422"' not in metrics
