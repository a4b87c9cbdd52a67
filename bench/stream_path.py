"""The stream path's ceiling, on any machine: the real HTTP server (server/, uvicorn, the real engine process loop
of engine/process.py) in front of a synthetic engine core that gives every running request one token a step at a
fixed step time, as a GPU engine at a large batch would, loaded by bench/serve.py's client. It prints bench/serve.py's
table and CPU line beside the rate the engine offered, so the HTTP process's cost a chunk and the throughput it
caps can be measured and tuned without a GPU. --in-process drives the app through ASGI calls in one process instead
(no sockets, no engine process, no client): the server's own Python a chunk, measured alone. Not a test.

    # 64 streams, a step every 1.4 ms (about an H100's batch-64 plain step on the embedded model: 45.7k tok/s offered)
    .venv/bin/python bench/stream_path.py --concurrency 64 --num-requests 192 --output-len 256 --step-ms 1.4 \\
        --client raw --client-processes 4

The tokens are the embedded model's tokenization of a fixed English text, each request starting at its own place
in it, so the server's detokenizer sees ordinary text. Requests with stop strings are refused (the real engine
would detokenize those itself).
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx  # noqa: E402

from bench import serve as load  # noqa: E402

TEXT = ("The river ran past the old mill, where the miller kept his accounts in a ledger bound in green cloth. "
        "Every morning he counted the sacks of grain, wrote the numbers in a careful hand, and walked to the "
        "harbor to watch the boats come in. Some days the fog lay so thick that he could hear the bells long "
        "before the masts appeared, and he would stand at the end of the pier, listening, until the first hull "
        "slid out of the grey. His daughter said he loved the boats more than the mill; he said that a mill "
        "without boats was only a wheel turning water into noise. ")


def text_token_ids(tokenizer) -> list[int]:
    return tokenizer.encode(TEXT * 8, add_special_tokens=False)


class SyntheticRequests:
    """The synthetic engine's requests: each gets its next token of the text a step, until its max_tokens."""

    def __init__(self, text_ids: list[int]):
        self.text_ids = text_ids
        self.state: dict[str, list[int]] = {}  # id -> [tokens left, next text position, prompt length]
        self.num_added = 0

    def add(self, request_id: str, num_prompt_tokens: int, max_tokens: int) -> None:
        self.state[request_id] = [max_tokens, (self.num_added * 97) % len(self.text_ids), num_prompt_tokens]
        self.num_added += 1

    def abort(self, request_id: str) -> None:
        self.state.pop(request_id, None)

    def step(self) -> list:
        from engine.messages import Delta

        deltas = []
        for rid, state in list(self.state.items()):
            token, state[1] = self.text_ids[state[1]], (state[1] + 1) % len(self.text_ids)
            state[0] -= 1
            finished = state[0] <= 0
            deltas.append(Delta(rid, [token], finished, "length" if finished else None, num_prompt_tokens=state[2]))
            if finished:
                del self.state[rid]
        return deltas


def step_stats(num_deltas: int, step_s: float):
    from engine.messages import StepStats

    return StepStats(num_running=num_deltas, num_waiting=0, kv_cache_usage=0.0, batch_size=num_deltas,
                     num_preemptions=0, timings={"forward": step_s})


class SyntheticCore:
    """Stands in for engine.core.EngineCore inside the real engine process: every running request gets its next
    token each step, a step every `step_s` seconds, until its max_tokens; no model, no KV cache."""
    step_s = 0.0014  # set by synthetic_engine before the process loop starts

    def __init__(self, config=None, log_level=None):
        from engine.model.embedded import embedded_gguf_path
        from engine.model.gguf import load_gguf_tokenizer

        path = embedded_gguf_path()
        self.tokenizer = load_gguf_tokenizer(path)
        self.loaded = types.SimpleNamespace(path=path)
        self.requests = SyntheticRequests(text_token_ids(self.tokenizer))
        self.vocab_size, self.max_model_len = len(self.tokenizer), 8192
        self.eos_token_ids = tuple(t for t in (self.tokenizer.eos_token_id,) if t is not None)
        self.blocks = types.SimpleNamespace(num_blocks=32768, usage=0.0)
        self.scheduler = types.SimpleNamespace(running=[], waiting=[])
        self.last_stats = None
        self.next_step = 0.0

    def add_request(self, prompt_token_ids, sampling, request_id):
        if sampling.stop:
            raise ValueError("the synthetic engine does not detokenize: no stop strings")
        self.requests.add(request_id, len(prompt_token_ids),
                          sampling.max_tokens or (self.max_model_len - len(prompt_token_ids)))
        self.scheduler.running = list(self.requests.state)

    def abort(self, request_id):
        self.requests.abort(request_id)
        self.scheduler.running = list(self.requests.state)

    def has_unfinished(self):
        return bool(self.requests.state)

    def step(self):
        now = time.perf_counter()
        if now < self.next_step:
            time.sleep(self.next_step - now)
        self.next_step = max(now, self.next_step) + self.step_s
        deltas = self.requests.step()
        self.scheduler.running = list(self.requests.state)
        self.last_stats = step_stats(len(deltas), self.step_s)
        return deltas

    def pop_request_errors(self):
        return []

    def check_ranks(self):
        pass

    def shutdown(self):
        pass


