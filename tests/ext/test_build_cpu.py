"""CPU checks of the CUDA extension: every kernel source compiles with nvcc alone for the shipped architectures
(syntax, types, ptxas), ops.cpp compiles against torch's headers, the pure-Python build/load logic (ext.prebuilt:
build.json compatibility, architecture lists; ext.build: the one-line reasons), and without a GPU every op in
ext.ops falls back to the reference with the same results; reference calls on CUDA tensors are counted and
warned about."""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from ext import build, dispatch, ops, prebuilt, reference
from ext.metadata import build_metadata, pack_bits


@pytest.mark.extended  # every GPU session builds all of them (`ddtree build-ext`) before its tests
@pytest.mark.skipif(build.nvcc() is None, reason="nvcc is not on PATH (the CUDA toolkit is not installed)")
def test_every_kernel_source_compiles_with_nvcc(tmp_path):
    sources = build.kernel_sources()
    assert {s.name for s in sources} >= {"attention.cu", "attention_gqa.cu", "attention_mla.cu", "cache.cu",
                                         "topk.cu", "tree_build.cu", "tree_accept.cu", "sampling.cu", "layers.cu"}
    arch_flags = prebuilt.gencode_flags(prebuilt.parse_arch_list(prebuilt.DEFAULT_ARCH_LIST))  # what build-ext ships

    def compile_one(src):
        cmd = [build.nvcc(), "-c", *arch_flags, "-std=c++17", "-Xptxas", "-O0", "-I", str(build.CSRC), str(src),
               "-o", str(tmp_path / (src.stem + ".o"))]
        return src.name, subprocess.run(cmd, capture_output=True, text=True)

    with ThreadPoolExecutor(max_workers=2) as pool:
        for name, proc in pool.map(compile_one, sources):
            assert proc.returncode == 0, f"{name}:\n{proc.stderr[-4000:]}"


