"""The deployment's configuration: one `serving.properties` file read by every process.

The file uses the seed's (DJL LMI) format: `key=value` lines, `#` comments, also at the
end of a line after whitespace (a `#` inside a value, as in a path, is kept). Environment
variables override the file the LMI way (`OPTION_MAX_SPARSITY=0.2` sets
`option.max_sparsity`), and command-line flags (`--max-sparsity 0.2`) override both. Unknown
keys are warned about by name; a bad value stops start-up with the key, the value and what
is allowed.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Mapping

from seqserve_common import option_values as ov

logger = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A configuration value is invalid; the message names key, value and what is allowed."""


@dataclass(frozen=True)
class Option:
    """How one option is read and checked; its type and default are ServingConfig's."""

    key: str  # name after "option." in the file ("engine" has no prefix)
    parse: Callable[[str], Any]
    allowed: str  # words for error messages
    check: Callable[[Any], bool] = lambda v: True
    help: str = ""

    @property
    def default(self) -> Any:
        return _DEFAULTS[self.key]


SCHEDULING_POLICIES = ("fcfs", "priority", "mlfq", "length-aware", "length-batched")
LENGTH_PREDICTORS = ("both", "prompt", "hidden")

OPTIONS: tuple[Option, ...] = (
    Option("engine", str, "any engine name (kept for DJL compatibility)",
           help="DJL engine name; seqserve runs its own engine whatever it says"),
    Option("model_id", str, "a local model directory, a hub name or a .gguf file",
           help="Hugging Face model directory or hub id, or the path of a .gguf file"),
    Option("tokenizer", str, "a local tokenizer directory, a hub name, a .gguf file or empty",
           help="tokenizer directory or hub id; empty: the model's"),
    Option("gguf_cache_dir", str, "a directory path, or empty to load a .gguf file each time",
           help="where the worker keeps a .gguf model converted once (dequantized, "
                "save_pretrained) to load it faster afterwards; relative to the working "
                "directory"),
    Option("tensor_parallel_degree", int, "an integer >= 1",
           lambda v: v >= 1, "ranks in the worker's tensor-parallel group (1: none); the "
           "worker starts the other ranks itself unless torchrun did (docs/deployment.md)"),
    Option("dtype", ov.dtype, "fp32, bf16, fp16 (or float32, bfloat16, float16, auto)",
           help="weights dtype; auto: the checkpoint's own (a GGUF file dequantizes to fp32)"),
    Option("kv_cache_dtype", ov.dtype, "fp32, bf16, fp16 (or float32, bfloat16, float16, auto)",
           help="dtype of the worker's KV buffers; auto: the model's, except on CPU: "
                "float32 for float16 models, and for bfloat16 ones where the native "
                "attention (native_attention.c) cannot be built"),
    Option("batch_invariant", ov.parse_bool, "true or false",
           help="make a request's tokens independent of the rest of the batch: every linear "
                "product computes at least two rows (oneDNN computes one row differently); "
                "bfloat16 on CPU only, checked on a probe at load (README: what exact means)"),
    Option("trust_remote_code", ov.parse_bool, "true or false",
           help="run model code shipped with the model (off unless set)"),
    Option("max_rolling_batch_size", int, "an integer >= 1", lambda v: v >= 1,
           "most sequences decoded together"),
    Option("rolling_batch", ov.choice("scheduler", "auto"), "scheduler",
           help="rolling batch implementation (seqserve's scheduler)"),
    Option("max_sparsity", ov.finite_float, "a number in [0, 1]", lambda v: 0 <= v <= 1,
           "padding fraction tolerated before the batch is split"),
    Option("max_splits", int, "an integer >= 1", lambda v: v >= 1,
           "most groups (attention calls per layer) per decoding step"),
    Option("decoding_strategy", ov.choice("greedy", "sample", "contrastive"), "greedy, sample or contrastive", help="default decoding strategy"),
    Option("device", ov.choice("auto", "cpu", "cuda"), "auto, cpu or cuda",
           help="worker device; auto picks cuda when available"),
    Option("host", str, "an address to listen on",
           help="address the servers listen on (127.0.0.1 keeps them local)"),
    Option("port", int, "a port in [0, 65535]", lambda v: 0 <= v <= 65535,
           "scheduler gRPC port (0: pick a free one)"),
    Option("http_port", int, "a port in [0, 65535], or -1 to disable",
           lambda v: -1 <= v <= 65535, "scheduler HTTP port for POST /invocations"),
    Option("openai_port", int, "a port in [0, 65535], or -1 to disable",
           lambda v: -1 <= v <= 65535, "scheduler HTTP port of the OpenAI-compatible API (/v1)"),
    Option("served_model_name", str, "any string; empty: the model_id",
           help="the model name the OpenAI-compatible API lists and accepts (besides model_id)"),
    Option("metrics_port", int, "a port in [0, 65535], or -1 to disable",
           lambda v: -1 <= v <= 65535, "scheduler Prometheus /metrics port"),
    Option("frontend_processes", int, "an integer in [0, 64]", lambda v: 0 <= v <= 64,
           "front-end processes that serve clients (tokenize, detokenize, stream) beside the "
           "scheduler core, all on the same public ports; 0: the scheduler process serves "
           "clients itself"),
    Option("core_port", int, "a port in [0, 65535]", lambda v: 0 <= v <= 65535,
           "loopback port of the scheduler core for its front-end processes and the worker "
           "admin API when frontend_processes >= 1 (0: any free port)"),
    Option("worker_port", int, "a port in [0, 65535]", lambda v: 0 <= v <= 65535,
           "worker gRPC port"),
    Option("worker_steps_link_port", int, "a port in [0, 65535], or -1 to disable",
           lambda v: -1 <= v <= 65535,
           "worker's direct Steps link (docs/architecture.md): the Steps without gRPC's "
           "per-message cost; 0: any free port; -1: none, Steps go over gRPC. A scheduler "
           "that cannot reach it uses gRPC"),
    Option("worker_metrics_port", int, "a port in [0, 65535], or -1 to disable",
           lambda v: -1 <= v <= 65535, "worker Prometheus /metrics port"),
    Option("worker_addresses", ov.addresses, "comma-separated host:port list",
           help="the workers the scheduler drives, each a full replica (data parallel)"),
    Option("max_num_batched_tokens", int, "an integer >= 1", lambda v: v >= 1, "tokens a step "
           "computes: decoding rows, then prompt chunks (unchunked: prompt tokens per step)"),
    Option("enable_chunked_prefill", ov.parse_bool, "true or false", help="split prompts over steps "
           "beside the decoding rows (false: each prompt is prefilled whole in one step)"),
    Option("steps_in_flight", int, "an integer >= 1", lambda v: v >= 1,
           "Steps sent to the worker before the oldest is answered (1: each waits for the "
           "previous one's tokens)"),
    Option("step_send_lead_ms", ov.finite_float, "a number of milliseconds >= 0, or -1",
           lambda v: v >= 0 or v == -1,
           "with steps_in_flight >= 2, the next Step is planned and sent this long (plus a "
           "tenth of its expected time) before the worker should end the one it runs, so "
           "requests arriving meanwhile join it; -1: sent as soon as the previous one is"),
    Option("scheduling_policy", ov.choice(*SCHEDULING_POLICIES), ", ".join(SCHEDULING_POLICIES),
           help="which waiting request runs next: fcfs (arrival order), priority (the "
                "request's priority, preempting less urgent work), mlfq (FastServe's "
                "skip-join multi-level feedback queue), length-aware (shortest predicted "
                "response first, KV reserved by prediction), length-batched (offline batch "
                "jobs: groups of similar predicted length, VBS and FCR); docs/scheduling.md"),
    Option("priority_aging_steps", int, "an integer >= 1", lambda v: v >= 1,
           "priority and mlfq: a waiting request gains one level of urgency per this many "
           "Steps waited, so none starves"),
    Option("priority_background_chunk_tokens", int, "an integer >= 0 (0: off)",
           lambda v: v >= 0,
           "priority: once a more urgent request was seen, prompt tokens the less urgent "
           "prompts' chunks may take together in one Step; their chunks also stay out of "
           "the Steps of urgent prompts' chunks and from behind each other in flight "
           "(0: no such rule); docs/scheduling.md"),
    Option("priority_urgent_steps", ov.parse_bool, "true or false", help="priority: a "
           "request that outranks running work and finds room is prefilled in an urgent "
           "Step, which the worker runs between two layers of the Step in progress and "
           "ahead of those queued (false: it waits for the next Step); docs/scheduling.md"),
    Option("mlfq_levels", int, "an integer in [1, 16]", lambda v: 1 <= v <= 16,
           "mlfq: number of queues"),
    Option("mlfq_quantum_steps", int, "an integer >= 1", lambda v: v >= 1,
           "mlfq: decoding Steps a job runs in the first queue before demotion (doubling "
           "per queue)"),
    Option("mlfq_prefill_tokens_per_step", int, "an integer >= 1", lambda v: v >= 1,
           "mlfq: prompt tokens whose prefill costs about one decoding Step (skip-join "
           "places a job by its prefill cost)"),
    Option("length_bucket_tokens", int, "an integer >= 1", lambda v: v >= 1,
           "length-aware, length-batched: width of the predicted-length buckets that admission orders and "
           "reserves KV by"),
    Option("length_predictor", ov.choice(*LENGTH_PREDICTORS), ", ".join(LENGTH_PREDICTORS),
           help="length-aware: both (the prompt-id predictor orders admission and sets the "
                "first reservation, the worker's hidden-state prediction, with the first "
                "token, then replaces it), prompt (prompt ids only), hidden (the worker's "
                "only: arrival order and max_new_tokens until it comes); docs/scheduling.md"),
    Option("length_probe_min_samples", int, "an integer >= 1", lambda v: v >= 1,
           "worker: sequences that ended by EOS or stop its length probe learns from before "
           "it predicts (worker_service/length_probe.py)"),
    Option("max_queue", int, "an integer >= 0", lambda v: v >= 0,
           "waiting requests at most; past it requests get RESOURCE_EXHAUSTED"),
    Option("max_new_tokens_limit", int, "an integer >= 1", lambda v: v >= 1,
           "largest max_new_tokens a request may ask for"),
    Option("default_max_new_tokens", int, "an integer >= 1", lambda v: v >= 1,
           "max_new_tokens when a request does not say"),
    Option("kv_cache_bytes", int, "an integer >= 1", lambda v: v >= 1,
           "worker memory for KV caches (bytes; on CPU one region mapped at start)"),
    Option("kv_arena_headroom", ov.finite_float, "a number >= 1", lambda v: v >= 1,
           "CPU worker: the region mapped at start for the KV groups' buffers is "
           "kv_cache_bytes times this. The scheduler admits kv_cache_bytes of KV tokens; "
           "the groups' buffers also hold padding (rows padded to the longest) and room to "
           "grow, which past the region come from the heap, slower to map (1: map exactly "
           "kv_cache_bytes)"),
    Option("prompt_cache_bytes", int, "an integer >= 0", lambda v: v >= 0,
           "worker memory for cached prompt prefixes (bytes)"),
    Option("prompt_cache_block_tokens", int, "an integer in [1, 1024]",
           lambda v: 1 <= v <= 1024, "tokens per prefix-cache block (prefixes match in blocks)"),
    Option("swap_space_bytes", int, "an integer >= -1", lambda v: v >= -1,
           "worker host memory for the KV of preempted sequences (bytes; -1: 4 GiB on an "
           "accelerator, 0 on CPU; 0: no swapping, preempted sequences are recomputed)"),
    Option("preemption_mode", ov.choice("auto", "swap", "recompute"), "auto, swap or recompute",
           help="how a preempted sequence comes back: auto swaps its KV to the worker's host "
                "memory where that costs less than re-prefilling it (both measured by the "
                "worker at start), swap whenever the swap space has room, recompute never"),
    Option("swap_prefetch", int, "an integer >= -1", lambda v: v >= -1,
           "swapped-out sequences whose KV the worker copies back to the device ahead of "
           "their turn, most urgent first (FastServe's proactive swapping; -1: 2 on an "
           "accelerator, 0 on CPU; 0: off)"),
    Option("drain_timeout", ov.finite_float, "a number of seconds >= 0", lambda v: v >= 0,
           "on SIGTERM, how long running requests may take to finish before exit"),
    Option("worker_timeout", ov.finite_float, "a number of seconds > 0", lambda v: v > 0,
           "how long the scheduler waits for a worker before failing requests"),
    # Security (docs/security.md). Paths are PEM files; empty means off.
    Option("tls_cert_file", str, "a PEM certificate chain file, or empty for plaintext",
           help="TLS certificate of the public gRPC and HTTP ports (with tls_key_file)"),
    Option("tls_key_file", str, "a PEM private key file, or empty for plaintext",
           help="TLS private key of the public ports (with tls_cert_file)"),
    Option("tls_client_ca_file", str, "a PEM CA file, or empty (no client certificates)",
           help="require public clients to present a certificate signed by this CA"),
    Option("worker_tls_cert_file", str, "a PEM certificate chain file, or empty",
           help="mutual TLS scheduler<->worker: this process's certificate (worker: server "
                "certificate; scheduler: client certificate)"),
    Option("worker_tls_key_file", str, "a PEM private key file, or empty",
           help="mutual TLS scheduler<->worker: the private key of worker_tls_cert_file"),
    Option("worker_tls_ca_file", str, "a PEM CA file, or empty",
           help="mutual TLS scheduler<->worker: the CA that signed the other side's certificate"),
    Option("auth_token", str, "any string; empty: no token required",
           help="bearer token the public API requires (prefer OPTION_AUTH_TOKEN to a flag)"),
    Option("control_token", str, "any string of 16 or more characters; empty: use the file",
           lambda v: v == "" or len(v) >= 16,
           help="secret the scheduler presents on every worker call (prefer "
                "OPTION_CONTROL_TOKEN to a flag); empty: the control_token_file's"),
    Option("control_token_file", str, "a file path; empty: ~/.cache/seqserve/control-token",
           help="file holding the control-plane secret, readable by its owner only; the "
                "first process to start creates it"),
    Option("worker_lease", ov.finite_float, "a number of seconds > 0", lambda v: v > 0,
           "a worker drops the sequences of a scheduler silent for this long"),
)
# Old names of options: still read (with a warning), so older files and flags keep working.
RENAMED = {"max_prefill_tokens": "max_num_batched_tokens"}
_BY_KEY = {o.key: o for o in OPTIONS}
_BY_KEY.update({old: _BY_KEY[new] for old, new in RENAMED.items()})


