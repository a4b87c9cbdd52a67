"""A server with --tensor-parallel-size 2 (CPU, gloo) on a tiny Llama with a real tokenizer: it serves, and when
the second rank is killed mid-request the open stream ends with an error, /health turns 503 and the server exits 1
for its orchestrator to restart it, as after an engine death."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.server.conftest import (REPO_ROOT, build_byte_level_tokenizer, child_pids, engine_pid, free_port,
                                  start_server, stop_server)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    """A tiny Llama (4 heads, 2 KV heads) with a real tokenizer, as a served checkpoint folder."""
    import torch
    import transformers as tf

    folder = str(tmp_path_factory.mktemp("tiny-llama-tok"))
    tokenizer = build_byte_level_tokenizer(folder, vocab_size=1024)
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    tf.LlamaForCausalLM(cfg).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tp_server(tmp_path_factory, tiny_llama):
    folder = tiny_llama
    s = start_server(tmp_path_factory.mktemp("tp-logs"), "tp", "--tensor-parallel-size", "2", "--drafter", "none",
                     "--max-model-len", "4096", model=folder)
    try:
        yield s
    finally:
        stop_server(s)


def follower_pid(s) -> int:
    for pid in child_pids(engine_pid(s)):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"engine.ranks" in f.read():
                return pid
    raise AssertionError("the engine has no second rank")


def test_two_ranks_serve_and_a_killed_rank_fails_the_request_and_the_server(tp_server):
    s = tp_server
    model = httpx.get(s.base_url + "/v1/models", timeout=5).json()["data"][0]["id"]
    r = httpx.post(s.base_url + "/v1/completions", timeout=60,
                   json={"model": model, "prompt": "def f(x):", "max_tokens": 16, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16, r.text
    body = {"model": model, "prompt": "import os", "max_tokens": 4000, "ignore_eos": True, "stream": True,
            "temperature": 1.0}
    with httpx.stream("POST", s.base_url + "/v1/completions", json=body, timeout=60) as stream:
        lines = stream.iter_lines()
        for line in lines:
            if line.startswith("data: ") and json.loads(line[6:]).get("choices"):
                break  # the request is running on both ranks
        os.kill(follower_pid(s), signal.SIGKILL)
        killed = time.monotonic()
        rest = [line[6:] for line in lines if line.startswith("data: ")]
    assert time.monotonic() - killed < 30
    assert rest[-1] == "[DONE]", rest[-3:]
    error = json.loads(rest[-2])["error"]
    assert error["code"] == "service_unavailable", error
    health = httpx.get(s.base_url + "/health", timeout=5)
    assert health.status_code == 503 and "engine" in health.json()["error"]["message"]
    assert s.proc.wait(timeout=60) == 1, s.log_tail()


def test_torchrun_starts_the_ranks_and_rank_0_serves(tiny_llama, tmp_path):
    """`torchrun --nproc-per-node 2 -m server serve ... --tensor-parallel-size 2`: rank 0 serves HTTP, rank 1 runs
    only its engine, both rendezvous on torchrun's store; the greedy output is the one-rank output; SIGTERM to
    torchrun leaves no process of the launch behind."""
    from engine import LLM, SamplingParams

    port = free_port()
    log_path = tmp_path / "torchrun.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "server",
           "serve", tiny_llama, "--tensor-parallel-size", "2", "--drafter", "ngram", "--host", "127.0.0.1",
           "--port", str(port), "--max-model-len", "1024", "--kv-cache-memory", "64M", "--log-level", "info"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=env,
                                start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, log_path.read_text()[-3000:]
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        model = httpx.get(base + "/v1/models", timeout=5).json()["data"][0]["id"]
        prompt = [5, 17, 300, 42, 9, 77]
        r = httpx.post(base + "/v1/completions", timeout=60, json={"model": model, "prompt": prompt, "max_tokens": 16,
                                                                   "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        want = LLM(tiny_llama).generate([prompt], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0]
        assert r.json()["choices"][0]["text"] == want.text
        log = log_path.read_text()
        assert "tensor parallel: 2 ranks started by torchrun" in log and "rank 1 of 2 (torchrun) ready" in log
        proc.send_signal(signal.SIGTERM)  # a supervisor stopping the launch: torchrun stops its ranks
        proc.wait(timeout=60)  # torchrun exits 1 when signalled (its own convention)
        deadline = time.monotonic() + 30
        while True:  # no rank, engine or follower outlives it
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            assert time.monotonic() < deadline, "processes of the launch outlived torchrun"
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_structured_output_on_two_ranks_equals_one_rank(tiny_llama):
    """Each rank compiles the request's grammar and builds the same grammar-aware DDTree trees on its host."""
    from engine import LLM, SamplingParams
    from engine.grammar import json_schema_grammar

    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "b": {"type": "string", "maxLength": 5}},
              "required": ["a", "b"], "additionalProperties": False}
    sp = SamplingParams(max_tokens=40, temperature=0, grammar=json_schema_grammar(schema))
    texts = {}
    for tp in (1, 2):
        with LLM(tiny_llama, drafter="ngram", spec_budget=8, tensor_parallel_size=tp) as llm:
            texts[tp] = [o.text for o in llm.generate([[5, 17, 300], [9, 9, 9, 12]], sp)]
    assert texts[2] == texts[1]
    assert all(set(json.loads(t)) == {"a", "b"} for t in texts[2])
