"""A real Prometheus scrapes a real server, and every PromQL expression of every Grafana panel returns data.

The server runs the embedded SmolLM2-135M-Instruct with the n-gram drafter (`python -m server serve`), Prometheus
(Debian's, from `make tools`) scrapes it every second on loopback with a copy of deploy/prometheus.yml's job.
After a little traffic (chat and completions, streamed and not, all at once, then one 400) and two scrapes, each
panel query runs through /api/v1/query with Grafana's variables substituted, as Grafana would send it."""
from __future__ import annotations

import concurrent.futures
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import httpx
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
SERVER_START_TIMEOUT_S = 150  # first run on a fresh machine converts the embedded GGUF (~15 s) and loads it
SUBSTITUTIONS = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "5m"}

pytestmark = pytest.mark.slow


def require(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.fail(f"`{tool}` is not installed: run `make tools` (Debian's prometheus package ships both "
                    f"prometheus and promtool)")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Process:
    """A child in its own process group, logged to a file; stop() always leaves nothing behind."""

    def __init__(self, argv: list[str], log: Path, env: dict | None = None):
        self.argv, self.log_path = argv, log
        self._log = open(log, "wb")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                                     start_new_session=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, n: int = 4000) -> str:
        self._log.flush()
        return self.log_path.read_bytes()[-n:].decode(errors="replace")

    def stop(self, grace_s: float = 20.0) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the group: the server's engine child goes too
        except ProcessLookupError:
            pass
        self.proc.wait()
        self._log.close()


