"""The subcommands of `python -m bench`, one module each; every module's `run(args)` makes
one benchmark's results (JSON and markdown under --out). bench/cli.py dispatches to them."""
