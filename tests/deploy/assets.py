"""Helpers of the deploy asset tests: reading the Dockerfile, compose, Kubernetes manifests and dashboards, and
parsing container commands with the real CLI."""
from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from server.cli import parser as cli_parser
from server.cli import serve_configs
from server.config import ServerConfig
from server.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
DASHBOARDS = DEPLOY / "grafana" / "dashboards"
PROVISIONING = DEPLOY / "grafana" / "provisioning"
SERVE_DEFAULTS = ServerConfig()


def serve_setup(argv: list[str]):
    """(ServerConfig, EngineConfig) that `ddtree <argv>` would serve with."""
    args = cli_parser().parse_args(argv)
    assert args.command == "serve"
    return serve_configs(args)
IMAGE_UID = 10001


# ------------------------------------------------------------------------------------------------ helpers

def load_yaml(path: Path):
    with open(path) as f:
        return yaml.safe_load(f)


def load_yaml_all(path: Path) -> list:
    with open(path) as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def compose_defaults(value: str) -> str:
    """What compose makes of `${VAR:-default}` with VAR unset."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", str(value))


def parse_serve(argv: list[str]):
    """Parses a container command with the real CLI (every flag must exist and take its value) into the
    settings it serves with: the ServerConfig and EngineConfig fields in one namespace."""
    from types import SimpleNamespace

    from server.cli import SERVE_SPEC_DEFAULTS, engine_config
    from server.flags import build

    assert argv[:2] == ["ddtree", "serve"], argv
    args = cli_parser().parse_args([compose_defaults(a) for a in argv[1:]])
    server, engine = build(ServerConfig, args), engine_config(args, SERVE_SPEC_DEFAULTS)
    return SimpleNamespace(**vars(engine), **vars(server), drain_timeout=server.drain_timeout_s,
                           draft_model=engine.spec.draft_model)


def exported_metric_names() -> set[str]:
    """Every series name GET /metrics can expose, from server/metrics.py's own registry."""
    names = set()
    for family in Metrics("m").registry.collect():
        if family.type == "counter":
            names.add(family.name + "_total")
        elif family.type == "histogram":
            names.update(family.name + suffix for suffix in ("_bucket", "_sum", "_count"))
        else:
            names.add(family.name)
    return names


def dockerfile_instructions() -> list[tuple[str, str, str]]:
    """(stage, INSTRUCTION, arguments), continuation lines joined, comments dropped."""
    lines, current = [], ""
    for raw in (ROOT / "Dockerfile").read_text().splitlines():
        stripped = raw.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        lines.append(current + stripped)
        current = ""
    out, stage = [], None
    for line in lines:
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            m = re.search(r"\bAS\s+(\S+)\s*$", rest, re.IGNORECASE)
            stage = m.group(1) if m else None
        out.append((stage, keyword, rest.strip()))
    return out


def stage_names() -> list[str]:
    return [stage for stage, keyword, _ in dockerfile_instructions() if keyword == "FROM"]


def stage(name: str) -> list[tuple[str, str]]:
    return [(k, a) for s, k, a in dockerfile_instructions() if s == name]


def dockerfile_args() -> dict[str, str]:
    """Global ARG defaults (before the first FROM)."""
    found = {}
    for s, keyword, rest in dockerfile_instructions():
        if keyword == "FROM":
            break
        if keyword == "ARG" and "=" in rest:
            key, value = rest.split("=", 1)
            found[key] = value
    return found


def dockerignore_excludes(rel: str) -> bool:
    """Docker's .dockerignore semantics, enough for our patterns: last match wins, `!` re-includes, a pattern
    that matches a parent folder excludes everything below it."""
    patterns = []
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            patterns.append(line)

    def to_regex(pattern: str) -> re.Pattern:
        out, i = "", 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                out, i = out + "(?:.*/)?", i + 3
            elif pattern.startswith("**", i):
                out, i = out + ".*", i + 2
            elif pattern[i] == "*":
                out, i = out + "[^/]*", i + 1
            elif pattern[i] == "?":
                out, i = out + "[^/]", i + 1
            else:
                out, i = out + re.escape(pattern[i]), i + 1
        return re.compile(out + r"\Z")

    parts = rel.strip("/").split("/")
    candidates = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        regex = to_regex(pattern.lstrip("!").strip("/"))
        if any(regex.match(c) for c in candidates):
            excluded = not negate
    return excluded


def makefile_pins() -> dict[str, str]:
    """torch's pin from the Makefile (constraints.txt has none: it differs between CPU and GPU machines)."""
    text = (ROOT / "Makefile").read_text()
    return {"torch": re.search(r"\btorch==([\w.]+)", text).group(1)}


def constraint_pins() -> dict[str, str]:
    """constraints.txt as {canonical name: version}."""
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version
    return pins


def pip_installs(text: str) -> list[str]:
    """Every `pip install ...` command in a shell text, up to its `&&`, `;`, `|` or the end."""
    return [m.group(0) for m in re.finditer(r"\bpip\b[^&;|\n]*?\binstall\b[^&;|\n]*", text)]


def health_url_port(command: str) -> int:
    m = re.search(r"http://127\.0\.0\.1:(\d+)/health\b", command)
    assert m, f"no http://127.0.0.1:PORT/health in {command!r}"
    return int(m.group(1))


def k8s_docs() -> dict[tuple[str, str], dict]:
    docs = {}
    for path in sorted(K8S.glob("*.yaml")):
        if path.name in ("kustomization.yaml", "prometheus-adapter-values.yaml"):
            continue
        for doc in load_yaml_all(path):
            docs[(doc["kind"], doc["metadata"]["name"])] = doc
    return docs


def dashboards() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}


def all_panels(dash: dict) -> list[dict]:
    out = []
    for panel in dash["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))  # a collapsed row keeps its panels inside it
    return out


def dashboard_exprs(dash: dict) -> list[str]:
    return [t["expr"] for p in all_panels(dash) for t in p.get("targets", []) if "expr" in t]
