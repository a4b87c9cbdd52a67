"""Graceful drain: on SIGTERM /health turns 503 and new requests get a 503 envelope while an open stream runs
to its end; then the process exits 0 (what Kubernetes' terminationGracePeriod relies on). What outlives
--drain-timeout is cut at that one deadline, each stream with an error event then [DONE]."""
from __future__ import annotations

import json
import signal
import threading
import time

import httpx

from tests.server.conftest import start_server, stop_server


def test_sigterm_drains_open_stream_then_exits_zero(tmp_path):
    server = start_server(tmp_path, "drain", "--drafter", "none", "--drain-timeout", "60")
    try:
        body = {"prompt": "Count: 1, 2, 3,", "max_tokens": 48, "temperature": 0, "ignore_eos": True, "stream": True}
        events, first = [], threading.Event()

        def stream():
            with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        first.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first.wait(60), server.log_tail()
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        health = httpx.get(server.base_url + "/health", timeout=10)
        late = httpx.post(server.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=10)
        assert health.status_code == 503
        assert late.status_code == 503 and late.json()["error"]["code"] is not None
        reader.join(120)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert server.proc.wait(timeout=60) == 0, server.log_tail()
    finally:
        stop_server(server)


def test_sigterm_cuts_what_outlives_the_drain_timeout(tmp_path):
    """Four streams and one non-streaming request, all far longer than a 3 s --drain-timeout: during the drain
    /health and new requests get 503 envelopes (the socket stays open); at the deadline every stream ends with
    an error event then [DONE] and the non-streaming request gets a 503 envelope; the process exits 0 within
    the timeout + 5 s (one timeout in total, not uvicorn's graceful timeout on top)."""
    drain_timeout, streams = 3.0, 4
    server = start_server(tmp_path, "cut", "--drafter", "none", "--drain-timeout", str(drain_timeout))
    try:
        long = {"prompt": "Once upon a time", "max_tokens": 1500, "temperature": 0, "ignore_eos": True}
        started = threading.Barrier(streams + 1)
        results: dict[int, object] = {}

        def stream(i: int) -> None:
            with httpx.stream("POST", server.base_url + "/v1/completions", json={**long, "stream": True},
                              timeout=60) as r:
                lines = (line[6:] for line in r.iter_lines() if line.startswith("data: "))
                events = [next(lines)]
                started.wait(60)
                results[i] = events + list(lines)

        def plain() -> None:
            results[streams] = httpx.post(server.base_url + "/v1/completions", json=long, timeout=60)

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(streams)]
        for t in threads:
            t.start()
        started.wait(120)
        threads.append(threading.Thread(target=plain))
        threads[-1].start()
        time.sleep(0.5)  # the non-streaming request reaches the engine
        server.proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        time.sleep(0.3)
        health = httpx.get(server.base_url + "/health", timeout=5)
        late = httpx.post(server.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=5)
        assert health.status_code == 503 and health.json()["error"]["code"] == "service_unavailable"
        assert late.status_code == 503 and late.json()["error"]["code"] == "service_unavailable"
        time.sleep(max(0.0, sent + drain_timeout - 0.5 - time.monotonic()))
        assert httpx.get(server.base_url + "/health", timeout=5).status_code == 503  # still listening
        assert server.proc.wait(timeout=drain_timeout + 5) == 0, server.log_tail()
        elapsed = time.monotonic() - sent
        assert elapsed >= drain_timeout - 0.5, "open requests did not get their drain timeout"
        for t in threads:
            t.join(10)
        for i in range(streams):
            events = results[i]
            assert events[-1] == "[DONE]", events[-3:]
            error = json.loads(events[-2])["error"]
            assert error["code"] == "service_unavailable" and "drain timeout" in error["message"], error
            assert all("choices" in json.loads(e) for e in events[:-2])
        r = results[streams]
        assert r.status_code == 503 and "drain timeout" in r.json()["error"]["message"]
        assert "cut 5 open request(s)" in server.log_tail()  # with --log-level warning
    finally:
        stop_server(server)
