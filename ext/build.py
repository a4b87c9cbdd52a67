"""Builds, finds and loads the CUDA extension (ext/csrc: ops.cpp and ops_layers.cpp, the torch-facing schemas and
launches, plus every torch-free *.cu kernel file). No silent fallback: `load_ops()` returns the op namespace
`torch.ops.ddtree` or None, and then `load_error()` says why in one line.

Ahead of time: `ddtree build-ext` (`build()`) compiles without a visible GPU for an explicit architecture list
(default `8.0;9.0a;9.0+PTX`: sm_80 and sm_90a machine code plus compute_90 PTX, which newer GPUs JIT-compile;
override with $DDTREE_CUDA_ARCH_LIST, same syntax as TORCH_CUDA_ARCH_LIST) into $DDTREE_EXT_DIR, else ext/lib/
inside the package, where pip installs and the Docker image find it. A library directory holds ddtree_ext.so and
build.json (torch and CUDA versions, source hash, architectures; ext/prebuilt.py reads and checks it).

At run time `load_ops()`, once per process:
  1. loads the first compatible prebuilt library with torch.ops.load_library, without a compiler (no nvcc, no
     ninja): $DDTREE_EXT_DIR alone when it is set, else ext/lib/ and then the JIT cache ($DDTREE_CACHE/ext, else
     ~/.cache/ddtree/ext). Compatible = same torch version, same CUDA version, built from these sources, and
     machine code or PTX the device can run;
  2. else, when nvcc and ninja are available, JIT-builds for the device's architecture into $DDTREE_EXT_DIR or
     the JIT cache (which then holds a prebuilt library for the next process);
  3. else returns None.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

from ext.prebuilt import (DEFAULT_ARCH_LIST, LIB_NAME, MANIFEST, check_dir, first_error_line, gencode_flags,
                          make_manifest, parse_arch_list, read_manifest, torch_arch_list)

CSRC = Path(__file__).resolve().parent / "csrc"
NAME = "ddtree_ext"  # the library is NAME + ".so" = LIB_NAME
NVCC_FLAGS = ["-O3", "-lineinfo"]

logger = logging.getLogger("ddtree.ext")


class BuildError(RuntimeError):
    """The extension cannot be built here; str(e) is the one-line reason."""


# ---- sources and toolchain -------------------------------------------------------------------------------------

def sources() -> list[Path]:
    return [*torch_sources(), *sorted(CSRC.glob("*.cu"))]


def torch_sources() -> list[Path]:
    """The torch-facing .cpp files (ops.cpp defines the `ddtree` library; the others add fragments to it)."""
    return sorted(CSRC.glob("*.cpp"))


def kernel_sources() -> list[Path]:
    """The torch-free .cu files (CI compiles each with nvcc alone)."""
    return sorted(CSRC.glob("*.cu"))


def source_hash() -> str:
    """sha256 over every source and header (name and bytes): a library built from other sources is stale."""
    h = hashlib.sha256()
    for path in sorted(p for p in CSRC.iterdir() if p.suffix in (".cpp", ".cu", ".cuh", ".h")):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def nvcc() -> str | None:
    """$CUDA_HOME/bin/nvcc (or $CUDA_PATH), else nvcc on PATH."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").exists():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def ninja() -> str | None:
    """ninja on PATH, else the one pip installs next to this interpreter (`pip install ninja`)."""
    found = shutil.which("ninja")
    if found:
        return found
    beside = Path(sys.executable).parent / "ninja"
    if beside.exists() and os.access(beside, os.X_OK):
        return str(beside)
    try:
        import ninja as ninja_pkg  # the PyPI package

        exe = Path(ninja_pkg.BIN_DIR) / "ninja"
        return str(exe) if exe.exists() else None
    except Exception:
        return None


def toolchain_missing() -> str | None:
    """Why a JIT build is impossible here (no nvcc / no ninja), or None."""
    if nvcc() is None:
        return "no CUDA compiler to build one (nvcc is not on PATH and CUDA_HOME is unset)"
    if ninja() is None:
        return "no ninja to build one (pip install ninja)"
    return None


