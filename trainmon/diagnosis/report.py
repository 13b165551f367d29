"""Shared output helpers of the diagnosis commands: JSON documents and aligned text tables."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterable, Sequence
from typing import TextIO

__all__ = ["dump_json", "table", "fmt_value", "escape", "parse_name_list"]


def dump_json(doc: object, out: TextIO | None = None) -> None:
    """Strict JSON (non-finite numbers are already spelled as strings by ``json_number``)."""
    out = out or sys.stdout
    json.dump(doc, out, indent=2, allow_nan=False)
    out.write("\n")


def escape(text: str) -> str:
    """``text`` with control characters (newline, carriage return, escape sequences, line and
    paragraph separators) and backslashes written as Python escapes: a recorded name, which any
    module can choose, stays on one line of a text report and cannot print a fake one."""
    if text.isprintable() and "\\" not in text:
        return text
    return "".join(_escape_char(c) for c in text)


def _escape_char(c: str) -> str:
    if c == "\\":
        return "\\\\"
    if c.isprintable() or c == " ":
        return c
    return repr(c)[1:-1] if len(repr(c)) > 3 else f"\\x{ord(c):02x}"


def fmt_value(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isfinite(value) and value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return f"{value:.6g}"
    return escape(str(value))


def table(headers: Sequence[str], rows: Iterable[Sequence[object]], out: TextIO | None = None) -> None:
    """A plain left/right aligned table (numbers right-aligned)."""
    out = out or sys.stdout
    cells = [[fmt_value(v) for v in row] for row in rows]
    numeric = [all(_is_number(r[i]) for r in cells) if cells else False for i in range(len(headers))]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)).rstrip()

    out.write(line(list(headers)) + "\n")
    for r in cells:
        out.write(line(r) + "\n")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return text == "-"
    return True


def parse_name_list(text: str | None) -> list[str] | None:
    if text is None:
        return None
    return [part.strip() for part in text.split(",") if part.strip()]
