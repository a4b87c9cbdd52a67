"""Server-sent events as raw bytes: framing line by line, chunk order (role, content, finish, usage, [DONE]),
errors before the stream starts, UTF-8-safe deltas, 64 concurrent streams that each produce what they
produce alone, and aborts on client disconnect (streaming and not) that free KV within a second."""
from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

CHAT = "/v1/chat/completions"


def sse_events(raw: str) -> list[str]:
    """Splits a complete SSE body into its `data:` payloads, checking the framing of every line."""
    assert raw.endswith("\n\n"), repr(raw[-40:])
    events = raw[:-2].split("\n\n")
    payloads = []
    for event in events:
        lines = event.split("\n")
        assert len(lines) == 1 and lines[0].startswith("data: "), repr(event)
        payloads.append(lines[0][len("data: "):])
    return payloads


def post_stream(http: httpx.Client, path: str, body: dict) -> tuple[httpx.Response, list[str]]:
    with http.stream("POST", path, json=body) as r:
        raw = r.read().decode("utf-8")
    return r, sse_events(raw) if r.status_code == 200 else [raw]


def test_chat_sse_framing_and_order(http, model_name):
    body = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    r, payloads = post_stream(http, CHAT, body)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    assert payloads[-1] == "[DONE]" and "[DONE]" not in payloads[:-1]
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == model_name and
               isinstance(c["created"], int) for c in chunks)
    role, *content, finish, usage = chunks
    assert role["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None, "stop_reason": None}]
    assert content and all(c["choices"][0]["delta"].keys() == {"content"} and c["choices"][0]["delta"]["content"]
                           and c["choices"][0]["finish_reason"] is None for c in content)
    assert finish["choices"][0]["delta"] == {} and finish["choices"][0]["finish_reason"] in ("stop", "length")
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] >= len(content)
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + usage["usage"]["completion_tokens"]
    text = "".join(c["choices"][0]["delta"]["content"] for c in content)
    full = http.post(CHAT, json={**body, "stream": False, "stream_options": None}).json()
    assert text == full["choices"][0]["message"]["content"]
    assert usage["usage"] == full["usage"]


def test_completion_sse_framing(http):
    body = {"prompt": ["Once upon a time", "In a galaxy"], "max_tokens": 5, "temperature": 0, "stream": True,
            "ignore_eos": True}
    r, payloads = post_stream(http, "/v1/completions", body)
    assert r.status_code == 200 and payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert all(c["object"] == "text_completion" and len(c["choices"]) == 1 for c in chunks)
    texts, finishes = {0: "", 1: ""}, {}
    for c in chunks:
        choice = c["choices"][0]
        assert choice["index"] not in finishes, "nothing may follow a choice's finish chunk"
        texts[choice["index"]] += choice["text"]
        if choice["finish_reason"]:
            finishes[choice["index"]] = choice["finish_reason"]
    assert finishes == {0: "length", 1: "length"}
    full = http.post("/v1/completions", json={**body, "stream": False}).json()
    assert [texts[0], texts[1]] == [c["text"] for c in full["choices"]]


