"""A server with --tensor-parallel-size 2 (CPU, gloo) on a tiny Llama with a real tokenizer: it serves, and when
the second rank is killed mid-request the open stream ends with an error, /health turns 503 and the server exits 1
for its orchestrator to restart it, as after an engine death."""
from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest

from tests.server.conftest import build_byte_level_tokenizer, child_pids, engine_pid, start_server, stop_server


@pytest.fixture(scope="module")
def tp_server(tmp_path_factory):
    import torch
    import transformers as tf

    folder = str(tmp_path_factory.mktemp("tiny-llama-tok"))
    tokenizer = build_byte_level_tokenizer(folder, vocab_size=1024)
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    tf.LlamaForCausalLM(cfg).save_pretrained(folder)
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
