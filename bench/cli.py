"""`python -m bench`: parse the command line, set up logging, run one subcommand."""

from __future__ import annotations

import logging
import sys
from typing import Sequence

from bench import length_prediction, policy_sim_report
from bench.commands import (all_figures, ceiling, matrix, matrix_median, offline_batch,
                            partition, peers, policies, prefix, replicas, scheduler_cost,
                            serve, sweep, throughput)
from bench.commands.common import set_command_line
from bench.parser import COMMANDS, build_parser

HANDLERS = {"throughput": throughput.run, "sweep": sweep.run, "partition": partition.run,
            "prefix": prefix.run, "serve": serve.run, "peers": peers.run,
            "ceiling": ceiling.run, "matrix": matrix.run, "matrix-median": matrix_median.run,
            "all": all_figures.run,
            "scheduler-cost": scheduler_cost.run, "replicas": replicas.run,
            "policies": policies.run, "offline-batch": offline_batch.run,
            "length-prediction": length_prediction.run, "policy-sim": policy_sim_report.run}


def main(argv: Sequence[str] | None, doc: str) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not any(a in COMMANDS for a in argv) and not {"-h", "--help"} & set(argv):
        argv.insert(0, "throughput")
    args = build_parser(doc).parse_args(argv)
    set_command_line(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    HANDLERS[args.command](args)
    return 0
