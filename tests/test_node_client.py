"""The public gRPC API through a client we did not write: Node's @grpc/grpc-js running
client/node/generate.js against the real scheduler and worker processes. Its tokens must be
exactly Hugging Face's greedy `generate`, its text the Python client's, whether each
message carries one token or several (a client that reads slowly gets what piled up in one
message: generate.proto's `tokens` and `token_texts`)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from client import Client
from scheduler_service.frontend import MAX_REQUEST_ID_CHARS
from tests import reference
from tests.conftest import REPO

NODE_CLIENT = REPO / "client" / "node"
# node_modules installed from package-lock.json live outside the repository, one directory
# per lock file, so a test run leaves the work tree as it found it.
NODE_CACHE = Path(os.environ.get("SEQSERVE_NODE_CACHE",
                                 Path.home() / ".cache" / "seqserve" / "node-client"))
PROMPT = "Once upon a time"
NEW_TOKENS = 48
SLOW_NEW_TOKENS = 900


# npm's codes for a registry it cannot reach (no route, no name, refused, timed out).
NETWORK_ERRORS = re.compile(r"\b(ECONNREFUSED|ECONNRESET|ENOTFOUND|EAI_AGAIN|ETIMEDOUT|"
                            r"ENETUNREACH|EHOSTUNREACH|ERR_SOCKET_TIMEOUT)\b")


def _npm_ci(target: Path) -> None:
    """`npm ci` of client/node's lock into `target`/node_modules, written beside it and
    renamed into place so that concurrent runs never see half an install. Skips the test
    when npm cannot reach its registry; fails it on any other npm error."""
    staging = target.with_name(f"{target.name}.tmp{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for name in ("package.json", "package-lock.json"):
        shutil.copy(NODE_CLIENT / name, staging / name)
    # --ignore-scripts: no dependency needs an install script (protobufjs's only checks
    # its own version's dependencies). Few, short retries: npm's defaults wait over a
    # minute before saying that the registry is unreachable.
    command = ["npm", "ci", "--ignore-scripts", "--no-audit", "--no-fund",
               "--cache", str(NODE_CACHE / "npm-cache"), "--fetch-retries", "1",
               "--fetch-retry-mintimeout", "1000", "--fetch-retry-maxtimeout", "5000"]
    try:
        done = subprocess.run(command, cwd=staging, capture_output=True, text=True,
                              timeout=300)
    except subprocess.TimeoutExpired as exc:
        shutil.rmtree(staging, ignore_errors=True)
        pytest.skip(f"npm ci of client/node did not finish in {exc.timeout} s; is the npm "
                    f"registry reachable?")
    if done.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        unreachable = NETWORK_ERRORS.search(done.stderr)
        if unreachable:
            pytest.skip(f"npm cannot reach its registry to install client/node's packages "
                        f"({unreachable.group(1)}; see `npm config get registry`)")
        pytest.fail(f"npm ci of client/node failed:\n{done.stdout[-2000:]}\n"
                    f"{done.stderr[-2000:]}")
    try:
        staging.rename(target)
    except OSError:  # another run installed the same lock first
        shutil.rmtree(staging, ignore_errors=True)


@pytest.fixture(scope="module")
def node_env() -> dict[str, str]:
    """The environment to run client/node/generate.js in: its packages from
    client/node/node_modules where someone installed them, else from the cache."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node and npm are needed to test the Node.js client (client/node); "
                    "install Node.js 18 or later")
    env = dict(os.environ)
    if (NODE_CLIENT / "node_modules").is_dir():
        return env
    lock = (NODE_CLIENT / "package-lock.json").read_bytes()
    target = NODE_CACHE / hashlib.sha256(lock).hexdigest()[:16]
    if not (target / "node_modules" / ".package-lock.json").is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        _npm_ci(target)
    env["NODE_PATH"] = str(target / "node_modules")
    return env


def node_generate(env: dict[str, str], address: str, *flags: str) -> dict:
    done = subprocess.run(["node", str(NODE_CLIENT / "generate.js"), "--address", address,
                           "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS),
                           "--decoding-strategy", "greedy", *flags],
                          env=env, capture_output=True, text=True, timeout=180)
    if done.returncode != 0:  # pytest.fail: an assert would print the 64 KiB argument
        pytest.fail(f"generate.js exited {done.returncode}: {done.stderr[-2000:]}")
    return json.loads(done.stdout)


# Slow: a deployment, the reference and two Node runs, one of them paused 1.5 s, took
# 20-38 s on 2 shared, busy cores (npm ci, once per lock file, 3-5 s more).
@pytest.mark.slow
def test_node_client_streams_exact_tokens_one_or_several_to_a_message(deploy, llama_dir,
                                                                     node_env):
    d = deploy(llama_dir)
    expected = reference.greedy(llama_dir, PROMPT, NEW_TOKENS)
    with Client(d.address, timeout=120) as c:
        python = c.generate(PROMPT, max_new_tokens=NEW_TOKENS, decoding_strategy="greedy")
    assert python.token_ids == expected

    # Read as it comes, health first: seqserve's names through grpc-health-check's proto.
    quick = node_generate(node_env, d.address, "--health", "--request-id", "node-quick")
    assert quick["request_id"] == "node-quick"
    assert quick["health"] == {"": "SERVING", "readiness": "SERVING", "liveness": "SERVING",
                               "seqserve.v1.Generation": "SERVING"}
    assert quick["token_ids"] == expected
    assert quick["text"] == python.text
    assert quick["finish_reason"] == python.finish_reason
    assert quick["usage"]["generated_tokens"] == len(expected)

    # Read slowly: after the first token the client stops reading for a while. Messages of
    # ~300 bytes (a request_id at its 256-character cap, echoed in every message), a
    # 64-byte HTTP/2 window and a long generation fill the buffers between the server's
    # writes and the client, so the server's writes block and the tokens generated
    # meanwhile pile up and come back several to a message.
    long_expected = reference.greedy(llama_dir, PROMPT, SLOW_NEW_TOKENS)
    rid = "node-slow-" + "x" * (MAX_REQUEST_ID_CHARS - len("node-slow-"))
    slow = node_generate(node_env, d.address, "--pause-ms", "1500", "--window", "64",
                         "--request-id", rid, "--max-new-tokens", str(SLOW_NEW_TOKENS))
    assert slow["request_id"] == rid
    assert max(slow["tokens_per_message"]) > 1, slow["tokens_per_message"]
    assert slow["token_ids"] == long_expected
    assert sum(slow["tokens_per_message"]) == len(long_expected)
