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
                  "--budget", "8", "--no-adaptive")  # a fixed budget: every step verifies a tree
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


def test_cli_defaults_are_the_config_dataclasses_defaults():
    """Flags carry no defaults of their own: `serve` and `generate` with no flags build exactly the
    dataclasses' defaults (serve's one documented difference: the n-gram drafter), and every field has a flag
    whose --help text is the field's own."""
    import dataclasses

    from engine.config import EngineConfig, SpecConfig
    from engine.drafters import shipped_drafter_dir
    from server import cli
    from server.config import ServerConfig
    from server.flags import cli_fields, flag_name

    p = cli.parser()
    serve_args = p.parse_args(["serve"])
    server, engine = cli.serve_configs(serve_args)
    assert server == ServerConfig()
    assert engine == EngineConfig(spec=SpecConfig(**cli.SERVE_SPEC_DEFAULTS))
    # the embedded model's shipped drafter is one flag away; another model needs its own
    shipped = cli.serve_configs(p.parse_args(["serve", "--drafter", "dflash"]))[1].spec
    assert shipped.draft_model == shipped_drafter_dir()
    assert cli.serve_configs(p.parse_args(["serve", ".", "--draft-model", "d"]))[1].spec.drafter == "dflash"
    with pytest.raises(ValueError, match="needs --draft-model"):
        cli.serve_configs(p.parse_args(["serve", ".", "--drafter", "dflash"]))
    generate_args = p.parse_args(["generate", "--prompt", "hi"])
    assert cli.engine_config(generate_args) == EngineConfig()
    assert cli.engine_config(p.parse_args(["generate", "--prompt", "hi", "--draft-model", "x"])).spec.drafter == \
        "dflash"
    serve_help = p._subparsers._group_actions[0].choices["serve"].format_help()
    for cls in (EngineConfig, SpecConfig, ServerConfig):
        for f in cli_fields(cls):
            name = f.name if f.metadata.get("positional") else flag_name(f)
            assert name in serve_help, name
    assert {f.name for f in dataclasses.fields(EngineConfig)} - {f.name for f in cli_fields(EngineConfig)} == \
        {"spec", "test_fault_seed"}
    assert cli.serve_configs(p.parse_args(["serve", "--kv-cache-memory", "2G", "--no-access-log"]))[1] \
        .kv_cache_memory == 2 << 30