def test_errors_come_before_the_stream(http):
    too_long = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000, "stream": True}
    r = http.post(CHAT, json=too_long)
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")
    assert r.json()["error"]["param"] == "max_tokens"
    r = http.post(CHAT, json={"messages": [{"role": "user", "content": "hi"}], "stream_options":
                              {"include_usage": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"


def test_utf8_deltas_are_whole_characters(http):
    body = {"messages": [{"role": "user", "content": "Write the word 'thank you' in Japanese, Chinese and "
                                                     "Korean, and add a smiley emoji."}],
            "max_tokens": 40, "temperature": 0, "stream": True}
    r, payloads = post_stream(http, CHAT, body)
    deltas = [json.loads(p)["choices"][0]["delta"].get("content") or "" for p in payloads[:-1]]
    text = "".join(deltas)
    assert "\ufffd" not in text and any(ord(ch) > 0x2E80 for ch in text), text
    full = http.post(CHAT, json={**body, "stream": False}).json()["choices"][0]["message"]["content"]
    assert text == full


def test_64_concurrent_streams_match_their_solo_output(server):
    """64 streams at once (8 prompts x 8 copies), greedy: each equals its prompt's output when run alone."""
    prompts = [f"Give me one word that rhymes with {w}." for w in
               ("cat", "tree", "blue", "light", "rain", "stone", "fire", "moon")]

    async def one(client: httpx.AsyncClient, prompt: str) -> str:
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 16, "temperature": 0,
                "stream": True}
        async with client.stream("POST", CHAT, json=body) as r:
            assert r.status_code == 200
            raw = (await r.aread()).decode()
        payloads = sse_events(raw)
        assert payloads[-1] == "[DONE]"
        return "".join(json.loads(p)["choices"][0]["delta"].get("content") or "" for p in payloads[:-1]
                       if json.loads(p)["choices"])

    async def main() -> tuple[list[str], list[str]]:
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=300, limits=limits) as client:
            t0 = time.monotonic()
            together = await asyncio.gather(*(one(client, prompts[i % 8]) for i in range(64)))
            print(f"64 concurrent streams: {time.monotonic() - t0:.1f} s")
            alone = [await one(client, p) for p in prompts]
        return together, alone

    together, alone = asyncio.run(main())
    mismatches = [(i, together[i], alone[i % 8]) for i in range(64) if together[i] != alone[i % 8]]
    assert not mismatches, mismatches[:5]
    assert all(alone)


def scheduler_gauges(http: httpx.Client) -> dict[str, float]:
    wanted = {"ddtree:kv_cache_usage_perc", "ddtree:num_requests_running", "ddtree:num_requests_waiting"}
    out = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        if family.name in wanted:
            out[family.name] = family.samples[0].value
    return out


def wait_until_idle(http: httpx.Client, within_s: float) -> float:
    t0 = time.monotonic()
    while True:
        g = scheduler_gauges(http)
        if g["ddtree:kv_cache_usage_perc"] == 0 and g["ddtree:num_requests_running"] == 0 and \
                g["ddtree:num_requests_waiting"] == 0:
            return time.monotonic() - t0
        if time.monotonic() - t0 > within_s:
            pytest.fail(f"KV not freed within {within_s} s of the disconnect: {g}")
        time.sleep(0.02)


LONG = {"messages": [{"role": "user", "content": "Tell me a very long story about a dragon."}],
        "max_tokens": 1000, "ignore_eos": True, "temperature": 0}


def abort_count(http: httpx.Client) -> float:
    for family in text_string_to_metric_families(http.get("/metrics").text):
        if family.name == "ddtree:request_success":
            return sum(s.value for s in family.samples if s.labels["finished_reason"] == "abort")
    raise AssertionError("no request_success metric")


def test_stream_disconnect_frees_kv(http, server):
    aborts = abort_count(http)
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        with client.stream("POST", CHAT, json={**LONG, "stream": True}) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]  # role chunk + some content, with blank separators
            assert any('"content"' in line for line in got)
            assert scheduler_gauges(http)["ddtree:kv_cache_usage_perc"] > 0
    wait_until_idle(http, within_s=1.0)
    assert abort_count(http) == aborts + 1


def test_non_stream_disconnect_frees_kv(http, server):
    """A raw socket, so the test closes the connection exactly when the request is running in the engine."""
    aborts = abort_count(http)
    body = json.dumps(LONG).encode()
    host, port = server.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 60
        while scheduler_gauges(http)["ddtree:num_requests_running"] < 1:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.02)
    wait_until_idle(http, within_s=1.0)
    assert abort_count(http) == aborts + 1


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_ends_the_engine_request(http, stream):
    """A stop string ends a request the engine would otherwise continue: it must be aborted there too."""
    head = http.post(CHAT, json={**LONG, "max_tokens": 8}).json()["choices"][0]["message"]["content"]
    stop = head.split()[2]
    body = {**LONG, "stop": [stop], "stream": stream}
    if stream:
        r, payloads = post_stream(http, CHAT, body)
        chunks = [json.loads(p) for p in payloads[:-1]]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        finish = chunks[-1]["choices"][0]["finish_reason"]
    else:
        choice = http.post(CHAT, json=body).json()["choices"][0]
        text, finish = choice["message"]["content"], choice["finish_reason"]
    assert finish == "stop" and text == head[:head.index(stop)]
    wait_until_idle(http, within_s=1.0)
