"""How the values of serving options are read from their text: each parser returns the
value or raises ValueError saying what it expected (config.py adds the key and origin)."""

from __future__ import annotations

import math
from typing import Callable


def parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("true", "1", "yes", "on"):
        return True
    if low in ("false", "0", "no", "off"):
        return False
    raise ValueError("expected true or false")


DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
          "fp16": "float16", "float16": "float16", "auto": "auto"}


def choice(*values: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        v = text.strip().lower()
        if v not in values:
            raise ValueError(f"expected one of {', '.join(values)}")
        return v
    return parse


def finite_float(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise ValueError("expected a finite number")
    return v


def dtype(text: str) -> str:
    v = text.strip().lower()
    if v not in DTYPES:
        raise ValueError(f"expected one of {', '.join(DTYPES)}")
    return DTYPES[v]


def addresses(text: str) -> tuple[str, ...]:
    items = tuple(a.strip() for a in text.split(",") if a.strip())
    for a in items:
        host, _, port = a.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"{a!r} is not host:port")
    return items