def wait_until(what: str, predicate, timeout_s: float, proc: Process | None = None, every_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and not proc.alive():
            pytest.fail(f"{what}: the process exited with {proc.proc.returncode}:\n{proc.tail()}")
        try:
            value = predicate()
            if value:
                return value
        except (httpx.HTTPError, OSError, KeyError, ValueError):
            pass
        time.sleep(every_s)
    pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}" + (f":\n{proc.tail()}" if proc else ""))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    log = tmp_path_factory.mktemp("server") / "server.log"
    # --no-adaptive: every decoding request verifies its n-gram tree, so the speculative panels have data however
    # loaded the host is (the adaptive budget, tested on its own, may choose plain decoding on a busy 2-core CI
    # machine and leave them empty)
    proc = Process([sys.executable, "-m", "server", "serve", "--host", "127.0.0.1", "--port", str(port),
                    "--max-model-len", "2048", "--kv-cache-memory", "256M", "--drain-timeout", "5",
                    "--no-adaptive"], log, env)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until("the server's /health", lambda: httpx.get(f"{base}/health", timeout=5).status_code == 200,
                   SERVER_START_TIMEOUT_S, proc)
        model = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
        yield {"url": base, "model": model, "port": port, "proc": proc}
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def prometheus(server, tmp_path_factory):
    binary = require("prometheus")
    tmp = tmp_path_factory.mktemp("prometheus")
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    # deploy/prometheus.yml's own ddtree job, pointed at the test server and scraped faster
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "ddtree"]
    job["scrape_interval"], job["scrape_timeout"] = "1s", "1s"
    job["static_configs"] = [{"targets": [f"127.0.0.1:{server['port']}"]}]
    config["scrape_configs"] = [job]
    config["global"].update(scrape_interval="1s", scrape_timeout="1s")
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    check = subprocess.run([require("promtool"), "check", "config", str(tmp / "prometheus.yml")],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    port = free_port()
    proc = Process([binary, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
                    f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"], tmp / "prometheus.log")
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until("Prometheus /-/ready", lambda: httpx.get(f"{base}/-/ready", timeout=5).status_code == 200, 60,
                   proc)
        yield {"url": base, "proc": proc}
    finally:
        proc.stop(grace_s=10)


def last_scrape(prom: dict) -> float:
    """Unix time of the ddtree target's last successful scrape (0 before the first)."""
    targets = httpx.get(f"{prom['url']}/api/v1/targets", timeout=5).json()["data"]["activeTargets"]
    (target,) = [t for t in targets if t["labels"]["job"] == "ddtree"]
    if target["health"] != "up":
        return 0.0
    stamp = target["lastScrape"]  # RFC 3339 with nanoseconds, e.g. 2026-12-01T08:00:00.123456789Z
    m = re.fullmatch(r"([^.]+?)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)", stamp)
    whole, frac, zone = m.group(1), (m.group(2) or "0")[:6], m.group(3).replace("Z", "+00:00")
    return datetime.fromisoformat(f"{whole}.{frac.ljust(6, '0')}{zone}").timestamp()


def wait_for_scrapes(prom: dict, after: float, count: int) -> None:
    seen = after
    for i in range(count):
        seen = wait_until(f"scrape {i + 1} of {count} after the traffic",
                          lambda: (t := last_scrape(prom)) > seen and t, 30, prom["proc"], every_s=0.2)


def query(prom: dict, expr: str) -> list[dict]:
    r = httpx.post(f"{prom['url']}/api/v1/query", data={"query": expr}, timeout=10)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", f"{expr}\n-> {r.status_code} {body}"
    assert body["data"]["resultType"] == "vector", expr
    return body["data"]["result"]


def send_traffic(base: str, model: str) -> dict:
    """A few requests of every kind, at once (batched steps); returns the completion tokens the responses reported."""
    repetitive = "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3,"  # n-gram drafts get accepted on this, at several depths
    chat = [{"role": "user", "content": "Count: 1, 2, 3, 1, 2, 3, 1, 2, 3. Continue the pattern."}]

    def chat_plain(client):
        r = client.post("/v1/chat/completions", json={"model": model, "messages": chat, "max_tokens": 16,
                                                      "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["completion_tokens"]

    def stream(client, path, body):
        usage = None
        with client.stream("POST", path, json=dict(body, model=model, stream=True, max_tokens=16, temperature=0,
                                                   stream_options={"include_usage": True})) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    usage = chunk.get("usage") or usage
        assert usage is not None, f"{path}: no usage chunk"
        return usage["completion_tokens"]

    def completion_plain(client):
        r = client.post("/v1/completions", json={"model": model, "prompt": repetitive, "max_tokens": 16,
                                                 "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["completion_tokens"]

    with httpx.Client(base_url=base, timeout=120) as client:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            jobs = [pool.submit(chat_plain, client), pool.submit(completion_plain, client),
                    pool.submit(stream, client, "/v1/chat/completions", {"messages": chat}),
                    pool.submit(stream, client, "/v1/completions", {"prompt": repetitive})]
            tokens = sum(job.result() for job in jobs)
        bad = client.post("/v1/chat/completions", json={"model": model, "max_tokens": 4})  # no messages
        assert 400 <= bad.status_code < 500, bad.text
    return {"completion_tokens": tokens, "bad_status": bad.status_code}


def panel_queries() -> list[tuple[str, str, str]]:
    """(dashboard, panel title, expr) for every target of every panel, rows' nested panels included."""
    out = []
    for path in sorted((DEPLOY / "grafana" / "dashboards").glob("*.json")):
        dash = json.loads(path.read_text())
        panels = []
        for panel in dash["panels"]:
            panels.append(panel)
            panels.extend(panel.get("panels", []))
        for panel in panels:
            for target in panel.get("targets", []):
                if target.get("expr"):
                    out.append((path.name, panel["title"], target["expr"]))
    return out


def substitute(expr: str, model_regex: str) -> str:
    for var, value in SUBSTITUTIONS.items():
        expr = expr.replace(var, value)
    expr = expr.replace("${model_name}", model_regex).replace("$model_name", model_regex)
    assert "$" not in expr, f"unsubstituted variable in {expr}"
    return expr


def test_promtool_accepts_the_shipped_config():
    proc = subprocess.run([require("promtool"), "check", "config", str(DEPLOY / "prometheus.yml")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_dashboard_query_returns_data(server, prometheus):
    wait_until("the first scrape", lambda: last_scrape(prometheus) > 0, 30, prometheus["proc"])
    sent = send_traffic(server["url"], server["model"])
    wait_for_scrapes(prometheus, time.time(), 2)

    # the model_name template variable: label_values(ddtree:num_requests_running, model_name)
    values = httpx.get(f"{prometheus['url']}/api/v1/label/model_name/values",
                       params={"match[]": "ddtree:num_requests_running"}, timeout=5).json()["data"]
    assert server["model"] in values

    queries = panel_queries()
    assert len(queries) > 30
    empty = []
    for model_regex in (server["model"], ".*"):  # one model selected, and All
        for dashboard, title, expr in queries:
            if not query(prometheus, substitute(expr, model_regex)):
                empty.append(f"{dashboard} / {title} (model_name=~{model_regex!r}): {expr}")
    assert not empty, "queries with no result:\n" + "\n".join(empty)

    # and the numbers mean what the panels say they mean
    def scalar(expr: str) -> float:
        (sample,) = query(prometheus, substitute(expr, ".*"))
        return float(sample["value"][1])

    assert scalar('sum(ddtree:generation_tokens_total{model_name=~"$model_name"})') == sent["completion_tokens"]
    assert scalar('sum(rate(ddtree:generation_tokens_total{model_name=~"$model_name"}[1m]))') > 0
    accept = scalar('sum(rate(ddtree:spec_decode_accept_length_sum{model_name=~"$model_name"}[1m])) / '
                    'sum(rate(ddtree:spec_decode_accept_length_count{model_name=~"$model_name"}[1m]))')
    assert math.isfinite(accept) and accept > 1.0, "the repetitive prompt should get n-gram drafts accepted"
    statuses = {s["metric"]["status"] for s in query(prometheus, 'ddtree:http_requests_total{status=~"4..|5.."}')}
    assert str(sent["bad_status"]) in statuses
    ttft = scalar('histogram_quantile(0.5, sum by (le) (rate(ddtree:time_to_first_token_seconds_bucket'
                  '{model_name=~"$model_name"}[1m])))')
    assert math.isfinite(ttft) and ttft > 0
