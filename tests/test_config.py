"""serving.properties loading: the seed's file, overrides, and errors that name the key."""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys

import pytest

from seqserve_common.command_line import add_config_arguments, config_from_args
from seqserve_common.config import ConfigError, load_config, parse_properties

SEED_EXAMPLE = """\
# serving.properties

engine=MPI
option.model_id=/workspace/llama-2-70b-hf/
option.tensor_parallel_degree=1
option.dtype=fp16
option.trust_remote_code=true

# rolling-batch parameters
option.max_rolling_batch_size=64
option.rolling_batch=scheduler

# seq-scheduler parameters
option.max_sparsity=0.33
option.max_splits=3
option.decoding_strategy=contrastive  # other options: greedy, sample
"""


def test_seed_example_loads(tmp_path):
    path = tmp_path / "serving.properties"
    path.write_text(SEED_EXAMPLE)
    cfg = load_config(path, env={})
    assert cfg.engine == "MPI" and cfg.model_id == "/workspace/llama-2-70b-hf/"
    assert cfg.dtype == "float16" and cfg.trust_remote_code is True
    assert cfg.max_rolling_batch_size == 64 and cfg.max_sparsity == 0.33 and cfg.max_splits == 3
    assert cfg.decoding_strategy == "contrastive"


def test_env_overrides_file_and_flags_override_env(tmp_path):
    path = tmp_path / "serving.properties"
    path.write_text("option.max_sparsity=0.5\noption.max_splits=2\n")
    cfg = load_config(path, env={"OPTION_MAX_SPARSITY": "0.2"})
    assert cfg.max_sparsity == 0.2 and cfg.max_splits == 2
    cfg = load_config(path, env={"OPTION_MAX_SPARSITY": "0.2"}, overrides={"max_sparsity": "0.1"})
    assert cfg.max_sparsity == 0.1


@pytest.mark.parametrize("line, key", [
    ("option.max_sparsity=1.5", "option.max_sparsity"),
    ("option.max_sparsity=nan", "option.max_sparsity"),
    ("option.max_splits=0", "option.max_splits"),
    ("option.max_splits=two", "option.max_splits"),
    ("option.dtype=int4", "option.dtype"),
    ("option.tensor_parallel_degree=0", "option.tensor_parallel_degree"),
    ("option.decoding_strategy=beam", "option.decoding_strategy"),
    ("option.trust_remote_code=maybe", "option.trust_remote_code"),
    ("option.max_rolling_batch_size=0", "option.max_rolling_batch_size"),
    ("option.worker_addresses=nohostport", "option.worker_addresses"),
    ("option.max_num_batched_tokens=0", "option.max_num_batched_tokens"),
    ("option.max_num_batched_tokens=-16", "option.max_num_batched_tokens"),
    ("option.enable_chunked_prefill=sometimes", "option.enable_chunked_prefill"),
    ("option.kv_arena_headroom=0.5", "option.kv_arena_headroom"),
    ("option.kv_arena_headroom=inf", "option.kv_arena_headroom"),
])
def test_bad_values_name_key_and_value(tmp_path, line, key):
    path = tmp_path / "serving.properties"
    path.write_text(line + "\n")
    value = line.split("=", 1)[1]
    with pytest.raises(ConfigError) as err:
        load_config(path, env={})
    assert key in str(err.value) and value in str(err.value) and "allowed" in str(err.value)


def test_unknown_key_warns(tmp_path, caplog):
    path = tmp_path / "serving.properties"
    path.write_text("option.max_spasity=0.2\n")
    with caplog.at_level(logging.WARNING):
        load_config(path, env={})
    assert "option.max_spasity" in caplog.text


def test_renamed_prefill_budget_key_still_reads(tmp_path, caplog):
    path = tmp_path / "serving.properties"
    path.write_text("option.max_prefill_tokens=512\n")
    with caplog.at_level(logging.WARNING):
        assert load_config(path, env={}).max_num_batched_tokens == 512
    assert "option.max_num_batched_tokens" in caplog.text
    assert load_config(None, env={"OPTION_MAX_PREFILL_TOKENS": "64"}).max_num_batched_tokens == 64
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    args = parser.parse_args(["--max-prefill-tokens", "32"])
    assert config_from_args(args).max_num_batched_tokens == 32


@pytest.mark.parametrize("service", ["scheduler_service.main", "worker_service.main"])
def test_a_token_budget_below_one_token_stops_start_up(service):
    """Both processes exit at once with a usage error that names the option and the value."""
    proc = subprocess.run([sys.executable, "-m", service, "--model-id", "unused",
                           "--max-num-batched-tokens", "0"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "option.max_num_batched_tokens='0'" in proc.stderr and ">= 1" in proc.stderr


def test_parse_properties_comments():
    assert parse_properties("a=1 # c\n# x\n\nb = two\n") == {"a": "1", "b": "two"}
    with pytest.raises(ConfigError, match="key=value"):
        parse_properties("novalue\n")
