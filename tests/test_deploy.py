"""Deployment files: docker-compose.yml, Prometheus and Grafana configuration, the metrics
documentation and deploy/serving.properties, checked against the code they describe."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from seqserve_common.config import load_config
from scheduler_service.metrics import SchedulerMetrics
from worker_service.metrics import WorkerMetrics

yaml = pytest.importorskip("yaml")

REPO = Path(__file__).resolve().parents[1]
COMPOSE = REPO / "docker-compose.yml"
PROPERTIES = REPO / "deploy" / "serving.properties"
PROMETHEUS = REPO / "deploy" / "prometheus" / "prometheus.yml"
GRAFANA = REPO / "deploy" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "seqserve.json"
METRICS_DOC = REPO / "docs" / "metrics.md"
IN_CONTAINER = "/opt/ml/model/serving.properties"

# Series prometheus_client exposes per family type (labelled families have no samples
# until a label value is used, so the names are derived from the type as well).
_SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",),
             "histogram": ("_bucket", "_sum", "_count", "_created"),
             "summary": ("", "_sum", "_count", "_created")}
_METRIC = re.compile(r"\bseqserve_[a-z0-9_]+")


def _registries():
    return [("scheduler", SchedulerMetrics()), ("worker", WorkerMetrics())]


def _families() -> dict[str, str]:
    """Family name -> type, both processes."""
    out = {}
    for _, m in _registries():
        for fam in m.registry.collect():
            out[fam.name] = fam.type
    return out


def _sample_names() -> set[str]:
    names = set()
    for _, m in _registries():
        for fam in m.registry.collect():
            names.update(s.name for s in fam.samples)
            names.update(fam.name + suffix for suffix in _SUFFIXES[fam.type])
    return names


def _label_names() -> set[str]:
    labels = set()
    for _, m in _registries():
        for value in vars(m).values():
            labels.update(getattr(value, "_labelnames", ()))
    return labels


def _dashboard_exprs() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            out.append((panel["title"], target["expr"]))
    return out


def _compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


# --- docker-compose.yml --------------------------------------------------------------------

@pytest.mark.parametrize("profile", [[], ["--profile", "gpu"]], ids=["default", "gpu"])
def test_compose_config_is_valid(profile):
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.skip("the docker-compose binary is not installed "
                    "(apt-get install docker-compose; CI installs it)")
    run = subprocess.run([exe, "-f", str(COMPOSE), *profile, "config", "-q"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"docker-compose {' '.join(profile)} config failed:\n{run.stderr}"
    full = subprocess.run([exe, "-f", str(COMPOSE), *profile, "config", "--services"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert full.returncode == 0, full.stderr
    assert {"scheduler", "worker", "prometheus", "grafana"} <= set(full.stdout.split())


def test_compose_services():
    services = _compose()["services"]
    assert {"scheduler", "worker", "worker-gpu", "prometheus", "grafana"} <= set(services)
    sched, worker, gpu = services["scheduler"], services["worker"], services["worker-gpu"]

    assert {"8000:8000", "8080:8080", "8001:8001"} <= set(sched["ports"])
    assert "worker" in sched["depends_on"]
    assert sched["command"][0] == "seqserve-scheduler"
    for svc in (worker, gpu):
        assert svc["command"][0] == "seqserve-worker"
    for svc in (sched, worker, gpu):
        assert svc["command"][1:] == ["--properties", IN_CONTAINER]
        assert f"./deploy/serving.properties:{IN_CONTAINER}:ro" in svc["volumes"]
        assert svc["environment"]["SERVING_PROPERTIES"] == IN_CONTAINER
        assert "grpc_health.v1" in svc["healthcheck"]["test"][-1]

    assert "profiles" not in worker and gpu["profiles"] == ["gpu"]
    assert gpu["environment"]["OPTION_DEVICE"] == "cuda"
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]

    assert services["prometheus"]["image"].startswith("prom/prometheus")
    assert "./deploy/prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in \
        services["prometheus"]["volumes"]
    graf = services["grafana"]
    assert graf["image"].startswith("grafana/grafana")
    assert graf["environment"]["GF_AUTH_ANONYMOUS_ENABLED"] == "true"
    assert graf["environment"]["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    mounts = {v.split(":")[0]: v.split(":")[1] for v in graf["volumes"]}
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    provider = yaml.safe_load(
        (GRAFANA / "provisioning" / "dashboards" / "seqserve.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == mounts["./deploy/grafana/dashboards"]


def _healthcheck(service: str, port: int) -> str:
    code = _compose()["services"][service]["healthcheck"]["test"][-1]
    default = load_config(PROPERTIES, env={})
    container_port = default.port if service == "scheduler" else default.worker_port
    needle = f"127.0.0.1:{container_port}'"
    assert needle in code, f"{service} health check does not probe its own port"
    return code.replace(needle, f"127.0.0.1:{port}'")


def _probe(code: str) -> int:
    return subprocess.run([sys.executable, "-c", code], capture_output=True,
                          timeout=60).returncode


def test_compose_healthchecks_probe_readiness(llama_dir, tmp_path):
    """The health-check one-liners fail while a process is not SERVING and pass once it is."""
    from bench.deployment import Deployment
    from bench.processes import free_port

    d = Deployment(llama_dir, tmp_path)
    worker_port = free_port()
    try:
        assert _probe(_healthcheck("worker", worker_port)) != 0  # nothing listening yet
        d.start_scheduler(worker_port=worker_port, wait_ready=False)
        scheduler_check = _healthcheck("scheduler", d.scheduler.ports["grpc"])
        assert _probe(scheduler_check) != 0  # up, but no worker: NOT_SERVING
        d.start_worker(port=worker_port)
        assert _probe(_healthcheck("worker", worker_port)) == 0
        assert _probe(_healthcheck("worker-gpu", worker_port)) == 0
        deadline = time.monotonic() + 60
        while _probe(scheduler_check) != 0:
            assert time.monotonic() < deadline, "scheduler health check never passed"
            time.sleep(0.5)
    finally:
        d.stop()


# --- Prometheus -----------------------------------------------------------------------------

def test_prometheus_scrapes_both_processes():
    cfg = yaml.safe_load(PROMETHEUS.read_text())
    props = load_config(PROPERTIES, env={})
    targets = {t for job in cfg["scrape_configs"] for sc in job["static_configs"]
               for t in sc["targets"]}
    assert f"scheduler:{props.metrics_port}" in targets
    assert f"worker:{props.worker_metrics_port}" in targets
    assert cfg["global"]["scrape_interval"] == "5s"
    promtool = shutil.which("promtool")
    if promtool:
        run = subprocess.run([promtool, "check", "config", str(PROMETHEUS)],
                             capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stdout + run.stderr


# --- Grafana dashboard ----------------------------------------------------------------------

def test_dashboard_uses_only_real_metric_names():
    known = _sample_names()
    used = {}
    for title, expr in _dashboard_exprs():
        for name in _METRIC.findall(expr):
            used.setdefault(name, title)
    assert used, "no seqserve metric in the dashboard"
    unknown = {name: title for name, title in used.items() if name not in known}
    assert not unknown, f"dashboard queries metrics no registry exports: {unknown}"


def test_dashboard_uses_only_real_labels():
    allowed = _label_names() | {"le", "job", "instance"}
    dash = json.loads(DASHBOARD.read_text())
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            grouped = [label.strip() for clause in re.findall(r"by \(([^)]*)\)", target["expr"])
                       for label in clause.split(",")]
            legend = re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", ""))
            bad = [label for label in grouped + legend if label not in allowed]
            assert not bad, f"{panel['title']}: unknown labels {bad}"


def test_dashboard_covers_the_serving_metrics():
    used = {name for _, expr in _dashboard_exprs() for name in _METRIC.findall(expr)}
    wanted = {
        "seqserve_batch_sparsity_bucket", "seqserve_batch_sparsity_sum",
        "seqserve_batch_sparsity_count", "seqserve_batch_splits_bucket",
        "seqserve_batch_splits_sum", "seqserve_kv_padded_slots", "seqserve_kv_tokens",
        "seqserve_regroup_bytes_total", "seqserve_num_requests_running",
        "seqserve_num_requests_waiting", "seqserve_time_to_first_token_seconds_bucket",
        "seqserve_inter_token_latency_seconds_bucket",
        "seqserve_e2e_request_latency_seconds_bucket", "seqserve_generation_tokens_total",
        "seqserve_step_seconds_bucket", "seqserve_worker_forward_seconds_sum",
        "seqserve_worker_sampling_seconds_sum", "seqserve_worker_regroup_seconds_sum",
    }
    assert not wanted - used, f"dashboard lacks {sorted(wanted - used)}"


def test_dashboard_is_well_formed():
    dash = json.loads(DASHBOARD.read_text())
    assert 36 <= dash["schemaVersion"] <= 41
    assert dash["uid"] == "seqserve"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        assert p["gridPos"]["x"] + p["gridPos"]["w"] <= 24, p["title"]
    variables = {v["name"] for v in dash["templating"]["list"]}
    for _, expr in _dashboard_exprs():
        for var in re.findall(r"\$(\w+)", expr):
            assert var.startswith("__") or var in variables, f"undefined ${var} in {expr}"
    sources = yaml.safe_load(
        (GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    prom = sources["datasources"][0]
    assert prom["type"] == "prometheus" and prom["url"] == "http://prometheus:9090"


def test_dashboard_promql_parses(tmp_path):
    """promtool parses every expression (as a recording rule), with Grafana's variables
    replaced by the values they take."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    rules = []
    for i, (_, expr) in enumerate(_dashboard_exprs()):
        expr = (expr.replace("$__rate_interval", "20s").replace("$max_sparsity", "0.33")
                .replace("$max_splits", "3"))
        rules.append({"record": f"seqserve:dashboard:{i}", "expr": expr})
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    run = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr


