"""Failure isolation and the server's lifecycle when things break.

Live (one `python -m server serve` on the embedded SmolLM2, CPU, with the test-only fault hook
DDTREE_TEST_FAULT_SEED): a request that fails inside the engine gets a 500 envelope, or an SSE error event then
[DONE], while 7 concurrent requests complete; then the engine process is SIGKILLed: every open stream ends
with an error event and [DONE] within 2 s, /health answers 503 within 1 s, and the server exits non-zero so
that its orchestrator restarts it.

Without a model: the real engine process around a fake core that crashes (the server logs the engine's
traceback at ERROR, open requests fail, the failure listeners run); the engine loop's request errors and
gauge refresh; DDTREE_API_KEY; `serve --drafter oracle` is refused."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.server.conftest import REPO_ROOT, engine_pid, start_server, stop_server

FAULT_SEED = 4242


@pytest.fixture(scope="module")
def faulty_server(tmp_path_factory):
    s = start_server(tmp_path_factory.mktemp("faulty-logs"), "faulty", "--drafter", "none",
                     env={"DDTREE_TEST_FAULT_SEED": str(FAULT_SEED)})
    try:
        yield s
    finally:
        stop_server(s)  # the SIGKILL test leaves it exited (status 1) already


def sse_events(lines) -> list[str]:
    return [line[6:] for line in lines if line.startswith("data: ")]


def body(prompt: str, max_tokens: int, **extra) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}


# ------------------------------------------------------------------------------------------------ live

def test_fault_in_one_request_fails_it_alone(faulty_server):
    """Two requests carry the faulty seed (one streaming, one not; the fault fires at their second step), seven
    others run beside them and complete; the engine goes on serving."""
    url = faulty_server.base_url + "/v1/completions"

    async def normal(client: httpx.AsyncClient, i: int):
        return await client.post(url, json=body(f"Item {i}:", 6))

    async def faulty_plain(client: httpx.AsyncClient):
        return await client.post(url, json=body("Count: 1, 2,", 24, seed=FAULT_SEED))

    async def faulty_stream(client: httpx.AsyncClient):
        async with client.stream("POST", url, json=body("Count: 1, 2,", 24, seed=FAULT_SEED, stream=True)) as r:
            return r.status_code, sse_events([line async for line in r.aiter_lines()])

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(faulty_plain(client), faulty_stream(client),
                                        *(normal(client, i) for i in range(7)))

    plain, (stream_status, events), *others = asyncio.run(run())
    assert plain.status_code == 500, plain.text
    error = plain.json()["error"]
    assert error["code"] == "internal_error" and error["type"] == "server_error"
    assert "injected fault" in error["message"], error
    assert stream_status == 200 and events[-1] == "[DONE]", events
    error = json.loads(events[-2])["error"]
    assert error["code"] == "internal_error" and "injected fault" in error["message"], events
    assert any(json.loads(e).get("choices") for e in events[:-2]), "the fault fires after the first token"
    for r in others:
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 6
    after = httpx.post(url, json=body("Again:", 2), timeout=60)
    assert after.status_code == 200 and httpx.get(faulty_server.base_url + "/health").status_code == 200
    log = faulty_server.log_tail(200)
    assert "failed in the engine" in log  # the server's line
    assert "ERROR ddtree.engine" in log  # the engine process logs to the server's stderr, at its level


def test_engine_sigkill_fails_open_requests_then_server_exits(faulty_server):
    """Run last in this module: the server exits. Four open streams and one non-streaming request."""
    s, open_requests = faulty_server, 5
    started = threading.Barrier(open_requests + 1)
    ended: dict[int, tuple[float, object]] = {}

    def stream(i: int) -> None:
        with httpx.stream("POST", s.base_url + "/v1/completions", json=body(f"Story {i}:", 400, stream=True),
                          timeout=60) as r:
            lines = r.iter_lines()
            events = []
            for line in lines:
                events += sse_events([line])
                if any(json.loads(e).get("choices") for e in events if e != "[DONE]"):
                    break
            started.wait(60)
            events += sse_events(lines)
        ended[i] = (time.monotonic(), events)

    def plain() -> None:
        started.wait(60)  # submitted when the streams run; killed before its 400 tokens
        r = httpx.post(s.base_url + "/v1/completions", json=body("Essay:", 400), timeout=60)
        ended[open_requests] = (time.monotonic(), r)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(open_requests - 1)]
    threads.append(threading.Thread(target=plain))
    for t in threads:
        t.start()
    started.wait(120)
    time.sleep(0.5)  # the non-streaming request reaches the engine
    os.kill(engine_pid(s), signal.SIGKILL)
    killed = time.monotonic()
    while (health := httpx.get(s.base_url + "/health", timeout=5)).status_code != 503:
        assert time.monotonic() - killed < 1.0, "/health still 200 a second after the engine died"
        time.sleep(0.05)
    assert time.monotonic() - killed < 1.0
    assert "engine" in health.json()["error"]["message"]
    late = httpx.post(s.base_url + "/v1/completions", json=body("Late:", 2), timeout=5)
    assert late.status_code == 503 and late.json()["error"]["code"] == "service_unavailable"
    gauges = [line for line in httpx.get(s.base_url + "/metrics", timeout=5).text.splitlines()
              if line.startswith(("ddtree:num_requests_running", "ddtree:num_requests_waiting",
                                  "ddtree:kv_cache_usage_perc"))]
    assert len(gauges) == 3 and all(float(line.rsplit(" ", 1)[1]) == 0 for line in gauges), gauges
    for t in threads:
        t.join(30)
    assert len(ended) == open_requests
    for i in range(open_requests - 1):
        when, events = ended[i]
        assert when - killed < 2.0, f"stream {i} ended {when - killed:.2f} s after the kill"
        assert events[-1] == "[DONE]", events[-3:]
        error = json.loads(events[-2])["error"]
        assert error["code"] == "service_unavailable" and "SIGKILL" in error["message"], error
    when, r = ended[open_requests]
    assert when - killed < 2.0 and r.status_code == 503 and r.json()["error"]["code"] == "service_unavailable"
    assert s.proc.wait(timeout=30) == 1, s.log_tail()
    log = s.log_tail(200)
    assert "the engine died" in log and "killed by SIGKILL" in log and "exiting with status 1" in log
    assert "unhandled error" not in log and "stream failed" not in log  # the server itself raised nothing


# ----------------------------------------------------------------------------------------- no model

def test_engine_crash_is_logged_with_its_traceback_and_fails_open_requests(caplog):
    """The real engine process (engine/process.py) around a fake core whose step raises."""
    import multiprocessing as mp

    from engine.config import EngineConfig
    from engine.request import SamplingParams
    from server.engine_client import EngineClient, EngineDeadError, EngineRequestError
    from tests.server import fake_engine

    failures: list[str] = []

    async def scenario():
        client = EngineClient(EngineConfig(), log_level="WARNING")
        client.process = mp.get_context("spawn").Process(target=fake_engine.crashing_engine, daemon=True,
                                                         args=(client.inbox, client.outbox))
        await client.start()
        client.add_failure_listener(failures.append)
        await asyncio.wait_for(client.wait_ready(), 60)
        with pytest.raises(EngineRequestError, match="empty"):  # a refusal (kind invalid): a 400 upstream
            await anext(client.generate("refused", [], SamplingParams(max_tokens=1)))
        gen = client.generate("ok", [1, 2], SamplingParams(max_tokens=100))
        first = (await anext(gen)).new_token_ids  # (steps queued before the read arrive as one delta)
        assert first and set(first) == {1}
        doomed = client.generate("doomed", [fake_engine.FakeCore.CRASH], SamplingParams(max_tokens=100))
        with pytest.raises(EngineDeadError, match="engine step failed: ZeroDivisionError: the step blew up"):
            async for _ in doomed:
                pass
        with pytest.raises(EngineDeadError):
            async for _ in gen:
                pass
        with pytest.raises(EngineDeadError):  # and every later request
            await anext(client.generate("late", [1], SamplingParams(max_tokens=1)))
        await asyncio.sleep(0.1)
        client.process.join(10)
        return client

    with caplog.at_level(logging.ERROR, logger="ddtree.server"):
        client = asyncio.run(scenario())
    assert client.process.exitcode == 1 and not client.alive
    assert failures == ["engine step failed: ZeroDivisionError: the step blew up"]
    (record,) = [r for r in caplog.records if "the engine died" in r.getMessage()]
    assert record.levelno == logging.ERROR
    message = record.getMessage()
    assert "Traceback (most recent call last)" in message and "explode_in_step" in message, message


def test_engine_loop_sends_request_errors_and_refreshes_gauges():
    """engine/process.py's loop: a request failing alone is reported (kind internal) and, when no step ran,
    an idle StepOutputs refreshes the server's gauges; a bad request is refused (kind invalid)."""
    from engine.messages import AddRequest, RequestError, Shutdown, StepOutputs
    from engine.process import serve_core
    from engine.request import SamplingParams
    from tests.server.fake_engine import FakeCore

    inbox, outbox = queue.Queue(), queue.Queue()
    for rid, prompt in (("bad", []), ("fails", [FakeCore.FAIL]),):
        inbox.put(AddRequest(rid, prompt, SamplingParams(max_tokens=4)))
    core = FakeCore()
    threading.Timer(0.3, inbox.put, args=(Shutdown(),)).start()
    serve_core(core, inbox, outbox)
    messages = []
    while not outbox.empty():
        messages.append(outbox.get())
    errors = {m.request_id: m for m in messages if isinstance(m, RequestError)}
    assert errors["bad"].kind == "invalid" and "empty" in errors["bad"].message
    assert errors["fails"].kind == "internal" and "alone failed" in errors["fails"].message
    stats = [m.stats for m in messages if isinstance(m, StepOutputs)]
    assert stats and stats[-1].num_running == 0 and stats[-1].kv_cache_usage == 0.0


def test_api_key_from_the_environment(monkeypatch):
    from server.cli import parser, serve_configs

    monkeypatch.setenv("DDTREE_API_KEY", "sk-from-env\n")
    assert serve_configs(parser().parse_args(["serve"]))[0].api_key == "sk-from-env"
    assert serve_configs(parser().parse_args(["serve", "--api-key", "sk-flag"]))[0].api_key == "sk-flag"
    monkeypatch.setenv("DDTREE_API_KEY", "")
    assert serve_configs(parser().parse_args(["serve"]))[0].api_key is None
    monkeypatch.delenv("DDTREE_API_KEY")
    assert serve_configs(parser().parse_args(["serve"]))[0].api_key is None


def test_serve_refuses_the_oracle_drafter():
    proc = subprocess.run([sys.executable, "-m", "server", "serve", "--drafter", "oracle"], capture_output=True,
                          text=True, cwd=REPO_ROOT, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "oracle" in lines[0] and "generate" in lines[0]
