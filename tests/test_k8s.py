"""deploy/k8s: the Kubernetes manifests, rendered as kustomize renders them, validated offline
against the Kubernetes API schemas (kubernetes-validate) and checked against the code they
configure: probes, serving.properties, the worker's DNS name, GPUs, the control-plane
secret, graceful termination and Prometheus scraping.

No cluster and no kubectl are needed: `render` below applies the few kustomize features the
manifests use (resources, components, configMapGenerator with kustomize's hash suffix,
strategic-merge patches) and refuses any other. Where kubectl is installed, its own
`kubectl kustomize` output is compared with ours. Every check is a function of the rendered
objects, and `test_each_check_catches_its_breakage` breaks the manifests once per check to
show that it can fail.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Callable

import pytest

from scheduler_service.metrics import SchedulerMetrics
from seqserve_common.config import ServingConfig, load_config, parse_properties

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "deploy" / "k8s"
BASE = K8S / "base"
GPU = K8S / "overlays" / "gpu"
GPU_COMPONENT = K8S / "components" / "gpu"
MONITORING = K8S / "components" / "prometheus-operator"
DEPLOYMENT_DOC = REPO / "docs" / "deployment.md"
PROPERTIES_PATH = "/opt/ml/model/serving.properties"
SECRET = ("seqserve-control", "token")
# The oldest Kubernetes with gRPC probes GA (1.27) and the newest schemas the package ships.
K8S_VERSIONS = ("1.27", kubernetes_validate.latest_version())
# Kinds from CRDs, which kubernetes-validate has no schema for; checked structurally.
CRD_KINDS = {("monitoring.coreos.com/v1", "PodMonitor")}


# --- a small kustomize ------------------------------------------------------------------------

_SUPPORTED = {"apiVersion", "kind", "resources", "components", "configMapGenerator", "patches"}
# Strategic merge: lists under these fields merge item by item on the key; other lists are
# replaced, as Kubernetes' patch strategy for them says (command, args, tolerations, ...).
_MERGE_KEYS = {"containers": "name", "initContainers": "name", "env": "name",
               "volumes": "name", "volumeMounts": "mountPath"}
_UNSUPPORTED_LISTS = {"ports"}  # merge keys differ by kind; no patch here touches them


def _load_yaml(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def configmap_hash(data: dict[str, str]) -> str:
    """kustomize's name suffix (api/hasher): sha256 of Go's JSON of kind, name and data,
    first 10 hex digits with 0, 1, 3, a, e swapped for letters. Its lookup of
    "metadata/name" finds no such field, so the name hashes as ""."""
    text = json.dumps({"data": data, "kind": "ConfigMap", "name": ""}, sort_keys=True,
                      separators=(",", ":"), ensure_ascii=False)
    text = text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    return hashlib.sha256(text.encode()).hexdigest()[:10].translate(str.maketrans("013ae", "ghkmt"))


def strategic_merge(base, patch, field: str = ""):
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for key, value in patch.items():
            out[key] = strategic_merge(base[key], value, key) if key in base else copy.deepcopy(value)
        return out
    if isinstance(base, list) and isinstance(patch, list):
        if field in _UNSUPPORTED_LISTS:
            raise NotImplementedError(f"patching {field!r} lists is not supported here")
        key = _MERGE_KEYS.get(field)
        if key is None:
            return copy.deepcopy(patch)
        out = [copy.deepcopy(item) for item in base]
        index = {item[key]: i for i, item in enumerate(out)}
        for item in patch:
            if item[key] in index:
                out[index[item[key]]] = strategic_merge(out[index[item[key]]], item)
            else:
                out.append(copy.deepcopy(item))
        return out
    return copy.deepcopy(patch)


def _ident(obj: dict) -> tuple[str, str, str]:
    return obj["apiVersion"], obj["kind"], obj["metadata"]["name"]


def _apply(root: Path, kust: dict, objs: list[dict], generated: dict[str, str]) -> None:
    """One kustomization or component's own generators and patches, onto `objs`."""
    unknown = set(kust) - _SUPPORTED
    if unknown:
        raise NotImplementedError(f"{root}: kustomization fields not supported: {sorted(unknown)}")
    for entry in kust.get("resources", []):
        path = root / entry
        objs.extend(render(path) if path.is_dir() else _load_yaml(path))
    for entry in kust.get("components", []):
        comp_root = root / entry
        comp = yaml.safe_load((comp_root / "kustomization.yaml").read_text())
        if comp.get("kind") != "Component":
            raise ValueError(f"{comp_root} is not a kustomize Component")
        _apply(comp_root, comp, objs, generated)
    for gen in kust.get("configMapGenerator", []):
        if set(gen) - {"name", "files", "options"} or set(gen.get("options", {})) - {"labels"}:
            raise NotImplementedError(f"configMapGenerator fields: {sorted(gen)}")
        data = {}
        for f in gen["files"]:
            key, _, rel = f.rpartition("=") if "=" in f else (Path(f).name, "", f)
            data[key] = (root / rel).read_text()
        meta = {"name": gen["name"]}
        if gen.get("options", {}).get("labels"):
            meta["labels"] = dict(gen["options"]["labels"])
        objs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data})
        generated[gen["name"]] = f"{gen['name']}-{configmap_hash(data)}"
    for patch in kust.get("patches", []):
        if set(patch) != {"path"}:
            raise NotImplementedError(f"only `patches: - path:` is supported, got {patch}")
        for doc in _load_yaml(root / patch["path"]):
            matches = [i for i, o in enumerate(objs) if _ident(o) == _ident(doc)]
            if len(matches) != 1:
                raise ValueError(f"patch {patch['path']} matches {len(matches)} objects")
            objs[matches[0]] = strategic_merge(objs[matches[0]], doc)