@pytest.mark.extended  # as above
@pytest.mark.skipif(build.nvcc() is None or shutil.which("g++") is None, reason="needs nvcc (CUDA headers) and g++")
@pytest.mark.parametrize("name", [p.name for p in build.torch_sources()])
def test_ops_cpp_compiles_against_torch_headers(tmp_path, name):
    """ops.cpp and ops_layers.cpp, the torch-facing files, against this torch's headers (a syntax and type check:
    CPU wheels lack one generated CUDA header, stubbed here)."""
    from torch.utils import cpp_extension

    stub = tmp_path / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    (stub / "cuda_cmake_macros.h").write_text("#pragma once\n")
    includes = [str(tmp_path), *cpp_extension.include_paths(), str(build.CSRC),
                str(Path(build._cuda_home(build.nvcc())) / "include"),
                sysconfig.get_paths()["include"]]
    std = "-std=c++20" if tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 12) else "-std=c++17"
    cmd = ["g++", std, "-fsyntax-only", *[f"-I{i}" for i in includes], str(build.CSRC / name)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_kernel_sources_are_torch_free():
    for src in build.kernel_sources() + sorted(build.CSRC.glob("*.cuh")) + [build.CSRC / "kernels.h"]:
        includes = [line for line in src.read_text().splitlines() if line.lstrip().startswith("#include")]
        assert not [i for i in includes if any(w in i for w in ("torch", "ATen", "c10", "pybind"))], src.name


def test_sources_stay_small():
    for src in build.CSRC.iterdir():
        assert len(src.read_text().splitlines()) <= 400, src.name


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only fallback")
def test_load_ops_is_none_without_cuda():
    assert build.load_ops() is None
    assert "CPU-only build" in build.load_error() and torch.__version__ in build.load_error()


# ---- build.json, architectures, reasons --------------------------------------------------------------------------

WANT = {"torch": "2.11.0+cu130", "cuda": "13.0", "source_hash": "abc"}


def manifest(**over):
    return {**WANT, "library": prebuilt.LIB_NAME, "archs": ["sm_80", "sm_90", "compute_90"], **over}


def test_manifest_compatibility():
    assert prebuilt.check_manifest(manifest(), WANT, (9, 0)) is None
    assert prebuilt.check_manifest(manifest(), WANT) is None  # no device to check
    assert prebuilt.check_manifest(manifest(torch="2.10.0+cu128"), WANT) == \
        "built for torch 2.10.0+cu128, this is torch 2.11.0+cu130"
    assert prebuilt.check_manifest(manifest(cuda="12.8"), WANT) == "built for CUDA 12.8, this torch uses CUDA 13.0"
    assert "other sources" in prebuilt.check_manifest(manifest(source_hash="def"), WANT)
    reason = prebuilt.check_manifest(manifest(archs=["sm_90"]), WANT, (8, 0))
    assert reason.startswith("built for sm_90, the device is sm_80") and "8.0" in reason
    assert "incomplete" in prebuilt.check_manifest({"torch": "x"}, WANT)
    assert prebuilt.check_manifest(manifest(), WANT, (12, 0)) is None  # compute_90 PTX runs on newer GPUs


@pytest.mark.parametrize("cc, ok", [((8, 0), True), ((8, 6), True), ((8, 9), True), ((9, 0), True),
                                    ((10, 0), True), ((12, 1), True), ((7, 5), False)])
def test_default_archs_cover(cc, ok):
    assert prebuilt.covers(prebuilt.parse_arch_list(prebuilt.DEFAULT_ARCH_LIST), cc) is ok


def test_arch_lists():
    targets = prebuilt.parse_arch_list("8.0;9.0+PTX")
    assert targets == ["sm_80", "sm_90", "compute_90"]
    assert prebuilt.gencode_flags(targets) == ["-gencode=arch=compute_80,code=sm_80",
                                            "-gencode=arch=compute_90,code=sm_90",
                                            "-gencode=arch=compute_90,code=compute_90"]
    assert prebuilt.torch_arch_list(targets) == "8.0;9.0+PTX"
    assert prebuilt.parse_arch_list("9.0a, 10.0 12.0+PTX") == ["sm_90a", "sm_100", "sm_120", "compute_120"]
    assert prebuilt.covers(["sm_90a"], (9, 0)) and not prebuilt.covers(["sm_90a"], (10, 0))
    assert not prebuilt.covers(["sm_90"], (8, 9)) and not prebuilt.covers(["sm_80"], (9, 0))
    with pytest.raises(ValueError):
        prebuilt.parse_arch_list("sm_90")


def test_hopper_builds_carry_the_warpgroup_attention():
    """A JIT build on a 9.0 device targets sm_90a (wgmma); the host passes learn it from -DDDTREE_SM90A, which
    the ahead-of-time default list gets too."""
    assert build.device_arch((9, 0)) == "9.0a" and build.device_arch((8, 9)) == "8.9"
    assert build.device_arch((10, 0)) == "10.0"
    assert build.target_defines(prebuilt.parse_arch_list(prebuilt.DEFAULT_ARCH_LIST)) == ["-DDDTREE_SM90A"]
    assert build.target_defines(prebuilt.parse_arch_list("8.0;9.0+PTX")) == []
    # one cubin for a 9.0 device: the arch-specific one (the driver would pick between two)
    assert prebuilt.gencode_flags(prebuilt.parse_arch_list(prebuilt.DEFAULT_ARCH_LIST)) == [
        "-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90a,code=sm_90a",
        "-gencode=arch=compute_90,code=compute_90"]


def test_check_dir_and_search_order(tmp_path, monkeypatch):
    monkeypatch.setenv("DDTREE_EXT_DIR", str(tmp_path))
    assert build.search_dirs() == [tmp_path] and build.output_dir() == tmp_path == build.jit_dir()
    assert prebuilt.check_dir(tmp_path, WANT) == "no prebuilt library"
    (tmp_path / prebuilt.MANIFEST).write_text(json.dumps(manifest()))
    assert prebuilt.check_dir(tmp_path, WANT) == f"{prebuilt.MANIFEST} but no {prebuilt.LIB_NAME}"
    (tmp_path / prebuilt.LIB_NAME).write_bytes(b"")
    assert prebuilt.check_dir(tmp_path, WANT, (9, 0)) is None
    (tmp_path / prebuilt.MANIFEST).write_text("{not json")
    assert prebuilt.check_dir(tmp_path, WANT) == f"no readable {prebuilt.MANIFEST}"
    monkeypatch.delenv("DDTREE_EXT_DIR")
    monkeypatch.setenv("DDTREE_CACHE", str(tmp_path / "cache"))
    assert build.search_dirs() == [build.package_lib_dir(), tmp_path / "cache" / "ext"]
    assert build.output_dir() == build.package_lib_dir() and build.jit_dir() == tmp_path / "cache" / "ext"


def test_each_source_folder_builds_in_its_own_workspace(tmp_path, monkeypatch):
    """Two checkouts (an A/B pair) building at once must not share ninja's workspace; one checkout keeps its own
    across rebuilds (incremental)."""
    monkeypatch.setenv("DDTREE_CACHE", str(tmp_path))
    targets = prebuilt.parse_arch_list("9.0a")
    here = build.workspace_dir(targets)
    assert here == build.workspace_dir(targets) and here.parent == tmp_path / "ext"
    assert here.name.startswith("build-sm_90a-")
    monkeypatch.setattr(build, "CSRC", tmp_path / "other" / "csrc")
    assert build.workspace_dir(targets) != here and build.workspace_dir(targets).parent == here.parent


def test_manifest_records_this_build():
    m = prebuilt.make_manifest(prebuilt.parse_arch_list(prebuilt.DEFAULT_ARCH_LIST), build.expected())
    assert m["torch"] == torch.__version__ and m["source_hash"] == build.source_hash()
    assert m["archs"] == ["sm_80", "sm_90a", "sm_90", "compute_90"] and m["arch_list"] == "8.0;9.0a;9.0+PTX"
    assert prebuilt.check_manifest(m, build.expected()) is None


def test_source_hash_covers_every_source():
    names = {p.name for p in build.CSRC.iterdir()}
    assert {"ops.cpp", "ops_layers.cpp", "ops_common.h", "kernels.h", "common.cuh", "sampling.cu"} <= names
    assert {p.name for p in build.sources()} >= {"ops.cpp", "ops_layers.cpp", "layers.cu"}
    assert len(build.source_hash()) == 64


def test_first_error_line():
    log = ("Error building extension 'ddtree_ext': [1/3] /usr/local/cuda/bin/nvcc -c sampling.cu -o s.o\n"
           "FAILED: sampling.cuda.o\n/usr/local/cuda/bin/nvcc -O3 -c sampling.cu -o sampling.cuda.o\n"
           "/x/ext/csrc/sampling.cu(42): error: identifier \"foo\" is undefined\n1 error detected\n"
           "ninja: build stopped: subcommand failed.\n")
    assert prebuilt.first_error_line(log) == '/x/ext/csrc/sampling.cu(42): error: identifier "foo" is undefined'
    gcc = "[2/3] c++ -c ops.cpp\nFAILED: ops.o\nops.cpp:12:3: error: 'x' was not declared in this scope\n"
    assert prebuilt.first_error_line(gcc) == "ops.cpp:12:3: error: 'x' was not declared in this scope"
    assert prebuilt.first_error_line("ld: x.o: undefined reference to `foo'\ncollect2: error: ld returned 1") \
        .startswith("ld: x.o: undefined reference")
    assert prebuilt.first_error_line("CUDA_HOME environment variable is not set.\nmore") == \
        "CUDA_HOME environment variable is not set."


def test_toolchain_reasons(monkeypatch):
    monkeypatch.setattr(build, "nvcc", lambda: None)
    assert "nvcc is not on PATH" in build.toolchain_missing()
    monkeypatch.setattr(build, "nvcc", lambda: "/usr/bin/nvcc")
    monkeypatch.setattr(build, "ninja", lambda: None)
    assert "pip install ninja" in build.toolchain_missing()


def test_build_without_cuda_torch_says_why(tmp_path):
    if torch.version.cuda is not None:
        pytest.skip("a CUDA build of torch")
    with pytest.raises(build.BuildError, match="CPU-only build"):
        build.build(tmp_path)
    assert not list(tmp_path.iterdir())


def test_cli_build_ext_reports_the_reason(tmp_path):
    if torch.version.cuda is not None:
        pytest.skip("a CUDA build of torch")
    env = {**os.environ, "DDTREE_EXT_DIR": str(tmp_path)}
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-m", "server", "build-ext"], capture_output=True, text=True, env=env,
                          cwd=root, timeout=120)
    assert proc.returncode == 1 and "CPU-only build" in proc.stderr, proc.stderr