def synthetic_engine(config, inbox, outbox, log_level, step_s: float) -> None:
    """Spawn target: engine/process.py's run_engine around SyntheticCore."""
    SyntheticCore.step_s = step_s
    module = types.ModuleType("engine.core")
    module.EngineCore = SyntheticCore
    sys.modules["engine.core"] = module  # run_engine imports EngineCore from here
    from engine.process import run_engine

    run_engine(config, inbox, outbox, log_level)


def serve_synthetic(port: int, step_s: float) -> None:
    """The server process: `ddtree serve` as usual, its engine process running synthetic_engine."""
    import multiprocessing as mp

    import server.state
    from server.cli import parser, serve_configs
    from server.engine_client import EngineClient
    from server.serve import exit_now, serve

    class SyntheticClient(EngineClient):
        def __init__(self, config, on_step=None, log_level=None):
            super().__init__(config, on_step=on_step, log_level=log_level)
            self.process = mp.get_context("spawn").Process(
                target=synthetic_engine, args=(config, self.inbox, self.outbox, log_level or "WARNING", step_s),
                daemon=True, name="ddtree-engine")

    server.state.EngineClient = SyntheticClient
    args = parser().parse_args(["serve", "--host", "127.0.0.1", "--port", str(port), "--no-access-log",
                                "--log-level", "warning"])
    exit_now(serve(*serve_configs(args)))


