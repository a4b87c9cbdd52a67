"""Static checks of the deployment assets beyond the image (tests/deploy/test_docker.py): compose, Prometheus,
Grafana and Kubernetes files parse, and every file, port, path, flag and metric they name exists, in the repo, in
the CLI or in server/metrics.py. No container engine or cluster runs here, so this is what stands between a typo
and a broken `docker compose up` or `kubectl apply -k`."""
from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest
import yaml

from tests.deploy.assets import (
    DASHBOARDS, DEPLOY, IMAGE_UID, K8S, PROVISIONING, ROOT, SERVE_DEFAULTS, all_panels, dashboard_exprs,
    dashboards, exported_metric_names, health_url_port, k8s_docs, load_yaml, parse_serve,
    stage_names)


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


# ---------------------------------------------------------------------------------------- tensor parallel

def test_compose_tp8_server(compose):
    svc = compose["services"]["server-tp8"]
    args = parse_serve(svc["command"])
    assert args.tensor_parallel_size == 8 and args.device == "cuda" and args.model.startswith("/models/")
    (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
    assert device["count"] == args.tensor_parallel_size and svc["profiles"] == ["gpu-tp8"]
    assert svc["shm_size"].endswith("gb") and int(svc["shm_size"][:-2]) >= 8


def _replace(doc, pointer: str, value) -> None:
    """RFC 6902 `replace`: the target must exist (kustomize fails otherwise)."""
    *parents, last = [p for p in pointer.split("/")[1:]]
    for part in parents:
        doc = doc[int(part)] if isinstance(doc, list) else doc[part]
    key = int(last) if isinstance(doc, list) else last
    assert (key < len(doc)) if isinstance(doc, list) else (key in doc), pointer
    doc[key] = value


def test_k8s_tp8_overlay_patches_the_base_deployment():
    overlay = load_yaml(K8S / "tp8" / "kustomization.yaml")
    assert overlay["resources"] == [".."]
    (patch,) = overlay["patches"]
    assert patch["target"] == {"kind": "Deployment", "name": "ddtree"}
    deployment = k8s_docs()[("Deployment", "ddtree")]
    for op in yaml.safe_load(patch["patch"]):
        assert op["op"] == "replace"
        _replace(deployment, op["path"], op["value"])
    spec = deployment["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    args = parse_serve(container["args"])
    assert args.tensor_parallel_size == 8 and args.device == "cuda"
    for key in ("requests", "limits"):
        assert container["resources"][key]["nvidia.com/gpu"] == 8
    shm = {v["name"]: v for v in spec["volumes"]}["shm"]
    assert shm["emptyDir"]["medium"] == "Memory" and shm["emptyDir"]["sizeLimit"] == "16Gi"