def _cuda_home(nvcc_path: str) -> str:
    """The toolkit root of `nvcc_path`: $CUDA_HOME, else two levels up from the real nvcc, else nvcc's own TOP."""
    env = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if env:
        return env
    home = Path(os.path.realpath(nvcc_path)).parent.parent
    if (home / "include" / "cuda_runtime.h").exists():
        return str(home)
    try:  # a wrapper script: ask nvcc where it lives
        out = subprocess.run([nvcc_path, "-dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull],
                             capture_output=True, text=True, timeout=60)
        m = re.search(r"^#\$ TOP=(.+)$", out.stdout + out.stderr, re.MULTILINE)
        if m:
            return os.path.normpath(m.group(1).strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return str(home)


def target_defines(targets: list[str]) -> list[str]:
    """Macros the host passes see: DDTREE_SM90A when sm_90a machine code is built (the attention's warpgroup-MMA
    tiles, ext/csrc/wgmma.cuh)."""
    return ["-DDDTREE_SM90A"] if "sm_90a" in targets else []


def device_arch(capability: tuple[int, int]) -> str:
    """The architecture a JIT build targets for this device: its own, arch-specific on Hopper (9.0a: wgmma)."""
    return "9.0a" if tuple(capability) == (9, 0) else f"{capability[0]}.{capability[1]}"


def arch_list() -> str:
    """The ahead-of-time architecture list: $DDTREE_CUDA_ARCH_LIST, else DEFAULT_ARCH_LIST."""
    return os.environ.get("DDTREE_CUDA_ARCH_LIST") or DEFAULT_ARCH_LIST


# ---- library directories and build.json -------------------------------------------------------------------------

def package_lib_dir() -> Path:
    """ext/lib/ inside the installed package: where `ddtree build-ext` writes by default."""
    return Path(__file__).resolve().parent / "lib"


def cache_dir() -> Path:
    base = os.environ.get("DDTREE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "ddtree")
    return Path(base) / "ext"


def output_dir() -> Path:
    """Where `ddtree build-ext` writes: $DDTREE_EXT_DIR, else the package's ext/lib/."""
    return Path(os.environ["DDTREE_EXT_DIR"]) if os.environ.get("DDTREE_EXT_DIR") else package_lib_dir()


def jit_dir() -> Path:
    """Where a run-time (JIT) build goes: $DDTREE_EXT_DIR, else the JIT cache."""
    return Path(os.environ["DDTREE_EXT_DIR"]) if os.environ.get("DDTREE_EXT_DIR") else cache_dir()


def search_dirs() -> list[Path]:
    """Where load_ops() looks for a prebuilt library, in order."""
    if os.environ.get("DDTREE_EXT_DIR"):
        return [Path(os.environ["DDTREE_EXT_DIR"])]
    return [package_lib_dir(), cache_dir()]


def expected() -> dict:
    """What a compatible build.json must say about this process."""
    import torch

    return {"torch": torch.__version__, "cuda": torch.version.cuda, "source_hash": source_hash()}


def find_prebuilt(capability: tuple[int, int] | None = None) -> tuple[Path | None, list[str]]:
    """(the first directory whose library is compatible, else None; 'dir: reason' for each one rejected)."""
    want = expected()
    rejected = []
    for d in search_dirs():
        reason = check_dir(d, want, capability)
        if reason is None:
            return d, rejected
        rejected.append(f"{d}: {reason}")
    return None, rejected


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:400]


# ---- building ---------------------------------------------------------------------------------------------------

def workspace_dir(targets: list[str]) -> Path:
    """ninja's incremental workspace for one architecture list and one source folder (object files; never shipped).
    Per folder because two checkouts building at once in one workspace race: each installs the library the
    workspace holds when its own compile returns, which can be the other's (two trees built side by side for an A/B
    run came out as one library, twice: docs/BENCHMARKS.md 2026-12-04 12:04 and 2026-12-06 07:19)."""
    folder = hashlib.sha256(str(CSRC.resolve()).encode()).hexdigest()[:10]
    return cache_dir() / ("build-" + "-".join(targets) + "-" + folder)


def _compile(targets: list[str], verbose: bool) -> Path:
    """Compiles in workspace_dir(targets) and loads the result into this process (which also proves that it
    links and loads). Returns the built library. Raises BuildError."""
    global _built_here
    nv, nj = nvcc(), ninja()
    if nv is None or nj is None:
        raise BuildError(toolchain_missing() or "no toolchain")
    workspace = workspace_dir(targets)
    saved = {k: os.environ.get(k) for k in ("TORCH_CUDA_ARCH_LIST", "PATH", "CUDA_HOME")}
    log = ""
    try:
        workspace.mkdir(parents=True, exist_ok=True)
        os.environ["TORCH_CUDA_ARCH_LIST"] = torch_arch_list(targets)  # never query a device
        os.environ["CUDA_HOME"] = _cuda_home(nv)
        if shutil.which("ninja") is None:
            os.environ["PATH"] = str(Path(nj).parent) + os.pathsep + os.environ.get("PATH", "")
        from torch.utils import cpp_extension

        cpp_extension.CUDA_HOME = os.environ["CUDA_HOME"]  # else fixed when cpp_extension was first imported
        if verbose:
            print(f"ddtree: building the CUDA extension for {', '.join(targets)} in {workspace} "
                  f"(nvcc {nv}; takes minutes)", file=sys.stderr, flush=True)
        path = cpp_extension.load(
            name=NAME,
            sources=[str(s) for s in sources()],
            extra_cflags=["-O3"],
            extra_cuda_cflags=NVCC_FLAGS + gencode_flags(targets) + target_defines(targets),
            extra_include_paths=[str(CSRC)],
            build_directory=str(workspace),
            with_cuda=True,
            is_python_module=False,
            verbose=False,  # keeps the compiler output in the exception: its first error is the reason
        )
        _built_here = Path(path) if path else workspace / LIB_NAME
        return _built_here
    except BuildError:
        raise
    except Exception as e:
        log = str(e)
        raise BuildError(f"the build failed: {first_error_line(log)}") from e
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if log and verbose:
            print(log, file=sys.stderr, flush=True)


def _install(built: Path, out: Path, targets: list[str]) -> Path:
    """Copies the library next to its build.json in `out` (atomic renames)."""
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{LIB_NAME}.{os.getpid()}.tmp"
    shutil.copy2(built, tmp)
    os.replace(tmp, out / LIB_NAME)
    tmp = out / f".{MANIFEST}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(make_manifest(targets, expected()), indent=2) + "\n")
    os.replace(tmp, out / MANIFEST)
    return out / LIB_NAME


def build(out_dir: str | Path | None = None, arch_list_text: str | None = None, verbose: bool = False) -> Path:
    """Ahead-of-time build (`ddtree build-ext`): needs a CUDA build of torch, nvcc and ninja, never a GPU.
    Writes ddtree_ext.so and build.json into `out_dir` (default output_dir()); returns the library's path.
    Raises BuildError with a one-line reason."""
    import torch

    if torch.version.cuda is None:
        raise BuildError(f"torch {torch.__version__} is a CPU-only build: install a CUDA build of torch")
    missing = toolchain_missing()
    if missing:
        raise BuildError(missing.replace("to build one ", ""))
    try:
        targets = parse_arch_list(arch_list_text or arch_list())
    except ValueError as e:
        raise BuildError(str(e)) from None
    out = Path(out_dir) if out_dir is not None else output_dir()
    built = _compile(targets, verbose)
    try:
        return _install(built, out, targets)
    except OSError as e:
        raise BuildError(f"cannot write {out}: {e}") from e


# ---- loading ----------------------------------------------------------------------------------------------------

_lock = threading.Lock()
_state: tuple | None = None  # (ops namespace or None, error or None, library path or None)
_built_here: Path | None = None  # built (and so loaded) by this process: never load a second copy


def load_ops(verbose: bool = False):
    """torch.ops.ddtree once loaded (cached for the process), else None (load_error() says why). Never raises."""
    global _state
    if _state is None:
        with _lock:
            if _state is None:
                try:
                    _state = _load(verbose)
                except Exception as e:  # never take the caller down: the reason is reported instead
                    _state = (None, f"unexpected error while loading the CUDA extension: {_first_line(e)}", None)
                if _state[1]:
                    logger.info("CUDA extension unavailable: %s", _state[1])
    return _state[0]


def load_error() -> str | None:
    """One line: why load_ops() returns None (it tries the load first if nobody has); None once loaded."""
    load_ops()
    return _state[1]


def loaded_from() -> Path | None:
    """The library file this process loaded, if any."""
    load_ops()
    return _state[2]


def _loaded(path: Path, verbose: bool):
    import torch

    from ext import fake

    fake.register()
    if verbose:
        print(f"ddtree: CUDA extension loaded from {path}", file=sys.stderr, flush=True)
    logger.info("CUDA extension loaded from %s", path)
    return torch.ops.ddtree, None, path


def _load(verbose: bool):
    try:
        import torch
    except ImportError:
        return None, "torch is not installed", None
    if torch.version.cuda is None:
        return None, f"torch {torch.__version__} is a CPU-only build (torch.version.cuda is None)", None
    if not torch.cuda.is_available():
        return None, "no CUDA device is visible (torch.cuda.is_available() is False)", None
    if _built_here is not None:
        return _loaded(_built_here, verbose)
    capability = tuple(torch.cuda.get_device_capability())
    want = expected()
    rejected = []
    for d in search_dirs():
        reason = check_dir(d, want, capability)
        if reason is None:
            lib = d / (read_manifest(d) or {}).get("library", LIB_NAME)
            try:
                torch.ops.load_library(str(lib))
                return _loaded(lib, verbose)
            except Exception as e:
                reason = f"loading {lib.name} failed: {_first_line(e)}"
        rejected.append((d, reason))
    if all(r == "no prebuilt library" for _, r in rejected):
        found = "no prebuilt CUDA extension in " + " or ".join(str(d) for d, _ in rejected)
    else:
        found = "no usable prebuilt CUDA extension (" + "; ".join(
            f"{d}: {r}" for d, r in rejected if r != "no prebuilt library") + ")"
    missing = toolchain_missing()
    if missing:
        return None, f"{found} and {missing}; run `ddtree build-ext` where the CUDA toolkit is installed", None
    targets = parse_arch_list(os.environ.get("DDTREE_CUDA_ARCH_LIST") or device_arch(capability))
    logger.info("%s: JIT-building the CUDA extension for %s", found, ", ".join(targets))
    out = jit_dir()
    try:
        built = _compile(targets, verbose)
    except BuildError as e:
        return None, f"{found} and {e}", None
    try:
        _install(built, out, targets)
    except OSError as e:  # loaded anyway; the next process builds again
        logger.warning("cannot keep the JIT-built CUDA extension in %s: %s", out, e)
    return _loaded(built, verbose)