@pytest.fixture
def fake_cuda_torch(monkeypatch, tmp_path):
    """A CUDA-looking torch with an sm_90 device and nothing prebuilt: load_ops()'s decisions without a GPU."""
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(build, "_state", None)
    monkeypatch.setenv("DDTREE_EXT_DIR", str(tmp_path))
    monkeypatch.setattr(build, "nvcc", lambda: None)
    return tmp_path


def write_library(directory, **over):
    m = prebuilt.make_manifest(["sm_80", "sm_90"], build.expected())
    (directory / prebuilt.MANIFEST).write_text(json.dumps({**m, **over}))
    (directory / prebuilt.LIB_NAME).write_bytes(b"not a shared library")


def test_load_reasons(fake_cuda_torch, monkeypatch):
    d = fake_cuda_torch
    assert build.load_ops() is None
    assert build.load_error() == (f"no prebuilt CUDA extension in {d} and no CUDA compiler to build one (nvcc is "
                                  "not on PATH and CUDA_HOME is unset); run `ddtree build-ext` where the CUDA "
                                  "toolkit is installed")
    for over, reason in [({"torch": "2.10.0"}, f"built for torch 2.10.0, this is torch {torch.__version__}"),
                         ({"source_hash": "0"}, "built from other sources"),
                         ({"archs": ["sm_80"]}, "built for sm_80, the device is sm_90"),
                         ({}, "loading ddtree_ext.so failed: ")]:  # compatible, but not a library: dlopen fails
        write_library(d, **over)
        monkeypatch.setattr(build, "_state", None)
        assert build.load_ops() is None
        err = build.load_error()
        assert err.startswith(f"no usable prebuilt CUDA extension ({d}: {reason}") and "no CUDA compiler" in err, err
        assert "\n" not in err