def _rename_configmaps(objs: list[dict], names: dict[str, str]) -> None:
    """Generated ConfigMaps get their hashed names, and so do the pod templates' references."""
    for obj in objs:
        if obj["kind"] == "ConfigMap" and obj["metadata"]["name"] in names:
            obj["metadata"]["name"] = names[obj["metadata"]["name"]]
        pod = obj.get("spec", {}).get("template", {}).get("spec")
        if not pod:
            continue
        for vol in pod.get("volumes", []):
            if "configMap" in vol and vol["configMap"]["name"] in names:
                vol["configMap"]["name"] = names[vol["configMap"]["name"]]
        for c in pod.get("containers", []) + pod.get("initContainers", []):
            for env in c.get("env", []):
                ref = env.get("valueFrom", {}).get("configMapKeyRef")
                if ref and ref["name"] in names:
                    ref["name"] = names[ref["name"]]
            for src in c.get("envFrom", []):
                ref = src.get("configMapRef")
                if ref and ref["name"] in names:
                    ref["name"] = names[ref["name"]]


def render(root: Path, kust: dict | None = None) -> list[dict]:
    """The objects `kubectl kustomize root` prints (up to key and list order)."""
    if kust is None:
        kust = yaml.safe_load((root / "kustomization.yaml").read_text())
    if kust.get("kind", "Kustomization") != "Kustomization":
        raise ValueError(f"{root}: not a Kustomization")
    objs: list[dict] = []
    generated: dict[str, str] = {}
    _apply(root, kust, objs, generated)
    _rename_configmaps(objs, generated)
    idents = [_ident(o) for o in objs]
    assert len(idents) == len(set(idents)), f"duplicate objects in {root}: {idents}"
    return objs


def render_with_monitoring() -> list[dict]:
    """The base with components/prometheus-operator, as an overlay listing both would."""
    return render(K8S, {"kind": "Kustomization", "resources": [str(BASE)],
                        "components": [str(MONITORING)]})


VARIANTS: dict[str, Callable[[], list[dict]]] = {
    "base": lambda: render(BASE),
    "gpu": lambda: render(GPU),
    "base+prometheus-operator": render_with_monitoring,
}


# --- looking things up in rendered objects --------------------------------------------------

