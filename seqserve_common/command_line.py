"""The command line both processes share: one flag per configuration option over the
serving.properties file and OPTION_* variables (config.py), --port-file and --log-level."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Callable, NoReturn

from seqserve_common.config import _BY_KEY, OPTIONS, ConfigError, ServingConfig, load_config


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """--properties FILE and one flag per option (e.g. --max-sparsity)."""
    parser.add_argument("--properties", metavar="FILE",
                        help="serving.properties file (default: $SERVING_PROPERTIES if set)")
    group = parser.add_argument_group("options (override the file and OPTION_* variables)")
    for opt in OPTIONS:
        names = [k for k, o in _BY_KEY.items() if o is opt]  # its current and old names
        group.add_argument(*(f"--{k.replace('_', '-')}" for k in names), dest=f"opt_{opt.key}",
                           metavar="V",
                           help=f"{opt.help} [{opt.allowed}; default {opt.default}]")


def config_from_args(args: argparse.Namespace) -> ServingConfig:
    overrides = {o.key: getattr(args, f"opt_{o.key}") for o in OPTIONS}
    path = args.properties or os.environ.get("SERVING_PROPERTIES") or None
    return load_config(path, overrides=overrides)


def process_arguments(prog: str, description: str | None, argv: list[str] | None,
                      extra: Callable[[argparse.ArgumentParser], object] | None = None
                      ) -> tuple[argparse.ArgumentParser, argparse.Namespace, ServingConfig]:
    """The command line both processes share: options, --port-file, --log-level, and what
    `extra` adds; sets up logging and requires option.model_id. Exits with a usage error
    naming a bad option."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_config_arguments(parser)
    if extra is not None:
        extra(parser)
    parser.add_argument("--port-file", help="write the bound ports as JSON to this file")
    parser.add_argument("--log-level", default=os.environ.get("LOG_LEVEL", "INFO"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = config_from_args(args)
        if not cfg.model_id:
            raise ConfigError("option.model_id is not set; pass --model-id DIR or set it in "
                              "serving.properties")
    except ConfigError as exc:
        parser.error(str(exc))
    return parser, args, cfg


def write_port_file(path: str | None, ports: dict) -> None:
    """Tell a parent process (tests, make run, benchmarks) the ports actually bound."""
    if not path:
        return
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(ports))
    os.replace(tmp, path)


def run_and_exit(main: Callable[[], int]) -> NoReturn:
    """Run a process's `main` and end the process with its exit code, without the
    interpreter's teardown when it returns normally: collecting torch's and transformers'
    objects at exit takes about 2 s on a small CPU, a wait added to every stop and restart.
    Each main stops its servers, children and temporary files itself before it returns;
    logs and standard streams are flushed here. An exception still exits the usual way."""
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
