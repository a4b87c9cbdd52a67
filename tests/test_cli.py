"""`ddtree generate`: text and --json output, every drafter mode, and one-line errors for bad flags."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ddtree(*args, timeout=300):
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "server", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout, env=env)


def test_generate_embedded_chat_json():
    proc = ddtree("generate", "--prompt", "What is the capital of France?", "--chat", "--max-tokens", "12", "--json")
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "Paris" in record["text"]
    assert len(record["token_ids"]) == record["num_generated_tokens"] <= 12
    assert record["elapsed_s"] > 0 and record["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize("drafter", ["ngram", "oracle"])
def test_generate_with_drafter_reports_acceptance(tiny_checkpoints, drafter):
    folder, _ = tiny_checkpoints("llama")
    plain = ddtree("generate", folder, "--prompt-ids", "1,2,3", "--max-tokens", "24", "--json")
    spec = ddtree("generate", folder, "--prompt-ids", "1,2,3", "--max-tokens", "24", "--json", "--drafter", drafter,
                  "--budget", "8")
    assert plain.returncode == 0 and spec.returncode == 0, spec.stderr
    a, b = json.loads(plain.stdout), json.loads(spec.stdout)
    assert a["token_ids"] == b["token_ids"]
    assert b["steps"] >= 1 and b["mean_accept_length"] >= 1.0
    accepted_drafts = b["mean_accept_length"] * b["steps"] - b["steps"]  # tokens per step minus each bonus
    assert sum(b["accepted_per_depth"]) == pytest.approx(accepted_drafts)
    if drafter == "oracle":
        assert b["mean_accept_length"] > 4


@pytest.mark.parametrize("args,needle", [
    (["--budget", "-1", "--drafter", "ngram"], "budget"),
    (["--drafter", "dflash"], "draft-model"),
    (["--dtype", "fp32", "--max-tokens", "0"], "max_tokens"),
])
def test_bad_flags_are_one_line(tiny_checkpoints, args, needle):
    folder, _ = tiny_checkpoints("llama")
    proc = ddtree("generate", folder, "--prompt-ids", "5,6", *args)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], proc.stderr
