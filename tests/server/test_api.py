"""The HTTP API against a live server, over plain httpx: routes, request fields, auth, admission (429), and
that speculation changes nothing a client can see (greedy text and the target model's logprobs)."""
from __future__ import annotations

import math
import threading
import time

import httpx
import pytest

from tests.server.conftest import PLAIN_API_KEY, PLAIN_MAX_QUEUE_LEN

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def chat(client: httpx.Client, messages=QUESTION, **fields) -> dict:
    defaults = {"temperature": 0} if "max_completion_tokens" in fields else {"temperature": 0, "max_tokens": 12}
    r = client.post("/v1/chat/completions", json={"messages": messages, **defaults, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def tokenize(client: httpx.Client, **body) -> list[int]:
    r = client.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_health_models_and_unknown_routes(http, server, model_name):
    assert server.saw_503_while_loading, "/health should answer 503 while the model loads"
    r = http.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    models = http.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [model_name]
    card = models["data"][0]
    assert card["max_model_len"] == 2048
    assert card["speculative_config"]["drafter"] == "ngram"
    assert http.get(f"/v1/models/{model_name}").json()["id"] == model_name
    r = http.get("/v1/models/not-a-model")
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = http.get("/v2/nothing-here")
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = http.get("/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_chat_response_shape_and_usage(http, model_name):
    body = chat(http)
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["model"] == model_name and isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["message"]["role"] == "assistant"
    assert "Paris" in choice["message"]["content"]
    assert choice["finish_reason"] in ("stop", "length")
    prompt_ids = tokenize(http, messages=QUESTION)
    usage = body["usage"]
    assert usage["prompt_tokens"] == len(prompt_ids)
    assert 0 < usage["completion_tokens"] <= 12
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_completion_prompt_forms_agree(http):
    text = "The first three planets from the sun are"
    ids = tokenize(http, prompt=text)
    assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"] == text
    common = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    as_text = http.post("/v1/completions", json={"prompt": text, **common}).json()
    as_ids = http.post("/v1/completions", json={"prompt": ids, **common}).json()
    assert as_text["choices"][0]["text"] == as_ids["choices"][0]["text"]
    assert as_text["usage"]["prompt_tokens"] == len(ids)
    batch = http.post("/v1/completions", json={"prompt": [text, "Two plus two is"], "n": 2, **common}).json()
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2, 3]
    assert batch["choices"][0]["text"] == batch["choices"][1]["text"] == as_text["choices"][0]["text"]
    assert batch["usage"]["completion_tokens"] == 4 * 6
    assert batch["usage"]["prompt_tokens"] == len(ids) + len(tokenize(http, prompt="Two plus two is"))
    ids_batch = http.post("/v1/completions", json={"prompt": [ids, ids[:3]], **common}).json()
    assert ids_batch["choices"][0]["text"] == as_text["choices"][0]["text"]
    echo = http.post("/v1/completions", json={"prompt": text, "echo": True, **common}).json()
    assert echo["choices"][0]["text"] == text + as_text["choices"][0]["text"]


def test_length_stop_token_and_max_completion_tokens(http):
    body = chat(http, max_completion_tokens=3, ignore_eos=True)
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 3
    full = chat(http, max_tokens=8, ignore_eos=True, logprobs=True)
    ids = tokenize(http, prompt="".join(t["token"] for t in full["choices"][0]["logprobs"]["content"]))
    stop_id = ids[2]
    stopped = chat(http, max_tokens=8, ignore_eos=True, stop_token_ids=[stop_id])
    choice = stopped["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop_id
    assert stopped["usage"]["completion_tokens"] == ids.index(stop_id) + 1


def test_logit_bias_and_penalties(http):
    (target,) = tokenize(http, prompt=" banana")
    body = chat(http, max_tokens=4, ignore_eos=True, logit_bias={str(target): 100})
    assert body["choices"][0]["message"]["content"] == " banana" * 4
    # a greedy continuation that repeats a word; each penalty alone must cut the repetition
    repeat = {"prompt": "hello hello hello hello hello hello hello hello", "max_tokens": 10, "ignore_eos": True,
              "temperature": 0}

    def hellos(**penalty) -> int:
        r = http.post("/v1/completions", json={**repeat, **penalty})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"].count("hello")

    base = hellos()
    assert base >= 2
    for penalty in ({"repetition_penalty": 1.5}, {"presence_penalty": 1.5}, {"frequency_penalty": 1.5}):
        assert hellos(**penalty) < base, penalty
    assert chat(http, max_tokens=2, top_k=5, top_p=0.9, min_p=0.05, temperature=0.7, seed=1,
                user="someone")["usage"]["completion_tokens"] >= 1


def test_unsupported_and_unknown_fields(http):
    r = http.post("/v1/chat/completions", json={"messages": QUESTION, "tools": [{"type": "function"}]})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("tools"), r.text  # no function
    r = http.post("/v1/chat/completions", json={"messages": QUESTION, "guided_json": {"type": "object"}})
    assert r.status_code == 400 and "guided_json" in r.json()["error"]["message"]
    # neutral values of known fields and unknown extras are accepted
    assert chat(http, max_tokens=1, response_format={"type": "text"}, some_future_field=1)["choices"]


def test_speculation_is_invisible_to_clients(http, plain_http):
    """Greedy text and the target model's logprobs are the same with the n-gram drafter on and off."""
    messages = [{"role": "user", "content": "Count from one to ten in words: one, two, three,"}]
    spec = chat(http, messages, max_tokens=16, ignore_eos=True, logprobs=True, top_logprobs=2)
    plain = chat(plain_http, messages, max_tokens=16, ignore_eos=True, logprobs=True, top_logprobs=2)
    assert spec["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
    for a, b in zip(spec["choices"][0]["logprobs"]["content"], plain["choices"][0]["logprobs"]["content"],
                    strict=True):
        assert a["token"] == b["token"]
        assert math.isclose(a["logprob"], b["logprob"], abs_tol=2e-3), (a, b)
        assert [t["token"] for t in a["top_logprobs"]] == [t["token"] for t in b["top_logprobs"]]


def test_api_key(plain_server):
    url = plain_server.base_url
    body = {"messages": QUESTION, "max_tokens": 1}
    assert httpx.post(url + "/v1/chat/completions", json=body).status_code == 401
    for header in (f"Bearer {PLAIN_API_KEY}x", "Bearer", PLAIN_API_KEY, f"Basic {PLAIN_API_KEY}"):
        r = httpx.post(url + "/v1/chat/completions", json=body, headers={"Authorization": header})
        assert r.status_code == 401, header
        assert r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(url + "/v1/models").status_code == 401
    assert httpx.post(url + "/tokenize", json={"prompt": "x"}).status_code == 401
    ok = httpx.post(url + "/v1/chat/completions", json=body, headers=plain_server.headers, timeout=60)
    assert ok.status_code == 200
    assert httpx.get(url + "/health").status_code == 200  # probes and scrapes stay open
    assert httpx.get(url + "/metrics").status_code == 200
    with open(f"/proc/{plain_server.proc.pid}/cmdline", "rb") as f:  # the key came through DDTREE_API_KEY
        assert PLAIN_API_KEY.encode() not in f.read()


def test_queue_full_is_429(plain_server, plain_http):
    """PLAIN_MAX_QUEUE_LEN engine requests in flight (one request with n = the limit): the next gets 429."""
    body = {"messages": QUESTION, "max_tokens": 200, "ignore_eos": True, "temperature": 0, "stream": True,
            "n": PLAIN_MAX_QUEUE_LEN}
    with httpx.Client(base_url=plain_server.base_url, headers=plain_server.headers, timeout=60) as holder:
        with holder.stream("POST", "/v1/chat/completions", json=body) as stream:
            assert stream.status_code == 200
            lines = stream.iter_lines()  # keep a reference: a discarded iterator closes the connection
            next(lines)  # the stream has started: all its choices are in the engine
            r = plain_http.post("/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 1})
            assert r.status_code == 429, r.text
            assert r.json()["error"]["type"] == "rate_limit_error"
    # the stream's choices are aborted once the server sees the disconnect; then admission opens again
    deadline = time.monotonic() + 5
    while (r := plain_http.post("/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 1})
           ).status_code == 429:
        assert time.monotonic() < deadline, "admission did not reopen after the stream closed"
        time.sleep(0.05)
    assert r.status_code == 200, r.text
    # a request that could never fit the limit is a 400 (a 429 would invite useless retries)
    r = plain_http.post("/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 1,
                                                      "n": PLAIN_MAX_QUEUE_LEN + 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


def test_concurrent_mixed_requests_keep_their_own_output(http):
    """Requests of different kinds in flight at once do not leak into each other."""
    prompts = ["Name a color.", "Name an animal.", "Name a fruit."]
    alone = [chat(http, [{"role": "user", "content": p}], max_tokens=8)["choices"][0]["message"]["content"]
             for p in prompts]
    results: dict[int, str] = {}

    def worker(i: int) -> None:
        with httpx.Client(base_url=str(http.base_url), timeout=120) as c:
            results[i] = chat(c, [{"role": "user", "content": prompts[i % 3]}], max_tokens=8)[
                "choices"][0]["message"]["content"]

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[i] for i in range(6)] == alone * 2


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
def test_tokenizer_routes_validate(http, path):
    r = http.post(path, json={"tokens": [10 ** 9]} if path == "/detokenize" else {"prompt": 5})
    assert r.status_code == 400 and "error" in r.json()


def test_kv_cache_sizing_then_engine_death(tmp_path):
    """A KV cache that cannot hold one max_model_len request fails at startup (exit 1, the log names the flags
    to change). A cache that can admits a request without max_tokens, which runs to the end of its context.
    After the engine process is killed, /health and generation answer 503 envelopes, then the server exits
    with status 1 (for its orchestrator to restart it; tests/server/test_failures.py has the details)."""
    import os
    import signal

    from tests.server.conftest import engine_pid, start_server, stop_server

    small = "--kv-cache-memory", "32M"  # ~720 tokens of SmolLM2 KV
    with pytest.raises(pytest.fail.Exception, match="--max-model-len"):
        start_server(tmp_path, "too-small", "--drafter", "none", *small)
    s = start_server(tmp_path, "doomed", "--drafter", "none", *small, "--max-model-len", "96")
    try:
        r = httpx.post(s.base_url + "/v1/chat/completions", json={"messages": QUESTION, "ignore_eos": True},
                       timeout=120)  # no max_tokens: up to the end of the 96-token context
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] == 96
        assert r.json()["choices"][0]["finish_reason"] == "length"
        os.kill(engine_pid(s), signal.SIGKILL)
        deadline = time.monotonic() + 10
        while (r := httpx.get(s.base_url + "/health")).status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert "engine" in r.json()["error"]["message"]
        r = httpx.post(s.base_url + "/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 1})
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable_error"
        assert s.proc.wait(timeout=30) == 1, s.log_tail()
    finally:
        stop_server(s)
