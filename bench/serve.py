"""Serving load generator: streams chat completions through the official OpenAI client at a fixed
concurrency or a Poisson request rate, and prints TTFT / ITL / TPOT / e2e percentiles and token
throughput as a table. Not a test.

    # against a running server
    .venv/bin/python bench/serve.py --base-url http://127.0.0.1:8000 --num-requests 64 --concurrency 16
    # start `python -m server serve` itself (extra flags after --server-args go to the server)
    .venv/bin/python bench/serve.py --num-requests 32 --request-rate 4 --server-args --drafter none

TTFT is measured from sending the request to the first content chunk; ITL is the gap between content
chunks divided by the tokens they carry (from per-chunk usage, so a speculative burst of k tokens counts as
k gaps); TPOT = (e2e - TTFT) / (output tokens - 1). Output lengths are forced with ignore_eos: all equal by
default, or drawn uniformly from [L(1-r), L(1+r)] with --output-len-range r (the same lengths for a given seed,
like vLLM's --random-range-ratio). Equal lengths started together keep a closed loop in lockstep: requests
admitted in one step finish in one step, so the next prompts arrive together and are prefilled in one batch.

The last line gives the CPU time per content chunk of this client and, when the bench started the server, of the
server's HTTP process (its engine process apart; Linux /proc): on a small model the stream path rather than the
engine can bound a run, and this says which side of it does. --client-processes N spreads the load over N forked
client processes (seats and arrival rate split evenly) when one Python client's CPU is the bound. A last line sums up
what speculative decoding did (the server's own counters over the run: tree steps, acceptance, the adaptive budget,
the throughput guard).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import queue
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

import httpx
import openai

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = ("river mountain lantern copper violet orchard signal harbor meadow engine quartz saffron tunnel "
         "glacier pepper falcon marble cedar thunder velvet compass ember willow canyon").split()


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int = 0
    itls: list[float] = field(default_factory=list)
    chunks: int = 0  # content chunks received
    error: str = ""


def make_prompt(rng: random.Random, approx_tokens: int) -> str:
    # roughly one token per word for this vocabulary
    return "Continue this list of words: " + " ".join(rng.choice(WORDS) for _ in range(max(1, approx_tokens - 8)))


class StreamClient:
    """Streams a chat completion as (has content, cumulative usage or None) per chunk: through the official OpenAI
    client (the default: what users run), or --client raw, httpx reading the SSE lines with json.loads (about
    what vLLM's serving benchmark does with aiohttp), for when the SDK's per-chunk parsing would bound the run."""

    def __init__(self, args, base_url: str):
        self.raw, self.base_url = args.client == "raw", base_url
        limits = httpx.Limits(max_connections=max(args.concurrency, 1) + 8)
        self.http = httpx.AsyncClient(limits=limits, timeout=args.timeout,
                                      headers={"Authorization": f"Bearer {args.api_key or 'unused'}"})
        self.sdk = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key=args.api_key or "unused", max_retries=0,
                                      timeout=args.timeout, http_client=self.http)

    async def model(self) -> str:
        return (await self.sdk.models.list()).data[0].id

    async def chunks(self, body: dict) -> AsyncIterator[tuple[bool, dict | None]]:
        if not self.raw:
            sdk_body = {k: v for k, v in body.items() if k != "ignore_eos"}  # (not an SDK parameter)
            stream = await self.sdk.chat.completions.create(**sdk_body, extra_body={"ignore_eos": body["ignore_eos"]})
            async for chunk in stream:
                usage = chunk.usage.model_dump() if chunk.usage is not None else None
                yield bool(chunk.choices and chunk.choices[0].delta.content), usage
            return
        async with self.http.stream("POST", self.base_url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                raise BenchError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
            async for line in sse_lines(r):
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                choices = chunk.get("choices")
                yield bool(choices and choices[0]["delta"].get("content")), chunk.get("usage")

    async def aclose(self) -> None:
        await self.sdk.close()
        await self.http.aclose()  # (the SDK's close may leave a client it was given open; closing twice is fine)


async def sse_lines(response: httpx.Response) -> AsyncIterator[str]:
    """The response's lines as SSE ends them (LF, CRLF or CR). Not httpx's aiter_lines: it splits like
    str.splitlines, so a token such as U+2028 or U+0085 inside a JSON string (legal unescaped there) cut a chunk."""
    pending = ""
    async for text in response.aiter_text():
        *lines, pending = re.split(r"\r\n|\r|\n", pending + text)
        for line in lines:
            yield line
    if pending:
        yield pending


class BenchError(RuntimeError):
    pass


async def one_request(client: StreamClient, model: str, prompt: str, output_len: int,
                      sampling: dict | None = None) -> Result:
    """One streamed chat completion; sampling: temperature, top_p and seed (default greedy)."""
    # continuous_usage_stats (vLLM/ddtree extension): cumulative usage on every chunk, so each chunk's token count
    # is known and a k-token speculative chunk counts as k inter-token gaps
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": output_len,
            **(sampling or {"temperature": 0}), "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    t0 = time.perf_counter()
    first = last = None
    itls: list[float] = []
    usage, seen_tokens, chunks = None, 0, 0
    try:
        async for content, chunk_usage in client.chunks(body):
            now = time.perf_counter()
            if chunk_usage is not None:
                usage = chunk_usage
            if not content:
                continue
            chunks += 1
            tokens = (usage["completion_tokens"] - seen_tokens) if usage is not None else 1
            seen_tokens = usage["completion_tokens"] if usage is not None else seen_tokens + 1
            if first is None:
                first = now
            elif tokens > 0:
                itls.extend([(now - last) / tokens] * tokens)
            last = now
    except (openai.APIError, httpx.HTTPError, BenchError) as e:
        return Result(ok=False, error=f"{type(e).__name__}: {e}")
    end = time.perf_counter()
    if first is None or usage is None:
        return Result(ok=False, error="no content or no usage chunk")
    return Result(ok=True, ttft=first - t0, e2e=end - t0, output_tokens=usage["completion_tokens"],
                  prompt_tokens=usage["prompt_tokens"], itls=itls, chunks=chunks)


@dataclass
class Share:
    """One client process's part of the load: its requests (index, prompt, output length), seats and rate."""
    jobs: list[tuple[int, str, int]]
    concurrency: int  # 0 = unbounded
    request_rate: float  # Poisson arrivals per second (0 = all at once)
    seed: int


async def run_share(args, base_url: str, share: Share, ready) -> tuple[list[Result], float, float]:
    """Runs one share after a warm-up request; `ready()` is called once warm (a barrier across client
    processes). Returns the results in job order and the monotonic start and end of the timed part."""
    rng = random.Random(share.seed)
    client = StreamClient(args, base_url)
    try:
        model = args.model or await client.model()
        await one_request(client, model, "Hello", 4)  # warm-up
        await asyncio.get_running_loop().run_in_executor(None, ready)
        sem = asyncio.Semaphore(share.concurrency if share.concurrency > 0 else max(1, len(share.jobs)))

        async def gated(index: int, prompt: str, output_len: int) -> Result:
            sampling = {"temperature": args.temperature, "top_p": args.top_p, "seed": args.seed + index}
            async with sem:
                return await one_request(client, model, prompt, output_len, sampling)

        t0 = time.monotonic()
        print(f"timed load started: {len(share.jobs)} requests", file=sys.stderr, flush=True)  # (for profilers)
        tasks = []
        for job in share.jobs:
            tasks.append(asyncio.create_task(gated(*job)))
            if share.request_rate > 0:
                await asyncio.sleep(rng.expovariate(share.request_rate))
        results = await asyncio.gather(*tasks)
        return results, t0, time.monotonic()
    finally:
        await client.aclose()


def make_jobs(args) -> list[tuple[int, str, int]]:
    """Every request of the load: (index, prompt, output length), the same for a given seed."""
    rng = random.Random(args.seed)
    return [(i, make_prompt(rng, args.input_len), n) for i, n in enumerate(output_lengths(args))]


def num_client_processes(args) -> int:
    return max(1, min(args.client_processes, args.num_requests))


def make_shares(args) -> list[Share]:
    """The requests dealt round-robin over --client-processes, with the seats and the arrival rate split so
    the processes together keep --concurrency in flight and arrive at --request-rate."""
    jobs, num = make_jobs(args), num_client_processes(args)
    seats = [args.concurrency // num + (w < args.concurrency % num) for w in range(num)]
    if args.concurrency > 0 and min(seats) == 0:
        raise SystemExit("--client-processes must not exceed --concurrency")
    return [Share(jobs[w::num], seats[w], args.request_rate / num, args.seed + 1000 * (w + 1))
            for w in range(num)]


def _share_worker(args, base_url: str, share: Share, barrier, out) -> None:
    cpu0 = time.process_time()
    results, t0, t1 = asyncio.run(run_share(args, base_url, share, barrier.wait))
    out.put((results, t0, t1, time.process_time() - cpu0))


def run_load(args, base_url: str) -> tuple[list[Result], float, float]:
    """All requests, in this process or spread over --client-processes (forked, each with its own event loop and
    connections, started together after their warm-ups). Returns the results, the wall time of the timed part
    and the clients' CPU seconds (warm-ups included)."""
    shares = make_shares(args)
    if len(shares) == 1:
        cpu0 = time.process_time()
        results, t0, t1 = asyncio.run(run_share(args, base_url, shares[0], lambda: None))
        return results, t1 - t0, time.process_time() - cpu0
    ctx = mp.get_context("fork")
    barrier, out = ctx.Barrier(len(shares)), ctx.Queue()
    workers = [ctx.Process(target=_share_worker, args=(args, base_url, share, barrier, out), daemon=True)
               for share in shares]
    for w in workers:
        w.start()
    parts = []
    while len(parts) < len(workers):
        try:
            parts.append(out.get(timeout=1.0))
        except queue.Empty:
            if any(w.exitcode not in (None, 0) for w in workers):
                barrier.abort()
                raise SystemExit("a client process failed (its traceback is above)")
    for w in workers:
        w.join()
    results = [r for part in parts for r in part[0]]
    return results, max(p[2] for p in parts) - min(p[1] for p in parts), sum(p[3] for p in parts)


def output_lengths(args) -> list[int]:
    """Each request's forced output length: --output-len, or uniform in [L(1-r), L(1+r)] (at least 1)."""
    if args.output_len_range <= 0:
        return [args.output_len] * args.num_requests
    rng = random.Random(args.seed + 1)
    low = max(1, round(args.output_len * (1 - args.output_len_range)))
    high = max(low, round(args.output_len * (1 + args.output_len_range)))
    return [rng.randint(low, high) for _ in range(args.num_requests)]


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = (len(values) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def print_table(results: list[Result], elapsed: float, args) -> None:
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    print(f"\nrequests {len(ok)}/{len(results)} ok in {elapsed:.2f} s  (concurrency {args.concurrency or 'inf'}, "
          f"rate {args.request_rate or 'inf'} req/s, input ~{args.input_len} tok, output {output_desc(args)} tok, "
          f"temperature {args.temperature}, top_p {args.top_p})")
    if failed:
        print(f"first error: {failed[0].error}")
    if not ok:
        return
    out_tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    rows = [("TTFT", [r.ttft for r in ok]), ("ITL", [x for r in ok for x in r.itls]), ("TPOT", tpot),
            ("E2E", [r.e2e for r in ok])]
    print(f"{'metric (ms)':<12}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}{'max':>10}")
    for name, values in rows:
        if values:
            print(f"{name:<12}{1e3 * statistics.fmean(values):>10.1f}{1e3 * pct(values, 50):>10.1f}"
                  f"{1e3 * pct(values, 90):>10.1f}{1e3 * pct(values, 99):>10.1f}{1e3 * max(values):>10.1f}")
    print(f"output tokens/s {out_tokens / elapsed:.1f}   requests/s {len(ok) / elapsed:.2f}   "
          f"prompt tokens {sum(r.prompt_tokens for r in ok)}   output tokens {out_tokens}")


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a process (Linux /proc; None elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def print_cpu(results: list[Result], client_s: float, server_s: float | None, num_processes: int) -> None:
    chunks = sum(r.chunks for r in results if r.ok)
    if not chunks:
        return
    server = f", the server's HTTP process {1e6 * server_s / chunks:.1f}" if server_s is not None else ""
    who = "this client" if num_processes == 1 else f"the {num_processes} client processes together"
    print(f"CPU us per content chunk ({chunks} chunks): {who} {1e6 * client_s / chunks:.1f}{server}")


def metric_samples(base_url: str) -> dict[tuple[str, tuple], float]:
    """The server's /metrics as {(sample name, sorted labels without the model): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    response = httpx.get(base_url + "/metrics", timeout=10)
    response.raise_for_status()
    text = response.text
    return {(sample.name, tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def try_metric_samples(base_url: str) -> dict | None:
    try:
        return metric_samples(base_url)
    except (httpx.HTTPError, ValueError) as e:
        print(f"speculation: the server's /metrics could not be read ({type(e).__name__}: {e})")
        return None


def print_speculation(before: dict, after: dict) -> None:
    """What speculative decoding did during the load, from the server's counters (after - before): tree steps,
    drafts and acceptance, the adaptive budget and its probes, steps that drafted curves only, the throughput
    guard's checks and forced plain steps."""
    def total(name: str, **labels) -> float:
        want = set(labels.items())
        return sum(v - before.get(k, 0.0) for k, v in after.items() if k[0] == name and want <= set(k[1]))

    steps = {dict(k[1]).get("mode"): total("ddtree:engine_steps_total", mode=dict(k[1]).get("mode"))
             for k in after if k[0] == "ddtree:engine_steps_total"}
    budget_n = total("ddtree:spec_decode_budget_count")
    drafts, nodes = total("ddtree:spec_decode_num_drafts_total"), total("ddtree:spec_decode_num_draft_tokens_total")
    accepted = total("ddtree:spec_decode_num_accepted_tokens_total")
    checks = {o: int(total("ddtree:spec_decode_guard_checks_total", outcome=o)) for o in ("won", "lost", "discarded")}
    curve_steps = int(total("ddtree:spec_decode_curve_draft_steps_total"))
    probes = int(total("ddtree:spec_decode_probes_total"))
    kinds = ", ".join(f"{m} {int(n)}" for m, n in sorted(steps.items()) if n)
    print(f"speculation: {'engine steps ' + kinds + '; ' if kinds else ''}"
          f"trees verified {int(drafts)} ({nodes / drafts if drafts else 0:.1f} nodes, "
          f"{accepted / drafts if drafts else 0:.2f} accepted each); budget mean "
          f"{total('ddtree:spec_decode_budget_sum') / budget_n if budget_n else 0:.2f} over {int(budget_n)} "
          f"request-steps; probes {probes}; steps drafting curves only {curve_steps}; guard checks {checks}, "
          f"forced plain steps {int(total('ddtree:spec_decode_guard_plain_steps_total'))}")


def output_desc(args) -> str:
    if args.output_len_range <= 0:
        return str(args.output_len)
    return f"{args.output_len} +-{100 * args.output_len_range:.0f}%"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float = 300) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return url
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    proc.kill()
    raise SystemExit("server did not become healthy")


def start_server(server_args: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "server", "serve", "--port", str(port), "--no-access-log", *server_args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env)
    return proc, wait_healthy(proc, f"http://127.0.0.1:{port}")


def add_load_args(ap: argparse.ArgumentParser) -> None:
    """The load's flags (also bench/stream_path.py's)."""
    ap.add_argument("--model", default=None, help="default: the first of /v1/models")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8, help="requests in flight at most (0 = unbounded)")
    ap.add_argument("--request-rate", type=float, default=0.0, help="Poisson arrivals per second (0 = all at once)")
    ap.add_argument("--input-len", type=int, default=64, help="approximate prompt tokens")
    ap.add_argument("--output-len", type=int, default=64, help="output tokens per request (ignore_eos)")
    ap.add_argument("--output-len-range", type=float, default=0.0,
                    help="r in [0, 1): output lengths uniform in [L(1-r), L(1+r)] (0 = all equal)")
    ap.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--client", choices=("openai", "raw"), default="openai",
                    help="the official OpenAI client, or httpx reading the SSE lines (a lighter client)")
    ap.add_argument("--client-processes", type=int, default=1,
                    help="client processes sharing the load (a Python client's CPU can bound many fast streams)")
    ap.add_argument("--seed", type=int, default=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default=None, help="a running server; default: start one")
    add_load_args(ap)
    ap.add_argument("--server-args", nargs=argparse.REMAINDER, default=[],
                    help="flags for `python -m server serve` when the bench starts the server")
    args = ap.parse_args()
    if not 0 <= args.output_len_range < 1:
        ap.error("--output-len-range must be in [0, 1)")
    proc = None
    base_url = args.base_url
    if base_url is None:
        proc, base_url = start_server(args.server_args)
    try:
        server0 = process_cpu_s(proc.pid) if proc is not None else None
        metrics0 = try_metric_samples(base_url.rstrip("/"))
        results, elapsed, client_s = run_load(args, base_url.rstrip("/"))
        server1 = process_cpu_s(proc.pid) if proc is not None else None
        print_table(results, elapsed, args)
        print_cpu(results, client_s, server1 - server0 if server0 is not None and server1 is not None else None,
                  num_client_processes(args))
        metrics1 = try_metric_samples(base_url.rstrip("/"))
        if metrics0 is not None and metrics1 is not None:
            print_speculation(metrics0, metrics1)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)


if __name__ == "__main__":
    main()
