"""The stream path's ceiling, on any machine: the real HTTP server (server/, uvicorn, the real engine process loop
of engine/process.py) in front of a synthetic engine core that gives every running request one token a step at a
fixed step time, as a GPU engine at a large batch would, loaded by bench/serve.py's client. It prints bench/serve.py's
table and CPU line beside the rate the engine offered, so the HTTP process's cost a chunk and the throughput it
caps can be measured and tuned without a GPU. Not a test.

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
        self.text_ids = self.tokenizer.encode(TEXT * 8, add_special_tokens=False)
        self.vocab_size, self.max_model_len = len(self.tokenizer), 8192
        self.eos_token_ids = tuple(t for t in (self.tokenizer.eos_token_id,) if t is not None)
        self.blocks = types.SimpleNamespace(num_blocks=32768, usage=0.0)
        self.scheduler = types.SimpleNamespace(running=[], waiting=[])
        self.requests: dict[str, list[int]] = {}  # id -> [tokens left, next text position, prompt length]
        self.last_stats = None
        self.next_step = 0.0

    def add_request(self, prompt_token_ids, sampling, request_id):
        if sampling.stop:
            raise ValueError("the synthetic engine does not detokenize: no stop strings")
        left = sampling.max_tokens or (self.max_model_len - len(prompt_token_ids))
        self.requests[request_id] = [left, (len(self.requests) * 97) % len(self.text_ids), len(prompt_token_ids)]
        self.scheduler.running = list(self.requests)

    def abort(self, request_id):
        self.requests.pop(request_id, None)
        self.scheduler.running = list(self.requests)

    def has_unfinished(self):
        return bool(self.requests)

    def step(self):
        from engine.messages import Delta, StepStats

        now = time.perf_counter()
        if now < self.next_step:
            time.sleep(self.next_step - now)
        self.next_step = max(now, self.next_step) + self.step_s
        deltas = []
        for rid, state in list(self.requests.items()):
            token, state[1] = self.text_ids[state[1]], (state[1] + 1) % len(self.text_ids)
            state[0] -= 1
            finished = state[0] <= 0
            deltas.append(Delta(rid, [token], finished, "length" if finished else None, num_prompt_tokens=state[2]))
            if finished:
                del self.requests[rid]
        self.scheduler.running = list(self.requests)
        self.last_stats = StepStats(num_running=len(deltas), num_waiting=0, kv_cache_usage=0.0,
                                    batch_size=len(deltas), num_preemptions=0, timings={"forward": self.step_s})
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


def start(step_s: float) -> tuple[subprocess.Popen, str]:
    port = load.free_port()
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve-port", str(port),
                             "--step-ms", str(1e3 * step_s)], cwd=load.REPO_ROOT,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    return proc, load.wait_healthy(proc, f"http://127.0.0.1:{port}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--step-ms", type=float, default=1.4, help="the synthetic engine's step time")
    ap.add_argument("--serve-port", type=int, default=None, help=argparse.SUPPRESS)  # the server process's mode
    load.add_load_args(ap)
    args = ap.parse_args()
    if args.serve_port is not None:
        return serve_synthetic(args.serve_port, args.step_ms / 1e3)
    proc, base_url = start(args.step_ms / 1e3)
    try:
        server0 = load.process_cpu_s(proc.pid)
        results, elapsed, client_s = load.run_load(args, base_url)
        server1 = load.process_cpu_s(proc.pid)
        load.print_table(results, elapsed, args)
        print(f"the engine offers {1e3 / args.step_ms:.0f} steps/s: up to "
              f"{1e3 / args.step_ms * (args.concurrency or args.num_requests):,.0f} tok/s at this concurrency")
        load.print_cpu(results, client_s, None if server0 is None else server1 - server0,
                       len(load.make_shares(args)))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()
