"""What a prebuilt CUDA extension directory holds and whether it can serve this process, as pure functions
(ext.build does the building and loading): architecture lists, build.json, the compatibility reasons, and the
first error of a build log. A directory holds ddtree_ext.so and build.json, which records the torch and CUDA
versions, the sources' hash and the architectures (machine code `sm_XY`, PTX `compute_XY`)."""
from __future__ import annotations

import datetime
import json
import re
import sys
from pathlib import Path

LIB_NAME = "ddtree_ext.so"
MANIFEST = "build.json"
# sm_80 and sm_90a (Hopper's warpgroup MMAs) machine code, compute_90 PTX for newer GPUs (gencode_flags leaves the
# listed sm_90 machine code out)
DEFAULT_ARCH_LIST = "8.0;9.0a;9.0+PTX"


# ---- architectures -----------------------------------------------------------------------------------------------

def parse_arch_list(text: str) -> list[str]:
    """'8.0;9.0+PTX' (TORCH_CUDA_ARCH_LIST syntax, ';', ',' or spaces between) -> targets
    ['sm_80', 'sm_90', 'compute_90']: machine code per entry, plus PTX where it says +PTX."""
    targets: list[str] = []
    for item in re.split(r"[;,\s]+", text.strip()):
        if not item:
            continue
        m = re.fullmatch(r"(\d+)\.(\d)([af]?)(\+PTX)?", item, re.IGNORECASE)
        if not m:
            raise ValueError(f"bad CUDA architecture {item!r} in {text!r} (expected e.g. 8.0;9.0+PTX)")
        num = f"{m.group(1)}{m.group(2)}{m.group(3).lower()}"
        for t in [f"sm_{num}"] + ([f"compute_{num}"] if m.group(4) else []):
            if t not in targets:
                targets.append(t)
    if not targets:
        raise ValueError(f"empty CUDA architecture list {text!r}")
    return targets


def gencode_flags(targets: list[str]) -> list[str]:
    """['sm_80', 'compute_90'] -> nvcc -gencode flags (machine code for sm_*, PTX for compute_*). Generic machine
    code beside the same version's arch-specific one (sm_90 with sm_90a) is left out: the device would hold two
    cubins and the driver picks one, and only the arch-specific one runs the warpgroup attention."""
    flags = []
    for t in targets:
        if t.startswith("sm_") and (t + "a" in targets or t + "f" in targets):
            continue
        kind, num = t.split("_", 1)
        flags.append(f"-gencode=arch=compute_{num},code={'sm' if kind == 'sm' else 'compute'}_{num}")
    return flags


def torch_arch_list(targets: list[str]) -> str:
    """targets -> the TORCH_CUDA_ARCH_LIST spelling ('8.0;9.0+PTX'), set during builds so torch never asks a
    device which architecture to build for."""
    out = []
    for t in targets:
        kind, num = t.split("_", 1)
        digits, suffix = num.rstrip("af"), num[len(num.rstrip("af")):]
        name = f"{digits[:-1]}.{digits[-1]}{suffix}"
        if kind == "sm":
            out.append(name)
        elif name in out:
            out[out.index(name)] = name + "+PTX"
        else:
            out.append(name + "+PTX")
    return ";".join(out)


def _target_cc(target: str) -> tuple[str, int, int, bool]:
    kind, num = target.split("_", 1)
    digits = num.rstrip("af")
    return kind, int(digits[:-1]), int(digits[-1]), digits != num


def covers(targets: list[str], capability: tuple[int, int]) -> bool:
    """Whether a library with these targets runs on a device of this compute capability: machine code of the
    same major version and a lower or equal minor one, or PTX of a lower or equal version (arch-specific 'a'/'f'
    targets only on their exact version)."""
    major, minor = capability
    for t in targets:
        kind, tmaj, tmin, specific = _target_cc(t)
        if specific:
            ok = (tmaj, tmin) == (major, minor)
        elif kind == "sm":
            ok = tmaj == major and tmin <= minor
        else:
            ok = (tmaj, tmin) <= (major, minor)
        if ok:
            return True
    return False


# ---- build.json ---------------------------------------------------------------------------------------------------

def make_manifest(targets: list[str], want: dict) -> dict:
    """build.json for a library built for `targets` in this process (`want`: torch, cuda, source_hash)."""
    import torch

    return {**want, "library": LIB_NAME, "archs": list(targets), "arch_list": torch_arch_list(targets),
            "python": f"{sys.version_info.major}.{sys.version_info.minor}",
            "built": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "cxx11_abi": bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))}


def read_manifest(directory: Path) -> dict | None:
    try:
        return json.loads((Path(directory) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def check_manifest(manifest: dict, want: dict, capability: tuple[int, int] | None = None) -> str | None:
    """Why a library described by `manifest` cannot serve this process (`want` = expected()), or None if it can."""
    if not isinstance(manifest, dict) or any(k not in manifest for k in ("torch", "cuda", "source_hash", "archs")):
        return f"{MANIFEST} is incomplete"
    if manifest["torch"] != want["torch"]:
        return f"built for torch {manifest['torch']}, this is torch {want['torch']}"
    if manifest["cuda"] != want["cuda"]:
        return f"built for CUDA {manifest['cuda']}, this torch uses CUDA {want['cuda']}"
    if manifest["source_hash"] != want["source_hash"]:
        return "built from other sources (ext/csrc changed since)"
    if capability is not None:
        try:
            ok = covers(list(manifest["archs"]), capability)
        except (ValueError, AttributeError, TypeError):
            return f"{MANIFEST} has unreadable architectures {manifest['archs']!r}"
        if not ok:
            return (f"built for {', '.join(manifest['archs'])}, the device is sm_{capability[0]}{capability[1]}; "
                    f"rebuild with DDTREE_CUDA_ARCH_LIST including {capability[0]}.{capability[1]}")
    return None


def check_dir(directory: Path, want: dict, capability: tuple[int, int] | None = None) -> str | None:
    """Why the library in `directory` cannot be loaded here, or None if it can."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    if manifest is None:
        return "no prebuilt library" if not (directory / LIB_NAME).exists() else f"no readable {MANIFEST}"
    if not (directory / manifest.get("library", LIB_NAME)).exists():
        return f"{MANIFEST} but no {manifest.get('library', LIB_NAME)}"
    return check_manifest(manifest, want, capability)


# ---- build logs ---------------------------------------------------------------------------------------------------

_ERROR_LINE = re.compile(r"(\berror\b|undefined reference|undefined symbol|cannot find -l|fatal)", re.IGNORECASE)


def first_error_line(text: str) -> str:
    """The first line of a build log that reports an error (compiler, linker), else its first non-empty line."""
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    skip = ("FAILED:", "ninja: build stopped", "Error building extension", "[", "#$")
    for line in lines:
        if _ERROR_LINE.search(line) and not line.startswith(skip):
            return line[:400]
    for line in lines:
        if line.startswith("Error building extension") and ":" in line:
            head, _, rest = line.partition(": ")
            if rest:
                return rest[:400]
    return lines[0][:400] if lines else "unknown error"
