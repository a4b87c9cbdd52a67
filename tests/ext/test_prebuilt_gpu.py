"""The extension ships ahead of time: `ddtree build-ext` builds it with no GPU visible, and a fresh process with no
compiler (nvcc and ninja off PATH, CUDA_HOME unset) loads it and runs an op without touching the toolchain;
with nothing prebuilt and no compiler, load_ops() is None and load_error() names the reason. Also: a CUDA call
that the reference serves is counted."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ext import build, ops

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


def no_compiler_env(**extra) -> dict:
    """This environment without CUDA_HOME/CUDA_PATH and without the PATH entries that hold nvcc or ninja."""
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "CUDA_PATH")}
    keep = [d for d in env.get("PATH", "").split(os.pathsep)
            if d and not any((Path(d) / exe).exists() for exe in ("nvcc", "ninja"))]
    env["PATH"] = os.pathsep.join(keep)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])  # keep site dirs
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_python(code: str, env: dict, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=timeout)


LOAD_AND_RUN = """
import shutil, sys, torch
from ext import build, ops
assert build.nvcc() is None and shutil.which("ninja") is None, (build.nvcc(), shutil.which("ninja"))
lib = build.load_ops()
assert lib is not None, build.load_error()
assert str(build.loaded_from()).startswith(sys.argv[1]), build.loaded_from()
x = torch.randn(4, 1000, device="cuda")
tok = ops.sample_tokens(x, torch.zeros(4), torch.zeros(4), torch.zeros(4, dtype=torch.float64))
assert torch.equal(tok, x.argmax(-1)), tok
assert ops.cuda_calls() == {"sample_tokens": 1} and ops.reference_fallbacks() == {}
assert "torch.utils.cpp_extension" not in sys.modules, "the loader imported the build machinery"
print("loaded", build.loaded_from())
"""


def test_build_without_gpu_then_load_without_compiler(tmp_path):
    out, cache = tmp_path / "lib", tmp_path / "cache"
    env = dict(os.environ, DDTREE_EXT_DIR=str(out), DDTREE_CACHE=str(cache), CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=str(ROOT))
    env.pop("DDTREE_CUDA_ARCH_LIST", None)
    code = ("import sys, torch\nassert not torch.cuda.is_available()\n"
            "from server.cli import main\nsys.exit(main(['build-ext']))")
    proc = run_python(code, env, timeout=3600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    assert sorted(p.name for p in out.iterdir()) == ["build.json", "ddtree_ext.so"]
    manifest = json.loads((out / "build.json").read_text())
    assert manifest["archs"] == ["sm_80", "sm_90a", "sm_90", "compute_90"], manifest
    assert manifest["torch"] == torch.__version__ and manifest["cuda"] == torch.version.cuda
    assert manifest["source_hash"] == build.source_hash()

    proc = run_python(LOAD_AND_RUN, no_compiler_env(DDTREE_EXT_DIR=out, DDTREE_CACHE=tmp_path / "empty-cache"),
                      str(out))
    assert proc.returncode == 0 and "loaded" in proc.stdout, proc.stdout + proc.stderr[-4000:]


def test_no_prebuilt_and_no_compiler_says_why(tmp_path):
    empty = tmp_path / "ext"
    empty.mkdir()
    code = "from ext import build\nassert build.load_ops() is None\nprint(build.load_error())"
    env = no_compiler_env(DDTREE_EXT_DIR=empty, DDTREE_CACHE=tmp_path / "cache")
    proc = run_python(code, env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    reason = proc.stdout.strip()
    assert reason.startswith(f"no prebuilt CUDA extension in {empty} and no CUDA compiler"), reason
    assert "nvcc is not on PATH" in reason and "ddtree build-ext" in reason and "\n" not in reason

    stale = {"torch": "0.0.1+cu000", "cuda": torch.version.cuda, "source_hash": build.source_hash(),
             "archs": ["sm_90"], "library": "ddtree_ext.so"}
    (empty / "build.json").write_text(json.dumps(stale))
    (empty / "ddtree_ext.so").write_bytes(b"not a library")
    proc = run_python(code, env)
    reason = proc.stdout.strip()
    assert f"built for torch 0.0.1+cu000, this is torch {torch.__version__}" in reason, reason
    assert "no CUDA compiler" in reason


def test_reference_served_cuda_calls_are_counted():
    assert build.load_ops() is not None, build.load_error()
    ops.take_reference_fallbacks()
    logits = torch.randn(1, 2, 3000, device="cuda")
    lp, ids = ops.topk_logprobs(logits, 1100)  # k above the kernel's 1024
    assert ids.shape == (1, 2, 1100)
    assert ops.take_reference_fallbacks() == {"topk_logprobs": 1}


ENGINE_WITHOUT_EXTENSION = """
import sys
from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.core import EngineCore
from ext import ops
try:
    EngineCore(EngineConfig(model=sys.argv[1], device="cuda", dtype="fp32", max_model_len=128))
except RuntimeError as e:
    print("REFUSED:", e)
else:
    raise SystemExit("the engine started on CUDA without its extension")
llm = LLM(sys.argv[1], device="cuda", dtype="fp32", max_model_len=128, reference_kernels=True)
out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
assert len(out.token_ids) == 4
print("FALLBACKS:", sorted(ops.reference_fallbacks()))
"""


def test_engine_refuses_cuda_without_the_extension_unless_asked(tmp_path, tiny_checkpoints):
    """On CUDA with no loadable extension the engine fails at startup with the loader's reason; with
    --reference-kernels it starts, runs the references and counts them."""
    folder, _ = tiny_checkpoints("llama")
    empty = tmp_path / "ext"
    empty.mkdir()
    env = no_compiler_env(DDTREE_EXT_DIR=empty, DDTREE_CACHE=tmp_path / "cache")
    proc = run_python(ENGINE_WITHOUT_EXTENSION, env, folder)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    refused = next(line for line in proc.stdout.splitlines() if line.startswith("REFUSED:"))
    assert "the CUDA extension cannot be loaded" in refused and "no prebuilt" in refused and "build-ext" in refused
    assert "paged_attention" in proc.stdout.split("FALLBACKS:")[1]
    assert "running ext's PyTorch references on the GPU" in proc.stderr