def test_load_reason_of_a_failed_build(fake_cuda_torch, monkeypatch):
    monkeypatch.setattr(build, "nvcc", lambda: "/usr/bin/nvcc")
    monkeypatch.setattr(build, "ninja", lambda: "/usr/bin/ninja")

    def failing(targets, verbose):
        assert targets == ["sm_90a"]  # a JIT build targets the device alone (Hopper: arch-specific)
        raise build.BuildError("the build failed: sampling.cu(3): error: boom")

    monkeypatch.setattr(build, "_compile", failing)
    assert build.load_ops() is None
    assert build.load_error() == (f"no prebuilt CUDA extension in {fake_cuda_torch} and the build failed: "
                                  "sampling.cu(3): error: boom")


def test_a_library_built_in_this_process_is_the_one_loaded(fake_cuda_torch, monkeypatch, tmp_path):
    """build() loads what it compiled; a later load_ops() must not dlopen a second copy (one TORCH_LIBRARY)."""
    write_library(fake_cuda_torch)  # compatible on paper: would fail to load if tried
    monkeypatch.setattr(build, "_built_here", tmp_path / "build-sm_90" / prebuilt.LIB_NAME)
    from ext import fake

    monkeypatch.setattr(fake, "register", lambda: None)  # no real ddtree ops to attach fakes to here
    assert build.load_ops() is torch.ops.ddtree and build.load_error() is None
    assert build.loaded_from() == tmp_path / "build-sm_90" / prebuilt.LIB_NAME


