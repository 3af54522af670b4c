"""Operations over real processes: health readiness, DJL /invocations, and a real Prometheus
server scraping both processes."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request

import pytest

from bench.deployment import Deployment
from bench.processes import free_port, health_status
from client import Client


def test_readiness_follows_the_worker(llama_dir, tmp_path):
    d = Deployment(llama_dir, tmp_path)
    worker_port = free_port()
    try:
        d.start_scheduler(worker_port=worker_port, wait_ready=False)
        # Live (it answers) but not ready (no worker): a supervisor must not restart it.
        deadline = time.monotonic() + 30
        status = None
        while time.monotonic() < deadline:
            try:
                status = health_status(d.address)
                break
            except Exception:
                time.sleep(0.1)
        assert status == "NOT_SERVING"
        assert d.scheduler.proc.poll() is None
        d.start_worker(port=worker_port)
        deadline = time.monotonic() + 60
        while health_status(d.address) != "SERVING":
            assert time.monotonic() < deadline, "scheduler never became ready"
            time.sleep(0.2)
        with Client(d.address, timeout=60) as c:
            assert c.generate("Once upon a time", max_new_tokens=5).generated_tokens == 5
    finally:
        d.stop()


SEED_BODY = ('{"inputs":"The new movie that got Oscar this year","parameters":{"max_new_tokens":50, '
             '"do_sample":true},\n  "cached_prompt":"This is a prompt that will be cached and '
             'appended to the front of the inputs strings."}')


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_seed_curl_request_both_forms(llama_dir, deploy):
    d = deploy(llama_dir)
    url = f"{d.http_url}/invocations"
    cmd = ["curl", "-sS", "-X", "POST", url, "--connect-timeout", "60",
           "-H", "Content-type: application/json", "-d", SEED_BODY]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120).stdout
    reply = json.loads(out)
    assert isinstance(reply["generated_text"], str)
    assert reply["details"]["generated_tokens"] <= 50

    body = json.loads(SEED_BODY)
    body["stream"] = True
    cmd[-1] = json.dumps(body)
    lines = subprocess.run(cmd, check=True, capture_output=True, text=True,
                           timeout=120).stdout.splitlines()
    events = [json.loads(x) for x in lines]
    tokens = [e["token"] for e in events if "token" in e]
    assert tokens and all(isinstance(t["id"], int) for t in tokens)
    assert events[-1]["generated_text"] == "".join(t["text"] for t in tokens) + events[-1]["text"]
    assert events[-1]["details"]["generated_tokens"] == len(tokens)

    bad = subprocess.run(["curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}", "-X", "POST",
                          url, "-d", '{"inputs": "x", "parameters": {"temperature": -1}}'],
                         capture_output=True, text=True, timeout=60).stdout
    assert bad == "400"


def _prom_query(base: str, expr: str) -> list:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    data = json.loads(urllib.request.urlopen(url, timeout=10).read())
    assert data["status"] == "success", data
    return data["data"]["result"]


@pytest.mark.skipif(shutil.which("prometheus") is None,
                    reason="Prometheus is not installed (apt-get install prometheus; .ci/run does)")
def test_real_prometheus_scrapes_sparsity_and_splits(llama_dir, deploy, tmp_path):
    d = deploy(llama_dir, max_sparsity=0.05, max_splits=4)
    prom_port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(f"""
global:
  scrape_interval: 1s
scrape_configs:
  - job_name: seqserve-scheduler
    static_configs: [{{targets: ["127.0.0.1:{d.scheduler.ports['metrics']}"]}}]
  - job_name: seqserve-worker
    static_configs: [{{targets: ["127.0.0.1:{d.worker.ports['metrics']}"]}}]
""")
    prom = subprocess.Popen(
        ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{prom_port}"],
        stdout=(tmp_path / "prom.log").open("w"), stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{prom_port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if urllib.request.urlopen(f"{base}/-/ready", timeout=2).status == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "prom.log").read_text()[-2000:]
            time.sleep(0.3)
        with Client(d.address, timeout=120) as c:
            for n in (5, 40, 120, 260, 15, 80):
                c.generate("word " * n, max_new_tokens=24)
        deadline = time.monotonic() + 30
        while True:
            splits = _prom_query(base, "seqserve_batch_splits_count")
            sparsity = _prom_query(base, "seqserve_batch_sparsity_sum")
            worker = _prom_query(base, "seqserve_worker_steps_total")
            if splits and float(splits[0]["value"][1]) > 0 and worker:
                break
            assert time.monotonic() < deadline, "Prometheus never saw the seqserve series"
            time.sleep(1)
        assert float(sparsity[0]["value"][1]) >= 0
        up = _prom_query(base, "up")
        assert {r["metric"]["job"] for r in up if r["value"][1] == "1"} == {
            "seqserve-scheduler", "seqserve-worker"}
    finally:
        prom.terminate()
        prom.wait(10)


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_seed_properties_fp16_serve_on_any_cpu(deploy, tmp_path):
    """The seed's serving.properties, verbatim but for the model id (option.dtype=fp16,
    contrastive by default), starts on this CPU and answers the seed's curl request. A
    CPU without native float16 (no avx512_fp16 / avx_ne_convert, where oneDNN refuses
    float16 weights) computes in float32, which holds every float16 weight exactly: the
    reply is then contrastive search over the float32 copy of the float16 model."""
    import torch
    from transformers import AutoTokenizer

    from tests.conftest import MODELS
    from tests.test_config import SEED_EXAMPLE
    from tests.test_decoding import contrastive_reference
    from worker_service.fixtures import make_model
    from worker_service.kernels import linear_prepack

    model_dir = make_model(MODELS / "tiny-llama-fp16", arch="llama", dtype="float16")
    assert "option.dtype=fp16" in SEED_EXAMPLE and "engine=MPI" in SEED_EXAMPLE
    props = tmp_path / "serving.properties"
    props.write_text(SEED_EXAMPLE.replace("/workspace/llama-2-70b-hf/", str(model_dir)))
    d = deploy(model_dir, {"properties": props}, properties=props)
    log = d.worker.log.read_text()
    native = linear_prepack.runs(torch.float16)
    assert ("computes in float32" in log) == (not native), log[-3000:]

    prompt = "The new movie that got Oscar this year"
    body = json.dumps({"inputs": prompt, "parameters": {"max_new_tokens": 50}})
    cmd = ["curl", "-sS", "-X", "POST", f"{d.http_url}/invocations", "--connect-timeout", "60",
           "-H", "Content-type: application/json", "-d", body]
    reply = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True,
                                      timeout=120).stdout)
    assert 0 < reply["details"]["generated_tokens"] <= 50
    if not native:
        tok = AutoTokenizer.from_pretrained(model_dir)
        expected = contrastive_reference(model_dir, prompt, 50, top_k=4, alpha=0.6)
        assert reply["generated_text"] == tok.decode(expected, skip_special_tokens=True)
