"""Security over real processes: TLS on the public port, mutual TLS between scheduler
and worker, the bearer token, and configuration errors that stop start-up.

Certificates are made here with the openssl command: a CA, a server certificate for
127.0.0.1/localhost, a client certificate (the scheduler's, toward the worker, and a public
client's), and a client certificate from another CA that nobody trusts.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.deployment import Deployment
from bench.processes import free_port, health_status
from client import AsyncClient, Client
from client import cli
from seqserve_common import tls
from seqserve_common.control_auth import call_metadata, control_token
from seqserve_common.config import ConfigError, ServingConfig, load_config
from seqserve.worker.v1 import worker_pb2, worker_pb2_grpc
from tests.conftest import REPO

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")

TOKEN = "test-token-7f3a9c"


# --- certificates -------------------------------------------------------------------------

def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _ca(d: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2",
             "-subj", f"/CN=seqserve test {name}",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=d)


def _leaf(d: Path, name: str, ca: str, cn: str, ext: str) -> None:
    (d / f"{name}.ext").write_text(ext)
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={cn}", cwd=d)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext",
             cwd=d)


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("certs")
    _ca(d, "ca")
    _leaf(d, "server", "ca", "localhost",
          "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
          "extendedKeyUsage=serverAuth\nsubjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _leaf(d, "client", "ca", "seqserve-scheduler",
          "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n"
          "extendedKeyUsage=clientAuth\n")
    _ca(d, "rogue_ca")
    _leaf(d, "rogue", "rogue_ca", "intruder",
          "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n"
          "extendedKeyUsage=clientAuth\n")
    return {f"{n}.{e}": str(d / f"{n}.{e}") for n in ("ca", "server", "client", "rogue_ca",
                                                       "rogue") for e in ("pem", "key")}


def _read(path: str) -> bytes:
    return Path(path).read_bytes()


def _creds(certs, ca="ca.pem", client: str | None = None) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        _read(certs[ca]), _read(certs[f"{client}.key"]) if client else None,
        _read(certs[f"{client}.pem"]) if client else None)


# --- helpers for processes whose health check needs TLS -------------------------------------


def secure_health(address: str, creds: grpc.ChannelCredentials, timeout: float = 2.0) -> str:
    with grpc.secure_channel(address, creds) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""),
                                                    timeout=timeout)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def wait_secure(address: str, creds, proc, want=("SERVING",), timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        if proc.proc.poll() is not None:
            raise RuntimeError(f"{proc.name} exited with {proc.proc.returncode}:\n"
                               f"{proc.log.read_text()[-4000:]}")
        try:
            status = secure_health(address, creds)
            if status in want:
                return status
        except grpc.RpcError as exc:
            last = exc
        time.sleep(0.1)
    raise TimeoutError(f"{address} not {want} after {timeout} s ({last}):\n"
                       f"{proc.log.read_text()[-4000:]}")


def rpc_code(fn) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value.code(), info.value.details() or ""


def http_post(url: str, body: dict, headers: dict | None = None,
              context: ssl.SSLContext | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60, context=context) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


# --- configuration (no processes) -----------------------------------------------------------

def test_defaults_are_safe():
    cfg = load_config(env={})
    assert cfg.host == "127.0.0.1"
    assert cfg.trust_remote_code is False
    assert cfg.auth_token == "" and cfg.tls_cert_file == "" and cfg.worker_tls_cert_file == ""
    assert tls.public_tls(cfg) is None and tls.worker_tls(cfg) is None
    assert ServingConfig().host == "127.0.0.1" and ServingConfig().trust_remote_code is False


def test_token_from_environment_is_not_in_repr():
    cfg = load_config(env={"OPTION_AUTH_TOKEN": TOKEN})
    assert cfg.auth_token == TOKEN
    assert TOKEN not in repr(cfg)


@pytest.mark.parametrize("which, options, words", [
    (tls.public_tls, {"tls_cert_file": "server.pem"}, ["option.tls_cert_file",
                                                        "option.tls_key_file"]),
    (tls.public_tls, {"tls_key_file": "server.key"}, ["option.tls_key_file",
                                                       "option.tls_cert_file"]),
    (tls.public_tls, {"tls_client_ca_file": "ca.pem"}, ["option.tls_client_ca_file",
                                                         "option.tls_cert_file"]),
    (tls.worker_tls, {"worker_tls_cert_file": "client.pem"},
     ["option.worker_tls_cert_file", "option.worker_tls_key_file"]),
    (tls.worker_tls, {"worker_tls_key_file": "client.key"},
     ["option.worker_tls_key_file", "option.worker_tls_cert_file"]),
    (tls.worker_tls, {"worker_tls_cert_file": "client.pem", "worker_tls_key_file": "client.key"},
     ["option.worker_tls_ca_file"]),
    (tls.worker_tls, {"worker_tls_cert_file": "client.pem", "worker_tls_key_file": "server.key",
                       "worker_tls_ca_file": "ca.pem"},
     ["option.worker_tls_cert_file", "option.worker_tls_key_file", "client.pem"]),
    (tls.public_tls, {"tls_cert_file": "server.pem", "tls_key_file": "missing.key"},
     ["option.tls_key_file", "missing.key", "no such file"]),
    (tls.public_tls, {"tls_cert_file": "server.pem", "tls_key_file": "server.key",
                       "tls_client_ca_file": "server.ext"},
     ["option.tls_client_ca_file", "server.ext", "not a PEM file"]),
])
def test_bad_tls_configuration_names_keys_and_paths(certs, which, options, words):
    d = Path(certs["ca.pem"]).parent
    cfg = ServingConfig(**{k: str(d / v) for k, v in options.items()})
    with pytest.raises(ConfigError) as info:
        which(cfg)
    for w in words:
        assert w in str(info.value)


def test_good_tls_configuration_loads(certs):
    cfg = ServingConfig(tls_cert_file=certs["server.pem"], tls_key_file=certs["server.key"],
                        worker_tls_cert_file=certs["client.pem"],
                        worker_tls_key_file=certs["client.key"],
                        worker_tls_ca_file=certs["ca.pem"])
    pub, wrk = tls.public_tls(cfg), tls.worker_tls(cfg)
    assert pub.ca is None and pub.cert_chain.startswith(b"-----BEGIN")
    assert wrk.ca == _read(certs["ca.pem"])
    pub.server_ssl_context()


@pytest.mark.parametrize("module, flags, keys", [
    ("scheduler_service.main", ["--tls-cert-file", "server.pem"],
     ["option.tls_cert_file", "option.tls_key_file"]),
    ("worker_service.main", ["--worker-tls-key-file", "server.key"],
     ["option.worker_tls_key_file", "option.worker_tls_cert_file"]),
])
def test_bad_configuration_stops_start_up(certs, tmp_path, llama_dir, module, flags, keys):
    cmd = [sys.executable, "-m", module, "--model-id", str(llama_dir), "--port", "0",
           "--worker-port", "0", "--metrics-port", "-1", "--http-port", "-1",
           "--worker-metrics-port", "-1", *[certs.get(f, f) for f in flags]]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode != 0
    for k in keys:
        assert k in proc.stderr, proc.stderr


# --- public TLS and worker mutual TLS, one deployment ---------------------------------------

@pytest.fixture(scope="module")
def secure(certs, llama_dir, tmp_path_factory):
    """Public port over TLS; scheduler and worker over mutual TLS."""
    d = Deployment(llama_dir, tmp_path_factory.mktemp("secure"),
                   options={"tls_cert_file": certs["server.pem"],
                            "tls_key_file": certs["server.key"],
                            "worker_tls_cert_file": certs["client.pem"],
                            "worker_tls_key_file": certs["client.key"],
                            "worker_tls_ca_file": certs["ca.pem"]},
                   worker_options={"worker_tls_cert_file": certs["server.pem"],
                                   "worker_tls_key_file": certs["server.key"],
                                   "worker_tls_ca_file": certs["ca.pem"]})
    try:
        d.start_worker(wait_ready=False)
        wait_secure(f"127.0.0.1:{d.worker.ports['grpc']}", _creds(certs, client="client"),
                    d.worker)
        d.start_scheduler(wait_ready=False)
        wait_secure(d.address, _creds(certs), d.scheduler)
        yield d
    finally:
        d.stop()


def test_public_tls_client_generates(secure, certs):
    with Client(secure.address, timeout=60, tls_ca_file=certs["ca.pem"]) as c:
        reply = c.generate("Once upon a time", max_new_tokens=5)
        assert reply.generated_tokens == 5 and len(reply.token_ids) == 5
        assert c.model_info().vocab_size > 0

    async def run():
        async with AsyncClient(secure.address, timeout=60, tls_ca_file=certs["ca.pem"]) as c:
            return await c.generate("Once upon a time", max_new_tokens=5)

    assert asyncio.run(run()).token_ids == reply.token_ids  # greedy: the same tokens
    # The direct Steps link has no TLS: under mutual TLS the Steps stay on gRPC.
    assert secure.worker.ports["steps_link"] == -1
    assert "Steps over gRPC" in secure.scheduler.log.read_text()


def test_public_tls_refuses_plaintext_and_unknown_ca(secure, certs):
    with Client(secure.address, timeout=10) as c:
        code, _ = rpc_code(lambda: c.generate("Hello", max_new_tokens=2))
    assert code == grpc.StatusCode.UNAVAILABLE
    with Client(secure.address, timeout=10, tls_ca_file=certs["rogue_ca.pem"]) as c:
        code, _ = rpc_code(lambda: c.generate("Hello", max_new_tokens=2))
    assert code == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(grpc.RpcError):
        health_status(secure.address)  # conftest's plaintext health check


def test_http_invocations_over_tls(secure, certs):
    url = f"https://127.0.0.1:{secure.scheduler.ports['http']}/invocations"
    ctx = ssl.create_default_context(cafile=certs["ca.pem"])
    status, body = http_post(url, {"inputs": "Hello", "parameters": {"max_new_tokens": 3}},
                             context=ctx)
    assert status == 200 and body["details"]["generated_tokens"] == 3
    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
        http_post(url.replace("https://", "http://"), {"inputs": "Hello"})


def test_worker_requires_client_certificate(secure, certs):
    address = f"127.0.0.1:{secure.worker.ports['grpc']}"

    def info(channel: grpc.Channel):
        with channel as ch:
            return worker_pb2_grpc.WorkerStub(ch).Info(
                worker_pb2.InfoRequest(), timeout=10,
                metadata=call_metadata(control_token(ServingConfig())))

    # The scheduler holds the right client certificate, so requests are served (above); a
    # plaintext channel, a TLS channel with no certificate and one from another CA are not,
    # even with the control-plane token.
    code, _ = rpc_code(lambda: info(grpc.insecure_channel(address)))
    assert code == grpc.StatusCode.UNAVAILABLE
    code, _ = rpc_code(lambda: info(grpc.secure_channel(address, _creds(certs))))
    assert code == grpc.StatusCode.UNAVAILABLE
    code, _ = rpc_code(lambda: info(grpc.secure_channel(address, _creds(certs, client="rogue"))))
    assert code == grpc.StatusCode.UNAVAILABLE
    assert info(grpc.secure_channel(address, _creds(certs, client="client"))).vocab_size > 0
    assert "mutual TLS" in secure.worker.log.read_text()


def test_public_mutual_tls(certs, llama_dir, tmp_path):
    """tls_client_ca_file: public clients need a certificate too (scheduler alone: the
    handshake is the point, so no worker is needed and health answers NOT_SERVING)."""
    d = Deployment(llama_dir, tmp_path, options={"tls_cert_file": certs["server.pem"],
                                                 "tls_key_file": certs["server.key"],
                                                 "tls_client_ca_file": certs["ca.pem"]})
    try:
        d.start_scheduler(worker_port=free_port(), wait_ready=False)
        assert wait_secure(d.address, _creds(certs, client="client"), d.scheduler,
                           want=("NOT_SERVING", "SERVING")) == "NOT_SERVING"
        for creds in (_creds(certs), _creds(certs, client="rogue")):
            with pytest.raises(grpc.RpcError) as info:
                secure_health(d.address, creds)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        with Client(d.address, timeout=10, tls_ca_file=certs["ca.pem"],
                    tls_cert_file=certs["client.pem"], tls_key_file=certs["client.key"]) as c:
            code, _ = rpc_code(c.model_info)
        assert code == grpc.StatusCode.UNAVAILABLE  # past the handshake: no worker yet

        ping = f"https://127.0.0.1:{d.scheduler.ports['http']}/ping"
        ctx = ssl.create_default_context(cafile=certs["ca.pem"])
        with pytest.raises((urllib.error.URLError, ConnectionError, OSError)) as info:
            urllib.request.urlopen(ping, timeout=10, context=ctx)
        assert not isinstance(info.value, urllib.error.HTTPError)  # refused in the handshake
        ctx.load_cert_chain(certs["client.pem"], certs["client.key"])
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(ping, timeout=10, context=ctx)
        assert info.value.code == 503  # through TLS; not ready without a worker
    finally:
        d.stop()


# --- bearer token ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def with_token(llama_dir, tmp_path_factory):
    """A plaintext deployment whose token comes the usual way, from OPTION_AUTH_TOKEN."""
    d = Deployment(llama_dir, tmp_path_factory.mktemp("token"), env={"OPTION_AUTH_TOKEN": TOKEN})
    try:
        yield d.start()  # conftest's readiness check: health works without a token
    finally:
        d.stop()


def test_token_required_on_public_grpc(with_token):
    with Client(with_token.address, timeout=60) as c:
        code, details = rpc_code(lambda: c.generate("Hello", max_new_tokens=2))
        assert code == grpc.StatusCode.UNAUTHENTICATED
        assert "missing" in details and "authorization: Bearer <token>" in details
        code, _ = rpc_code(c.model_info)
        assert code == grpc.StatusCode.UNAUTHENTICATED
    with Client(with_token.address, timeout=60, token="not-" + TOKEN) as c:
        code, details = rpc_code(lambda: c.generate("Hello", max_new_tokens=2))
        assert code == grpc.StatusCode.UNAUTHENTICATED and "invalid bearer token" in details
    with grpc.insecure_channel(with_token.address) as ch:
        from seqserve.v1 import generate_pb2, generate_pb2_grpc
        stub = generate_pb2_grpc.GenerationStub(ch)
        code, details = rpc_code(lambda: stub.ModelInfo(
            generate_pb2.ModelInfoRequest(), metadata=(("authorization", f"Basic {TOKEN}"),),
            timeout=10))
        assert code == grpc.StatusCode.UNAUTHENTICATED and "malformed" in details
    with Client(with_token.address, timeout=60, token=TOKEN) as c:
        assert c.generate("Hello", max_new_tokens=3).generated_tokens == 3
        assert c.model_info().vocab_size > 0

    async def run():
        async with AsyncClient(with_token.address, timeout=60, token=TOKEN) as c:
            return await c.generate("Hello", max_new_tokens=3)

    assert asyncio.run(run()).generated_tokens == 3
    assert health_status(with_token.address) == "SERVING"  # no token needed


def test_token_required_on_http(with_token):
    url = f"{with_token.http_url}/invocations"
    body = {"inputs": "Hello", "parameters": {"max_new_tokens": 3}}
    status, reply = http_post(url, body)
    assert status == 401 and reply["code"] == 401 and "Authorization: Bearer" in reply["error"]
    status, reply = http_post(url, body, {"Authorization": "Bearer wrong"})
    assert status == 401 and "invalid" in reply["error"]
    status, reply = http_post(url, body, {"Authorization": f"Bearer {TOKEN}"})
    assert status == 200 and reply["details"]["generated_tokens"] == 3
    with urllib.request.urlopen(f"{with_token.http_url}/ping", timeout=10) as resp:
        assert resp.status == 200  # stays open for health checks


def test_cli_token(with_token, monkeypatch, capsys):
    monkeypatch.delenv("SEQSERVE_TOKEN", raising=False)
    assert cli.main(["--address", with_token.address, "info"]) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    assert cli.main(["--address", with_token.address, "--token", TOKEN, "info"]) == 0
    assert "vocab_size" in capsys.readouterr().out
    monkeypatch.setenv("SEQSERVE_TOKEN", TOKEN)
    assert cli.main(["--address", with_token.address, "generate", "Hi",
                     "--max-new-tokens", "2"]) == 0
