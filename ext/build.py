"""Builds and caches the CUDA extension with torch.utils.cpp_extension (JIT on first use; `ddtree build-ext`
prebuilds). `load_ops()` returns the op namespace `torch.ops.ddtree`, or None where there is no CUDA device,
no CUDA build of torch, or no nvcc; it never raises (a failed build warns and returns None).

Sources: ext/csrc/ops.cpp (schemas, checks, launches) plus every ext/csrc/*.cu (torch-free kernels). Machine
code for sm_90 (H100/H200) plus compute_80 PTX as the portable fallback. The build directory is
$DDTREE_EXT_DIR, else $DDTREE_CACHE/ext, else ~/.cache/ddtree/ext; cpp_extension rebuilds when a source changes.
"""
from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

CSRC = Path(__file__).resolve().parent / "csrc"
NAME = "ddtree_ext"
NVCC_FLAGS = [
    "-O3",
    "-lineinfo",
    "-gencode=arch=compute_90,code=sm_90",
    "-gencode=arch=compute_80,code=compute_80",
]


def sources() -> list[Path]:
    return [CSRC / "ops.cpp", *sorted(CSRC.glob("*.cu"))]


def kernel_sources() -> list[Path]:
    """The torch-free .cu files (CI compiles each with nvcc alone)."""
    return sorted(CSRC.glob("*.cu"))


def nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").exists():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def build_dir() -> Path:
    if os.environ.get("DDTREE_EXT_DIR"):
        return Path(os.environ["DDTREE_EXT_DIR"])
    base = os.environ.get("DDTREE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "ddtree")
    return Path(base) / "ext"


_UNSET = object()
_ops = _UNSET


def load_ops(verbose: bool = False):
    """torch.ops.ddtree once built and loaded (cached for the process), else None."""
    global _ops
    if _ops is _UNSET:
        _ops = _load(verbose)
    return _ops


def _load(verbose: bool):
    try:
        import torch

        if torch.version.cuda is None or not torch.cuda.is_available() or nvcc() is None:
            return None
        from torch.utils import cpp_extension

        out = build_dir()
        out.mkdir(parents=True, exist_ok=True)
        cpp_extension.load(
            name=NAME,
            sources=[str(s) for s in sources()],
            extra_cflags=["-O3"],
            extra_cuda_cflags=NVCC_FLAGS,
            extra_include_paths=[str(CSRC)],
            build_directory=str(out),
            with_cuda=True,
            is_python_module=False,
            verbose=verbose,
        )
        from ext import fake

        fake.register()
        return torch.ops.ddtree
    except Exception as e:  # a broken toolchain must not take the engine down: the reference still works
        warnings.warn(f"ddtree CUDA extension unavailable, using the PyTorch reference ops: {e}", stacklevel=2)
        return None