def run_in_process(args) -> None:
    """--in-process: the app (server.app.create_app) driven through ASGI calls in this process, its engine client
    fed by an in-loop ticker: no sockets, no engine process, no client, so the CPU time is the server's own
    Python a chunk (a run's chunks carry one token each unless the loop falls behind the ticker)."""
    import asyncio
    import json

    from engine.messages import AbortRequest, AddRequest, Ready, StepOutputs
    from engine.model.embedded import embedded_gguf_path
    from engine.model.gguf import load_gguf_tokenizer
    from engine.tokenizer_export import export_tokenizer
    import server.state
    from server.app import create_app
    from server.cli import parser, serve_configs
    from server.engine_client import EngineClient

    path = embedded_gguf_path()
    tokenizer = load_gguf_tokenizer(path)
    tokenizer_dir, requests = export_tokenizer(tokenizer, path), SyntheticRequests(text_token_ids(tokenizer))
    step_s = args.step_ms / 1e3

    class Inbox:
        def put(self, msg) -> None:
            if isinstance(msg, AddRequest):
                requests.add(msg.request_id, len(msg.prompt_token_ids), msg.sampling.max_tokens)
            elif isinstance(msg, AbortRequest):
                requests.abort(msg.request_id)

    class InProcessClient(EngineClient):
        async def start(self) -> None:
            self.loop, self._started, self.inbox = asyncio.get_running_loop(), True, Inbox()
            self._dispatch(Ready(len(tokenizer), 8192, (tokenizer.eos_token_id,), 32768, 16,
                                 tokenizer_dir=tokenizer_dir))
            self.ticker = asyncio.ensure_future(self._tick())

        async def _tick(self) -> None:
            # Every step that fell due while the loop was busy is dispatched on waking, as the engine process would
            # have made them meanwhile: a loop that cannot keep up sees its readers' queues grow and coalesce.
            next_step = time.perf_counter()
            while True:
                await asyncio.sleep(max(0.0, next_step - time.perf_counter()))
                while next_step <= time.perf_counter():
                    next_step += step_s
                    deltas = requests.step()
                    if deltas:
                        self._dispatch(StepOutputs(deltas, step_stats(len(deltas), step_s)))

        @property
        def alive(self) -> bool:
            return True

        def shutdown(self, timeout: float = 5.0) -> None:
            self.ticker.cancel()

    server.state.EngineClient = InProcessClient
    app = create_app(*serve_configs(parser().parse_args(["serve", "--log-level", "warning"])))
    jobs = load.make_jobs(args)
    num_sends = 0

    async def one(job: tuple[int, str, int], sem: asyncio.Semaphore) -> None:
        nonlocal num_sends
        _, prompt, output_len = job
        body = json.dumps({"messages": [{"role": "user", "content": prompt}], "max_tokens": output_len,
                           "temperature": args.temperature, "stream": True, "ignore_eos": True,
                           "stream_options": {"include_usage": True, "continuous_usage_stats": True}}).encode()
        done, asked = asyncio.Event(), False

        async def receive():
            nonlocal asked
            if not asked:
                asked = True
                return {"type": "http.request", "body": body, "more_body": False}
            await done.wait()
            return {"type": "http.disconnect"}

        async def send(message) -> None:
            nonlocal num_sends
            if message["type"] == "http.response.body":
                num_sends += 1
                if not message.get("more_body"):
                    done.set()

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
                 "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
        async with sem:
            await app(scope, receive, send)

    async def main() -> tuple[float, float]:
        nonlocal num_sends
        async with app.router.lifespan_context(app):
            while app.state.server.tokenizer is None:
                await asyncio.sleep(0.01)
            sem = asyncio.Semaphore(args.concurrency or len(jobs))
            await asyncio.gather(*(one(job, sem) for job in jobs[:4]))  # warm-up
            num_sends = 0
            cpu0, t0 = time.process_time(), time.perf_counter()
            await asyncio.gather(*(one(job, sem) for job in jobs))
            return time.process_time() - cpu0, time.perf_counter() - t0

    cpu_s, wall_s = asyncio.run(main())
    num_tokens = sum(n for _, _, n in jobs)
    print(f"in process: {num_tokens} tokens in {wall_s:.2f} s, {num_sends} SSE events "
          f"({num_tokens / wall_s:,.0f} tok/s, the engine offers {offered_tok_s(args):,.0f}); server CPU "
          f"{cpu_s:.2f} s: {1e6 * cpu_s / num_tokens:.1f} us a token, {1e6 * cpu_s / num_sends:.1f} us an SSE event")


def offered_tok_s(args) -> float:
    """Tokens per second the synthetic engine makes with every seat taken."""
    return 1e3 / args.step_ms * (args.concurrency or args.num_requests)


def start(step_s: float) -> tuple[subprocess.Popen, str]:
    port = load.free_port()
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve-port", str(port),
                             "--step-ms", str(1e3 * step_s)], cwd=load.REPO_ROOT,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    return proc, load.wait_healthy(proc, f"http://127.0.0.1:{port}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--step-ms", type=float, default=1.4, help="the synthetic engine's step time")
    ap.add_argument("--in-process", action="store_true",
                    help="drive the app through ASGI calls in this process (no sockets, engine process or client)")
    ap.add_argument("--serve-port", type=int, default=None, help=argparse.SUPPRESS)  # the server process's mode
    load.add_load_args(ap)
    args = ap.parse_args()
    if args.serve_port is not None:
        return serve_synthetic(args.serve_port, args.step_ms / 1e3)
    if args.in_process:
        return run_in_process(args)
    proc, base_url = start(args.step_ms / 1e3)
    try:
        server0 = load.process_cpu_s(proc.pid)
        results, elapsed, client_s = load.run_load(args, base_url)
        server1 = load.process_cpu_s(proc.pid)
        load.print_table(results, elapsed, args)
        print(f"the engine offers {1e3 / args.step_ms:.0f} steps/s: up to {offered_tok_s(args):,.0f} tok/s at this "
              f"concurrency")
        load.print_cpu(results, client_s, None if server0 is None else server1 - server0,
                       load.num_client_processes(args))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()