@dataclass(frozen=True)
class ServingConfig:
    """Every option, typed, with its default (stated here only). Field names are the keys
    without `option.`."""

    engine: str = "Python"
    model_id: str = ""
    tokenizer: str = ""
    gguf_cache_dir: str = "models"
    tensor_parallel_degree: int = 1
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    batch_invariant: bool = False
    trust_remote_code: bool = False
    max_rolling_batch_size: int = 64
    rolling_batch: str = "scheduler"
    max_sparsity: float = 0.33
    max_splits: int = 3
    decoding_strategy: str = "greedy"
    device: str = "auto"
    host: str = "127.0.0.1"
    port: int = 8000
    http_port: int = 8080
    openai_port: int = 8081
    served_model_name: str = ""
    metrics_port: int = 8001
    frontend_processes: int = 0
    core_port: int = 0
    worker_port: int = 8100
    worker_steps_link_port: int = 0
    worker_metrics_port: int = 8101
    worker_addresses: tuple[str, ...] = ("127.0.0.1:8100",)
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    steps_in_flight: int = 2
    step_send_lead_ms: float = 3.0
    scheduling_policy: str = "fcfs"
    priority_aging_steps: int = 64
    priority_background_chunk_tokens: int = 128
    priority_urgent_steps: bool = True
    mlfq_levels: int = 4
    mlfq_quantum_steps: int = 8
    mlfq_prefill_tokens_per_step: int = 128
    length_bucket_tokens: int = 50
    length_predictor: str = "both"
    length_probe_min_samples: int = 32
    max_queue: int = 1024
    max_new_tokens_limit: int = 4096
    default_max_new_tokens: int = 64
    kv_cache_bytes: int = 4 << 30
    kv_arena_headroom: float = 1.5
    prompt_cache_bytes: int = 512 << 20
    prompt_cache_block_tokens: int = 16
    swap_space_bytes: int = -1
    preemption_mode: str = "auto"
    swap_prefetch: int = -1
    drain_timeout: float = 30.0
    worker_timeout: float = 60.0
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_client_ca_file: str = ""
    worker_tls_cert_file: str = ""
    worker_tls_key_file: str = ""
    worker_tls_ca_file: str = ""
    auth_token: str = field(default="", repr=False)
    control_token: str = field(default="", repr=False)
    control_token_file: str = ""
    worker_lease: float = 30.0

    @property
    def length_probe_used(self) -> bool:
        """Whether the worker's hidden-state length probe is read: only the length-aware
        policy with a hidden-state predictor reads it, so under any other setting the
        worker keeps no probe and the scheduler sends it no lengths to learn from."""
        return self.scheduling_policy == "length-aware" and self.length_predictor != "prompt"


