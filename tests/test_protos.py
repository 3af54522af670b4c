"""The generated code under protos/ must be what `make proto` makes from the .proto files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROTOS = ["seqserve/v1/generate.proto", "seqserve/worker/v1/worker.proto",
          "seqserve/admin/v1/admin.proto", "seqserve/core/v1/core.proto"]


def test_generated_code_is_in_sync(tmp_path):
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{REPO / 'protos'}",
                    f"--python_out={tmp_path}", f"--grpc_python_out={tmp_path}",
                    f"--pyi_out={tmp_path}", *PROTOS], check=True)
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    assert generated, "protoc produced nothing"
    stale = [str(rel) for rel in generated
             if (REPO / "protos" / rel).read_text() != (tmp_path / rel).read_text()]
    assert not stale, f"run `make proto`: generated code is out of date for {stale}"


def test_every_field_is_documented():
    """Each message field and rpc in the contracts has a comment line right above it."""
    for rel in PROTOS:
        lines = (REPO / "protos" / rel).read_text().splitlines()
        for i, line in enumerate(lines):
            s = line.strip()
            is_field = s.endswith(";") and "=" in s and not s.startswith(("option", "syntax", "package"))
            is_rpc = s.startswith("rpc ")
            if is_field or is_rpc:
                assert lines[i - 1].strip().startswith("//"), f"{rel}:{i + 1} undocumented: {s}"