def one(objs: list[dict], kind: str, name: str) -> dict:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def container(workload: dict, name: str) -> dict:
    found = [c for c in workload["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    assert len(found) == 1, f"container {name}: {len(found)} found"
    return found[0]


def env_of(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


def port_of(c: dict, name: str) -> int:
    found = [p["containerPort"] for p in c.get("ports", []) if p.get("name") == name]
    assert len(found) == 1, f"container {c['name']} has no port named {name}"
    return found[0]


def scheduler(objs):
    return one(objs, "Deployment", "seqserve-scheduler")


def worker(objs):
    return one(objs, "StatefulSet", "seqserve-worker")


def properties_configmap(objs: list[dict], workload: dict) -> dict:
    """The ConfigMap the workload mounts at /opt/ml/model/serving.properties."""
    c = container(workload, workload["spec"]["template"]["spec"]["containers"][0]["name"])
    mounts = [m for m in c.get("volumeMounts", []) if m["mountPath"] == PROPERTIES_PATH]
    assert len(mounts) == 1, f"{workload['metadata']['name']}: nothing mounted at {PROPERTIES_PATH}"
    vols = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
    cm = one(objs, "ConfigMap", vols[mounts[0]["name"]]["configMap"]["name"])
    assert mounts[0].get("subPath") in cm["data"], "the mounted key is not in the ConfigMap"
    return cm


def serving_config(objs: list[dict], workload: dict, tmp_dir: Path) -> ServingConfig:
    """What the process in `workload` reads: the mounted file, then its OPTION_* literals."""
    cm = properties_configmap(objs, workload)
    c = workload["spec"]["template"]["spec"]["containers"][0]
    mount = next(m for m in c["volumeMounts"] if m["mountPath"] == PROPERTIES_PATH)
    text = cm["data"][mount["subPath"]]
    parse_properties(text)  # raises on a malformed line
    path = tmp_dir / f"{workload['metadata']['name']}.properties"
    path.write_text(text)
    env = {k: e["value"] for k, e in env_of(c).items() if k.startswith("OPTION_") and "value" in e}
    return load_config(path, env=env)


# --- the checks -------------------------------------------------------------------------------

def check_schemas(objs: list[dict]) -> None:
    for obj in objs:
        if (obj["apiVersion"], obj["kind"]) in CRD_KINDS:
            continue
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                raise AssertionError(f"{obj['kind']}/{obj['metadata']['name']} is invalid for "
                                     f"Kubernetes {version}: {exc.message} at "
                                     f"{'.'.join(map(str, exc.path))}") from None


def check_probes(objs: list[dict], tmp_dir: Path) -> None:
    """gRPC probes on each process's own gRPC port: readiness and liveness by their health
    names, a startup probe, and for the worker room for loading a model."""
    for workload, cname, port_key in ((scheduler(objs), "scheduler", "port"),
                                      (worker(objs), "worker", "worker_port")):
        cfg = serving_config(objs, workload, tmp_dir)
        c = container(workload, cname)
        grpc_port = getattr(cfg, port_key)
        assert port_of(c, "grpc") == grpc_port, f"{cname}: containerPort grpc != option.{port_key}"
        for probe, service in (("readinessProbe", "readiness"), ("livenessProbe", "liveness"),
                               ("startupProbe", None)):
            assert probe in c, f"{cname} has no {probe}"
            p = c[probe]
            assert set(p) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"grpc"}, \
                f"{cname} {probe} is not a gRPC probe"
            assert p["grpc"]["port"] == grpc_port, f"{cname} {probe} probes port {p['grpc']['port']}"
            if service:
                assert p["grpc"].get("service") == service, f"{cname} {probe} asks for {p['grpc'].get('service')!r}"
            assert p.get("timeoutSeconds", 1) >= 2, f"{cname} {probe}: a 1 s timeout fails under load"
        startup = c["startupProbe"]
        assert startup["grpc"]["service"] in ("liveness", "readiness")
        budget = startup.get("periodSeconds", 10) * startup.get("failureThreshold", 3)
        if cname == "worker":
            assert startup["grpc"]["service"] == "readiness", "the worker's startup is the model load"
            assert budget >= 900, f"worker startupProbe allows only {budget} s for loading a model"


def check_properties_and_worker_address(objs: list[dict], tmp_dir: Path) -> None:
    """Both processes read the same serving.properties, and the scheduler's one worker
    address is the worker StatefulSet's pod 0 through its headless Service."""
    sched, work = scheduler(objs), worker(objs)
    assert properties_configmap(objs, sched) is properties_configmap(objs, work)
    for wl in (sched, work):
        c = wl["spec"]["template"]["spec"]["containers"][0]
        assert c["command"][-2:] == ["--properties", PROPERTIES_PATH], c["command"]
    cfg = serving_config(objs, sched, tmp_dir)
    wcfg = serving_config(objs, work, tmp_dir)
    assert cfg.host == wcfg.host == "0.0.0.0", "a pod must listen beyond loopback"
    # One address per worker pod, in ordinal order (today exactly one: the scheduler
    # refuses more until data parallelism lands).
    assert work["spec"]["replicas"] == len(cfg.worker_addresses), \
        f"{work['spec']['replicas']} worker pods, {len(cfg.worker_addresses)} worker addresses"
    svc = one(objs, "Service", work["spec"]["serviceName"])
    assert svc["spec"].get("clusterIP") == "None", "the worker Service must be headless"
    assert svc["spec"].get("publishNotReadyAddresses") is True
    pod_labels = work["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items(), "the Service selects no worker"
    grpc_port = port_of(container(work, "worker"), "grpc")
    assert grpc_port == wcfg.worker_port
    expected = tuple(f"{work['metadata']['name']}-{i}.{svc['metadata']['name']}:{grpc_port}"
                     for i in range(work["spec"]["replicas"]))
    assert cfg.worker_addresses == expected, f"{cfg.worker_addresses} != {expected}"
    assert any(p["port"] == grpc_port for p in svc["spec"]["ports"])
    assert sched["spec"]["replicas"] == 1 and sched["spec"]["strategy"]["type"] == "Recreate", \
        "two schedulers on one worker would reset each other's sequences"


def check_services(objs: list[dict], tmp_dir: Path) -> None:
    sched = scheduler(objs)
    cfg = serving_config(objs, sched, tmp_dir)
    svc = one(objs, "Service", "seqserve-scheduler")
    labels = sched["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items(), "the Service selects no scheduler"
    c = container(sched, "scheduler")
    want = {"grpc": cfg.port, "http": cfg.http_port, "openai": cfg.openai_port}
    for name, port in want.items():
        assert port_of(c, name) == port, f"containerPort {name} != the option ({port})"
        assert any(p["name"] == name and p["port"] == port for p in svc["spec"]["ports"]), \
            f"Service seqserve-scheduler lacks {name}:{port}"


def check_gpu(objs: list[dict], want_gpu: bool) -> None:
    """The gpu variant's worker asks for one NVIDIA GPU and runs on cuda; nothing else does."""
    c = container(worker(objs), "worker")
    res = c["resources"]
    if want_gpu:
        assert str(res["limits"].get("nvidia.com/gpu")) == "1", "gpu worker: no nvidia.com/gpu limit"
        assert str(res["requests"].get("nvidia.com/gpu")) == "1", "gpu worker: no nvidia.com/gpu request"
        assert env_of(c)["OPTION_DEVICE"]["value"] == "cuda"
        assert c["image"].endswith(":cuda"), "the CPU image has no CUDA torch"
    else:
        assert env_of(c)["OPTION_DEVICE"]["value"] == "cpu"
        assert str(env_of(c)["OMP_NUM_THREADS"]["value"]) == str(res["limits"]["cpu"]), \
            "torch's threads must match the CPU limit"
    for obj in objs:
        for cont in obj.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
            if obj is worker(objs) and want_gpu:
                continue
            for part in ("requests", "limits"):
                assert "nvidia.com/gpu" not in cont.get("resources", {}).get(part, {}), \
                    f"{obj['metadata']['name']} asks for a GPU"
    for obj in (scheduler(objs), worker(objs)):
        for cont in obj["spec"]["template"]["spec"]["containers"]:
            assert {"requests", "limits"} <= set(cont.get("resources", {})), \
                f"{cont['name']}: requests and limits"
            assert "memory" in cont["resources"]["limits"]


def check_control_token(objs: list[dict], tmp_dir: Path) -> None:
    """Both sides take OPTION_CONTROL_TOKEN from the one Secret; the manifests hold none."""
    for wl, cname in ((scheduler(objs), "scheduler"), (worker(objs), "worker")):
        env = env_of(container(wl, cname))
        assert "OPTION_CONTROL_TOKEN" in env, f"{cname} has no OPTION_CONTROL_TOKEN"
        ref = env["OPTION_CONTROL_TOKEN"].get("valueFrom", {}).get("secretKeyRef")
        assert ref is not None and "value" not in env["OPTION_CONTROL_TOKEN"], \
            f"{cname}: the control token must come from a Secret"
        assert (ref["name"], ref["key"]) == SECRET, ref
        assert not ref.get("optional", False)
        assert "OPTION_CONTROL_TOKEN_FILE" not in env
        cfg = serving_config(objs, wl, tmp_dir)
        assert cfg.control_token == "" and cfg.control_token_file == "", \
            "the secret belongs in the Secret, not in serving.properties"
    assert not [o for o in objs if o["kind"] == "Secret"], "no Secret may ship in the manifests"
    cm_text = json.dumps([o.get("data") for o in objs if o["kind"] == "ConfigMap"])
    assert "control_token" not in cm_text and "auth_token=" not in cm_text


def check_termination(objs: list[dict], tmp_dir: Path) -> None:
    """The scheduler drains for drain_timeout before Kubernetes kills it; its worker stays
    up that long too, then has time for its own 5 s stop."""
    sched, work = scheduler(objs), worker(objs)
    drain = serving_config(objs, sched, tmp_dir).drain_timeout
    grace = sched["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > drain + 5, f"scheduler grace {grace} s <= drain_timeout {drain} s + 5 s"
    wgrace = work["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    pre = container(work, "worker")["lifecycle"]["preStop"]
    seconds = pre["sleep"]["seconds"] if "sleep" in pre else int(pre["exec"]["command"][-1])
    if "exec" in pre:
        assert pre["exec"]["command"][0] == "sleep"
    assert seconds >= drain, f"worker preStop {seconds} s < drain_timeout {drain} s"
    assert wgrace > seconds + 5, f"worker grace {wgrace} s leaves no time after preStop"


def check_prometheus(objs: list[dict], tmp_dir: Path) -> None:
    for wl, cname, key in ((scheduler(objs), "scheduler", "metrics_port"),
                           (worker(objs), "worker", "worker_metrics_port")):
        port = getattr(serving_config(objs, wl, tmp_dir), key)
        ann = wl["spec"]["template"]["metadata"].get("annotations", {})
        assert ann.get("prometheus.io/scrape") == "true", f"{cname}: not scraped"
        assert ann.get("prometheus.io/port") == str(port), f"{cname}: scrape port != option.{key}"
        assert ann.get("prometheus.io/path") == "/metrics"
        assert port_of(container(wl, cname), "metrics") == port


def check_podmonitors(objs: list[dict]) -> None:
    monitors = [o for o in objs if o["kind"] == "PodMonitor"]
    assert {m["metadata"]["name"] for m in monitors} == {"seqserve-scheduler", "seqserve-worker"}
    for m in monitors:
        assert m["apiVersion"] == "monitoring.coreos.com/v1"
        assert set(m["spec"]) <= {"selector", "podMetricsEndpoints", "namespaceSelector",
                                  "jobLabel", "podTargetLabels"}
        wl = scheduler(objs) if m["metadata"]["name"].endswith("scheduler") else worker(objs)
        labels = wl["spec"]["template"]["metadata"]["labels"]
        assert m["spec"]["selector"]["matchLabels"].items() <= labels.items(), \
            f"PodMonitor {m['metadata']['name']} selects no pod"
        c = wl["spec"]["template"]["spec"]["containers"][0]
        for ep in m["spec"]["podMetricsEndpoints"]:
            assert ep["port"] in {p["name"] for p in c["ports"]}, ep
            assert ep.get("path", "/metrics") == "/metrics"


def check_network_policy(objs: list[dict], tmp_dir: Path) -> None:
    """Only scheduler pods may reach the worker's control port."""
    work, sched = worker(objs), scheduler(objs)
    pol = one(objs, "NetworkPolicy", "seqserve-worker")
    assert pol["spec"]["podSelector"]["matchLabels"].items() <= \
        work["spec"]["template"]["metadata"]["labels"].items()
    grpc_port = serving_config(objs, work, tmp_dir).worker_port
    rules = [r for r in pol["spec"]["ingress"]
             if any(p.get("port") == grpc_port for p in r.get("ports", []))]
    assert rules, "no rule admits the scheduler to the worker"
    sched_labels = sched["spec"]["template"]["metadata"]["labels"]
    for r in rules:
        peers = r.get("from", [])
        assert peers, "the worker's control port is open to every pod"
        for peer in peers:
            assert set(peer) == {"podSelector"}
            assert peer["podSelector"]["matchLabels"].items() <= sched_labels.items()


# --- tests ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def rendered():
    return {name: make() for name, make in VARIANTS.items()}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_manifest_is_valid_for_the_kubernetes_schemas(rendered, variant):
    objs = rendered[variant]
    assert objs
    check_schemas(objs)
    kinds = {(o["apiVersion"], o["kind"]) for o in objs}
    for api, kind in kinds - CRD_KINDS:
        kubernetes_validate.validate(  # no SchemaNotFoundError: every other kind is checked
            next(o for o in objs if (o["apiVersion"], o["kind"]) == (api, kind)),
            K8S_VERSIONS[-1], strict=True)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_facts_of_every_variant(rendered, variant, tmp_path):
    objs = rendered[variant]
    check_probes(objs, tmp_path)
    check_properties_and_worker_address(objs, tmp_path)
    check_services(objs, tmp_path)
    check_gpu(objs, want_gpu=(variant == "gpu"))
    check_control_token(objs, tmp_path)
    check_termination(objs, tmp_path)
    check_prometheus(objs, tmp_path)
    check_network_policy(objs, tmp_path)


def test_prometheus_operator_component(rendered):
    check_podmonitors(rendered["base+prometheus-operator"])
    assert not [o for o in rendered["base"] if o["kind"] == "PodMonitor"], \
        "the base must run on clusters without the Prometheus Operator"


def test_gpu_component_changes_only_the_worker(rendered):
    base, gpu = rendered["base"], rendered["gpu"]
    assert [_ident(o) for o in base] == [_ident(o) for o in gpu]
    for b, g in zip(base, gpu):
        if _ident(b) != _ident(worker(base)):
            assert b == g, f"components/gpu changed {_ident(b)}"


# Each check, a breakage of the real manifests it must catch, and the variant it runs on.
def _set_env(c, name, value):
    for e in c["env"]:
        if e["name"] == name:
            e.clear()
            e.update({"name": name, "value": value})


def _edit_properties(objs, old, new):
    for o in objs:
        if o["kind"] == "ConfigMap":
            text = o["data"]["serving.properties"]
            assert old in text
            o["data"]["serving.properties"] = text.replace(old, new)


_BREAKAGES = {
    "schema: unknown field": (lambda o: container(scheduler(o), "scheduler").update(livenesProbe={}),
                              lambda o, t: check_schemas(o)),
    "schema: port as text": (lambda o: container(worker(o), "worker")["ports"][0].update(containerPort="8100"),
                             lambda o, t: check_schemas(o)),
    "probe: http instead of grpc": (
        lambda o: container(worker(o), "worker").update(
            readinessProbe={"httpGet": {"port": 8101, "path": "/metrics"}}),
        check_probes),
    "probe: wrong service name": (
        lambda o: container(scheduler(o), "scheduler")["readinessProbe"]["grpc"].update(service="liveness"),
        check_probes),
    "probe: wrong port": (
        lambda o: container(worker(o), "worker")["livenessProbe"]["grpc"].update(port=8000),
        check_probes),
    "probe: short startup": (
        lambda o: container(worker(o), "worker")["startupProbe"].update(failureThreshold=10),
        check_probes),
    "properties: unparsable": (lambda o: _edit_properties(o, "option.max_splits=3", "option.max_splits=three"),
                               check_probes),
    "properties: worker address": (
        lambda o: _edit_properties(o, "seqserve-worker-0.seqserve-worker:8100", "seqserve-worker:8100"),
        check_properties_and_worker_address),
    "properties: two workers": (
        lambda o: _edit_properties(o, "seqserve-worker-0.seqserve-worker:8100",
                                   "seqserve-worker-0.seqserve-worker:8100,seqserve-worker-1.seqserve-worker:8100"),
        check_properties_and_worker_address),
    "worker service not headless": (lambda o: one(o, "Service", "seqserve-worker")["spec"].pop("clusterIP"),
                                    check_properties_and_worker_address),
    "scheduler rolling update": (lambda o: scheduler(o)["spec"].update(strategy={"type": "RollingUpdate"}),
                                 check_properties_and_worker_address),
    "service lacks openai port": (lambda o: one(o, "Service", "seqserve-scheduler")["spec"]["ports"].pop(2),
                                  check_services),
    "gpu: no gpu limit": (lambda o: container(worker(o), "worker")["resources"]["limits"].pop("nvidia.com/gpu"),
                          lambda o, t: check_gpu(o, want_gpu=True)),
    "gpu: in the cpu base": (lambda o: container(worker(o), "worker")["resources"]["limits"].update({"nvidia.com/gpu": 1}),
                             lambda o, t: check_gpu(o, want_gpu=False)),
    "token: literal value": (lambda o: _set_env(container(worker(o), "worker"), "OPTION_CONTROL_TOKEN", "x" * 32),
                             check_control_token),
    "token: in properties": (lambda o: _edit_properties(o, "option.worker_lease=30",
                                                        "option.worker_lease=30\noption.control_token=" + "y" * 20),
                             check_control_token),
    "token: a shipped Secret": (lambda o: o.append({"apiVersion": "v1", "kind": "Secret",
                                                    "metadata": {"name": "seqserve-control"},
                                                    "stringData": {"token": "z" * 32}}),
                                check_control_token),
    "termination: grace below drain": (
        lambda o: scheduler(o)["spec"]["template"]["spec"].update(terminationGracePeriodSeconds=30),
        check_termination),
    "termination: longer drain": (lambda o: _edit_properties(o, "option.drain_timeout=30", "option.drain_timeout=60"),
                                  check_termination),
    "prometheus: wrong port": (
        lambda o: worker(o)["spec"]["template"]["metadata"]["annotations"].update({"prometheus.io/port": "8100"}),
        check_prometheus),
    "network policy: open control port": (
        lambda o: one(o, "NetworkPolicy", "seqserve-worker")["spec"]["ingress"][0].pop("from"),
        check_network_policy),
    "podmonitor: wrong port name": (
        lambda o: next(m for m in o if m["kind"] == "PodMonitor")["spec"]["podMetricsEndpoints"][0].update(port="prom"),
        lambda o, t: check_podmonitors(o)),
}


@pytest.mark.parametrize("name", list(_BREAKAGES))
def test_each_check_catches_its_breakage(rendered, name, tmp_path):
    variant = "gpu" if name == "gpu: no gpu limit" else "base+prometheus-operator"
    objs = copy.deepcopy(rendered[variant])
    check = _BREAKAGES[name][1]
    check(objs, tmp_path)  # passes on the real manifests ...
    _BREAKAGES[name][0](objs)
    with pytest.raises((AssertionError, ValueError)):  # ... and fails once broken
        check(objs, tmp_path)


# --- the renderer itself ----------------------------------------------------------------------

def test_configmap_hash_is_kustomizes():
    # `kubectl kustomize` (kustomize v5.5.0) names a generator `x` with literal a=b x-4h2mbtbbt6.
    assert configmap_hash({"a": "b"}) == "4h2mbtbbt6"
    assert configmap_hash({"a": "c"}) != configmap_hash({"a": "b"})


def test_strategic_merge_merges_named_lists_and_replaces_others():
    base = {"containers": [{"name": "a", "env": [{"name": "X", "value": "1"}], "command": ["p", "q"]},
                           {"name": "b"}],
            "tolerations": [{"key": "k1"}]}
    patch = {"containers": [{"name": "a", "env": [{"name": "X", "value": "2"}, {"name": "Y", "value": "3"}],
                             "command": ["r"]}],
             "tolerations": [{"key": "k2"}]}
    out = strategic_merge(base, patch)
    a = out["containers"][0]
    assert a["env"] == [{"name": "X", "value": "2"}, {"name": "Y", "value": "3"}]
    assert a["command"] == ["r"] and out["containers"][1] == {"name": "b"}
    assert out["tolerations"] == [{"key": "k2"}]
    assert base["containers"][0]["env"][0]["value"] == "1", "the base must not change"
    with pytest.raises(NotImplementedError):
        strategic_merge({"ports": [{"containerPort": 1}]}, {"ports": [{"containerPort": 2}]})


def test_render_refuses_what_it_does_not_implement(tmp_path):
    (tmp_path / "kustomization.yaml").write_text("resources: []\nnamePrefix: x-\n")
    with pytest.raises(NotImplementedError):
        render(tmp_path)
    (tmp_path / "kustomization.yaml").write_text("patches:\n  - path: p.yaml\n")
    (tmp_path / "p.yaml").write_text("apiVersion: v1\nkind: Service\nmetadata: {name: nope}\n")
    with pytest.raises(ValueError):
        render(tmp_path)


def _normalised(objs: list[dict]) -> list:
    def norm(v, field=""):
        if isinstance(v, dict):
            return {k: norm(x, k) for k, x in v.items()}
        if isinstance(v, list):
            items = [norm(x) for x in v]
            if field in _MERGE_KEYS:
                return sorted(items, key=lambda x: json.dumps(x, sort_keys=True))
            return items
        return v
    return sorted((norm(o) for o in objs), key=lambda o: json.dumps(_ident(o)))


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
@pytest.mark.parametrize("root", [BASE, GPU], ids=["base", "gpu"])
def test_render_matches_kubectl_kustomize(root):
    out = subprocess.run(["kubectl", "kustomize", str(root)], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    theirs = [d for d in yaml.safe_load_all(out) if d]
    assert _normalised(render(root)) == _normalised(theirs)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_monitoring_render_matches_kubectl_kustomize(tmp_path):
    """An overlay with the base and components/prometheus-operator, beside a copy of deploy/k8s."""
    shutil.copytree(K8S, tmp_path / "k8s")
    overlay = tmp_path / "k8s" / "overlays" / "monitoring"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": ["../../base"], "components": ["../../components/prometheus-operator"]}))
    out = subprocess.run(["kubectl", "kustomize", str(overlay)], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    theirs = [d for d in yaml.safe_load_all(out) if d]
    assert _normalised(render(overlay)) == _normalised(theirs)
    assert _normalised(render_with_monitoring()) == _normalised(theirs)


# --- the inference gateway's metrics ----------------------------------------------------------

_EPP_FLAG = re.compile(r"--(total-queued-requests|total-running-requests|kv-cache-usage-percentage)"
                       r"-metric=([A-Za-z_:][A-Za-z0-9_:]*)")
_EPP_SPEC = re.compile(r"(queuedRequestsSpec|runningRequestsSpec|kvUsageSpec): *\"?([A-Za-z_:][A-Za-z0-9_:]*)")


def test_the_gateway_mapping_in_docs_names_real_scheduler_gauges():
    """docs/deployment.md tells the endpoint picker which seqserve gauges to read (both as
    flags and as the extractor's engine config); each must be a gauge the scheduler exports."""
    text = DEPLOYMENT_DOC.read_text()
    gauges = {f.name for f in SchedulerMetrics().registry.collect() if f.type == "gauge"}
    flags = dict(_EPP_FLAG.findall(text))
    specs = dict(_EPP_SPEC.findall(text))
    assert flags == {"total-queued-requests": "seqserve_num_requests_waiting",
                     "total-running-requests": "seqserve_num_requests_running",
                     "kv-cache-usage-percentage": "seqserve_kv_budget_used_ratio"}, flags
    assert specs == {"queuedRequestsSpec": flags["total-queued-requests"],
                     "runningRequestsSpec": flags["total-running-requests"],
                     "kvUsageSpec": flags["kv-cache-usage-percentage"]}, specs
    for name in flags.values():
        assert name in gauges, f"{name} is not a gauge of the scheduler"
    labels = scheduler(render(BASE))["spec"]["template"]["metadata"]["labels"]
    assert labels.get("inference.networking.k8s.io/engine-type") == "seqserve"
    assert "name: seqserve" in text, "the engine config must be named as the pods' engine-type label"