assert [f.name for f in fields(ServingConfig)] == [o.key for o in OPTIONS]
_DEFAULTS = {f.name: f.default for f in fields(ServingConfig)}


# A comment starts at a `#` at the start of a line or after whitespace; a `#` inside a
# value (`option.model_id=/models/a#b`) is part of the value.
_COMMENT = re.compile(r"(?:^|(?<=\s))#.*$")


def parse_properties(text: str, source: str = "serving.properties") -> dict[str, str]:
    """`key=value` lines; blank lines ignored. `#` starts a comment at the start of a line
    or after whitespace (`option.x=y   # note`); elsewhere it belongs to the value."""
    out: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = _COMMENT.sub("", line, count=1).strip()
        if not line:
            continue
        key, sep, value = line.partition("=")
        if not sep:
            raise ConfigError(f"{source}:{n}: expected key=value, got {line!r}")
        out[key.strip()] = value.strip()
    return out


def _option_key(raw: str) -> str | None:
    key = raw.strip()
    if key == "engine":
        return key
    if key.startswith("option."):
        return key[len("option."):]
    return None


def _convert(key: str, raw: str, origin: str) -> Any:
    opt = _BY_KEY[key]
    name = "engine" if key == "engine" else f"option.{key}"
    if key != opt.key:
        logger.warning("%s (%s) is now option.%s", name, origin, opt.key)
    try:
        value = opt.parse(raw)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{name}={raw!r} ({origin}) is invalid: {exc}; allowed: {opt.allowed}") from None
    if not opt.check(value):
        raise ConfigError(f"{name}={raw!r} ({origin}) is out of range; allowed: {opt.allowed}")
    return value


def load_config(path: str | Path | None = None, env: Mapping[str, str] | None = None,
                overrides: Mapping[str, str] | None = None) -> ServingConfig:
    """File, then `OPTION_*` environment variables, then flag overrides (raw strings)."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    if path is not None:
        text = Path(path).read_text()
        for raw_key, raw in parse_properties(text, str(path)).items():
            key = _option_key(raw_key)
            if key not in _BY_KEY:
                logger.warning("%s: unknown key %r ignored", path, raw_key)
                continue
            values[_BY_KEY[key].key] = _convert(key, raw, str(path))
    for var, raw in env.items():
        if var.startswith("OPTION_"):
            key = var[len("OPTION_"):].lower()
            if key not in _BY_KEY:
                logger.warning("environment: unknown option %s ignored", var)
                continue
            values[_BY_KEY[key].key] = _convert(key, raw, f"environment {var}")
        elif var == "SERVING_ENGINE":
            values["engine"] = raw
    for key, raw in (overrides or {}).items():
        if raw is not None:
            values[key] = _convert(key, str(raw), f"flag --{key.replace('_', '-')}")
    return ServingConfig(**values)