# --- docs/metrics.md ------------------------------------------------------------------------

def test_metrics_doc_lists_every_metric():
    doc = METRICS_DOC.read_text()
    missing = [name for name in _families() if f"`{name}`" not in doc]
    assert not missing, f"docs/metrics.md does not document {missing}"
    missing_labels = [label for label in _label_names() if f"`{label}`" not in doc]
    assert not missing_labels, f"docs/metrics.md does not name labels {missing_labels}"
    known = _sample_names() | set(_families())
    stale = sorted({name for name in _METRIC.findall(doc) if name not in known})
    assert not stale, f"docs/metrics.md names metrics that do not exist: {stale}"
    defaults = load_config(None, env={})
    assert str(defaults.metrics_port) in doc and str(defaults.worker_metrics_port) in doc


# --- deploy/serving.properties --------------------------------------------------------------

def test_serving_properties_loads():
    cfg = load_config(PROPERTIES, env={})
    assert cfg.engine == "Python"
    assert cfg.model_id == "/models/tiny-llama"
    assert cfg.tensor_parallel_degree == 1
    assert cfg.dtype == "float32"
    assert cfg.max_rolling_batch_size == 64
    assert cfg.rolling_batch == "scheduler"
    assert cfg.max_sparsity == 0.33 and cfg.max_splits == 3
    assert cfg.decoding_strategy == "greedy"
    assert cfg.host == "0.0.0.0"
    assert cfg.worker_addresses == ("worker:8100",)
    assert (cfg.port, cfg.http_port, cfg.metrics_port) == (8000, 8080, 8001)
    assert (cfg.worker_port, cfg.worker_metrics_port) == (8100, 8101)
    # The environment overrides the file the LMI way (what worker-gpu relies on).
    assert load_config(PROPERTIES, env={"OPTION_DEVICE": "cuda"}).device == "cuda"


def test_serving_properties_keys_are_commented():
    for line in PROPERTIES.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            assert "#" in line, f"no comment on {line!r}"


def test_dockerfile_builds_the_configured_model():
    text = (REPO / "Dockerfile").read_text()
    model = load_config(PROPERTIES, env={}).model_id
    assert f"--out {model}" in text
    assert "FROM python:3.11-slim" in text
    assert re.search(r"^CMD \[\"seqserve-scheduler\"", text, re.M)
