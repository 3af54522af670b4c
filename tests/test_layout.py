"""The package layout the architecture relies on, checked on the source itself."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Who may import whom: the two services share only seqserve_common; the client library
# stands alone so a user installs no server code to call the API.
FORBIDDEN = {
    "scheduler_service": {"worker_service", "bench", "client"},
    "worker_service": {"scheduler_service", "bench", "client"},
    "seqserve_common": {"scheduler_service", "worker_service", "bench", "client"},
    "client": {"scheduler_service", "worker_service", "bench", "seqserve_common"},
}
MAX_LINES = 400


def _python_files(package: str) -> list[Path]:
    return sorted((REPO / package).rglob("*.py"))


def _imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_packages_import_only_what_they_may(package):
    files = _python_files(package)
    assert files, f"no Python files under {package}/"
    wrong = {f"{p.relative_to(REPO)} imports {name}"
             for p in files for name in _imported_packages(p) & FORBIDDEN[package]}
    assert not wrong, sorted(wrong)


def test_no_hand_written_module_is_too_long():
    generated = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")
    long = []
    for package in ("seqserve_common", "scheduler_service", "worker_service", "client", "bench",
                    "tests"):
        for p in _python_files(package):
            if p.name.endswith(generated) or package == "tests":
                continue
            n = len(p.read_text().splitlines())
            if n > MAX_LINES:
                long.append(f"{p.relative_to(REPO)}: {n} lines")
    assert not long, long
