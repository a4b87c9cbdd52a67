"""Bad checkpoints fail with one line naming the file, tensor or field — never a deep traceback and never a
silently wrong model."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from engine.model.errors import CheckpointError, ConfigError
from engine.model.loader import load_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def checkpoint(tiny_checkpoints, tmp_path):
    """A private copy of the tiny Llama checkpoint that a test may damage."""
    folder, _ = tiny_checkpoints("llama")
    dst = tmp_path / "ckpt"
    shutil.copytree(folder, dst)
    return dst


def edit_config(folder, **changes):
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def one_line(err) -> str:
    msg = str(err)
    assert "\n" not in msg
    return msg


def test_missing_path(tmp_path):
    with pytest.raises(CheckpointError) as e:
        load_model(str(tmp_path / "nope"))
    assert str(tmp_path / "nope") in one_line(e.value)


def test_missing_config(checkpoint):
    (checkpoint / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json"):
        load_model(str(checkpoint))


def test_corrupt_config(checkpoint):
    (checkpoint / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError) as e:
        load_model(str(checkpoint))
    assert "config.json" in one_line(e.value)


def test_truncated_weights(checkpoint):
    path = checkpoint / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])
    with pytest.raises(CheckpointError) as e:
        load_model(str(checkpoint))
    assert "model.safetensors" in one_line(e.value)


def test_pickle_only_is_refused(checkpoint):
    (checkpoint / "model.safetensors").rename(checkpoint / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pickle"):
        load_model(str(checkpoint))


def test_unsupported_architecture(checkpoint):
    edit_config(checkpoint, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ConfigError) as e:
        load_model(str(checkpoint))
    assert "GPT2LMHeadModel" in one_line(e.value)


@pytest.mark.parametrize("field,value", [("hidden_act", "gelu"), ("pretraining_tp", 2),
                                         ("rope_parameters", {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0})])
def test_unhandled_config_field_is_named(checkpoint, field, value):
    edit_config(checkpoint, **{field: value})
    if field == "rope_parameters":
        edit_config(checkpoint, rope_scaling=None)
    with pytest.raises(ConfigError) as e:
        load_model(str(checkpoint))
    assert field.split("_")[0] in one_line(e.value)


def test_missing_tensor_is_named(checkpoint):
    from safetensors.torch import load_file, save_file

    path = str(checkpoint / "model.safetensors")
    state = load_file(path)
    del state["model.layers.1.mlp.down_proj.weight"]
    save_file(state, path)
    with pytest.raises(CheckpointError, match="model.layers.1.mlp.down_proj.weight"):
        load_model(str(checkpoint))


def test_wrong_shape_is_named(checkpoint):
    edit_config(checkpoint, intermediate_size=96)
    with pytest.raises(CheckpointError, match=r"mlp\..*shape"):
        load_model(str(checkpoint))


def test_cli_reports_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "server", "generate", str(tmp_path / "missing"), "--prompt", "hi"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "missing" in lines[0] and lines[0].startswith("ddtree: error:")
