"""Graceful drain: on SIGTERM /health turns 503 and new requests get a 503 envelope while an open stream runs
to its end; then the process exits 0 (what Kubernetes' terminationGracePeriod relies on)."""
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