def test_load_without_a_device(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(build, "_state", None)
    assert build.load_ops() is None
    assert build.load_error() == "no CUDA device is visible (torch.cuda.is_available() is False)"


# ---- reference fallbacks on CUDA tensors -------------------------------------------------------------------------

def test_reference_fallbacks_are_counted_and_warned_once(monkeypatch, caplog):
    """Pretend the tensors are on CUDA with no extension: every op is served by the reference, counted per op,
    and warned about once per op with load_error()'s reason."""
    monkeypatch.setattr(dispatch, "_on_cuda", lambda t: True)
    monkeypatch.setattr(build, "load_ops", lambda verbose=False: None)
    monkeypatch.setattr(build, "load_error", lambda: "no CUDA compiler (test)")
    monkeypatch.setattr(dispatch, "_warned", set())
    before = ops.reference_fallbacks()
    ops.take_reference_fallbacks()
    logits = torch.randn(3, 40)
    zeros = torch.zeros(3)
    with caplog.at_level(logging.WARNING, logger="ddtree.ext"):
        for _ in range(3):
            ops.sample_tokens(logits, zeros, zeros, torch.zeros(3, dtype=torch.float64))
        ops.pack_tree_mask(torch.ones(2, 3, dtype=torch.bool))
    assert ops.take_reference_fallbacks() == {"sample_tokens": 3, "pack_tree_mask": 1}
    assert ops.take_reference_fallbacks() == {}
    after = ops.reference_fallbacks()
    assert after["sample_tokens"] - before.get("sample_tokens", 0) == 3
    warnings = [r.getMessage() for r in caplog.records if r.name == "ddtree.ext"]
    assert len(warnings) == 2 and all("no CUDA compiler (test)" in w for w in warnings), warnings
    assert ops.cuda_calls().get("sample_tokens", 0) == 0


def test_cpu_tensors_are_not_fallbacks():
    ops.take_reference_fallbacks()
    ops.sample_tokens(torch.randn(2, 5), torch.ones(2), torch.zeros(2), torch.rand(2, dtype=torch.float64))
    assert ops.take_reference_fallbacks() == {}


def _tiny_meta(seed=0):
    gen = torch.Generator().manual_seed(seed)
    block_size, query_lens, ctx = 4, [1, 3], [5, 2]
    seq_lens = [c + q for c, q in zip(ctx, query_lens)]
    tables = [[2, 0], [1, 3]]
    slots, positions = [], []
    for table, c, q in zip(tables, ctx, query_lens):
        for p in range(c, c + q):
            slots.append(table[p // block_size] * block_size + p % block_size)
            positions.append(p)
    mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    meta = build_metadata(positions, slots, query_lens, seq_lens, tables, block_size, tree_masks=[None, mask])
    return meta, gen


def test_cpu_ops_equal_reference():
    meta, gen = _tiny_meta()
    k = torch.randn(4, 4, 2, 8, generator=gen)
    v = torch.randn(4, 4, 2, 8, generator=gen)
    q = torch.randn(4, 4, 8, generator=gen)
    assert torch.equal(ops.paged_attention(q, k, v, meta, 0.3), reference.paged_attention(q, k, v, meta, 0.3))
    latent = torch.randn(4, 4, 12, generator=gen)
    ql, qr = torch.randn(4, 4, 8, generator=gen), torch.randn(4, 4, 4, generator=gen)
    assert torch.equal(ops.mla_paged_attention(ql, qr, latent, meta, 0.3),
                       reference.mla_paged_attention(ql, qr, latent, meta, 0.3))
    cache_a, cache_b = k.clone(), k.clone()
    rows = torch.randn(4, 2, 8, generator=gen)
    ops.write_kv(cache_a, rows, meta.slot_mapping)
    reference.write_kv(cache_b, rows, meta.slot_mapping)
    assert torch.equal(cache_a, cache_b)

    logits = torch.randn(3, 4, 50, generator=gen)
    lp, ids = ops.topk_logprobs(logits, 6)
    ref_lp, ref_ids = reference.topk_logprobs(logits, 6)
    assert torch.equal(ids, ref_ids) and torch.equal(lp, ref_lp)
    budgets = torch.tensor([0, 5, 9])
    tree = ops.build_tree(lp, ids, budgets, 9)
    ref_tree = reference.build_tree(lp, ids, budgets, 9)
    assert all(torch.equal(a, b) for a, b in zip(tree, ref_tree))
    target = torch.randint(0, 50, tree.node_token_ids.shape, generator=gen)
    target[:, 0] = tree.node_token_ids[:, 1]
    walked = ops.tree_accept(target, tree.node_token_ids, tree.parents, tree.num_nodes, 4)
    ref_walked = reference.tree_accept(target, tree.node_token_ids, tree.parents, tree.num_nodes, 4)
    assert all(torch.equal(a, b) for a, b in zip(walked, ref_walked))

    caches = [torch.randn(40, 3, generator=gen), torch.randn(40, 2, 2, generator=gen)]
    copies = [c.clone() for c in caches]
    accepted = torch.tensor([[0, 2, 5, -1], [0, 1, 2, 3]])
    tree_slots = torch.stack([torch.arange(0, 10), torch.arange(20, 30)])
    ops.kv_compact_tree(caches, accepted, tree_slots)
    src, dst, noop = reference.compaction_slots(accepted, tree_slots)
    assert noop.tolist() == [False, True]
    reference.kv_compact(copies, src, dst)
    assert all(torch.equal(a, b) for a, b in zip(caches, copies))
    ops.kv_compact(caches, src, dst)
    reference.kv_compact(copies, src, dst)
    assert all(torch.equal(a, b) for a, b in zip(caches, copies))

    scores = torch.randn(5, 30, generator=gen)
    temp, min_p = torch.tensor([0.0, 1.0, 1.0, 0.0, 2.0]), torch.tensor([0.0, 0.0, 0.1, 0.0, 0.5])
    u = torch.rand(5, generator=gen, dtype=torch.float64)
    sampled = ops.sample_tokens(scores, temp, min_p, u)
    assert torch.equal(sampled, reference.sample_tokens(scores, temp, min_p, u))
    assert sampled[0] == scores[0].argmax() and sampled[3] == scores[3].argmax()
    assert ((sampled >= 0) & (sampled < 30)).all()
    assert torch.equal(ops.pack_tree_mask(meta.tree_mask), pack_bits(meta.tree_mask))
    assert torch.equal(meta.packed_tree_mask(), pack_bits(meta.tree_mask))
    assert ops.cuda_calls() == {} or torch.cuda.is_available()
