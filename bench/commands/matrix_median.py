"""`python -m bench matrix-median RUN.json ...`: the median of several `bench matrix` runs
(issue 21 asks for the median of at least three, each listed), as markdown on stdout."""

from __future__ import annotations

import json

from bench.matrix_report import median_markdown


def run(args) -> None:
    results = [json.loads(path.read_text()) for path in args.runs]
    print(median_markdown(results))
